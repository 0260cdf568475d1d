"""jaxfrontier vs a plain jitted JAX GPT of the same shape, interleaved in one process.

  JAX_PLATFORMS=cpu python benchmarks/compare_baseline.py [--rounds 3] [--steps 10]
  JAX_PLATFORMS=cpu python benchmarks/compare_baseline.py --attention=reference,blockwise --torch

--attention times jaxfrontier once per attention kernel in each round (the whole step before
and after blockwise attention); --torch adds the same model in PyTorch under torch.compile
(benchmarks/torch_gpt.py, fp32 on the CPU) to each round, and each row's ratio to it.

Default shape (docs/PERFORMANCE.md): 6 layers, width 384, 6 heads, sequence 256, vocabulary
512, batch 8, fp32, one device, AdamW. Each round times both implementations back to back;
the machine is shared and noisy, so the result is the ratio of medians over rounds. MFU is
model FLOPs (Megatron formula, f = 3) over the measured fp32 matmul peak of this CPU.
"""

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import baseline_jax_gpt  # noqa: E402
import harness  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402


def jaxfrontier_config(b: baseline_jax_gpt.Config, attention: str = 'auto'):
    c = config_lib.base_config()
    c.model.update(num_layers=b.layers, d_model=b.d_model, num_heads=b.heads, seq_len=b.seq_len,
                   vocab_size=b.vocab, vocab_multiple=128, dtype=b.dtype, remat='none', attention=attention,
                   tied_embeddings=True, scan_unroll=b.layers if not b.scan else 1)
    c.train.update(global_batch=b.batch, micro_batch=b.batch, accum_steps=1)
    c.data.kind = 'synthetic'
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--steps', type=int, default=10)
    p.add_argument('--attention', default='auto', help='comma-separated model.attention values to time')
    p.add_argument('--torch', action='store_true', help='add PyTorch (torch.compile) to every round')
    args = p.parse_args()
    b = baseline_jax_gpt.Config(steps=args.steps, warmup=2)
    kernels = args.attention.split(',')
    rows = {'baseline': [], **{f'jaxfrontier_{k}': [] for k in kernels}, **({'torch': []} if args.torch else {})}
    mfu = []
    for r in range(args.rounds):
        rows['baseline'].append(baseline_jax_gpt.run_benchmark(b)['tokens_per_s'])
        for k in kernels:
            mine = harness.time_train_step(jaxfrontier_config(b, k), steps=args.steps, warmup=2)
            rows[f'jaxfrontier_{k}'].append(mine['perf/tokens_per_s'])
            mfu.append(mine['perf/mfu'])
        if args.torch:
            import torch_gpt  # pylint: disable=g-import-not-at-top  (needs torch)
            rows['torch'].append(torch_gpt.time_step(jaxfrontier_config(b), steps=args.steps, warmup=2)['tokens_per_s'])
        print(json.dumps({'round': r, **{f'{name}_tokens_per_s': v[-1] for name, v in rows.items()},
                          'peak_source': mine['peak_source']}), flush=True)
    median = {name: statistics.median(v) for name, v in rows.items()}
    first = f'jaxfrontier_{kernels[0]}'
    summary = {**{f'{name}_tokens_per_s': v for name, v in median.items()},
               'ratio': median[first] / median['baseline'], 'jaxfrontier_mfu': statistics.median(mfu),
               **{f'{name}_over_baseline': v / median['baseline'] for name, v in median.items()},
               **({f'{name}_over_torch': v / median['torch'] for name, v in median.items()} if args.torch else {})}
    print(json.dumps(summary))


if __name__ == '__main__':
    main()
