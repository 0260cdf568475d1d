"""KV-cached decoding against recomputing the prefix, at 256 new tokens.

  PYTHONPATH=$PWD python benchmarks/decode.py [--layers=2] [--width=128] [--batch=2] [--new=256]

Both loops are jaxfrontier.inference.generate's, on one device, fp32, greedy, the same random
parameters and prompts (16 tokens): `generate` prefills a key/value cache and then runs one
token per step; `generate_recompute` runs the whole [B, seq_len] sequence through the model
every step (seq_len = prompt + new tokens, rounded up to 64). Each is compiled and run once to
warm up, then timed over 3 runs (median). Reported: new tokens/s of each and the speed-up; a
JSON line goes to benchmarks/results/decode.json. The two produce the same tokens (asserted).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier.inference import generate as gen  # noqa: E402
from jaxfrontier.model.params import ModelDef, init_params  # noqa: E402


def time_runs(fn, args, runs=3):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--layers', type=int, default=2)
    p.add_argument('--width', type=int, default=128)
    p.add_argument('--batch', type=int, default=2)
    p.add_argument('--new', type=int, default=256)
    p.add_argument('--prompt', type=int, default=16)
    a = p.parse_args()
    c = config_lib.base_config()
    seq_len = -(-(a.prompt + a.new) // 64) * 64
    c.model.update(num_layers=a.layers, d_model=a.width, num_heads=a.width // 64, seq_len=seq_len, vocab_size=256,
                   dtype='float32', remat='none', attention='reference')
    shape = config_lib.model_shape(c)
    model_def, params = ModelDef.create(shape), init_params(shape, jax.random.key(0))
    prompt_bp = np.random.RandomState(0).randint(0, 256, (a.batch, a.prompt)).astype(np.int32)
    args = (params, prompt_bp, np.full(a.batch, a.prompt, np.int32), jax.random.key(0))
    rule = gen.Sampling(0.0)
    cached_s, cached = time_runs(gen.make_generate(model_def, max_new=a.new, rule=rule), args)
    full_s, full = time_runs(gen.make_generate(model_def, max_new=a.new, rule=rule, cached=False), args)
    np.testing.assert_array_equal(cached, full)
    row = {'layers': a.layers, 'width': a.width, 'batch': a.batch, 'prompt': a.prompt, 'new_tokens': a.new,
           'seq_len': seq_len, 'device': jax.devices()[0].device_kind,
           'cached_tokens_per_s': a.batch * a.new / cached_s, 'recompute_tokens_per_s': a.batch * a.new / full_s,
           'speedup': full_s / cached_s}
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), 'results', 'decode.json'), 'w') as f:
        json.dump(row, f, indent=1)
    print(json.dumps(row))
    print(f'KV cache {row["cached_tokens_per_s"]:.0f} tokens/s, recompute {row["recompute_tokens_per_s"]:.0f} '
          f'tokens/s: {row["speedup"]:.1f}x at {a.new} new tokens')


if __name__ == '__main__':
    main()
