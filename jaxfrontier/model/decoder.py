"""What every family's decoder shares: the stacked blocks' runner call, the head, the loss.

A family's module subclasses `Decoder` and defines its parameters, `embed` and `final_norm`;
the trainer, the pipeline executors, evaluation and decoding use only the methods here and
`embed`, so they never ask which family they run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.model import stack
from jaxfrontier.model.context import flatten_tokens, unflatten_tokens
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers.loss import cross_entropy
from jaxfrontier.model.sequence import Seq

EMBED_KEY_INDEX = 2**32 - 1  # dropout key of the embedding: an index no layer takes


class Decoder(nnx.Module):
    """The shared half of a family's module (see the module docstring).

    Subclasses set `shape` (config.ModelShape), `wte` [V, d], `blocks` (stack.create), `head`
    [d, V] unless the shape ties the embeddings, and define `embed` and `final_norm`.
    """

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.shape.dtype)

    def apply_blocks(self, x_nd: jax.Array, seq: int | Seq, dropout_key: jax.Array | None = None) -> jax.Array:
        """Applies the blocks this module holds with the model's remat policy and unroll
        (`seq`: the sequence length, or a Seq with positions / documents; model/sequence.py)."""
        graphdef, stacked = nnx.split(self.blocks)
        return stack.apply_stack(graphdef, stacked, x_nd, seq_len=seq, remat=self.shape.remat,
                                 dropout_key=dropout_key, unroll=self.shape.scan_unroll)

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

    def loss(self, tokens_bt: jax.Array, targets_bt: jax.Array, dropout_key: jax.Array | None = None,
             positions_bt: jax.Array | None = None, segments_bt: jax.Array | None = None,
             weights_bt: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy (fp32) of one micro-batch; positions and documents [B, T]
        where they are not plain (model/sequence.py); per-prediction weights [B, T] as `head_loss`."""
        seq = Seq(tokens_bt.shape[1], positions_bt, segments_bt)
        x_nd = self.apply_blocks(self.embed(tokens_bt, dropout_key, positions_bt), seq if not seq.plain else seq.length,
                                 dropout_key)
        return self.head_loss(x_nd, targets_bt, weights_bt)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Logits [B, T, V] (fp32) for evaluation and inference."""
        b, t = tokens_bt.shape
        logits_nv = self.logits(self.apply_blocks(self.embed(tokens_bt), t))
        return unflatten_tokens(logits_nv, b, t)
