"""jaxfrontier vs a plain jitted JAX GPT of the same shape, interleaved in one process.

  JAX_PLATFORMS=cpu python benchmarks/compare_baseline.py [--rounds 3] [--steps 10]

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


def jaxfrontier_config(b: baseline_jax_gpt.Config):
    c = config_lib.base_config()
    c.model.update(num_layers=b.layers, d_model=b.d_model, num_heads=b.heads, seq_len=b.seq_len,
                   vocab_size=b.vocab, vocab_multiple=128, dtype=b.dtype, remat='none', attention='auto',
                   tied_embeddings=True, scan_unroll=b.layers if not b.scan else 1)
    c.train.update(global_batch=b.batch, micro_batch=b.batch, accum_steps=1)
    c.data.kind = 'synthetic'
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--rounds', type=int, default=3)
    p.add_argument('--steps', type=int, default=10)
    args = p.parse_args()
    b = baseline_jax_gpt.Config(steps=args.steps, warmup=2)
    c = jaxfrontier_config(b)
    ours, theirs, mfu = [], [], []
    for r in range(args.rounds):
        base = baseline_jax_gpt.run_benchmark(b)
        mine = harness.time_train_step(c, steps=args.steps, warmup=2)
        theirs.append(base['tokens_per_s'])
        ours.append(mine['perf/tokens_per_s'])
        mfu.append(mine['perf/mfu'])
        print(json.dumps({'round': r, 'baseline_tokens_per_s': theirs[-1], 'jaxfrontier_tokens_per_s': ours[-1],
                          'jaxfrontier_mfu': mfu[-1], 'peak_source': mine['peak_source']}), flush=True)
    summary = {'baseline_tokens_per_s': statistics.median(theirs), 'jaxfrontier_tokens_per_s': statistics.median(ours),
               'ratio': statistics.median(ours) / statistics.median(theirs), 'jaxfrontier_mfu': statistics.median(mfu)}
    print(json.dumps(summary))


if __name__ == '__main__':
    main()
