"""Context parallelism's token order: which of a micro-batch's tokens each device of `context` holds.

With mesh.context = c the sequence dimension T of every activation is split into c equal
parts over the `context` mesh axis (the logical name `length`).

The flat token order. The blocks work on flat activations [N, d], N = B*T. Row-major [B, T]
cannot be split over T by a 1-D tiling of N (a device's tokens t in part r of every row are not
contiguous), so with c > 1 the flat order is [c, B, T/c]: part-major, then row, then position
within the part (`flatten_tokens`; `unflatten_tokens` goes back). With B over the batch axes and
the part over `context`, both conversions are local transposes, and N is split over `tokens` =
(context, then the batch axes; config.DEFAULT_RULES). With c = 1 the order is [B, T], as
before, and the programs are unchanged. Per-token work (norms, MLPs, the head, the mean loss)
does not care about the order; attention and the embedding convert.

Under a causal mask the work of a token
grows with its position, so the device holding the last part would do the most attention
work. With `model.context_balance` the step permutes each micro-batch's inputs and targets
along T by `sequence.balanced_order` (device r holds chunks r and 2c-1-r of 2c), and passes
the permutation as the tokens' positions: the causal mask, learned position tables and
rotary embeddings read positions, not array indices, so the model computes the same function; the
loss is a mean over tokens, so their order does not change it either.

The order is static (a numpy array folded into the program), so every unit of the pipeline
rebuilds the same positions from it without any per-micro-batch data. The batch [B, T + 1]
arrives replicated over `context`, so the permutation is a local gather of a few int32s.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.model.sequence import Seq, balanced_order

TOKENS_BT = ('batch', 'length')  # token ids, targets and positions [B, T]


def parts() -> int:
    """Parts the sequence is split into under the active rules and mesh (1 outside them)."""
    axes = mesh_lib.active_axes('length')
    if not axes:
        return 1
    return math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)


def flatten_tokens(x_bt: jax.Array) -> jax.Array:
    """[B, T, ...] -> [N, ...] in the flat token order (the module docstring)."""
    b, t, rest = x_bt.shape[0], x_bt.shape[1], x_bt.shape[2:]
    c = parts()
    if c == 1:
        return x_bt.reshape(b * t, *rest)
    x_bctr = x_bt.reshape(b, c, t // c, *rest)  # [B, C, T/C, ...]
    return jnp.swapaxes(x_bctr, 0, 1).reshape(b * t, *rest)  # [C * B * T/C, ...]


def unflatten_tokens(x_n: jax.Array, b: int, t: int) -> jax.Array:
    """[N, ...] in the flat token order -> [B, T, ...]."""
    rest = x_n.shape[1:]
    c = parts()
    if c == 1:
        return x_n.reshape(b, t, *rest)
    x_cbtr = x_n.reshape(c, b, t // c, *rest)  # [C, B, T/C, ...]
    return jnp.swapaxes(x_cbtr, 0, 1).reshape(b, t, *rest)


class TokenOrder:
    """How a micro-batch's windows [B, T + 1] become the model's inputs, targets, positions,
    documents and loss weights (see the module docstring).

    `order` is None where nothing is permuted: context 1, or `context_balance` off (device r
    holds the r-th contiguous part). With packed documents (`packing`, model/packing.py) the
    documents, their restarting positions and the loss weights are found on the window in its
    natural order and then permuted with the tokens, so packing and balancing compose. Without
    either, the blocks see plain sequences, as without context. With a loss mask
    (`packing.loss_mask`, data/loss_mask.py) the flag is stripped from inputs, targets and the
    tokens packing reads, and weighs the flagged targets' predictions 0.
    """

    def __init__(self, seq_len: int, context: int = 1, balance: bool = True,
                 packing: packing_lib.Packing | None = None):
        self.seq_len, self.packing = seq_len, packing
        self.order = balanced_order(seq_len, context) if context > 1 and balance else None

    @classmethod
    def of(cls, layout: layout_lib.Layout, seq_len: int, packing: packing_lib.Packing | None = None) -> TokenOrder:
        """The order of a layout's micro-batches (what the steps and every pipeline unit use)."""
        return cls(seq_len, layout.context, layout.context_balance, packing)

    def permute(self, x_bt: jax.Array) -> jax.Array:
        """`x_bt` [B, T] in this order (unchanged where nothing is permuted)."""
        if self.order is None:
            return x_bt
        return mesh_lib.constrain(jnp.take(x_bt, jnp.asarray(self.order, jnp.int32), axis=1), TOKENS_BT)

    def seq(self, tokens_bt1: jax.Array) -> int | Seq:
        """What the blocks know of the micro-batch (model/sequence.py): T, or T with the tokens'
        positions (the permutation; per document when packed) and documents."""
        rows = tokens_bt1.shape[0]
        if self.packing is not None and self.packing.eot_id is not None:
            docs = packing_lib.documents(packing_lib.token_ids(tokens_bt1[:, :-1], self.packing), self.packing.eot_id)
            return Seq(self.seq_len, self.permute(docs.positions_bt), self.permute(docs.segments_bt))
        if self.order is None:
            return self.seq_len
        positions_bt = jnp.broadcast_to(jnp.asarray(self.order, jnp.int32)[None], (rows, self.seq_len))
        return Seq(self.seq_len, mesh_lib.constrain(positions_bt, TOKENS_BT))

    def positions(self, tokens_bt1: jax.Array) -> jax.Array | None:
        """Each input token's position [B, T] in this order, or None for 0..T-1."""
        seq = self.seq(tokens_bt1)
        return None if isinstance(seq, int) else seq.positions_bt

    def inputs(self, tokens_bt1: jax.Array) -> jax.Array:
        """A micro-batch's input tokens [B, T] from its windows [B, T + 1], in this order (ids: without
        the loss mask's flag)."""
        return self.permute(packing_lib.token_ids(tokens_bt1[:, :-1], self.packing))

    def targets(self, tokens_bt1: jax.Array) -> jax.Array:
        """The next tokens [B, T] of the windows [B, T + 1], in this order (ids, as `inputs`)."""
        return self.permute(packing_lib.token_ids(tokens_bt1[:, 1:], self.packing))

    def weights(self, tokens_bt1: jax.Array) -> jax.Array | None:
        """The predictions' loss weights [B, T] in this order (packing's times the loss mask's; None: all count)."""
        weights_bt = packing_lib.prediction_weights(tokens_bt1, self.packing)
        return None if weights_bt is None else self.permute(weights_bt)

    def loss_and_aux(self, model, tokens_bt1: jax.Array, dropout_key: jax.Array | None = None):
        """`model.loss_and_aux` (model/decoder.py) of one micro-batch's windows [B, T + 1] in this order:
        (cross-entropy, aux {name: [L, ...]})."""
        seq = self.seq(tokens_bt1)
        positions, segments = (None, None) if isinstance(seq, int) else (seq.positions_bt, seq.segments_bt)
        return model.loss_and_aux(self.inputs(tokens_bt1), self.targets(tokens_bt1), dropout_key, positions,
                                  segments, self.weights(tokens_bt1))

    def loss(self, model, tokens_bt1: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """`model.loss` (model/decoder.py) of one micro-batch's windows [B, T + 1] in this order."""
        return self.loss_and_aux(model, tokens_bt1, dropout_key)[0]
