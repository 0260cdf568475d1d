"""The token cross-entropy every family's head ends in (model/decoder.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_nv: jax.Array, targets_n: jax.Array, real_vocab: int,
                  weights_n: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy in fp32 from (possibly vocabulary-sharded) logits.

    Padding entries of the vocabulary (index >= real_vocab) are excluded from the softmax,
    so the loss does not depend on how far the vocabulary was padded. With `weights_n`, the
    mean over all N tokens of weight * loss (divided by N, not by the weights' sum: equal-sized
    micro-batches then average to the global weighted sum / N in every layout, and the step
    divides by the counted share once; model/packing.py).
    """
    logits_nv = logits_nv.astype(jnp.float32)
    vocab_v = jnp.arange(logits_nv.shape[-1])
    if real_vocab < logits_nv.shape[-1]:
        logits_nv = jnp.where(vocab_v < real_vocab, logits_nv, jnp.finfo(jnp.float32).min)
    lse_n = jax.nn.logsumexp(logits_nv, axis=-1)
    target_n = jnp.sum(jnp.where(vocab_v == targets_n[:, None], logits_nv, 0.0), axis=-1)
    loss_n = lse_n - target_n
    return jnp.mean(loss_n if weights_n is None else loss_n * weights_n)
