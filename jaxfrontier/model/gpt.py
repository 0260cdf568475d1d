"""The GPT: token and position embeddings, a scanned stack of pre-LN blocks, the LM head.

The blocks are created once with `nnx.vmap` (every parameter gets a leading `layers` axis)
and applied with `jax.lax.scan`, so compile time does not grow with depth. Per-layer
activation checkpointing wraps the scanned body. The loss is computed from vocabulary-
sharded logits without gathering them: logsumexp and the target logit are reductions over
the vocabulary, which XLA splits into per-shard partial reductions and one all-reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import ModelShape
from jaxfrontier.model.attention import Attention, KVCache
from jaxfrontier.model.layers import ACT_ND, MLP, LayerNorm, dropout, embedding_lookup, param

EMBED_KEY_INDEX = 2**32 - 1  # dropout key of the embedding: an index no layer takes

REMAT_POLICIES = {
    'full': None,  # save only each layer's input, recompute everything inside it
    'save_dots': jax.checkpoint_policies.checkpoint_dots,
    'save_dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        out_std = s.init_std / (2 * s.num_layers) ** 0.5  # GPT-2 / Megatron scaled residual init
        self.dropout_rate = s.dropout_rate
        self.ln1 = LayerNorm(s.d_model, rngs=rngs)
        self.attn = Attention(s.d_model, s.num_heads, impl=s.attention, init_std=s.init_std, out_std=out_std,
                              rngs=rngs, blocks=(s.attention_block_q, s.attention_block_kv))
        self.ln2 = LayerNorm(s.d_model, rngs=rngs)
        self.mlp = MLP(s.d_model, s.mlp_dim, init_std=s.init_std, out_std=out_std, rngs=rngs)

    def __call__(self, x_nd: jax.Array, seq_len: int, key: jax.Array | None, cache: KVCache | None = None,
                 positions_bt: jax.Array | None = None) -> jax.Array | tuple[jax.Array, KVCache]:
        """The block on `x_nd` [B*T, d]; decoding passes this layer's KV cache and the tokens'
        positions [B, T] and gets the extended cache back too (`Attention.__call__`)."""
        k_attn, k_mlp = (None, None) if key is None else tuple(jax.random.split(key))
        if cache is None:
            y_nd = self.attn(self.ln1(x_nd), seq_len)
        else:
            y_nd, cache = self.attn(self.ln1(x_nd), seq_len, cache, positions_bt)
        x_nd = x_nd + dropout(y_nd, self.dropout_rate, k_attn)
        x_nd = x_nd + dropout(self.mlp(self.ln2(x_nd)), self.dropout_rate, k_mlp)
        x_nd = mesh_lib.constrain(x_nd, ACT_ND)
        return x_nd if cache is None else (x_nd, cache)


def layer_key(dropout_key: jax.Array | None, index: int | jax.Array) -> jax.Array | None:
    """Layer `index`'s dropout key (its global index, so every layout draws the same masks)."""
    return None if dropout_key is None else jax.random.fold_in(dropout_key, index)


def apply_layer(graphdef: nnx.GraphDef, layer_state: nnx.State, x_nd: jax.Array, seq_len: int,
                key: jax.Array | None) -> jax.Array:
    """One layer of a stack (its state without the layers axis) on `x_nd`: the per-layer function
    the layer runner (`apply_stack`) and the pipeline's per-layer recomputation both call."""
    return nnx.merge(graphdef, layer_state)(x_nd, seq_len, key)


def recompute_after_cotangent(layer_fn):
    """`layer_fn(x, state, key)` with remat=full for a plain (unrolled) loop of layers.

    Saves the layer's input and recomputes the layer in the backward pass, like
    `jax.checkpoint(policy=None)`, and makes the recomputation's input depend on the incoming
    cotangent: `where(isnan(g), nan, x)`, with g and x of one shape and sharding, is x wherever
    the gradient is finite and needs no communication. So no scheduler can run the recomputation
    before the backward reaches the layer. Outside a scan, `jax.checkpoint` relies on
    optimization barriers (prevent_cse); XLA:CPU removes those before scheduling and runs every
    recomputation early, in the forward pass, so remat=full saved no memory there (issue 14).
    A data dependency survives every backend's passes.
    """

    @jax.custom_vjp
    def run(x, state, key):
        return layer_fn(x, state, key)

    def fwd(x, state, key):
        return layer_fn(x, state, key), (x, state, key)

    def bwd(res, g):
        x, state, key = res
        x = jnp.where(jnp.isnan(g), jnp.array(jnp.nan, x.dtype), x)  # elementwise: no collective
        _, vjp = jax.vjp(lambda x, state: layer_fn(x, state, key), x, state)
        g_x, g_state = vjp(g)
        return g_x, g_state, None if key is None else np.zeros(key.shape, jax.dtypes.float0)  # keys: no tangent

    run.defvjp(fwd, bwd)
    return run


