"""What every family's decoder shares: the stacked blocks' runner call, the head, the loss.

A family's module subclasses `Decoder` and defines its parameters, `embed` and `final_norm`;
the trainer, the pipeline executors, evaluation and decoding use only the methods here and
`embed`, so they never ask which family they run.

Layer groups: a model may hold several consecutive stacks of different block kinds (e.g. k dense
layers, then mixture-of-experts layers), each created by `stack.create` and run by its own scan.
`GROUPS` names their attributes in model order; the default, one group `blocks`, keeps today's
parameter tree (`params['blocks']`). `blocks` is the group a pipeline splits over its stages;
groups before it run with the embedding (pipeline/chunk.py) and take `stack.STEM_LAYERS` as their
stacked axis. A layer's global index (its dropout key) counts the layers of every group before it.
The blocks return auxiliary outputs (model/auxiliary.py), kept per group until `loss_and_aux` merges them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.model import auxiliary, stack
from jaxfrontier.model.context import flatten_tokens, unflatten_tokens
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers.loss import cross_entropy
from jaxfrontier.model.sequence import Seq

EMBED_KEY_INDEX = 2**32 - 1  # dropout key of the embedding: an index no layer takes
PIPELINED = 'blocks'  # the layer group a pipeline splits over its stages (pipeline/chunk.py)


class Decoder(nnx.Module):
    """The shared half of a family's module (see the module docstring).

    Subclasses set `shape` (config.ModelShape), `wte` [V, d], the stacks named in `GROUPS`
    (stack.create), `head` [d, V] unless the shape ties the embeddings, and define `embed` and
    `final_norm`.
    """

    GROUPS: tuple[str, ...] = (PIPELINED,)  # the layer groups' attributes, in model order

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.shape.dtype)

    def group_sizes(self) -> dict[str, int]:
        """Layers of each group, in model order."""
        return {name: jax.tree.leaves(nnx.state(getattr(self, name)))[0].shape[0] for name in self.GROUPS}

    def first_layers(self) -> dict[str, int]:
        """Global index of each group's first layer (the layers of the groups before it)."""
        first, offset = {}, 0
        for name, size in self.group_sizes().items():
            first[name], offset = offset, offset + size
        return first

    def run_groups(self, x_nd: jax.Array, seq: int | Seq, dropout_key: jax.Array | None = None,
                   groups: tuple[str, ...] | None = None) -> tuple[jax.Array, auxiliary.GroupAux]:
        """Runs the layer groups `groups` (default all; consecutive, in model order) with the model's
        remat policy and unroll; returns the output and each group's aux [L_g, ...].
        (`seq`: the sequence length, or a Seq with positions / documents; model/sequence.py.)"""
        first, aux = self.first_layers(), {}
        for name in groups or self.GROUPS:
            graphdef, stacked = nnx.split(getattr(self, name))
            x_nd, aux[name] = stack.apply_stack(graphdef, stacked, x_nd, seq_len=seq, remat=self.shape.remat,
                                                dropout_key=dropout_key, first_layer=first[name],
                                                unroll=self.shape.scan_unroll)
        return x_nd, aux

    def apply_blocks(self, x_nd: jax.Array, seq: int | Seq, dropout_key: jax.Array | None = None) -> jax.Array:
        """Applies every layer group (`run_groups`); the aux is dropped (inference, scoring)."""
        return self.run_groups(x_nd, seq, dropout_key)[0]

    def logits(self, x_nd: jax.Array) -> jax.Array:
        """Final norm and the (vocabulary-parallel) head; fp32 logits [B*T, V] (the head in the
        activations' dtype, the compute dtype: linear.py)."""
        name, letters = ('wte', 'nd,vd->nv') if self.shape.tied_embeddings else ('head', 'nd,dv->nv')
        return linear.project(self, name, letters, self.final_norm(x_nd), out_names=('tokens', 'vocab'),
                              preferred=jnp.float32)

    def head_loss(self, x_nd: jax.Array, targets_bt: jax.Array, weights_bt: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy (fp32) from the last block's output; with `weights_bt`
        [B, T], the mean over all B*T predictions of weight * loss (layers.cross_entropy).
        Targets and weights are flattened in the activations' token order (model/context.py)."""
        weights_n = None if weights_bt is None else flatten_tokens(weights_bt)
        return cross_entropy(self.logits(x_nd), flatten_tokens(targets_bt), self.shape.real_vocab_size, weights_n)

    def loss_and_aux(self, tokens_bt: jax.Array, targets_bt: jax.Array, dropout_key: jax.Array | None = None,
                     positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None,
                     weights_bt: jax.Array | None = None) -> tuple[jax.Array, auxiliary.Aux]:
        """Mean next-token cross-entropy (fp32) of one micro-batch and the layers' aux `{name: [L, ...]}`
        (model/auxiliary.py; the training objective is `auxiliary.objective(loss, aux)`); positions and
        documents [B, T] where they are not plain (model/sequence.py); per-prediction weights [B, T]
        as `head_loss`."""
        seq = Seq(tokens_bt.shape[1], positions_bt, segments_bt)
        x_nd, aux = self.run_groups(self.embed(tokens_bt, dropout_key, positions_bt),
                                    seq if not seq.plain else seq.length, dropout_key)
        return self.head_loss(x_nd, targets_bt, weights_bt), auxiliary.merge(aux, self.GROUPS)

    def loss(self, tokens_bt: jax.Array, targets_bt: jax.Array, dropout_key: jax.Array | None = None,
             positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None,
             weights_bt: jax.Array | None = None) -> jax.Array:
        """The cross-entropy of `loss_and_aux` (evaluation; the aux's loss terms are not in it)."""
        return self.loss_and_aux(tokens_bt, targets_bt, dropout_key, positions_bt, segments_bt, weights_bt)[0]

    def update_outside_gradient(self, params: dict, aux: auxiliary.Aux) -> dict:
        """The parameters after the train step's own rule for those no optimizer updates
        (model/params.py `OUTSIDE_GRADIENT`), from the step's aux `{name: [L, ...]}`; the identity for a
        model without such parameters (its program unchanged)."""
        del aux
        return params

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Logits [B, T, V] (fp32) for evaluation and inference."""
        b, t = tokens_bt.shape
        logits_nv = self.logits(self.apply_blocks(self.embed(tokens_bt), t))
        return unflatten_tokens(logits_nv, b, t)
