"""Ring attention: causal attention over a sequence split across the `context` mesh axis.

Each of the c context ranks holds T/c tokens of q, k, v and of their positions and segments
(in whatever order the caller laid them out: natural, or sequence.balanced_order's zigzag, in
which rank r holds chunks r and 2c-1-r of the sequence). The keys and values travel around the
ring with `lax.ppermute`, one hop per step, so after c steps every rank has seen every chunk:

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

from jaxfrontier.model import blockwise



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
    """Bytes each rank sends per ring attention call, {'forward', 'backward'} (no JAX; the planner's count).

    `batch` and `heads` are the rank's own (after any data / tensor split), `itemsize` that of
    k and v. The forward passes k, v and their int32 positions (and segments) c - 1 hops; the
    backward passes them again c - 1 hops, and the fp32 dk, dv buffers c hops (home).
    """
    rows = batch * (seq_len // context)
    kv = 2 * rows * heads * head_dim * itemsize + rows * 4 * (2 if segments else 1)
    grads = 2 * rows * heads * head_dim * 4
    hops = context - 1
    return {'forward': hops * kv, 'backward': hops * kv + (context * grads if context > 1 else 0)}


def _shard(axis: str, body, num_in: int, num_out: int):
    """`body` in a shard_map manual over `axis` only, every argument and result split on dim 1 (T)."""
    spec = P(None, axis)
    return jax.shard_map(body, in_specs=(spec,) * num_in, out_specs=(spec,) * num_out, axis_names={axis},
                         check_vma=False)


def _ring_perm(context: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % context) for i in range(context)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids):
    return _ring_fwd(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids)[0]


def _ring_fwd(axis, context, block_q, block_kv, q_bthk, k_bthk, v_bthk, ids):
    body = functools.partial(_forward_body, axis, context, block_q, block_kv, len(ids))
    o_bthk, lse_bth = _shard(axis, body, 3 + len(ids), 2)(q_bthk, k_bthk, v_bthk, *ids)
    o_bthk = o_bthk.astype(q_bthk.dtype)
    return o_bthk, (q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, ids)


def _ring_bwd(axis, context, block_q, block_kv, residuals, do_bthk):
    q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, ids = residuals
    body = functools.partial(_backward_body, axis, context, block_q, block_kv, len(ids))
    grads = _shard(axis, body, 6 + len(ids), 3)(q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, do_bthk, *ids)
    dq, dk, dv = (g.astype(x.dtype) for g, x in zip(grads, (q_bthk, k_bthk, v_bthk)))
    return dq, dk, dv, jax.tree.map(lambda _: None, ids)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _split_ids(num_ids, ids):
    """(positions, segments or None) from the 1 or 2 id arrays."""
    return ids[0], (ids[1] if num_ids == 2 else None)


def _forward_body(axis, context, block_q, block_kv, num_ids, q_bthk, k_bthk, v_bthk, *ids):
    """One rank: local queries against each chunk as it passes; (o fp32, lse) of the local rows."""
    q_pos, q_seg = _split_ids(num_ids, ids)
    perm = _ring_perm(context)

    def partial(kv):
        k, v, *kv_ids = kv
        kv_pos, kv_seg = _split_ids(num_ids, kv_ids)
        return blockwise.masked_forward(q_bthk, k, v, q_pos, kv_pos, q_seg, kv_seg, block_q=block_q,
                                        block_kv=block_kv)

    def step(carry, _):
        o, lse, kv = carry
        arriving = jax.lax.ppermute(kv, axis, perm)  # issued first: overlaps the compute below
        o, lse = merge(o, lse, *partial(kv))
        return (o, lse, arriving), None

    init = (jnp.zeros(q_bthk.shape, jnp.float32), jnp.full(q_bthk.shape[:3], blockwise.MASKED, jnp.float32),
            (k_bthk, v_bthk, *ids))
    (o, lse, kv), _ = jax.lax.scan(step, init, None, length=context - 1)
    return merge(o, lse, *partial(kv))  # the last visitor: nothing more to send


def _backward_body(axis, context, block_q, block_kv, num_ids, q_bthk, k_bthk, v_bthk, o_bthk, lse_bth, do_bthk,
                   *ids):
    """One rank's share of the second ring pass: (dq, dk, dv) fp32 of the local rows."""
    q_pos, q_seg = _split_ids(num_ids, ids)
    delta_bth = blockwise.row_delta(do_bthk, o_bthk)
    perm = _ring_perm(context)

    def grads(kv):
        k, v, *kv_ids = kv
        kv_pos, kv_seg = _split_ids(num_ids, kv_ids)
        return blockwise.masked_backward(q_bthk, k, v, do_bthk, lse_bth, delta_bth, q_pos, kv_pos, q_seg, kv_seg,
                                         block_q=block_q, block_kv=block_kv)

    def visit(dq, kv, dkv):
        dq_s, dk_s, dv_s = grads(kv)
        # dk, dv of the visiting chunk travel on with it; after c hops they are home.
        return dq + dq_s, jax.lax.ppermute((dkv[0] + dk_s, dkv[1] + dv_s), axis, perm)

    def step(carry, _):
        dq, kv, dkv = carry
        arriving = jax.lax.ppermute(kv, axis, perm)  # issued first: overlaps the compute below
        dq, dkv = visit(dq, kv, dkv)
        return (dq, arriving, dkv), None

    zeros = jnp.zeros(k_bthk.shape, jnp.float32)
    init = (jnp.zeros(q_bthk.shape, jnp.float32), (k_bthk, v_bthk, *ids), (zeros, zeros))
    (dq, kv, dkv), _ = jax.lax.scan(step, init, None, length=context - 1)
    dq, (dk, dv) = visit(dq, kv, dkv)
    return dq, dk, dv
