"""Ring attention against gathered attention at context 1, 2, 4 on simulated CPU devices, one run.

  python benchmarks/ring_attention.py [--seq 2048] [--contexts 1,2,4] [--block 128] [--rounds 5]

The attention core alone, forward + backward (output and dq, dk, dv from a fixed upstream
gradient), batch 2, 4 heads, head dim 64, fp32, causal, tokens in the balanced (zigzag) order
(model/sequence.balanced_order), on a mesh ('context',) of c simulated CPU devices:

  ring      model/ring.ring_attention: k/v passed around the ring with ppermute.
  gathered  all-gather context parallelism (MaxText's default): each rank all-gathers k, v and
            their positions, runs the masked blockwise kernel of its queries against the whole
            sequence, and reduce-scatters dk, dv in the backward (`gathered_attention` below).
            (Leaving it to XLA's sharding propagation is no baseline: it puts all-gathers inside
            the kernel's loops.)

Each round times both once (interleaved, so a shared machine's noise hits both alike); the
table reports the median per call. From each compiled program: the bytes each device sends
(plan/hlo_collectives, per device and call) by collective kind, against ring.ring_send_bytes;
and the block pairs each rank executes (ring.ring_block_pairs). (At context 2 the ring's
compiled program sends one k/v hop less than counted: XLA merges the backward's first hop
with the forward's, both being in one program without rematerialisation.) Simulated devices share the
host's cores, so the times show overhead and the work split, not a GPU ring's overlap: time
this on a quiet machine. JSON goes to benchmarks/results/ring_attention.json.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4').strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxfrontier.model.attention import blockwise
from jaxfrontier.model.attention import ring  # noqa: E402
from jaxfrontier.model.sequence import balanced_order  # noqa: E402
from jaxfrontier.plan import hlo_collectives  # noqa: E402

BATCH, HEADS, HEAD_DIM = 2, 4, 64


def gathered_attention(block, axis='context'):
    """All-gather context parallelism with the masked blockwise kernel (custom VJP, no ring)."""
    spec = P(None, axis)

    def gather(*xs):
        return [jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in xs]

    def local_fwd(q, k, v, pos):
        k_all, v_all, pos_all = gather(k, v, pos)
        o, lse = blockwise.masked_forward(q, k_all, v_all, pos, pos_all, block_q=block, block_kv=block)
        return o.astype(q.dtype), lse

    def local_bwd(q, k, v, pos, o, lse, do):
        k_all, v_all, pos_all = gather(k, v, pos)
        dq, dk_all, dv_all = blockwise.masked_backward(q, k_all, v_all, do, lse, blockwise.row_delta(do, o), pos,
                                                       pos_all, block_q=block, block_kv=block)
        dk, dv = (jax.lax.psum_scatter(g, axis, scatter_dimension=1, tiled=True) for g in (dk_all, dv_all))
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)

    def shard(fn, num_in, num_out):
        return jax.shard_map(fn, in_specs=(spec,) * num_in, out_specs=(spec,) * num_out, axis_names={axis},
                             check_vma=False)

    @jax.custom_vjp
    def attend(q, k, v, pos):
        return shard(local_fwd, 4, 2)(q, k, v, pos)[0]

    def fwd(q, k, v, pos):
        o, lse = shard(local_fwd, 4, 2)(q, k, v, pos)
        return o, (q, k, v, pos, o, lse)

    def bwd(res, do):
        return (*shard(local_bwd, 7, 3)(*res, do), None)

    attend.defvjp(fwd, bwd)
    return attend


def kernels(block):
    def ring_fn(q, k, v, pos):
        return ring.ring_attention(q, k, v, positions_bt=pos, block_q=block, block_kv=block)

    return {'ring': ring_fn, 'gathered': gathered_attention(block)}


def compiled(fn, mesh, args):
    """The jitted forward + backward of `fn` on `mesh` (inputs sharded over context), compiled."""

    def fwd_bwd(q, k, v, do, pos):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, pos), q, k, v)
        return (out, *vjp(do))

    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, NamedSharding(mesh, P(None, 'context'))) for a in args]
        exe = jax.jit(fwd_bwd).lower(*sharded).compile()
    return exe, sharded


def sent_bytes(hlo_text, context):
    """Bytes per device per call by collective kind, from the compiled program."""
    out = {}
    for c in hlo_collectives.collectives(hlo_text, {'context': context}):
        if c.group_size > 1:  # a group of one moves nothing
            out[c.kind] = out.get(c.kind, 0) + c.total_bytes
    return out


def measure(seq, context, block, rounds):
    mesh = jax.make_mesh((context,), ('context',), axis_types=(AxisType.Auto,), devices=jax.devices()[:context])
    rng = np.random.default_rng(0)
    order = balanced_order(seq, context)
    arrays = [jnp.asarray(rng.standard_normal((BATCH, seq, HEADS, HEAD_DIM), np.float32)) for _ in range(4)]
    pos = jnp.asarray(np.broadcast_to(order, (BATCH, seq)), jnp.int32)
    programs = {name: compiled(fn, mesh, [*arrays, pos]) for name, fn in kernels(block).items()}
    outs = {name: jax.block_until_ready(exe(*args)) for name, (exe, args) in programs.items()}
    for what, a, b in zip(('out', 'dq', 'dk', 'dv'), outs['ring'], outs['gathered']):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=what)  # a wrong kernel's time is void
    times = {name: [] for name in programs}
    for _ in range(rounds):
        for name, (exe, args) in programs.items():
            start = time.perf_counter()
            jax.block_until_ready(exe(*args))
            times[name].append(time.perf_counter() - start)
    return {
        'median_s': {name: statistics.median(ts) for name, ts in times.items()},
        'sent_bytes': {name: sent_bytes(exe.as_text(), context) for name, (exe, _) in programs.items()},
        'ring_send_bytes': ring.ring_send_bytes(BATCH, seq, HEADS, HEAD_DIM, 4, context, segments=False),
        'block_pairs_per_rank': ring.ring_block_pairs(pos, None, context, block, block).tolist(),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--seq', type=int, default=2048)
    p.add_argument('--contexts', default='1,2,4')
    p.add_argument('--block', type=int, default=128)
    p.add_argument('--rounds', type=int, default=5)
    args = p.parse_args()
    results = {c: measure(args.seq, c, args.block, args.rounds) for c in (int(x) for x in args.contexts.split(','))}
    print(f'attention core fwd + bwd, batch {BATCH}, {HEADS} heads, head dim {HEAD_DIM}, seq {args.seq}, '
          f'block {args.block}, fp32, balanced order, {os.cpu_count()} cores, median of {args.rounds} rounds')
    print('| context | ring ms | gathered ms | ring sent MB/device | counted MB | gathered sent MB/device | '
          'block pairs per rank |')
    print('|---|---|---|---|---|---|---|')
    for c, r in results.items():
        counted = sum(r['ring_send_bytes'].values()) / 1e6
        sent = {name: sum(kinds.values()) / 1e6 for name, kinds in r['sent_bytes'].items()}
        print(f"| {c} | {r['median_s']['ring'] * 1e3:.1f} | {r['median_s']['gathered'] * 1e3:.1f} | "
              f"{sent['ring']:.2f} | {counted:.2f} | {sent['gathered']:.2f} | {r['block_pairs_per_rank']} |")
    out = {'shape': dict(batch=BATCH, heads=HEADS, head_dim=HEAD_DIM, seq=args.seq, block=args.block,
                         dtype='float32'), 'cpu_count': os.cpu_count(), 'jax': jax.__version__,
           'rounds': args.rounds, 'results': {str(c): r for c, r in results.items()}}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'ring_attention.json')
    with open(path, 'w') as f:
        json.dump(out, f, indent=1)
    print(f'wrote {path}')


if __name__ == '__main__':
    main()
