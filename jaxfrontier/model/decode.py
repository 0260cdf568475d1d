"""Autoregressive decoding with a key/value cache: prefill a prompt, then one token per step.

Decoding runs the model's own blocks (`Block.__call__` with a cache and positions, which
`Attention` writes to and attends over); this module holds only the cache and the two
drivers. A query at position p sees the cached keys 0..p.

The cache is `{'k', 'v'}` of shape [L, B, S, G, K]: S = model.seq_len (the longest sequence
the model was built for), G the key/value heads (`ModelShape.kv_heads`: a grouped-query
cache H/G times smaller; G = H without grouping). Kv heads lie over `tensor` as in training (split where
G divides it, replicated where not: config.resolve_rules) and batch rows over the batch axes
like the activations, so a tensor-parallel decode keeps each device's heads local.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import ModelShape

CACHE_NAMES = (None, 'batch', None, 'kv_heads', None)  # [L, B, S, G, K]
Cache = dict[str, jax.Array]


def init_cache(s: ModelShape, batch: int) -> Cache:
    """An empty cache [L, B, S, G, K] in the compute dtype."""
    shape = (s.num_layers, batch, s.seq_len, s.kv_heads, s.head_dim)
    zeros = mesh_lib.constrain(jnp.zeros(shape, jnp.dtype(s.dtype)), CACHE_NAMES)
    return {'k': zeros, 'v': zeros}


def forward(model: nnx.Module, tokens_bt: jax.Array, pos_bt: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Final hidden states [B, T, d] of `tokens_bt` at positions `pos_bt`, and the extended cache.

    A prefill passes the whole prompt at positions 0..T-1; a decode step one token per row at
    that row's position. The layers are scanned with their caches, each running its block (a
    model with layer groups scans each group over its rows of the cache).
    """
    b, t = tokens_bt.shape
    x_nd = model.embed(tokens_bt, positions_bt=pos_bt)

    def run_group(x_nd, blocks, group_cache):
        graphdef, stacked = nnx.split(blocks)

        def body(x_nd, xs):
            layer_state, layer_cache = xs
            return nnx.merge(graphdef, layer_state)(x_nd, t, None, layer_cache, pos_bt)

        return jax.lax.scan(body, x_nd, (stacked, group_cache))

    if len(model.GROUPS) == 1:
        x_nd, cache = run_group(x_nd, getattr(model, model.GROUPS[0]), cache)
    else:  # layer groups (model/decoder.py): each scans its own rows of the cache
        first, caches = model.first_layers(), []
        for name, size in model.group_sizes().items():
            rows = {k: v[first[name]:first[name] + size] for k, v in cache.items()}
            x_nd, rows = run_group(x_nd, getattr(model, name), rows)
            caches.append(rows)
        cache = {k: jnp.concatenate([rows[k] for rows in caches]) for k in cache}
    return x_nd.reshape(b, t, -1), cache  # [B, T, d]


def prefill(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Runs prompts (right-padded to P) through the model; logits [B, V] at each row's last prompt token.

    Padding positions >= a row's length are written to the cache too, but each is overwritten
    by that row's decode step at that position before any query can see it.
    """
    b, p = prompt_bp.shape
    pos_bp = jnp.broadcast_to(jnp.arange(p)[None, :], (b, p))
    x_bpd, cache = forward(model, prompt_bp, pos_bp, cache)
    last_bd = jnp.take_along_axis(x_bpd, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
    return model.logits(last_bd), cache


def step(model: nnx.Module, tokens_b: jax.Array, pos_b: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """One decode step: logits [B, V] of the next token after `tokens_b` at positions `pos_b`."""
    x_b1d, cache = forward(model, tokens_b[:, None], pos_b[:, None], cache)
    return model.logits(x_b1d[:, 0]), cache
