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

The loss mask (supervised fine-tuning, `data.loss_mask`; data/loss_mask.py) rides the same
machinery: a target token flagged NOT_COUNTED weighs 0, times packing's weight where documents
are packed too, and the flag is stripped from every token before it is embedded, predicted or
compared with the end-of-text id. `Packing` carries both, so every layout (the pipeline's units
included, which all build their weights through model/context.py's TokenOrder) counts the same
predictions; without packing and without a mask it is None and the programs are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from jaxfrontier.data import loss_mask as loss_mask_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model.sequence import Seq


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a window's tokens are read and scored: its documents by the end-of-text id (None: not
    packed), whether the prediction across a boundary (from the end-of-text token) counts in the
    loss, and whether the tokens carry the loss mask's flag (data/loss_mask.py)."""

    eot_id: int | None
    boundary_loss: bool = False
    loss_mask: bool = False

    @property
    def uncounted(self) -> bool:
        """Whether some predictions may weigh 0: packing without `boundary_loss`, or a loss mask."""
        return (self.eot_id is not None and not self.boundary_loss) or self.loss_mask


def from_config(c: ml_collections.ConfigDict) -> Packing | None:
    """The run's Packing, or None without `data.pack_documents` and without a loss mask.

    `data.eot_id` and `data.loss_mask` must be resolved by then (data.loader.resolve_headers: the
    token file header's end-of-text id; 'auto' is 'on' only where a file has a mask).
    """
    masked = c.data.get('loss_mask', 'off') == 'on'
    if not c.data.pack_documents:
        return Packing(None, loss_mask=True) if masked else None
    if c.data.eot_id < 0:
        raise ConfigError('data.eot_id', c.data.eot_id, 'data.pack_documents needs the end-of-text token, which '
                          'has not been read from the token file header',
                          'run through python -m jaxfrontier.main (it reads the header), or set data.eot_id')
    return Packing(int(c.data.eot_id), bool(c.data.boundary_loss), masked)


def token_ids(tokens: jax.Array, packing: Packing | None) -> jax.Array:
    """Tokens without the loss mask's flag where the run has one (unchanged otherwise: no extra op)."""
    return loss_mask_lib.token_ids(tokens) if packing is not None and packing.loss_mask else tokens


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
    """Packing's per-prediction weights [B, T] (fp32) of input tokens [B, T]: 0 where the input is
    the end-of-text token (the prediction across the boundary) unless `boundary_loss`; None: all
    count (or documents not packed)."""
    if packing.eot_id is None or packing.boundary_loss:
        return None
    return (token_ids(tokens_bt, packing) != packing.eot_id).astype(jnp.float32)


def prediction_weights(tokens_bt1: jax.Array, packing: Packing | None) -> jax.Array | None:
    """The loss weights [B, T] (fp32) of windows [B, T + 1]'s predictions: packing's (by the inputs)
    times the loss mask's (by the targets' flags); None: every prediction counts."""
    if packing is None:
        return None
    weights_bt = loss_weights(tokens_bt1[:, :-1], packing)
    if packing.loss_mask:
        mask_bt = loss_mask_lib.counted(tokens_bt1[:, 1:]).astype(jnp.float32)
        weights_bt = mask_bt if weights_bt is None else weights_bt * mask_bt
    return weights_bt


def counted_share(tokens_gt: jax.Array, packing: Packing | None) -> jax.Array | float:
    """The share of a batch's predictions [G, T + 1] that count in the loss (1 where all count:
    no packing or `boundary_loss`, and no loss mask): how evaluation weighs its batches' losses."""
    weights = prediction_weights(tokens_gt, packing)
    return 1.0 if weights is None else jnp.mean(weights)


def count_scale(tokens_gt: jax.Array, packing: Packing | None) -> jax.Array | float:
    """Predictions over counted predictions of a batch [G, T + 1] (1 where all count): turns the
    mean over all predictions into the mean over the counted ones. A batch that counts nothing
    scores 0 (not NaN)."""
    share = counted_share(tokens_gt, packing)
    if isinstance(share, float):
        return 1.0
    return 1.0 / jnp.maximum(share, 1.0 / (tokens_gt.shape[0] * (tokens_gt.shape[1] - 1)))
