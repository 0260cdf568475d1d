"""Autoregressive decoding with a key/value cache: prefill a prompt, then one token per step.

The training path (gpt.py, attention.py) is untouched: this module reuses the modules' own
parameters and layers (LayerNorm, MLP, the QKV and output projections) and adds only the
attention over cached keys and values. Scores and softmax are fp32 as in
`attention.reference_attention`; a query at position p sees the cached keys 0..p.

The cache is `{'k', 'v'}` of shape [L, B, S, H, K] (S = model.seq_len, the learned positions'
length), heads over `tensor` and batch rows over the batch axes like the activations, so a
tensor-parallel decode keeps each device's heads local (Megatron's split, as in training).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import ModelShape
from jaxfrontier.model.gpt import GPT
from jaxfrontier.model.layers import ACT_ND, embedding_lookup

CACHE_NAMES = (None, 'batch', None, 'heads', None)  # [L, B, S, H, K]
Cache = dict[str, jax.Array]


def init_cache(s: ModelShape, batch: int) -> Cache:
    """An empty cache [L, B, S, H, K] in the compute dtype."""
    shape = (s.num_layers, batch, s.seq_len, s.num_heads, s.head_dim)
    zeros = mesh_lib.constrain(jnp.zeros(shape, jnp.dtype(s.dtype)), CACHE_NAMES)
    return {'k': zeros, 'v': zeros}


def cached_attention(q_bthk: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(K)) v over the cache; the query at position p sees keys 0..p."""
    scale = q_bthk.shape[-1] ** -0.5
    s_bhts = jnp.einsum('bthk,bshk->bhts', q_bthk, k_bshk, preferred_element_type=jnp.float32) * scale
    visible_bts = jnp.arange(k_bshk.shape[1])[None, None, :] <= pos_bt[:, :, None]
    s_bhts = jnp.where(visible_bts[:, None], s_bhts, jnp.finfo(jnp.float32).min)
    p_bhts = jax.nn.softmax(s_bhts, axis=-1).astype(v_bshk.dtype)
    return jnp.einsum('bhts,bshk->bthk', p_bhts, v_bshk)


def _write(cache_bshk: jax.Array, new_bthk: jax.Array, pos_bt: jax.Array) -> jax.Array:
    """Writes new keys or values at their positions: a prefill (T > 1) starts at 0, a step (T = 1) at pos."""
    if new_bthk.shape[1] > 1:
        return jax.lax.dynamic_update_slice(cache_bshk, new_bthk, (0, 0, 0, 0))
    at_bs = jnp.arange(cache_bshk.shape[1])[None, :] == pos_bt  # [B, S]: one position per row
    return jnp.where(at_bs[:, :, None, None], new_bthk, cache_bshk)


def _block(block, x_btd: jax.Array, k_bshk: jax.Array, v_bshk: jax.Array, pos_bt: jax.Array):
    """One pre-LN block (gpt.Block's computation) reading and extending the layer's cache."""
    b, t, d = x_btd.shape
    attn, dtype = block.attn, x_btd.dtype
    h_btd = block.ln1(x_btd)
    qkv_bt3hk = jnp.einsum('btd,dahk->btahk', h_btd, attn.w_qkv[...].astype(dtype)) + attn.b_qkv[...].astype(dtype)
    q_bthk, new_k, new_v = (mesh_lib.constrain(qkv_bt3hk[:, :, i], ('batch', None, 'heads', None)) for i in range(3))
    k_bshk = mesh_lib.constrain(_write(k_bshk, new_k, pos_bt), CACHE_NAMES[1:])
    v_bshk = mesh_lib.constrain(_write(v_bshk, new_v, pos_bt), CACHE_NAMES[1:])
    o_bthk = cached_attention(q_bthk, k_bshk, v_bshk, pos_bt)
    y_btd = jnp.einsum('bthk,hkd->btd', o_bthk, attn.w_out[...].astype(dtype)) + attn.b_out[...].astype(dtype)
    x_nd = (x_btd + y_btd).reshape(b * t, d)  # [B*T, d]: the MLP works on flat tokens
    x_nd = mesh_lib.constrain(x_nd + block.mlp(block.ln2(x_nd)), ACT_ND)
    return x_nd.reshape(b, t, d), k_bshk, v_bshk


def forward(model: GPT, tokens_bt: jax.Array, pos_bt: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Final hidden states [B, T, d] of `tokens_bt` at positions `pos_bt`, and the extended cache.

    A prefill passes the whole prompt at positions 0..T-1; a decode step one token per row at
    that row's position.
    """
    x_btd = embedding_lookup(model.wte[...], tokens_bt) + jnp.take(model.wpe[...], pos_bt, axis=0)
    x_btd = x_btd.astype(model.dtype)
    graphdef, stacked = nnx.split(model.blocks)

    def body(x, xs):
        layer_state, k, v = xs
        x, k, v = _block(nnx.merge(graphdef, layer_state), x, k, v, pos_bt)
        return x, (k, v)

    x_btd, (k, v) = jax.lax.scan(body, x_btd, (stacked, cache['k'], cache['v']))
    return x_btd, {'k': k, 'v': v}


def prefill(model: GPT, prompt_bp: jax.Array, lengths_b: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Runs prompts (right-padded to P) through the model; logits [B, V] at each row's last prompt token.

    Padding positions >= a row's length are written to the cache too, but each is overwritten
    by that row's decode step at that position before any query can see it.
    """
    b, p = prompt_bp.shape
    pos_bp = jnp.broadcast_to(jnp.arange(p)[None, :], (b, p))
    x_bpd, cache = forward(model, prompt_bp, pos_bp, cache)
    last_bd = jnp.take_along_axis(x_bpd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last_bd), cache


def step(model: GPT, tokens_b: jax.Array, pos_b: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """One decode step: logits [B, V] of the next token after `tokens_b` at positions `pos_b`."""
    x_b1d, cache = forward(model, tokens_b[:, None], pos_b[:, None], cache)
    return model.logits(x_b1d[:, 0]), cache