def apply_stack(graphdef: nnx.GraphDef, stacked: nnx.State, x_nd: jax.Array, *, seq_len: int, remat: str,
                dropout_key: jax.Array | None, first_layer: int | jax.Array = 0, unroll: int = 1,
                keep_inputs: bool = False):
    """Applies the layers of `stacked` (leading axis = layers) in order: the one layer runner.

    A pure function of the stacked block state: the model, and every pipeline executor on its
    chunk of layers (`first_layer` keeps dropout keys tied to the global layer index), call it.
    Returns the output, or (output, each layer's input [layers, N, d]) with `keep_inputs`
    (the lockstep pipeline's stash). `unroll` >= the layer count runs a plain loop; 0 always
    scans (the pipeline's chunks, whatever their length).
    """
    num_layers = jax.tree.leaves(stacked)[0].shape[0]

    fully_unrolled = 0 < unroll and num_layers <= unroll
    late_full = remat == 'full' and fully_unrolled  # see recompute_after_cotangent

    def run_layer(x, layer_state, key):
        return apply_layer(graphdef, layer_state, x, seq_len, key)

    run = recompute_after_cotangent(run_layer) if late_full else run_layer

    def body(x, xs):
        layer_state, index = xs
        return run(x, layer_state, layer_key(dropout_key, index)), (x if keep_inputs else None)

    if remat != 'none' and not late_full:
        # prevent_cse=False is safe only inside a scan, whose loop keeps XLA from merging the
        # recomputation into the forward pass; the unrolled plain loop needs the optimization
        # barrier, or the policy compiles to the same program as remat=none (issue 14, 6b).
        # XLA:CPU removes the barriers before scheduling and runs the recomputation early, so
        # there these policies save no memory unrolled; remat=full avoids it (late_full).
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=fully_unrolled)
    indices = first_layer + jnp.arange(num_layers)
    if fully_unrolled:  # a plain loop, no while loop around the layers
        inputs = []
        for i in range(num_layers):
            x_nd, x_in = body(x_nd, (jax.tree.map(lambda a, i=i: a[i], stacked), indices[i]))
            inputs.append(x_in)
        return (x_nd, jnp.stack(inputs)) if keep_inputs else x_nd
    x_nd, inputs = jax.lax.scan(body, x_nd, (stacked, indices), unroll=max(unroll, 1))
    return (x_nd, inputs) if keep_inputs else x_nd


def recompute_stack_vjp(graphdef: nnx.GraphDef, stacked: nnx.State, inputs_lnd: jax.Array, g_nd: jax.Array, *,
                        seq_len: int, dropout_key: jax.Array | None, first_layer: int | jax.Array = 0,
                        fetch_input=lambda x: x) -> tuple[nnx.State, jax.Array]:
    """The backward of `apply_stack` from each layer's stashed input (its `keep_inputs` output).

    Megatron's per-layer full recomputation: a reverse scan that recomputes one layer at a
    time under `jax.vjp` (`apply_layer`, the runner's own per-layer function) and pulls the
    cotangent through it, so one layer's residuals are live at a time. `fetch_input` brings a
    stashed input back just before its recomputation (the pipeline's all-gather over tensor).
    Not `jax.vjp(apply_stack)`: the stash comes from an earlier, separate forward unit, so
    that would run the forward a second time. Returns (gradients of `stacked`, of the input).
    """

    def body(g_out, xs):
        layer_state, x, index = xs
        key = layer_key(dropout_key, index)
        _, pull = jax.vjp(lambda ly, h: apply_layer(graphdef, ly, h, seq_len, key), layer_state, fetch_input(x))
        g_layer, g_in = pull(g_out)
        return g_in, g_layer

    indices = first_layer + jnp.arange(inputs_lnd.shape[0])
    g_in, g_stacked = jax.lax.scan(body, g_nd, (stacked, inputs_lnd, indices), reverse=True)
    return g_stacked, g_in


