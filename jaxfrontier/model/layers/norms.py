"""LayerNorm and RMSNorm: statistics in fp32 whatever the compute dtype, the result in it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.model.layers.base import param


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias; statistics in fp32 whatever the compute dtype."""

    def __init__(self, dim: int, *, eps: float = 1e-5, rngs: nnx.Rngs):
        del rngs
        self.eps = eps
        self.scale = param(None, (dim,), ('embed',), None)
        self.bias = param(None, (dim,), ('embed',), 0.0)

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        x32 = x_nd.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x_nd.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: x / rms(x) * scale, no mean and no bias; statistics in fp32.

    `names`: the scale's logical axis; the residual stream's `embed` by default, a head's `head_dim`
    for QK-norm (Qwen3: one scale per head width, shared by the heads, whole on every device).
    """

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, names: tuple[str, ...] = ('embed',)):
        del rngs
        self.eps = eps
        self.scale = param(None, (dim,), names, None)

    def __call__(self, x_nd: jax.Array) -> jax.Array:
        x32 = x_nd.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x_nd.dtype)
