"""The attention core alone, forward + backward: reference vs blockwise vs PyTorch, one run.

  JAX_PLATFORMS=cpu python benchmarks/attention.py [--seqs 256,2048] [--blocks 64,128,256] [--rounds 5]
  JAX_PLATFORMS=cpu python benchmarks/attention.py --seqs 256 --blocks 64 --kv-heads 2   # the small Llama's GQA

Shape (the peer benchmark's, docs/PERFORMANCE.md): batch 8, 6 heads, head dim 64, fp32, causal;
sequence 256 and 2048 by default. Each round times every kernel once (interleaved, so the
shared machine's noise hits all alike): `iters` calls of a jitted vjp (output and dq, dk, dv
from a fixed upstream gradient), blocked on the result; the table reports the median over
rounds, per call. Rows: `reference` (attention.reference_attention, materialised scores),
`blockwise bq/bkv` for each block size asked, and `torch` = torch.nn.functional.
scaled_dot_product_attention(is_causal=True) forward + backward with the same number of
threads as XLA uses (torch.set_num_threads(os.cpu_count())).

`--kv-heads G` (< 6): grouped-query attention with G key/value heads. The reference gets them
repeated to the 6 query heads (attention.repeat_kv); `blockwise` gets the G heads (its fast path
packs each group's query heads into one block, as the model's attention does) and `blockwise
.. repeated` the repeated ones (what the model ran before the packing); torch runs SDPA with
`enable_gqa=True`. Gradients of k and v are of the G heads everywhere.

PyTorch is not a dependency of the project; install the CPU wheel the numbers were taken with:
  pip install torch==2.13.0
Without torch the torch row is skipped. JSON goes to benchmarks/results/attention.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxfrontier.model import attention as attention_lib  # noqa: E402
from jaxfrontier.model.attention import blockwise  # noqa: E402

BATCH, HEADS, HEAD_DIM = 8, 6, 64


def jax_kernel(fn):
    """Jitted forward + backward of `fn(q, k, v)`; returns (out, dq, dk, dv)."""

    @jax.jit
    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(do))

    return lambda args: jax.block_until_ready(fwd_bwd(*args))


def torch_kernel(gqa: bool = False):
    """Forward + backward of PyTorch's fused CPU SDPA, or None when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None, None
    torch.set_num_threads(os.cpu_count())

    def run(args):
        q, k, v, do = args
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out.backward(do)
        return out, q.grad, k.grad, v.grad

    return run, torch.__version__


def inputs(seq, kv_heads=HEADS):
    """q, k, v, do: q and do of the 6 query heads, k and v of `kv_heads`."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal((BATCH, seq, h, HEAD_DIM), np.float32) for h in (HEADS, kv_heads, kv_heads, HEADS)]


def repeated(fn):
    """`fn` on k and v repeated to the query heads (the gradient flows back to the G heads)."""
    return lambda q, k, v: fn(q, attention_lib.repeat_kv(k, HEADS), attention_lib.repeat_kv(v, HEADS))


def measure(seq, blocks, rounds, iters, kv_heads=HEADS):
    """Median seconds per forward+backward call, per kernel, at sequence `seq`."""
    arrays = inputs(seq, kv_heads)
    jax_args = [jnp.asarray(a) for a in arrays]
    kernels = {'reference': (jax_kernel(repeated(attention_lib.reference_attention)), jax_args)}
    for b in blocks:
        fn = lambda q, k, v, b=b: blockwise.blockwise_attention(q, k, v, b, b)
        kernels[f'blockwise {b}/{b}'] = (jax_kernel(fn), jax_args)
        if kv_heads != HEADS:
            kernels[f'blockwise {b}/{b} repeated'] = (jax_kernel(repeated(fn)), jax_args)
    run_torch, torch_version = torch_kernel(kv_heads != HEADS)
    if run_torch is not None:
        import torch
        # SDPA takes [B, H, T, K]; the transposed views are what a model would pass.
        torch_args = [torch.from_numpy(a).transpose(1, 2).contiguous() for a in arrays]
        kernels['torch sdpa'] = (run_torch, torch_args)
    outputs = {name: run(args) for name, (run, args) in kernels.items()}  # warm-up and compile
    check_agreement(outputs)
    times = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, (run, args) in kernels.items():
            start = time.perf_counter()
            for _ in range(iters):
                run(args)
            times[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(ts) for name, ts in times.items()}, torch_version


def check_agreement(outputs):
    """Every kernel computes the same output and gradients (a benchmark of a wrong kernel is void)."""
    ref = [np.asarray(x) for x in outputs['reference']]
    for name, got in outputs.items():
        for what, g, r in zip(('out', 'dq', 'dk', 'dv'), got, ref):
            g = g.detach().numpy() if hasattr(g, 'detach') else np.asarray(g)
            if name == 'torch sdpa':
                g = g.transpose(0, 2, 1, 3)  # [B, H, T, K] -> [B, T, H, K]
            np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-4, err_msg=f'{name} {what}')


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--seqs', default='256,2048')
    p.add_argument('--blocks', default='64,128,256')
    p.add_argument('--rounds', type=int, default=5)
    p.add_argument('--iters', type=int, default=0, help='calls per round; 0: 5 at seq <= 512, else 1')
    p.add_argument('--kv-heads', type=int, default=HEADS, help=f'key/value heads dividing {HEADS} (GQA below {HEADS})')
    p.add_argument('--out', default=os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'attention.json'))
    args = p.parse_args()
    if args.kv_heads < 1 or HEADS % args.kv_heads:
        p.error(f'--kv-heads {args.kv_heads}: it must divide the {HEADS} query heads (1, 2, 3 or 6)')
    blocks = [int(b) for b in args.blocks.split(',')]
    results, torch_version = {}, None
    for seq in (int(s) for s in args.seqs.split(',')):
        iters = args.iters or (5 if seq <= 512 else 1)
        results[seq], torch_version = measure(seq, blocks, args.rounds, iters, args.kv_heads)
    print(f'attention core, forward + backward, batch {BATCH}, {HEADS} heads ({args.kv_heads} kv), head dim {HEAD_DIM}, fp32, '
          f'{os.cpu_count()} cores, median of {args.rounds} rounds (ms; x = / torch)')
    print('| kernel | ' + ' | '.join(f'seq {s} ms | x torch' for s in results) + ' |')
    print('|---|' + '---|---|' * len(results))
    for name in next(iter(results.values())):
        cells = []
        for r in results.values():
            ratio = r[name] / r['torch sdpa'] if 'torch sdpa' in r else float('nan')
            cells.append(f'{r[name] * 1e3:.1f} | {ratio:.2f}')
        print(f'| {name} | ' + ' | '.join(cells) + ' |')
    out = {'shape': dict(batch=BATCH, heads=HEADS, kv_heads=args.kv_heads, head_dim=HEAD_DIM, dtype='float32'), 'cpu_count': os.cpu_count(),
           'jax': jax.__version__, 'torch': torch_version, 'rounds': args.rounds,
           'median_s': {str(s): r for s, r in results.items()}}
    path = args.out
    with open(path, 'w') as f:
        json.dump(out, f, indent=1)
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