def cross_entropy(logits_nv: jax.Array, targets_n: jax.Array, real_vocab: int) -> jax.Array:
    """Mean token cross-entropy in fp32 from (possibly vocabulary-sharded) logits.

    Padding entries of the vocabulary (index >= real_vocab) are excluded from the softmax,
    so the loss does not depend on how far the vocabulary was padded.
    """
    logits_nv = logits_nv.astype(jnp.float32)
    vocab_v = jnp.arange(logits_nv.shape[-1])
    if real_vocab < logits_nv.shape[-1]:
        logits_nv = jnp.where(vocab_v < real_vocab, logits_nv, jnp.finfo(jnp.float32).min)
    lse_n = jax.nn.logsumexp(logits_nv, axis=-1)
    target_n = jnp.sum(jnp.where(vocab_v == targets_n[:, None], logits_nv, 0.0), axis=-1)
    return jnp.mean(lse_n - target_n)


class GPT(nnx.Module):
    """GPT-2 / Megatron-style decoder (FRONTIER.md): learned positions, GeLU MLP, biases."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        self.shape = s
        self.wte = param(rngs.params(), (s.vocab_size, s.d_model), ('vocab', 'embed'), s.init_std)
        self.wpe = param(rngs.params(), (s.seq_len, s.d_model), ('positions', 'embed'), s.init_std)

        @nnx.split_rngs(splits=s.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(s, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = LayerNorm(s.d_model, rngs=rngs)
        if not s.tied_embeddings:
            self.head = param(rngs.params(), (s.d_model, s.vocab_size), ('embed', 'vocab'), s.init_std)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.shape.dtype)

    def embed(self, tokens_bt: jax.Array, dropout_key: jax.Array | None = None,
              positions_bt: jax.Array | None = None) -> jax.Array:
        """Token + position embeddings, flattened to [B*T, d] in the compute dtype.

        Positions are 0..T-1 unless given (decoding: each row's own positions [B, T]).
        """
        b, t = tokens_bt.shape
        wpe = self.wpe[...][None, :t] if positions_bt is None else jnp.take(self.wpe[...], positions_bt, axis=0)
        x_btd = embedding_lookup(self.wte[...], tokens_bt) + wpe
        x_nd = x_btd.reshape(b * t, -1).astype(self.dtype)  # [B*T, d]
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, EMBED_KEY_INDEX)
        return mesh_lib.constrain(dropout(x_nd, self.shape.dropout_rate, key), ACT_ND)

    def apply_blocks(self, x_nd: jax.Array, seq_len: int, dropout_key: jax.Array | None = None) -> jax.Array:
        """Applies the blocks this module holds with the model's remat policy and unroll."""
        graphdef, stacked = nnx.split(self.blocks)
        return apply_stack(graphdef, stacked, x_nd, seq_len=seq_len, remat=self.shape.remat,
                           dropout_key=dropout_key, unroll=self.shape.scan_unroll)

    def logits(self, x_nd: jax.Array) -> jax.Array:
        """Final LayerNorm and the (vocabulary-parallel) head; fp32 logits [B*T, V]."""
        w, letters = (self.wte, 'nd,vd->nv') if self.shape.tied_embeddings else (self.head, 'nd,dv->nv')
        logits_nv = jnp.einsum(letters, self.ln_f(x_nd), w[...].astype(self.dtype), preferred_element_type=jnp.float32)
        return mesh_lib.constrain(logits_nv, ('batch', 'vocab'))

    def head_loss(self, x_nd: jax.Array, targets_bt: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy (fp32) from the last block's output."""
        return cross_entropy(self.logits(x_nd), targets_bt.reshape(-1), self.shape.real_vocab_size)

    def loss(self, tokens_bt: jax.Array, targets_bt: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """Mean next-token cross-entropy (fp32) of one micro-batch."""
        x_nd = self.apply_blocks(self.embed(tokens_bt, dropout_key), tokens_bt.shape[1], dropout_key)
        return self.head_loss(x_nd, targets_bt)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Logits [B, T, V] (fp32) for evaluation and inference."""
        b, t = tokens_bt.shape
        logits_nv = self.logits(self.apply_blocks(self.embed(tokens_bt), t))
        return logits_nv.reshape(b, t, -1)
