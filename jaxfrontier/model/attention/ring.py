"""Ring attention: causal attention over a sequence split across the `context` mesh axis.

Each of the c context ranks holds T/c tokens of q, k, v and of their positions and segments
(in whatever order the caller laid them out: natural, or sequence.balanced_order's zigzag, in
which rank r holds chunks r and 2c-1-r of the sequence). The keys and values travel around the
ring with `lax.ppermute`, one hop per step, so after c steps every rank has seen every chunk.
The ids are small (int32 per token): one all-gather before the ring gives each rank every
chunk's, and every step's visit table (blockwise.block_visits) is made then, so the loop
passes only k and v and waits on nothing else; the tables are saved for the backward.

  forward   c steps; step s computes the local queries against the chunk of rank r - s with the
            masked blockwise kernel (blockwise.masked_forward: normalised output and row
            logsumexp, fp32) and merges it into the running result by the online softmax
            (`merge`). The send of the next chunk is issued before the current chunk's compute,
            so XLA can overlap the two.
  backward  a second ring pass (custom VJP) recomputing from the saved q, k, v, output and
            logsumexp (FlashAttention-2's backward per chunk, blockwise.masked_backward): dq
            accumulates locally; dk and dv accumulate in fp32 buffers that travel with their
            chunk and arrive home after the full circle (c hops).

A visiting chunk that lies wholly after the local queries (causal), or in other documents, is
skipped block pair by block pair by the masked kernel's visit table, so the work a rank does
is the visible block pairs of its queries: equal across ranks under the balanced order, about
(2r + 1) / c of the mean for rank r under the natural one (`ring_block_pairs` counts it).

`ring_attention` is called inside an automatically sharded jit (T sharded over `axis`; batch and
heads may be sharded over other axes): its `jax.shard_map` is manual over `axis` only, so the
other axes stay automatic, and it nests inside the pipeline's map (manual over pipeline and data).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxfrontier.model.attention import blockwise, saved



def ring_attention(q_bthk: jax.Array, k_bthk: jax.Array, v_bthk: jax.Array, *, positions_bt: jax.Array | None,
                   segments_bt: jax.Array | None = None, block_q: int, block_kv: int,
                   axis: str = 'context') -> jax.Array:
    """Causal attention (attention.visible's mask) with the sequence split over mesh axis `axis`.

    Args:
      q_bthk, k_bthk, v_bthk: [B, T, H, K] (kv heads already repeated), T sharded over `axis`.
      positions_bt: the tokens' positions [B, T] in the layout's token order; None: 0..T-1.
      segments_bt: documents [B, T], or None (one per row).
      block_q, block_kv: the blockwise kernel's block sizes, applied to each rank's T/c rows.
      axis: the mesh axis the sequence is split over; the mesh is the one set by jax.set_mesh.

    Returns:
      The output [B, T, H, K] in q's dtype, laid out as q.
    """
    b, t = q_bthk.shape[:2]
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    mesh = jax.sharding.get_abstract_mesh()
    context = 1 if mesh.empty or axis not in mesh.shape else mesh.shape[axis]
    if context == 1:
        return blockwise.blockwise_attention(q_bthk, k_bthk, v_bthk, block_q, block_kv, positions_bt=positions_bt,
                                             segments_bt=segments_bt)
    if t % context:
        raise ValueError(f'ring attention: sequence {t} does not split over {axis}={context}')
    ids = (positions_bt,) if segments_bt is None else (positions_bt, segments_bt)
    return _ring(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids)


def merge(o_a, lse_a, o_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys -> one (online softmax).

    o [B, T, H, K] normalised and lse [B, T, H], fp32. A row that saw nothing has lse MASKED
    (finite) and o 0: its weight is exp(MASKED - lse) = 0, or 1 against another empty row, where
    both outputs are 0; never inf - inf.
    """
    m = jnp.maximum(lse_a, lse_b)
    w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
    lse = m + jnp.log(w_a + w_b)
    return (o_a * jnp.exp(lse_a - lse)[..., None] + o_b * jnp.exp(lse_b - lse)[..., None]), lse


def ring_block_pairs(positions_bt, segments_bt, context: int, block_q: int, block_kv: int) -> np.ndarray:
    """Block pairs each context rank computes over the c steps of the ring ([context] ints, numpy).

    `positions_bt` / `segments_bt` [B, T] in the layout's token order; rank r holds rows
    r*T/c .. (r+1)*T/c. The kernel's own visit rule (blockwise.block_visits), so these are the
    pairs the forward computes, and the backward too; a pair costs 4 * B * H * block_q * block_kv
    * K FLOPs forward.
    """
    positions_bt = np.asarray(positions_bt)
    chunks = np.split(positions_bt, context, axis=1)
    seg_chunks = [None] * context if segments_bt is None else np.split(np.asarray(segments_bt), context, axis=1)
    return np.array([sum(blockwise.executed_block_pairs(chunks[r], chunks[j], seg_chunks[r], seg_chunks[j],
                                                        block_q=block_q, block_kv=block_kv)
                         for j in range(context)) for r in range(context)])


def ring_send_bytes(batch: int, seq_len: int, heads: int, head_dim: int, itemsize: int, context: int,
                    segments: bool) -> dict[str, int]:
    """The ring's traffic per rank and call, {'forward', 'backward'} in bytes (no JAX; the planner's count).

    `batch` and `heads` are the rank's own (after any data / tensor split), `itemsize` that of k
    and v. The forward all-gathers the int32 positions (and segments) once and passes k, v c - 1
    hops; the backward passes k, v c - 1 hops again and the fp32 dk, dv buffers c hops (home).
    Bytes as plan/hlo_collectives counts them (a collective-permute: the buffer sent; an
    all-gather: the gathered buffer).
    """
    if context == 1:
        return {'forward': 0, 'backward': 0}
    rows = batch * (seq_len // context)
    kv = 2 * rows * heads * head_dim * itemsize
    gathered_ids = batch * seq_len * 4 * (2 if segments else 1)
    grads = 2 * rows * heads * head_dim * 4
    return {'forward': (context - 1) * kv + gathered_ids, 'backward': (context - 1) * kv + context * grads}


def _shard(axis: str, body, in_specs, out_specs):
    """`body` in a shard_map manual over `axis` only (every other mesh axis stays automatic)."""
    return jax.shard_map(body, in_specs=in_specs, out_specs=out_specs, axis_names={axis}, check_vma=False)


def _ring_perm(context: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % context) for i in range(context)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids):
    return _ring_fwd(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids)[0]


def _ring_fwd(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids):
    tokens, steps = P(None, axis), P(axis)  # [B, T, ...] split on T; per-step tables stacked by rank
    body = functools.partial(_forward_body, axis, context, block_q, block_kv, len(ids))
    o_bthk, lse_bth, plan = _shard(axis, body, (tokens,) * (3 + len(ids)), (tokens, tokens, steps))(
        q_bthk, k_bthk, v_bthk, *ids)
    o_bthk, (lse_bth, plan) = saved.keep(o_bthk.astype(q_bthk.dtype), (lse_bth, plan))  # one forward
    return o_bthk, (q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, ids, plan)


def _ring_bwd(axis, context, block_q, block_kv, residuals, do_bthk):
    q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, ids, plan = residuals
    tokens, steps = P(None, axis), P(axis)
    body = functools.partial(_backward_body, axis, context, block_q, block_kv, len(ids))
    grads = _shard(axis, body, (tokens,) * 6 + (steps,) + (tokens,) * len(ids), (tokens,) * 3)(
        q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, do_bthk, plan, *ids)
    dq, dk, dv = (g.astype(x.dtype) for g, x in zip(grads, (q_bthk, k_bthk, v_bthk)))
    return dq, dk, dv, jax.tree.map(lambda _: None, ids)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _split_ids(num_ids, ids):
    """(positions, segments or None) from the 1 or 2 id arrays."""
    return ids[0], (ids[1] if num_ids == 2 else None)


def _step_plan(axis, context, block_q, block_kv, num_ids, ids):
    """What each of the c steps visits, made once: (visit tables [c, Nq, Nkv], the visiting chunks'
    ids, each [c, B, T/c]).

    The ids are small (int32 per token), so one all-gather brings every chunk's; step s visits
    rank r - s's. Deciding every step's block pairs here (one reduction over an automatic batch
    axis, not one per step) leaves the ring loop only k and v to pass and nothing to wait on.
    """
    q_pos, q_seg = _split_ids(num_ids, ids)
    source = (jax.lax.axis_index(axis) - jnp.arange(context)) % context
    step_ids = tuple(jnp.take(jax.lax.all_gather(x, axis), source, axis=0) for x in ids)  # [c, B, T/c] each

    def visits(kv_ids):
        kv_pos, kv_seg = _split_ids(num_ids, kv_ids)
        return blockwise.block_visits(q_pos, kv_pos, q_seg, kv_seg, block_q, block_kv)

    return jax.vmap(visits)(step_ids), step_ids


def _forward_body(axis, context, block_q, block_kv, num_ids, q_bthk, k_bthk, v_bthk, *ids):
    """One rank: local queries against each chunk as it passes; (o fp32, lse, the step plan)."""
    q_pos, q_seg = _split_ids(num_ids, ids)
    perm = _ring_perm(context)
    plan = _step_plan(axis, context, block_q, block_kv, num_ids, ids)

    def partial(kv, visits, kv_ids):
        kv_pos, kv_seg = _split_ids(num_ids, kv_ids)
        return blockwise.masked_forward(q_bthk, *kv, q_pos, kv_pos, q_seg, kv_seg, block_q=block_q,
                                        block_kv=block_kv, visits=visits)

    def step(carry, plan_s):
        o, lse, kv = carry
        arriving = jax.lax.ppermute(kv, axis, perm)  # issued first: overlaps the compute below
        o, lse = merge(o, lse, *partial(kv, *plan_s))
        return (o, lse, arriving), None

    init = (jnp.zeros(q_bthk.shape, jnp.float32), jnp.full(q_bthk.shape[:3], blockwise.MASKED, jnp.float32),
            (k_bthk, v_bthk))
    (o, lse, kv), _ = jax.lax.scan(step, init, jax.tree.map(lambda x: x[:-1], plan))
    o, lse = merge(o, lse, *partial(kv, *jax.tree.map(lambda x: x[-1], plan)))  # the last visitor: no send
    return o, lse, plan


def _backward_body(axis, context, block_q, block_kv, num_ids, q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, do_bthk,
                   plan, *ids):
    """One rank's share of the second ring pass: (dq, dk, dv) fp32 of the local rows."""
    q_pos, q_seg = _split_ids(num_ids, ids)
    delta_bth = blockwise.row_delta(do_bthk, o_bthk)
    perm = _ring_perm(context)

    def visit(dq, kv, dkv, visits, kv_ids):
        kv_pos, kv_seg = _split_ids(num_ids, kv_ids)
        dq_s, dk_s, dv_s = blockwise.masked_backward(q_bthk, *kv, do_bthk, lse_bth, delta_bth, q_pos, kv_pos, q_seg,
                                                     kv_seg, block_q=block_q, block_kv=block_kv, visits=visits)
        # dk, dv of the visiting chunk travel on with it; after c hops they are home.
        return dq + dq_s, jax.lax.ppermute((dkv[0] + dk_s, dkv[1] + dv_s), axis, perm)

    def step(carry, plan_s):
        dq, kv, dkv = carry
        arriving = jax.lax.ppermute(kv, axis, perm)  # issued first: overlaps the compute below
        dq, dkv = visit(dq, kv, dkv, *plan_s)
        return (dq, arriving, dkv), None

    zeros = jnp.zeros(k_bthk.shape, jnp.float32)
    init = (jnp.zeros(q_bthk.shape, jnp.float32), (k_bthk, v_bthk), (zeros, zeros))
    (dq, kv, dkv), _ = jax.lax.scan(step, init, jax.tree.map(lambda x: x[:-1], plan))
    dq, (dk, dv) = visit(dq, kv, dkv, *jax.tree.map(lambda x: x[-1], plan))
    return dq, dk, dv
