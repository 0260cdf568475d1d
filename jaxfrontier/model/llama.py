"""The Llama family: token embeddings, RMSNorm pre-norm blocks with rotary attention and SwiGLU.

Llama 2/3, Mistral-style dense, Qwen2 (q/k/v biases) and Qwen3 (QK-norm, heads of a width of their
own) decoders: grouped-query attention (`num_kv_heads` key/value heads shared by groups of query
heads; 1 = multi-query), rotary position embeddings in Hugging Face's half-split convention
(model/layers/rope.py; theta and Llama 3.1's frequency scaling configurable), a SwiGLU MLP, no
biases by default, an untied head by default. The blocks, the head and the loss run as GPT's do
(model/decoder.py, stack.py); one block serves training and KV-cached decoding. The family's
declaration (fields, shape `LlamaShape`, parameter table, FLOPs, Hugging Face converter) is
families/llama.py.

Tensor parallelism (Megatron): q, gate and up column-parallel over heads / `mlp`, the output
and down projections row-parallel; the g kv heads split over `tensor` where g divides it and
are replicated where it does not (config.resolve_rules), each rank repeating them to its own
query heads (attention.repeat_kv).

Mixture of experts (`LlamaShape.moe`, families/moe.py): the first moe.first_dense layers keep the
SwiGLU (layer group `dense_blocks`, a stem before the pipelined `blocks`), the others' MLP is
model/layers/moe.py's MoE, whose auxiliary outputs (balancing and z losses, loads) the block returns.
"""

from __future__ import annotations

import jax
from flax import nnx

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.families import ModelShape  # the family's LlamaShape (families/llama.py)
from jaxfrontier.model import sequence, stack
from jaxfrontier.model.layers import linear, rope
from jaxfrontier.model.attention import KVCache, attend
from jaxfrontier.model.context import flatten_tokens, unflatten_tokens
from jaxfrontier.families.moe import DENSE_GROUP
from jaxfrontier.model.decoder import EMBED_KEY_INDEX, PIPELINED, Decoder
from jaxfrontier.model.layers.moe import MoE, update_router_bias
from jaxfrontier.model.layers import ACT_ND, RMSNorm, SwiGLU, dropout, embedding_lookup, param
from jaxfrontier.model.sequence import Seq, as_seq


class GroupedQueryAttention(nnx.Module):
    """Causal attention with g <= h key/value heads, RoPE on queries and keys (attention.attend).

    The query projection w_q [d, H, K] and the key/value projection w_kv [d, 2, G, K] are
    separate (Hugging Face's q_proj and k_proj/v_proj), so each lays its heads out on its own.
    K is the shape's `head_dim`: d / H, or a width of its own (Qwen3), when q is H K != d wide and
    w_out [H, K, d] projects back. QK-norm (Qwen3) RMS-normalises each head's q and k over K before
    RoPE, with one scale [K] each (q_norm, k_norm) shared by the heads.
    """

    def __init__(self, s: ModelShape, *, out_std: float, rngs: nnx.Rngs):
        d, h, g, k = s.d_model, s.num_heads, s.kv_heads, s.head_dim
        self.impl, self.blocks = s.attention, (s.attention_block_q, s.attention_block_kv)
        self.rope_theta, self.rope_scaling, self.qkv_bias = s.rope_theta, s.rope_scaling, s.qkv_bias
        self.qk_norm = s.qk_norm
        self.w_q = param(rngs.params(), (d, h, k), ('embed', 'heads', 'head_dim'), s.init_std)
        self.w_kv = param(rngs.params(), (d, 2, g, k), ('embed', 'qkv', 'kv_heads', 'head_dim'), s.init_std)
        if s.qkv_bias:
            self.b_q = param(None, (h, k), ('heads', 'head_dim'), 0.0)
            self.b_kv = param(None, (2, g, k), ('qkv', 'kv_heads', 'head_dim'), 0.0)
        if s.qk_norm:
            self.q_norm = RMSNorm(k, eps=s.norm_eps, rngs=rngs, names=('head_dim',))
            self.k_norm = RMSNorm(k, eps=s.norm_eps, rngs=rngs, names=('head_dim',))
        self.w_out = param(rngs.params(), (h, k, d), ('heads', 'head_dim', 'embed'), out_std)
        for name in ('w_q', 'w_kv', 'w_out'):  # LoRA adapters of the targeted ones (layers/linear.py)
            linear.adapt(self, name, s.lora and s.lora.under('attn'), rngs)

    def __call__(self, x_nd: jax.Array, seq: int | Seq, positions_bt: jax.Array, cache: KVCache | None = None,
                 key: jax.Array | None = None) -> tuple[jax.Array, KVCache | None]:
        """Attention of `x_nd` [B*T, d] at `positions_bt` [B, T]; the extended cache with `cache`; `key`:
        LoRA adapters' dropout (training)."""
        seq_len = as_seq(seq).length
        q_nhk = linear.project(self, 'w_q', 'nd,dhk->nhk', x_nd, key=key)
        kv_n2gk = linear.project(self, 'w_kv', 'nd,dagk->nagk', x_nd, key=key)
        if self.qkv_bias:  # added after both projections, not inside each: that would reorder the program
            q_nhk = linear.add_bias(self, 'b_q', q_nhk)
            kv_n2gk = linear.add_bias(self, 'b_kv', kv_n2gk)
        if self.qk_norm:  # each head's q over its K dimensions (statistics in fp32), before RoPE
            q_nhk = self.q_norm(q_nhk)
        n, h, k = q_nhk.shape
        b = n // seq_len
        inv_freq = rope.inverse_frequencies(k, self.rope_theta, self.rope_scaling)
        q_bthk = rope.apply_rope(unflatten_tokens(q_nhk, b, seq_len), positions_bt, inv_freq)  # [B, T, H, K]
        kv_bt2gk = unflatten_tokens(kv_n2gk, b, seq_len)  # [B, T, 2, G, K]
        k_btgk = kv_bt2gk[:, :, 0]
        if self.qk_norm:
            k_btgk = self.k_norm(k_btgk)
        k_btgk = rope.apply_rope(k_btgk, positions_bt, inv_freq)
        o_bthk, cache = attend(q_bthk, k_btgk, kv_bt2gk[:, :, 1], self.impl, self.blocks, cache, positions_bt, seq)
        return linear.project(self, 'w_out', 'nhk,hkd->nd', flatten_tokens(o_bthk), out_names=ACT_ND, key=key), cache


