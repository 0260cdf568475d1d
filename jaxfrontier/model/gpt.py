"""The GPT family: token and position embeddings, a stack of pre-LN blocks, the LM head.

The blocks are created once with `nnx.vmap` (every parameter gets a leading `layers` axis)
and run by the layer runner (model/stack.py). One block serves training and KV-cached
decoding (model/decode.py). The loss is computed from vocabulary-sharded logits without
gathering them: logsumexp and the target logit are reductions over the vocabulary, which XLA
splits into per-shard partial reductions and one all-reduce. The family's declaration
(parameter table, FLOPs, Hugging Face names) is families/gpt.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.families import ModelShape
from jaxfrontier.model.attention import Attention, KVCache
from jaxfrontier.model.context import flatten_tokens
from jaxfrontier.model.decoder import EMBED_KEY_INDEX, Decoder
from jaxfrontier.model.layers import ACT_ND, MLP, LayerNorm, dropout, embedding_lookup, param
from jaxfrontier.model import stack
from jaxfrontier.model.sequence import Seq


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        out_std = s.init_std / (2 * s.num_layers) ** 0.5  # GPT-2 / Megatron scaled residual init
        self.dropout_rate = s.dropout_rate
        self.ln1 = LayerNorm(s.d_model, rngs=rngs)
        self.attn = Attention(s.d_model, s.num_heads, impl=s.attention, init_std=s.init_std, out_std=out_std,
                              rngs=rngs, blocks=(s.attention_block_q, s.attention_block_kv),
                              lora=s.lora and s.lora.under('attn'))  # its LoRA targets, or None
        self.ln2 = LayerNorm(s.d_model, rngs=rngs)
        self.mlp = MLP(s.d_model, s.mlp_dim, init_std=s.init_std, out_std=out_std, rngs=rngs,
                       lora=s.lora and s.lora.under('mlp'))

    def __call__(self, x_nd: jax.Array, seq: int | Seq, key: jax.Array | None, cache: KVCache | None = None,
                 positions_bt: jax.Array | None = None) -> tuple[jax.Array, dict | KVCache]:
        """The block on `x_nd` [B*T, d] (`seq`: model/sequence.py): (output, aux), aux empty
        (model/auxiliary.py); decoding passes this layer's KV cache and the tokens' positions
        [B, T] and gets (output, the extended cache)."""
        k_attn, k_mlp = (None, None) if key is None else tuple(jax.random.split(key))
        if cache is None:
            y_nd = self.attn(self.ln1(x_nd), seq, key=k_attn)
        else:
            y_nd, cache = self.attn(self.ln1(x_nd), seq, cache, positions_bt)
        x_nd = x_nd + dropout(y_nd, self.dropout_rate, k_attn)
        x_nd = x_nd + dropout(self.mlp(self.ln2(x_nd), key=k_mlp), self.dropout_rate, k_mlp)
        x_nd = mesh_lib.constrain(x_nd, ACT_ND)
        return (x_nd, {}) if cache is None else (x_nd, cache)  # training: no auxiliary outputs


class GPT(Decoder):
    """GPT-2 / Megatron-style decoder (FRONTIER.md): learned positions, GeLU MLP, biases."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        self.shape = s
        self.wte = param(rngs.params(), (s.vocab_size, s.d_model), ('vocab', 'embed'), s.init_std)
        self.wpe = param(rngs.params(), (s.seq_len, s.d_model), ('positions', 'embed'), s.init_std)
        self.blocks = stack.create(lambda r: Block(s, rngs=r), s.num_layers, rngs)
        self.ln_f = LayerNorm(s.d_model, rngs=rngs)
        if not s.tied_embeddings:
            self.head = param(rngs.params(), (s.d_model, s.vocab_size), ('embed', 'vocab'), s.init_std)

    def embed(self, tokens_bt: jax.Array, dropout_key: jax.Array | None = None,
              positions_bt: jax.Array | None = None) -> jax.Array:
        """Token + position embeddings, flattened to [B*T, d] in the compute dtype.

        Positions are 0..T-1 unless given (decoding: each row's own positions [B, T]).
        """
        b, t = tokens_bt.shape
        x_btd = embedding_lookup(self.wte[...], tokens_bt)
        # Explicit positions (decoding) gather from a replicated copy of the small [S, d] table: gathering
        # from the table as stored (d over fsdp) gives rows split over d, which XLA can only turn into the
        # rows-over-batch activations by an "involuntary full rematerialization" (a warning per compile).
        x_btd = x_btd + (self.wpe[...][None, :t] if positions_bt is None else
                         jnp.take(mesh_lib.constrain(self.wpe[...], (None, None)), positions_bt, axis=0))
        x_nd = flatten_tokens(x_btd).astype(self.dtype)  # [N, d]
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, EMBED_KEY_INDEX)
        return mesh_lib.constrain(dropout(x_nd, self.shape.dropout_rate, key), ACT_ND)

    def final_norm(self, x_nd: jax.Array) -> jax.Array:
        return self.ln_f(x_nd)
