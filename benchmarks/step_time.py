"""Step-time benchmark of any config: one JSON line of throughput, MFU and memory.

  python benchmarks/step_time.py --config=configs/tiny.py
  python benchmarks/step_time.py --config=configs/gpt.py:size=125m --config.model.seq_len=256 \
      --config.train.micro_batch=8 --config.train.global_batch=8 --steps=10

FLOP convention: see benchmarks/harness.py (Megatron formula, f = 3 for MFU).
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from jaxfrontier import config as config_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file.', lock_config=True)
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps after warm-up.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps after compilation.')


def main(argv):
    del argv
    c = _CONFIG.value
    config_lib.set_cpu_device_count(c.mesh.cpu_devices)
    import harness  # pylint: disable=g-import-not-at-top  (imports JAX, after XLA_FLAGS is final)
    result = harness.time_train_step(c, steps=_STEPS.value, warmup=_WARMUP.value)
    print(json.dumps({'impl': 'jaxfrontier', **result}))


if __name__ == '__main__':
    app.run(main)