class Block(nnx.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP a SwiGLU, or with `moe` the
    mixture-of-experts layer (model/layers/moe.py), whose aux the block returns."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs, moe: bool = False):
        # Residual-output projections scaled down with depth, as GPT's (Megatron's init).
        out_std = s.init_std / (2 * s.num_layers) ** 0.5
        self.dropout_rate, self.moe = s.dropout_rate, moe
        self.attn_norm = RMSNorm(s.d_model, eps=s.norm_eps, rngs=rngs)
        self.attn = GroupedQueryAttention(s, out_std=out_std, rngs=rngs)
        self.mlp_norm = RMSNorm(s.d_model, eps=s.norm_eps, rngs=rngs)
        if moe:  # LoRA adapters go on attention and dense MLPs, not on experts (families/lora.py)
            self.mlp = MoE(s.d_model, s.moe, init_std=s.init_std, out_std=out_std, rngs=rngs)
        else:
            self.mlp = SwiGLU(s.d_model, s.mlp_dim, init_std=s.init_std, out_std=out_std, rngs=rngs,
                              lora=s.lora and s.lora.under('mlp'))

    def __call__(self, x_nd: jax.Array, seq: int | Seq, key: jax.Array | None, cache: KVCache | None = None,
                 positions_bt: jax.Array | None = None) -> tuple[jax.Array, dict | KVCache]:
        """The block on `x_nd` [B*T, d] (`seq`: model/sequence.py): (output, aux), aux empty
        (model/auxiliary.py); decoding passes this layer's KV cache and the tokens' positions
        [B, T] and gets (output, the extended cache). Training's
        positions are the Seq's, or 0..T-1."""
        k_attn, k_mlp = (None, None) if key is None else tuple(jax.random.split(key))
        if positions_bt is None:
            positions_bt = sequence.positions(seq, x_nd.shape[0] // as_seq(seq).length)
        y_nd, new_cache = self.attn(self.attn_norm(x_nd), seq, positions_bt, cache, key=k_attn)
        x_nd = x_nd + dropout(y_nd, self.dropout_rate, k_attn)
        if self.moe:  # decoding computes every assignment (no capacity drops for a few tokens)
            y_nd, aux = self.mlp(self.mlp_norm(x_nd), seq, dropless=True if cache is not None else None)
        else:
            y_nd, aux = self.mlp(self.mlp_norm(x_nd), key=k_mlp), {}  # no auxiliary outputs
        x_nd = x_nd + dropout(y_nd, self.dropout_rate, k_mlp)
        x_nd = mesh_lib.constrain(x_nd, ACT_ND)
        return (x_nd, aux) if cache is None else (x_nd, new_cache)


class Llama(Decoder):
    """Llama-style decoder: no position table (RoPE inside the blocks), RMSNorm, untied head by default."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        self.shape = s
        self.wte = param(rngs.params(), (s.vocab_size, s.d_model), ('vocab', 'embed'), s.init_std)
        if s.moe is None:
            self.blocks = stack.create(lambda r: Block(s, rngs=r), s.num_layers, rngs)
        else:  # the first moe.first_dense layers dense (a stem group), the others mixture-of-experts
            if s.moe.first_dense:
                self.GROUPS = (DENSE_GROUP, PIPELINED)
                self.dense_blocks = stack.create(lambda r: Block(s, rngs=r), s.moe.first_dense, rngs,
                                                 axis_name=stack.STEM_LAYERS)
            self.blocks = stack.create(lambda r: Block(s, rngs=r, moe=True), s.num_layers - s.moe.first_dense, rngs)
        self.norm_f = RMSNorm(s.d_model, eps=s.norm_eps, rngs=rngs)
        if not s.tied_embeddings:
            self.head = param(rngs.params(), (s.d_model, s.vocab_size), ('embed', 'vocab'), s.init_std)

    def embed(self, tokens_bt: jax.Array, dropout_key: jax.Array | None = None,
              positions_bt: jax.Array | None = None) -> jax.Array:
        """Token embeddings, flattened to [B*T, d] in the compute dtype; positions act in the blocks."""
        del positions_bt  # RoPE: each block rotates q and k by them
        x_nd = flatten_tokens(embedding_lookup(self.wte[...], tokens_bt)).astype(self.dtype)  # [N, d]
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, EMBED_KEY_INDEX)
        return mesh_lib.constrain(dropout(x_nd, self.shape.dropout_rate, key), ACT_ND)

    def final_norm(self, x_nd: jax.Array) -> jax.Array:
        return self.norm_f(x_nd)

    def update_outside_gradient(self, params: dict, aux: dict) -> dict:
        """The MoE router's balancing bias moved by the step's loads (moe.update_router_bias)."""
        moe = self.shape.moe
        if moe is None or not moe.router_bias or not moe.bias_rate:
            return params
        return update_router_bias(params, aux['moe_load'], moe.bias_rate, self.GROUPS)
