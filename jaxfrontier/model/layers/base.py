"""What every layer shares: the flat activations' logical names, fp32 parameters with logical axis names,
dropout.

Activations inside a block are kept flat, `x_nd` with n = batch x sequence tokens: XLA:CPU
runs 2-D matmuls about twice as fast as [B, T, d] ones, and GPUs do not mind.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# Flat activations [N, d] between the blocks' matmuls (the residual stream, norms, dropout), N = B*T
# in model/context.py's token order: `stream` is `tokens`' axes (the context axis, then the batch
# axes: converting to [B, T, ...] stays local) and, with sequence parallelism, the tensor axis
# after them (config.resolve_rules derives it). Inside attention and the MLP the tokens are on
# `tokens`: gathered over tensor.
ACT_ND = ('stream', 'act_embed')


def param(key: jax.Array, shape: Sequence[int], names: Sequence[str | None], std: float | None) -> nnx.Param:
    """An fp32 parameter of `shape`: normal(0, std) if std, else zeros (std=0.0) or ones (None).

    `names` are the logical axis names of its dimensions; `config.sharding.rules` lays them
    out on the mesh.
    """
    if std is None:
        value = jnp.ones(shape, jnp.float32)
    elif std == 0.0:
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = std * jax.random.normal(key, shape, jnp.float32)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when rate is 0 or key is None (evaluation)."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
