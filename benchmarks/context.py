"""Context parallelism: step time and temporary memory per device at context 1, 2, 4 for one sequence.

  python benchmarks/context.py                       # sequence 4096, writes benchmarks/results/context.json
  python benchmarks/context.py --seq_len=512 --steps=1 --warmup=0 --out=/tmp/context.json   # a quick check

One GPT sequence (global batch 1, data 1) split over `context` simulated CPU devices (the
devices of a run = context), balanced order, the given attention kernel at every context (the
one-device run uses the same kernel, so the comparison is of the split alone). Time it on a
quiet machine: simulated devices share the host's cores, so step time at context c measures the
split's overheads, not a speed-up. FLOP convention: benchmarks/harness.py.
"""

import json
import os
import sys

from absl import app, flags

from jaxfrontier import config as config_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_SEQ = flags.DEFINE_integer('seq_len', 4096, 'Tokens of the one sequence.')
_CONTEXTS = flags.DEFINE_list('contexts', ['1', '2', '4'], 'Context sizes (devices) to run.')
_ATTENTION = flags.DEFINE_string('attention', 'reference', 'model.attention of every run.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps after warm-up.')
_WARMUP = flags.DEFINE_integer('warmup', 1, 'Untimed steps after compilation.')
_OUT = flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results',
                                               'context.json'), 'Where the JSON rows go.')


def config(context: int):
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=64, num_heads=4, seq_len=_SEQ.value, vocab_size=256, dtype='float32',
                   remat='full', attention=_ATTENTION.value)
    c.mesh.update(context=context, cpu_devices=max(int(x) for x in _CONTEXTS.value))
    c.train.update(global_batch=1, micro_batch=1, accum_steps=1)
    c.data.kind = 'synthetic'
    return c


def main(argv):
    del argv
    config_lib.set_cpu_device_count(max(int(x) for x in _CONTEXTS.value))
    import harness  # pylint: disable=g-import-not-at-top  (imports JAX, after XLA_FLAGS is final)
    rows = []
    for context in (int(x) for x in _CONTEXTS.value):
        result = harness.time_train_step(config(context), steps=_STEPS.value, warmup=_WARMUP.value)
        rows.append({'context': context, 'seq_len': _SEQ.value, 'attention': _ATTENTION.value, **result})
        print(json.dumps(rows[-1]))
    harness.print_table(rows, ['context', 'seq_len', 'median_step_s', 'perf/tokens_per_s_per_device',
                               'temp_gib_per_device', 'compile_s'])
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)


if __name__ == '__main__':
    app.run(main)
