"""Rotary position embeddings (RoPE) in Hugging Face's half-split convention.

Dimension i < K/2 of a head is paired with dimension i + K/2 (`rotate_half`), not with its
neighbour as in Meta's interleaved original: Hugging Face checkpoints store q and k weights
permuted for that convention, so with it they load without a permutation.

Frequencies and angles are fp32 whatever the compute dtype (the angle of position 100,000
needs the mantissa); the optional long-context frequency scaling (numbers, `Scaling`; a family
maps its config to them) follows transformers' banded scaling exactly. Positions come in
explicitly [B, T], so packed documents can restart them and decoding can pass each row's own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# The banded frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
Scaling = tuple[float, float, float, int]


def inverse_frequencies(head_dim: int, theta: float, scaling: Scaling | None = None) -> np.ndarray:
    """The K/2 rotation frequencies theta^(-2i/K) (fp32), scaled by bands when `scaling` is given.

    The scaling keeps the high frequencies (wavelength under original_max / high_freq_factor),
    divides the low ones (wavelength over original_max / low_freq_factor) by `factor`, and blends
    the two in between, as transformers does. A numpy constant: it is folded into the program.
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, old_context_len = scaling
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_banded = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_banded / factor + smooth * inv_freq_banded
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_banded).astype(np.float32)


def rotate_half(x: jax.Array) -> jax.Array:
    """[x1, x2] -> [-x2, x1] over the last dimension (halves of K)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x_bthk: jax.Array, positions_bt: jax.Array, inv_freq_k2: np.ndarray) -> jax.Array:
    """x rotated by its token's position: x cos + rotate_half(x) sin, in fp32, back in x's dtype.

    Args:
      x_bthk: queries or keys [B, T, heads, K].
      positions_bt: each token's position [B, T] (integers).
      inv_freq_k2: `inverse_frequencies` [K/2].
    """
    angles_btk2 = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_k2, jnp.float32)
    angles_btk = jnp.concatenate([angles_btk2, angles_btk2], axis=-1)[:, :, None, :]  # [B, T, 1, K]
    x32 = x_bthk.astype(jnp.float32)
    return (x32 * jnp.cos(angles_btk) + rotate_half(x32) * jnp.sin(angles_btk)).astype(x_bthk.dtype)
