"""Packed documents (`data.pack_documents`): each window's documents kept apart, from its tokens alone.

`python -m jaxfrontier.prepare` writes the end-of-text token after every document, and a
training window is seq_len + 1 consecutive tokens of that stream, so it holds the tail of one
document, whole documents, and the head of another. With packing, attention never crosses a
boundary and positions restart at 0 in every document (learned position tables and rotary
embeddings read them), so a document is modelled as if it were alone.

Where the end-of-text token belongs: to the document it ends (Megatron-LM's and MaxText's
convention). The token after it starts the next document. So the prediction *of* the
end-of-text token (the model learns to end a document) is made inside the document, and the
prediction *from* it -- the next document's first token -- would have to be guessed from the
previous document alone: it is counted only with `data.boundary_loss=True`.

Everything here is computed on the device inside the step from the micro-batch's input tokens
[B, T] (the window minus its last token): segments and positions are prefix sums along T, so
every layout -- the pipeline's stages included, which all receive their micro-batch's tokens --
builds the same masks without any new data plumbing.

The loss stays a true mean over the counted predictions whatever the layout. A micro-batch's
loss is sum(weight * token loss) / (its B*T), a mean over *all* its predictions with the
uncounted ones weighted 0; every layout averages equal-sized micro-batches (accumulation,
data-parallel replicas, pipeline micro-batches), which gives sum over the global batch / (G*T);
the step then multiplies loss and gradients by `count_scale` = G*T / counted, once. A mean of
per-micro-batch means over counted tokens would be wrong: micro-batches count different numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from jaxfrontier.errors import ConfigError
from jaxfrontier.model.sequence import Seq


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a window's documents are found and scored: the end-of-text id, and whether the
    prediction across a boundary (from the end-of-text token) counts in the loss."""

    eot_id: int
    boundary_loss: bool = False


def from_config(c: ml_collections.ConfigDict) -> Packing | None:
    """The run's Packing, or None without `data.pack_documents`.

    `data.eot_id` must be resolved by then (data.loader.resolve_eot: the token file header's).
    """
    if not c.data.pack_documents:
        return None
    if c.data.eot_id < 0:
        raise ConfigError('data.eot_id', c.data.eot_id, 'data.pack_documents needs the end-of-text token, which '
                          'has not been read from the token file header',
                          'run through python -m jaxfrontier.main (it reads the header), or set data.eot_id')
    return Packing(int(c.data.eot_id), bool(c.data.boundary_loss))


def documents(tokens_bt: jax.Array, eot_id: int) -> Seq:
    """The Seq of input tokens [B, T]: segment ids (documents, counted from 0 in each row) and
    positions restarting at 0 after every end-of-text token (which ends its own document)."""
    b, t = tokens_bt.shape
    eot_bt = tokens_bt == eot_id
    starts_bt = jnp.concatenate([jnp.ones((b, 1), bool), eot_bt[:, :-1]], axis=1)  # a token after an EOT starts one
    segments_bt = jnp.cumsum(starts_bt, axis=1, dtype=jnp.int32) - 1
    index_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    first_bt = jax.lax.cummax(jnp.where(starts_bt, index_bt, 0), axis=1)  # where each token's document begins
    return Seq(t, index_bt - first_bt, segments_bt)


def loss_weights(tokens_bt: jax.Array, packing: Packing) -> jax.Array | None:
    """Per-prediction weights [B, T] (fp32) of input tokens [B, T]: 0 where the input is the
    end-of-text token (the prediction across the boundary) unless `boundary_loss`; None: all count."""
    if packing.boundary_loss:
        return None
    return (tokens_bt != packing.eot_id).astype(jnp.float32)


def counted_share(tokens_gt: jax.Array, packing: Packing | None) -> jax.Array | float:
    """The share of a batch's predictions [G, T + 1] that count in the loss (1 without packing
    or with `boundary_loss`): how evaluation weighs its batches' losses."""
    weights = None if packing is None else loss_weights(tokens_gt[:, :-1], packing)
    return 1.0 if weights is None else jnp.mean(weights)


def count_scale(tokens_gt: jax.Array, packing: Packing | None) -> jax.Array | float:
    """Predictions over counted predictions of a batch [G, T + 1] (1 without packing or with
    `boundary_loss`): turns the mean over all predictions into the mean over the counted ones.
    A batch that counts nothing scores 0 (not NaN)."""
    share = counted_share(tokens_gt, packing)
    if isinstance(share, float):
        return 1.0
    return 1.0 / jnp.maximum(share, 1.0 / (tokens_gt.shape[0] * (tokens_gt.shape[1] - 1)))
