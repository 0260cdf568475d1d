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

Everything is `lax.scan` / `lax.fori_loop` (trip counts depend on the block index), einsum
and elementwise ops, so XLA compiles it for the CPU, ROCm and CUDA alike. Matmul inputs stay
in the compute dtype; scores, softmax statistics and accumulators are fp32 (as in
attention.reference_attention). There is no attention-probability dropout, as in the
reference kernel (the model applies dropout to the residual branches only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxfrontier import mesh as mesh_lib

# Blocked activations: [blocks, batch, heads, rows, head_dim] and statistics [blocks, batch, heads, rows].
ACT_NBHRK = (None, 'batch', 'heads', None, None)
ACT_NBHR = (None, 'batch', 'heads', None)
_MASKED = float(jnp.finfo(jnp.float32).min)  # finite, so exp(_MASKED - m) = 0 and never inf - inf


def blockwise_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, block_q: int = 128,
                        block_kv: int = 128) -> jax.Array:
    """Causal softmax(q k^T / sqrt(k)) v, computed block by block (see the module docstring).

    Args:
      q_bthk, k_bshk, v_bshk: queries, keys and values [batch, seq, heads, head_dim]; the same
        sequence length (self-attention).
      block_q, block_kv: rows per query block and per key/value block; any positive sizes
        (the sequence need not be a multiple of either).

    Returns:
      The attention output [batch, seq, heads, head_dim] in q's dtype.
    """
    if q_bthk.shape != k_bshk.shape or k_bshk.shape != v_bshk.shape:
        raise ValueError(f'blockwise attention needs q, k, v of one shape, got {q_bthk.shape}, '
                         f'{k_bshk.shape}, {v_bshk.shape}')
    return _attention(block_q, block_kv, q_bthk, k_bshk, v_bshk)


