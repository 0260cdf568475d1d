"""Blockwise (flash-style) causal attention in plain JAX, for any XLA backend.

The sequence is cut into query blocks of `block_q` rows and key/value blocks of `block_kv`
rows (padded up to a multiple; padding sits after every real position, so the causal mask
already hides it from real queries). For each query block the forward pass visits only the
key/value blocks at or before it, keeping an online softmax (running row max `m`, running
sum `l`, unnormalised output `acc`); blocks entirely below the diagonal skip the mask, blocks
above it are never computed. It saves q, k, v, the output and the fp32 row logsumexp, so
memory is O(s) per head, never O(s^2).

The backward pass (FlashAttention-2, Dao 2023, Algorithm 2) loops over key/value blocks and,
inside, over the query blocks at or after each; it recomputes each block's probabilities
p = exp(q k^T * scale - lse) from the saved logsumexp, accumulates dK and dV in the loop
carry and adds each block's dQ into an O(s) dQ buffer.

Grouped-query attention (G kv heads < H query heads) on the causal fast path packs each kv
head's H/G query heads into one query block of H/G x block_q rows ([N, B, G, H/G x block_q, K],
`_q_to_blocks`): the group shares its key/value blocks as it shares the heads, nothing is
repeated, dK and dV sum over the group inside the matmuls, and each block pair is one matmul
H/G times taller (small Llama on the CPU: 30 vs 41 ms per layer, forward and backward;
docs/PERFORMANCE.md). Multi-head attention (G = H) is the same program as before.

With positions and segments (`blockwise_attention(..., positions_bt=, segments_bt=)`) a
masked path replaces the block-index arithmetic: the mask per visited block pair, the pairs to
visit decided once from per-block id ranges (`block_visits`; the masked-path section below).
Its lower-level form, queries against a separate key/value chunk, is what ring attention
(model/attention/ring.py) runs at each step.

Everything is `lax.scan` / `lax.fori_loop` (trip counts depend on the block index), einsum
and elementwise ops, so XLA compiles it for the CPU, ROCm and CUDA alike. Matmul inputs stay
in the compute dtype; scores, softmax statistics and accumulators are fp32 (as in
attention.reference_attention). There is no attention-probability dropout, as in the
reference kernel (the model applies dropout to the residual branches only).

The forward rules name the output and logsumexp they keep (saved.py) for `model.remat=save_dots_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.attention.saved import keep

# Blocked activations: [blocks, batch, heads, rows, head_dim] and statistics [blocks, batch, heads, rows].
ACT_NBHRK = (None, 'batch', 'heads', None, None)
ACT_NBHR = (None, 'batch', 'heads', None)
# Grouped-query attention packed by kv head: [blocks, batch, kv heads, group x rows, head_dim], statistics alike.
ACT_NBGRK = (None, 'batch', 'kv_heads', None, None)
ACT_NBGR = (None, 'batch', 'kv_heads', None)
MASKED = float(jnp.finfo(jnp.float32).min)  # finite, so exp(MASKED - m) = 0 and never inf - inf


def blockwise_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, block_q: int = 128,
                        block_kv: int = 128, *, positions_bt: jax.Array | None = None,
                        segments_bt: jax.Array | None = None) -> jax.Array:
    """Causal softmax(q k^T / sqrt(k)) v, computed block by block (see the module docstring).

    Args:
      q_bthk, k_bshk, v_bshk: queries [batch, seq, heads, head_dim] and keys and values
        [batch, seq, kv_heads, head_dim] of the same sequence (self-attention), kv_heads dividing
        heads (grouped-query attention: query head i reads kv head i // (heads / kv_heads), as
        attention.repeat_kv). The causal fast path packs each kv head's group of query heads
        into one block of group x block_q rows, so a group shares its key/value blocks without
        repeating them and each block pair is one larger matmul; the masked path repeats them.
      block_q, block_kv: rows per query block and per key/value block; any positive sizes
        (the sequence need not be a multiple of either).
      positions_bt, segments_bt: the tokens' positions and documents [batch, seq] (model/sequence.py).
        Both None: the plain causal fast path (block pairs chosen by index, no id arrays). Either
        given: the masked path (positions default to 0..T-1), query i seeing key j where
        pos_j <= pos_i within one segment, wholly masked block pairs skipped.

    Returns:
      The attention output [batch, seq, heads, head_dim] in q's dtype.
    """
    b, t, h, k = q_bthk.shape
    g = k_bshk.shape[2]
    if k_bshk.shape != v_bshk.shape or k_bshk.shape != (b, t, g, k) or h % g:
        raise ValueError(f'blockwise attention needs q [B, T, H, K] and k, v [B, T, G, K] with G dividing H, '
                         f'got {q_bthk.shape}, {k_bshk.shape}, {v_bshk.shape}')
    if positions_bt is None and segments_bt is None:
        return _attention(block_q, block_kv, q_bthk, k_bshk, v_bshk)
    if g != h:  # the masked path runs per query head: kv heads repeated (attention.repeat_kv's order)
        k_bshk, v_bshk = (jnp.repeat(x, h // g, axis=2) for x in (k_bshk, v_bshk))
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    return _masked_attention(block_q, block_kv, q_bthk, k_bshk, v_bshk, positions_bt, segments_bt)


def visited_block_pairs(seq_len: int, block_q: int, block_kv: int) -> int:
    """(query block, key/value block) pairs the forward (and the backward) computes: those at or
    before the diagonal, after padding the sequence to whole blocks. The planner's FLOP count."""
    num_q, num_kv = -(-seq_len // block_q), -(-seq_len // block_kv)
    return sum(min((i * block_q + block_q - 1) // block_kv + 1, num_kv) for i in range(num_q))


def _to_blocks(x_bthk: jax.Array, block: int, names=ACT_NBHRK) -> jax.Array:
    """[B, T, H, K] -> [T_pad / block, B, H, block, K], zero-padded at the end of the sequence (`names`:
    its logical axes; ACT_NBGRK for a grouped-query attention's kv heads)."""
    b, t, h, k = x_bthk.shape
    n = -(-t // block)
    x_bthk = jnp.pad(x_bthk, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    x_nbhrk = x_bthk.reshape(b, n, block, h, k).transpose(1, 0, 3, 2, 4)  # [N, B, H, block, K]
    return mesh_lib.constrain(x_nbhrk, names)


def _from_blocks(x_nbhrk: jax.Array, t: int) -> jax.Array:
    """Inverse of _to_blocks: [N, B, H, block, K] -> [B, t, H, K]."""
    n, b, h, r, k = x_nbhrk.shape
    return x_nbhrk.transpose(1, 0, 3, 2, 4).reshape(b, n * r, h, k)[:, :t]  # [B, N * block, H, K] -> [B, t, H, K]


def _q_to_blocks(x_bthk: jax.Array, block: int, kv_heads: int) -> jax.Array:
    """Queries (or anything per query head) [B, T, H, K] -> [N, B, G, H/G x block, K]: query head
    g * H/G + r's rows of a block at rows r * block.. of kv head g's. G = H: _to_blocks itself."""
    b, t, h, k = x_bthk.shape
    if kv_heads == h:
        return _to_blocks(x_bthk, block)
    n, group = -(-t // block), h // kv_heads
    x_bthk = jnp.pad(x_bthk, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    x = x_bthk.reshape(b, n, block, kv_heads, group, k).transpose(1, 0, 3, 4, 2, 5)  # [N, B, G, H/G, block, K]
    return mesh_lib.constrain(x.reshape(n, b, kv_heads, group * block, k), ACT_NBGRK)


def _q_from_blocks(x_nbgrk: jax.Array, t: int, heads: int) -> jax.Array:
    """Inverse of _q_to_blocks: [N, B, G, H/G x block, K] -> [B, t, H, K]."""
    n, b, g, rows, k = x_nbgrk.shape
    if g == heads:
        return _from_blocks(x_nbgrk, t)
    group = heads // g
    x = x_nbgrk.reshape(n, b, g, group, rows // group, k).transpose(1, 0, 4, 2, 3, 5)  # [B, N, block, G, H/G, K]
    return x.reshape(b, n * (rows // group), heads, k)[:, :t]


def _scores(q_bhqk, k_bhsk, scale, q_start, kv_start, masked: bool, block_q: int) -> jax.Array:
    """fp32 scaled scores [B, H, rows, block_kv] of one block pair, causally masked if asked; the
    rows are block_q queries, or a packed group's H/G x block_q (the same positions per head)."""
    s_bhqs = jnp.einsum('bhqk,bhsk->bhqs', q_bhqk, k_bhsk, preferred_element_type=jnp.float32) * scale
    if masked:
        rows = q_bhqk.shape[2]
        q_pos = q_start + (jnp.arange(rows) if rows == block_q else jnp.tile(jnp.arange(block_q), rows // block_q))
        kv_pos = kv_start + jnp.arange(k_bhsk.shape[2])
        s_bhqs = jnp.where(q_pos[:, None] >= kv_pos[None, :], s_bhqs, MASKED)
    return s_bhqs


def _forward(block_q: int, block_kv: int, q_bthk, k_bshk, v_bshk):
    """(output [B, T, H, K], logsumexp [Nq, B, G, H/G x block_q] fp32; G = H without grouped-query attention)."""
    t, h, head_dim, g = q_bthk.shape[1], q_bthk.shape[2], q_bthk.shape[3], k_bshk.shape[2]
    scale = head_dim ** -0.5
    act, act_stats = (ACT_NBHRK, ACT_NBHR) if g == h else (ACT_NBGRK, ACT_NBGR)
    q_nbhqk = _q_to_blocks(q_bthk, block_q, g)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv, act), _to_blocks(v_bshk, block_kv, act)
    num_kv = k_nbhsk.shape[0]

    def q_block(_, xs):
        q_bhqk, i = xs
        q_start = i * block_q
        b, h, rows, _ = q_bhqk.shape

        def kv_step(masked, j, carry):
            m_bhq, l_bhq, acc_bhqk = carry
            s_bhqs = _scores(q_bhqk, k_nbhsk[j], scale, q_start, j * block_kv, masked, block_q)
            m_new = jnp.maximum(m_bhq, s_bhqs.max(-1))
            alpha_bhq = jnp.exp(m_bhq - m_new)
            p_bhqs = jnp.exp(s_bhqs - m_new[..., None])
            l_bhq = alpha_bhq * l_bhq + p_bhqs.sum(-1)
            pv_bhqk = jnp.einsum('bhqs,bhsk->bhqk', p_bhqs.astype(v_nbhsk.dtype), v_nbhsk[j],
                                 preferred_element_type=jnp.float32)
            return m_new, l_bhq, alpha_bhq[..., None] * acc_bhqk + pv_bhqk

        # kv blocks [0, n_full) lie wholly at or before the block's first query: no mask.
        n_full = jnp.minimum((q_start + 1) // block_kv, num_kv)
        n_total = jnp.minimum((q_start + block_q - 1) // block_kv + 1, num_kv)
        init = (jnp.full((b, h, rows), MASKED, jnp.float32), jnp.zeros((b, h, rows), jnp.float32),
                jnp.zeros((b, h, rows, head_dim), jnp.float32))
        carry = jax.lax.fori_loop(0, n_full, functools.partial(kv_step, False), init)
        m_bhq, l_bhq, acc_bhqk = jax.lax.fori_loop(n_full, n_total, functools.partial(kv_step, True), carry)
        o_bhqk = (acc_bhqk / l_bhq[..., None]).astype(q_bhqk.dtype)
        return None, (o_bhqk, m_bhq + jnp.log(l_bhq))

    _, (o_nbhqk, lse_nbhq) = jax.lax.scan(q_block, None, (q_nbhqk, jnp.arange(q_nbhqk.shape[0])))
    return _q_from_blocks(mesh_lib.constrain(o_nbhqk, act), t, h), mesh_lib.constrain(lse_nbhq, act_stats)


def _pair_grads(p_bhqs, q_bhqk, do_bhqk, k_bhsk, v_bhsk, delta_bhq, scale, dk_bhsk, dv_bhsk):
    """One block pair's backward from its probabilities p (FlashAttention-2): (dq of the query
    block, dk and dv of the key/value block with this pair's share added), fp32 accumulation."""
    dv_bhsk = dv_bhsk + jnp.einsum('bhqs,bhqk->bhsk', p_bhqs.astype(do_bhqk.dtype), do_bhqk,
                                   preferred_element_type=jnp.float32)
    dp_bhqs = jnp.einsum('bhqk,bhsk->bhqs', do_bhqk, v_bhsk, preferred_element_type=jnp.float32)
    ds_bhqs = (p_bhqs * (dp_bhqs - delta_bhq[..., None]) * scale).astype(q_bhqk.dtype)
    dq_bhqk = jnp.einsum('bhqs,bhsk->bhqk', ds_bhqs, k_bhsk, preferred_element_type=jnp.float32)
    dk_bhsk = dk_bhsk + jnp.einsum('bhqs,bhqk->bhsk', ds_bhqs, q_bhqk, preferred_element_type=jnp.float32)
    return dq_bhqk, dk_bhsk, dv_bhsk


def _backward(block_q: int, block_kv: int, residuals, do_bthk):
    """(dq, dk, dv) by FlashAttention-2's backward: key/value blocks outer, query blocks inner."""
    q_bthk, k_bshk, v_bshk, o_bthk, lse_nbhq = residuals
    t, h, head_dim, g = q_bthk.shape[1], q_bthk.shape[2], q_bthk.shape[3], k_bshk.shape[2]
    scale = head_dim ** -0.5
    act = ACT_NBHRK if g == h else ACT_NBGRK
    q_nbhqk, do_nbhqk = _q_to_blocks(q_bthk, block_q, g), _q_to_blocks(do_bthk.astype(q_bthk.dtype), block_q, g)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv, act), _to_blocks(v_bshk, block_kv, act)
    # delta = rowsum(dO * O) = rowsum(P * dP): the softmax's backward subtracts it.
    delta_bht = jnp.einsum('bthk,bthk->bht', do_bthk.astype(jnp.float32), o_bthk.astype(jnp.float32))
    delta_nbhq = _q_to_blocks(delta_bht.transpose(0, 2, 1)[..., None], block_q, g)[..., 0]  # via [B, T, H, 1]
    num_q = q_nbhqk.shape[0]

    def kv_block(dq_nbhqk, xs):
        k_bhsk, v_bhsk, j = xs
        kv_start = j * block_kv

        def q_step(masked, i, carry):
            dq_nbhqk, dk_bhsk, dv_bhsk = carry
            q_bhqk, do_bhqk = q_nbhqk[i], do_nbhqk[i]
            s_bhqs = _scores(q_bhqk, k_bhsk, scale, i * block_q, kv_start, masked, block_q)
            p_bhqs = jnp.exp(s_bhqs - lse_nbhq[i][..., None])
            dq_bhqk, dk_bhsk, dv_bhsk = _pair_grads(p_bhqs, q_bhqk, do_bhqk, k_bhsk, v_bhsk, delta_nbhq[i], scale,
                                                    dk_bhsk, dv_bhsk)
            return dq_nbhqk.at[i].add(dq_bhqk), dk_bhsk, dv_bhsk

        # q blocks [first, num_q) see this kv block; from first_full on, every row sees all of it.
        first = jnp.minimum(kv_start // block_q, num_q)
        first_full = jnp.clip((kv_start + block_kv - 1 + block_q - 1) // block_q, first, num_q)
        zeros = jnp.zeros(k_bhsk.shape, jnp.float32)
        carry = jax.lax.fori_loop(first, first_full, functools.partial(q_step, True), (dq_nbhqk, zeros, zeros))
        dq_nbhqk, dk_bhsk, dv_bhsk = jax.lax.fori_loop(first_full, num_q, functools.partial(q_step, False), carry)
        return dq_nbhqk, (dk_bhsk, dv_bhsk)

    dq_init = mesh_lib.constrain(jnp.zeros(q_nbhqk.shape, jnp.float32), act)
    dq_nbhqk, (dk_nbhsk, dv_nbhsk) = jax.lax.scan(kv_block, dq_init,
                                                  (k_nbhsk, v_nbhsk, jnp.arange(k_nbhsk.shape[0])))
    dq_bthk = _q_from_blocks(mesh_lib.constrain(dq_nbhqk, act), t, h).astype(q_bthk.dtype)
    dk_bshk = _from_blocks(mesh_lib.constrain(dk_nbhsk, act), t).astype(k_bshk.dtype)
    return dq_bthk, dk_bshk, _from_blocks(mesh_lib.constrain(dv_nbhsk, act), t).astype(v_bshk.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(block_q: int, block_kv: int, q_bthk, k_bshk, v_bshk):
    return _forward(block_q, block_kv, q_bthk, k_bshk, v_bshk)[0]


def _attention_fwd(block_q, block_kv, q_bthk, k_bshk, v_bshk):
    o_bthk, lse_nbhq = keep(*_forward(block_q, block_kv, q_bthk, k_bshk, v_bshk))
    return o_bthk, (q_bthk, k_bshk, v_bshk, o_bthk, lse_nbhq)


_attention.defvjp(_attention_fwd, _backward)


# --------------------------------------------------------------------------- masked path
#
# With explicit positions and segments (packed documents, context parallelism's token order)
# query i sees key j iff pos_j <= pos_i and seg_i == seg_j (attention.visible). Queries and keys
# may be different chunks of one sequence (ring attention, model/attention/ring.py): each side brings its
# own positions and segments. Which block pairs hold any visible entry is decided once, before
# the loops, from each block's min/max position and segment (over the batch and the block's
# real rows; nothing assumes the blocks are in order), so a pair that is wholly masked is
# skipped whatever the token order; a pair that is visited is masked entry by entry.

_PAD_KV_POS = int(np.iinfo(np.int32).max)  # padded keys lie after every query: never visible
_PAD_Q_POS = int(np.iinfo(np.int32).min)  # padded queries see nothing (l = 0, output 0)


def block_visits(q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs, block_q: int, block_kv: int,
                 xp=jnp):
    """[Nq, Nkv] bool: which (query block, key/value block) pairs hold a visible entry in some row.

    Pure array code over `xp` (jax.numpy in the kernel, numpy for `executed_block_pairs`), so the
    count the planner and tests read is the kernel's own decision. Visible (seg_j == seg_i and
    pos_j <= pos_i) implies (seg_j, pos_j) <= (seg_i, pos_i) in lexicographic order, so a pair is
    empty in a row where the key block's smallest (segment, position) exceeds the query block's
    largest, or the key block's segments all precede the query block's: causal skipping that
    survives positions restarting per document, in any token order. Decided per row, then a
    pair is visited if any row of the batch needs it.
    """
    q_lo, q_hi = _block_keys(q_positions_bt, q_segments_bt, block_q, xp)
    k_lo, k_hi = _block_keys(kv_positions_bs, kv_segments_bs, block_kv, xp)
    (qs_lo, _), (qs_hi, qp_hi) = q_lo, q_hi
    (ks_lo, kp_lo), (ks_hi, _) = k_lo, k_hi
    qs_lo, qs_hi, qp_hi = qs_lo[:, :, None], qs_hi[:, :, None], qp_hi[:, :, None]  # [B, Nq, 1]
    ks_lo, ks_hi, kp_lo = ks_lo[:, None, :], ks_hi[:, None, :], kp_lo[:, None, :]  # [B, 1, Nkv]
    causal = (ks_lo < qs_hi) | ((ks_lo == qs_hi) & (kp_lo <= qp_hi))
    return (causal & (ks_hi >= qs_lo)).any(axis=0)


def executed_block_pairs(q_positions_bt, kv_positions_bs, q_segments_bt=None, kv_segments_bs=None, *,
                         block_q: int, block_kv: int) -> int:
    """Block pairs the masked kernel computes for these tokens (numpy; forward and backward alike).

    Each costs 4 * B * H * block_q * block_kv * head_dim FLOPs forward (two matmuls), twice that
    backward: the attention work a context rank executes (ring.ring_block_pairs)."""
    ids = [None if x is None else np.asarray(x, np.int32)
           for x in (q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs)]
    return int(block_visits(*ids, block_q, block_kv, xp=np).sum())


def _block_keys(positions_bt, segments_bt, block: int, xp):
    """Per row and block, the smallest and largest (segment, position) of its real tokens.

    Returns ((seg_lo, pos_lo), (seg_hi, pos_hi)), each [B, N]: pos_lo is the smallest position
    among the tokens of segment seg_lo, pos_hi the largest among those of seg_hi (no segments:
    all 0). Padding rows are left out.
    """
    b, t = positions_bt.shape
    n = -(-t // block)
    big, small = np.iinfo(np.int32).max, np.iinfo(np.int32).min
    valid = xp.arange(n * block).reshape(n, block) < t  # [N, block]
    pad = ((0, 0), (0, n * block - t))
    pos = xp.pad(positions_bt.astype(xp.int32), pad).reshape(b, n, block)  # [B, N, block]
    seg = (xp.zeros_like(pos) if segments_bt is None
           else xp.pad(segments_bt.astype(xp.int32), pad).reshape(b, n, block))
    seg_lo = xp.where(valid, seg, big).min(axis=2)
    seg_hi = xp.where(valid, seg, small).max(axis=2)
    pos_lo = xp.where(valid & (seg == seg_lo[..., None]), pos, big).min(axis=2)
    pos_hi = xp.where(valid & (seg == seg_hi[..., None]), pos, small).max(axis=2)
    return (seg_lo, pos_lo), (seg_hi, pos_hi)


def _ids_to_blocks(x_bt: jax.Array, block: int, pad_value: int) -> jax.Array:
    """Token ids [B, T] -> [N, B, block], padded with `pad_value`."""
    b, t = x_bt.shape
    n = -(-t // block)
    x_bt = jnp.pad(x_bt.astype(jnp.int32), ((0, 0), (0, n * block - t)), constant_values=pad_value)
    return x_bt.reshape(b, n, block).transpose(1, 0, 2)  # [B, N, block] -> [N, B, block]


def _stats_to_blocks(x_bth: jax.Array, block: int) -> jax.Array:
    """Row statistics [B, T, H] -> [N, B, H, block]."""
    return _to_blocks(x_bth[..., None], block)[..., 0]


def _stats_from_blocks(x_nbhq: jax.Array, t: int) -> jax.Array:
    """Inverse of _stats_to_blocks: [N, B, H, block] -> [B, t, H]."""
    return _from_blocks(x_nbhq[..., None], t)[..., 0]


def _visit_range(visit_n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[first, last + 1) of the True entries of a 1-D bool row ((0, 0) when none)."""
    n = visit_n.shape[0]
    idx = jnp.arange(n)
    lo = jnp.min(jnp.where(visit_n, idx, n))
    hi = jnp.max(jnp.where(visit_n, idx + 1, 0))
    return jnp.minimum(lo, hi), hi


def _pair_mask(qpos_bq, qseg_bq, kpos_bs, kseg_bs) -> jax.Array:
    """[B, 1, block_q, block_kv]: `attention.visible` for one block pair."""
    mask_bqs = kpos_bs[:, None, :] <= qpos_bq[:, :, None]
    if qseg_bq is not None:
        mask_bqs = mask_bqs & (kseg_bs[:, None, :] == qseg_bq[:, :, None])
    return mask_bqs[:, None]


def _blocked_ids(q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs, block_q, block_kv, visits):
    """Positions and segments cut into blocks (segments None stays None), and the visit table
    (`visits` if given, else block_visits')."""
    qpos = _ids_to_blocks(q_positions_bt, block_q, _PAD_Q_POS)
    kpos = _ids_to_blocks(kv_positions_bs, block_kv, _PAD_KV_POS)
    has_seg = q_segments_bt is not None
    qseg = _ids_to_blocks(q_segments_bt, block_q, 0) if has_seg else None
    kseg = _ids_to_blocks(kv_segments_bs, block_kv, 0) if has_seg else None
    if visits is None:
        visits = block_visits(q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs, block_q, block_kv)
    return qpos, kpos, qseg, kseg, visits


def masked_forward(q_bthk, k_bshk, v_bshk, q_positions_bt, kv_positions_bs, q_segments_bt=None,
                   kv_segments_bs=None, *, block_q: int, block_kv: int,
                   visits: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Queries against one key/value chunk under `attention.visible`'s mask: (o, lse).

    q [B, T, H, K] and k, v [B, S, H, K] may differ in length and positions (ring attention
    passes the local queries and a visiting chunk). Segments: both or neither. Returns the
    normalised output [B, T, H, K] and the row logsumexp [B, T, H], both fp32, so partial results
    over several chunks merge exactly (ring.merge); a row that sees no key of this chunk gets
    output 0 and logsumexp MASKED (finite: merging it gives it weight 0, never NaN). `visits`:
    the pairs to compute ([Nq, Nkv] bool, block_visits' for these ids), where the caller made
    them already (ring attention, once for every step); None: decided here.
    """
    head_dim = q_bthk.shape[3]
    t, scale = q_bthk.shape[1], head_dim ** -0.5
    q_nbhqk = _to_blocks(q_bthk, block_q)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv), _to_blocks(v_bshk, block_kv)
    qpos, kpos, qseg, kseg, visit = _blocked_ids(q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs,
                                                 block_q, block_kv, visits)

    def q_block(_, xs):
        q_bhqk, qpos_bq, qseg_bq, visit_n = xs
        b, h, rows, _ = q_bhqk.shape

        def visit_pair(j, carry):
            m_bhq, l_bhq, acc_bhqk = carry
            mask = _pair_mask(qpos_bq, qseg_bq, kpos[j], None if kseg is None else kseg[j])
            s_bhqs = jnp.einsum('bhqk,bhsk->bhqs', q_bhqk, k_nbhsk[j], preferred_element_type=jnp.float32) * scale
            s_bhqs = jnp.where(mask, s_bhqs, MASKED)
            m_new = jnp.maximum(m_bhq, s_bhqs.max(-1))
            alpha_bhq = jnp.exp(m_bhq - m_new)
            p_bhqs = jnp.where(mask, jnp.exp(s_bhqs - m_new[..., None]), 0.0)  # masked rows add nothing
            pv_bhqk = jnp.einsum('bhqs,bhsk->bhqk', p_bhqs.astype(v_nbhsk.dtype), v_nbhsk[j],
                                 preferred_element_type=jnp.float32)
            return m_new, alpha_bhq * l_bhq + p_bhqs.sum(-1), alpha_bhq[..., None] * acc_bhqk + pv_bhqk

        def kv_step(j, carry):
            return jax.lax.cond(visit_n[j], visit_pair, lambda _, c: c, j, carry)

        init = (jnp.full((b, h, rows), MASKED, jnp.float32), jnp.zeros((b, h, rows), jnp.float32),
                jnp.zeros((b, h, rows, head_dim), jnp.float32))
        m_bhq, l_bhq, acc_bhqk = jax.lax.fori_loop(*_visit_range(visit_n), kv_step, init)
        empty = l_bhq == 0.0  # sees no key here: output 0, logsumexp MASKED
        l_safe = jnp.where(empty, 1.0, l_bhq)
        return None, (acc_bhqk / l_safe[..., None], jnp.where(empty, MASKED, m_bhq + jnp.log(l_safe)))

    _, (o_nbhqk, lse_nbhq) = jax.lax.scan(q_block, None, (q_nbhqk, qpos, qseg, visit))
    o_nbhqk, lse_nbhq = mesh_lib.constrain(o_nbhqk, ACT_NBHRK), mesh_lib.constrain(lse_nbhq, ACT_NBHR)
    return _from_blocks(o_nbhqk, t), _stats_from_blocks(lse_nbhq, t)


def masked_backward(q_bthk, k_bshk, v_bshk, do_bthk, lse_bth, delta_bth, q_positions_bt, kv_positions_bs,
                    q_segments_bt=None, kv_segments_bs=None, *, block_q: int, block_kv: int,
                    visits: jax.Array | None = None):
    """(dq, dk, dv), fp32, of the queries against one key/value chunk, FlashAttention-2 style.

    `lse_bth` is the final row logsumexp over every chunk the queries saw and `delta_bth` =
    rowsum(dO * O) of the final output (fp32 [B, T, H]); with those, each chunk's share of the
    gradient is exact on its own (ring attention sums dq over chunks and sends dk, dv home).
    Skips the pairs `block_visits` rules out (or those `visits` does not list), as the forward does.
    """
    t, s, head_dim = q_bthk.shape[1], k_bshk.shape[1], q_bthk.shape[3]
    scale = head_dim ** -0.5
    q_nbhqk, do_nbhqk = _to_blocks(q_bthk, block_q), _to_blocks(do_bthk.astype(q_bthk.dtype), block_q)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv), _to_blocks(v_bshk, block_kv)
    lse_nbhq, delta_nbhq = _stats_to_blocks(lse_bth, block_q), _stats_to_blocks(delta_bth, block_q)
    qpos, kpos, qseg, kseg, visit = _blocked_ids(q_positions_bt, kv_positions_bs, q_segments_bt, kv_segments_bs,
                                                 block_q, block_kv, visits)

    def kv_block(dq_nbhqk, xs):
        k_bhsk, v_bhsk, kpos_bs, kseg_bs, visit_n = xs

        def visit_pair(i, dk_bhsk, dv_bhsk):
            q_bhqk, do_bhqk = q_nbhqk[i], do_nbhqk[i]
            mask = _pair_mask(qpos[i], None if qseg is None else qseg[i], kpos_bs, kseg_bs)
            s_bhqs = jnp.einsum('bhqk,bhsk->bhqs', q_bhqk, k_bhsk, preferred_element_type=jnp.float32) * scale
            p_bhqs = jnp.where(mask, jnp.exp(s_bhqs - lse_nbhq[i][..., None]), 0.0)
            return _pair_grads(p_bhqs, q_bhqk, do_bhqk, k_bhsk, v_bhsk, delta_nbhq[i], scale, dk_bhsk, dv_bhsk)

        def skip(i, dk_bhsk, dv_bhsk):
            return jnp.zeros(q_nbhqk.shape[1:], jnp.float32), dk_bhsk, dv_bhsk

        def q_step(i, carry):
            # The cond returns this block's dq only: the O(T) dq buffer stays outside it (no copy).
            dq_nbhqk, dk_bhsk, dv_bhsk = carry
            dq_bhqk, dk_bhsk, dv_bhsk = jax.lax.cond(visit_n[i], visit_pair, skip, i, dk_bhsk, dv_bhsk)
            return dq_nbhqk.at[i].add(dq_bhqk), dk_bhsk, dv_bhsk

        zeros = jnp.zeros(k_bhsk.shape, jnp.float32)
        dq_nbhqk, dk_bhsk, dv_bhsk = jax.lax.fori_loop(*_visit_range(visit_n), q_step, (dq_nbhqk, zeros, zeros))
        return dq_nbhqk, (dk_bhsk, dv_bhsk)

    dq_init = mesh_lib.constrain(jnp.zeros(q_nbhqk.shape, jnp.float32), ACT_NBHRK)
    dq_nbhqk, (dk_nbhsk, dv_nbhsk) = jax.lax.scan(kv_block, dq_init, (k_nbhsk, v_nbhsk, kpos, kseg, visit.T))
    return (_from_blocks(mesh_lib.constrain(dq_nbhqk, ACT_NBHRK), t),
            _from_blocks(mesh_lib.constrain(dk_nbhsk, ACT_NBHRK), s),
            _from_blocks(mesh_lib.constrain(dv_nbhsk, ACT_NBHRK), s))


def row_delta(do_bthk: jax.Array, o_bthk: jax.Array) -> jax.Array:
    """delta = rowsum(dO * O) [B, T, H] fp32: what the softmax's backward subtracts (= rowsum(P * dP))."""
    return jnp.einsum('bthk,bthk->bth', do_bthk.astype(jnp.float32), o_bthk.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _masked_attention(block_q: int, block_kv: int, q_bthk, k_bshk, v_bshk, positions_bt, segments_bt):
    return _masked_attention_fwd(block_q, block_kv, q_bthk, k_bshk, v_bshk, positions_bt, segments_bt)[0]


def _masked_attention_fwd(block_q, block_kv, q_bthk, k_bshk, v_bshk, positions_bt, segments_bt):
    o_bthk, lse_bth = masked_forward(q_bthk, k_bshk, v_bshk, positions_bt, positions_bt, segments_bt, segments_bt,
                                     block_q=block_q, block_kv=block_kv)
    o_bthk, lse_bth = keep(o_bthk.astype(q_bthk.dtype), lse_bth)
    return o_bthk, (q_bthk, k_bshk, v_bshk, o_bthk, lse_bth, positions_bt, segments_bt)


def _masked_attention_bwd(block_q, block_kv, residuals, do_bthk):
    q_bthk, k_bshk, v_bshk, o_bthk, lse_bth, positions_bt, segments_bt = residuals
    grads = masked_backward(q_bthk, k_bshk, v_bshk, do_bthk, lse_bth, row_delta(do_bthk, o_bthk), positions_bt,
                            positions_bt, segments_bt, segments_bt, block_q=block_q, block_kv=block_kv)
    dq, dk, dv = (g.astype(x.dtype) for g, x in zip(grads, (q_bthk, k_bshk, v_bshk)))
    return dq, dk, dv, None, None


_masked_attention.defvjp(_masked_attention_fwd, _masked_attention_bwd)