def visited_block_pairs(seq_len: int, block_q: int, block_kv: int) -> int:
    """(query block, key/value block) pairs the forward (and the backward) computes: those at or
    before the diagonal, after padding the sequence to whole blocks. The planner's FLOP count."""
    num_q, num_kv = -(-seq_len // block_q), -(-seq_len // block_kv)
    return sum(min((i * block_q + block_q - 1) // block_kv + 1, num_kv) for i in range(num_q))


def _to_blocks(x_bthk: jax.Array, block: int) -> jax.Array:
    """[B, T, H, K] -> [T_pad / block, B, H, block, K], zero-padded at the end of the sequence."""
    b, t, h, k = x_bthk.shape
    n = -(-t // block)
    x_bthk = jnp.pad(x_bthk, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    x_nbhrk = x_bthk.reshape(b, n, block, h, k).transpose(1, 0, 3, 2, 4)  # [N, B, H, block, K]
    return mesh_lib.constrain(x_nbhrk, ACT_NBHRK)


def _from_blocks(x_nbhrk: jax.Array, t: int) -> jax.Array:
    """Inverse of _to_blocks: [N, B, H, block, K] -> [B, t, H, K]."""
    n, b, h, r, k = x_nbhrk.shape
    return x_nbhrk.transpose(1, 0, 3, 2, 4).reshape(b, n * r, h, k)[:, :t]  # [B, N * block, H, K] -> [B, t, H, K]


def _scores(q_bhqk, k_bhsk, scale, q_start, kv_start, masked: bool) -> jax.Array:
    """fp32 scaled scores [B, H, block_q, block_kv] of one block pair, causally masked if asked."""
    s_bhqs = jnp.einsum('bhqk,bhsk->bhqs', q_bhqk, k_bhsk, preferred_element_type=jnp.float32) * scale
    if masked:
        q_pos = q_start + jnp.arange(q_bhqk.shape[2])
        kv_pos = kv_start + jnp.arange(k_bhsk.shape[2])
        s_bhqs = jnp.where(q_pos[:, None] >= kv_pos[None, :], s_bhqs, _MASKED)
    return s_bhqs


def _forward(block_q: int, block_kv: int, q_bthk, k_bshk, v_bshk):
    """(output [B, T, H, K], logsumexp [Nq, B, H, block_q] fp32)."""
    t, head_dim = q_bthk.shape[1], q_bthk.shape[3]
    scale = head_dim ** -0.5
    q_nbhqk = _to_blocks(q_bthk, block_q)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv), _to_blocks(v_bshk, block_kv)
    num_kv = k_nbhsk.shape[0]

    def q_block(_, xs):
        q_bhqk, i = xs
        q_start = i * block_q
        b, h, rows, _ = q_bhqk.shape

        def kv_step(masked, j, carry):
            m_bhq, l_bhq, acc_bhqk = carry
            s_bhqs = _scores(q_bhqk, k_nbhsk[j], scale, q_start, j * block_kv, masked)
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
        init = (jnp.full((b, h, rows), _MASKED, jnp.float32), jnp.zeros((b, h, rows), jnp.float32),
                jnp.zeros((b, h, rows, head_dim), jnp.float32))
        carry = jax.lax.fori_loop(0, n_full, functools.partial(kv_step, False), init)
        m_bhq, l_bhq, acc_bhqk = jax.lax.fori_loop(n_full, n_total, functools.partial(kv_step, True), carry)
        o_bhqk = (acc_bhqk / l_bhq[..., None]).astype(q_bhqk.dtype)
        return None, (o_bhqk, m_bhq + jnp.log(l_bhq))

    _, (o_nbhqk, lse_nbhq) = jax.lax.scan(q_block, None, (q_nbhqk, jnp.arange(q_nbhqk.shape[0])))
    return _from_blocks(mesh_lib.constrain(o_nbhqk, ACT_NBHRK), t), mesh_lib.constrain(lse_nbhq, ACT_NBHR)


def _backward(block_q: int, block_kv: int, residuals, do_bthk):
    """(dq, dk, dv) by FlashAttention-2's backward: key/value blocks outer, query blocks inner."""
    q_bthk, k_bshk, v_bshk, o_bthk, lse_nbhq = residuals
    t, head_dim = q_bthk.shape[1], q_bthk.shape[3]
    scale = head_dim ** -0.5
    q_nbhqk, do_nbhqk = _to_blocks(q_bthk, block_q), _to_blocks(do_bthk.astype(q_bthk.dtype), block_q)
    k_nbhsk, v_nbhsk = _to_blocks(k_bshk, block_kv), _to_blocks(v_bshk, block_kv)
    # delta = rowsum(dO * O) = rowsum(P * dP): the softmax's backward subtracts it.
    delta_bht = jnp.einsum('bthk,bthk->bht', do_bthk.astype(jnp.float32), o_bthk.astype(jnp.float32))
    delta_nbhq = _to_blocks(delta_bht.transpose(0, 2, 1)[..., None], block_q)[..., 0]  # via [B, T, H, 1]
    num_q = q_nbhqk.shape[0]

    def kv_block(dq_nbhqk, xs):
        k_bhsk, v_bhsk, j = xs
        kv_start = j * block_kv

        def q_step(masked, i, carry):
            dq_nbhqk, dk_bhsk, dv_bhsk = carry
            q_bhqk, do_bhqk = q_nbhqk[i], do_nbhqk[i]
            s_bhqs = _scores(q_bhqk, k_bhsk, scale, i * block_q, kv_start, masked)
            p_bhqs = jnp.exp(s_bhqs - lse_nbhq[i][..., None])
            dv_bhsk = dv_bhsk + jnp.einsum('bhqs,bhqk->bhsk', p_bhqs.astype(do_bhqk.dtype), do_bhqk,
                                           preferred_element_type=jnp.float32)
            dp_bhqs = jnp.einsum('bhqk,bhsk->bhqs', do_bhqk, v_bhsk, preferred_element_type=jnp.float32)
            ds_bhqs = (p_bhqs * (dp_bhqs - delta_nbhq[i][..., None]) * scale).astype(q_bhqk.dtype)
            dq_bhqk = jnp.einsum('bhqs,bhsk->bhqk', ds_bhqs, k_bhsk, preferred_element_type=jnp.float32)
            dk_bhsk = dk_bhsk + jnp.einsum('bhqs,bhqk->bhsk', ds_bhqs, q_bhqk, preferred_element_type=jnp.float32)
            return dq_nbhqk.at[i].add(dq_bhqk), dk_bhsk, dv_bhsk

        # q blocks [first, num_q) see this kv block; from first_full on, every row sees all of it.
        first = jnp.minimum(kv_start // block_q, num_q)
        first_full = jnp.clip((kv_start + block_kv - 1 + block_q - 1) // block_q, first, num_q)
        zeros = jnp.zeros(k_bhsk.shape, jnp.float32)
        carry = jax.lax.fori_loop(first, first_full, functools.partial(q_step, True), (dq_nbhqk, zeros, zeros))
        dq_nbhqk, dk_bhsk, dv_bhsk = jax.lax.fori_loop(first_full, num_q, functools.partial(q_step, False), carry)
        return dq_nbhqk, (dk_bhsk, dv_bhsk)

    dq_init = mesh_lib.constrain(jnp.zeros(q_nbhqk.shape, jnp.float32), ACT_NBHRK)
    dq_nbhqk, (dk_nbhsk, dv_nbhsk) = jax.lax.scan(kv_block, dq_init,
                                                  (k_nbhsk, v_nbhsk, jnp.arange(k_nbhsk.shape[0])))
    return tuple(_from_blocks(mesh_lib.constrain(g, ACT_NBHRK), t).astype(x.dtype)
                 for g, x in ((dq_nbhqk, q_bthk), (dk_nbhsk, k_bshk), (dv_nbhsk, v_bshk)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(block_q: int, block_kv: int, q_bthk, k_bshk, v_bshk):
    return _forward(block_q, block_kv, q_bthk, k_bshk, v_bshk)[0]


def _attention_fwd(block_q, block_kv, q_bthk, k_bshk, v_bshk):
    o_bthk, lse_nbhq = _forward(block_q, block_kv, q_bthk, k_bshk, v_bshk)
    return o_bthk, (q_bthk, k_bshk, v_bshk, o_bthk, lse_nbhq)


_attention.defvjp(_attention_fwd, _backward)
