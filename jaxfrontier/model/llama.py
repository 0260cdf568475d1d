"""The Llama family: token embeddings, RMSNorm pre-norm blocks with rotary attention and SwiGLU.

Llama 2/3, Mistral-style dense and Qwen2 (q/k/v biases) decoders: grouped-query attention
(`num_kv_heads` key/value heads shared by groups of query heads; 1 = multi-query), rotary
position embeddings in Hugging Face's half-split convention (model/layers/rope.py; theta and Llama
3.1's frequency scaling configurable), a SwiGLU MLP, no biases by default, an untied head
by default. The blocks, the head and the loss run as GPT's do (model/decoder.py, stack.py);
one block serves training and KV-cached decoding. The module ends with the family's
declaration (`FAMILY`; model/family.py).

Tensor parallelism (Megatron): q, gate and up column-parallel over heads / `mlp`, the output
and down projections row-parallel; the g kv heads split over `tensor` where g divides it and
are replicated where it does not (config.resolve_rules), each rank repeating them to its own
query heads (attention.repeat_kv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier import flops as flops_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import ModelShape
from jaxfrontier.model import hf_names, sequence, stack
from jaxfrontier.model.layers import rope
from jaxfrontier.model.attention import KVCache, attend
from jaxfrontier.model.context import flatten_tokens, unflatten_tokens
from jaxfrontier.model.decoder import EMBED_KEY_INDEX, Decoder
from jaxfrontier.model.family import Family, ParamSpec
from jaxfrontier.model.layers import ACT_ND, RMSNorm, SwiGLU, dropout, embedding_lookup, param
from jaxfrontier.model.sequence import Seq, as_seq


class GroupedQueryAttention(nnx.Module):
    """Causal attention with g <= h key/value heads, RoPE on queries and keys (attention.attend).

    The query projection w_q [d, H, K] and the key/value projection w_kv [d, 2, G, K] are
    separate (Hugging Face's q_proj and k_proj/v_proj), so each lays its heads out on its own.
    """

    def __init__(self, s: ModelShape, *, out_std: float, rngs: nnx.Rngs):
        d, h, g, k = s.d_model, s.num_heads, s.kv_heads, s.head_dim
        self.impl, self.blocks = s.attention, (s.attention_block_q, s.attention_block_kv)
        self.rope_theta, self.rope_scaling, self.qkv_bias = s.rope_theta, s.rope_scaling, s.qkv_bias
        self.w_q = param(rngs.params(), (d, h, k), ('embed', 'heads', 'head_dim'), s.init_std)
        self.w_kv = param(rngs.params(), (d, 2, g, k), ('embed', 'qkv', 'kv_heads', 'head_dim'), s.init_std)
        if s.qkv_bias:
            self.b_q = param(None, (h, k), ('heads', 'head_dim'), 0.0)
            self.b_kv = param(None, (2, g, k), ('qkv', 'kv_heads', 'head_dim'), 0.0)
        self.w_out = param(rngs.params(), (h, k, d), ('heads', 'head_dim', 'embed'), out_std)

    def __call__(self, x_nd: jax.Array, seq: int | Seq, positions_bt: jax.Array, cache: KVCache | None = None
                 ) -> tuple[jax.Array, KVCache | None]:
        """Attention of `x_nd` [B*T, d] at `positions_bt` [B, T]; the extended cache with `cache`."""
        seq_len = as_seq(seq).length
        dtype = x_nd.dtype
        q_nhk = jnp.einsum('nd,dhk->nhk', x_nd, self.w_q[...].astype(dtype))
        kv_n2gk = jnp.einsum('nd,dagk->nagk', x_nd, self.w_kv[...].astype(dtype))
        if self.qkv_bias:
            q_nhk = q_nhk + self.b_q[...].astype(dtype)
            kv_n2gk = kv_n2gk + self.b_kv[...].astype(dtype)
        n, h, k = q_nhk.shape
        b = n // seq_len
        inv_freq = rope.inverse_frequencies(k, self.rope_theta, self.rope_scaling)
        q_bthk = rope.apply_rope(unflatten_tokens(q_nhk, b, seq_len), positions_bt, inv_freq)  # [B, T, H, K]
        kv_bt2gk = unflatten_tokens(kv_n2gk, b, seq_len)  # [B, T, 2, G, K]
        k_btgk = rope.apply_rope(kv_bt2gk[:, :, 0], positions_bt, inv_freq)
        o_bthk, cache = attend(q_bthk, k_btgk, kv_bt2gk[:, :, 1], self.impl, self.blocks, cache, positions_bt, seq)
        y_nd = jnp.einsum('nhk,hkd->nd', flatten_tokens(o_bthk), self.w_out[...].astype(dtype))
        return mesh_lib.constrain(y_nd, ACT_ND), cache


class Block(nnx.Module):
    """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        # Residual-output projections scaled down with depth, as GPT's (Megatron's init).
        out_std = s.init_std / (2 * s.num_layers) ** 0.5
        self.dropout_rate = s.dropout_rate
        self.attn_norm = RMSNorm(s.d_model, eps=s.norm_eps, rngs=rngs)
        self.attn = GroupedQueryAttention(s, out_std=out_std, rngs=rngs)
        self.mlp_norm = RMSNorm(s.d_model, eps=s.norm_eps, rngs=rngs)
        self.mlp = SwiGLU(s.d_model, s.mlp_dim, init_std=s.init_std, out_std=out_std, rngs=rngs)

    def __call__(self, x_nd: jax.Array, seq: int | Seq, key: jax.Array | None, cache: KVCache | None = None,
                 positions_bt: jax.Array | None = None) -> tuple[jax.Array, dict | KVCache]:
        """The block on `x_nd` [B*T, d] (`seq`: model/sequence.py): (output, aux), aux empty
        (model/auxiliary.py); decoding passes this layer's KV cache and the tokens' positions
        [B, T] and gets (output, the extended cache). Training's
        positions are the Seq's, or 0..T-1."""
        k_attn, k_mlp = (None, None) if key is None else tuple(jax.random.split(key))
        if positions_bt is None:
            positions_bt = sequence.positions(seq, x_nd.shape[0] // as_seq(seq).length)
        y_nd, new_cache = self.attn(self.attn_norm(x_nd), seq, positions_bt, cache)
        x_nd = x_nd + dropout(y_nd, self.dropout_rate, k_attn)
        x_nd = x_nd + dropout(self.mlp(self.mlp_norm(x_nd)), self.dropout_rate, k_mlp)
        x_nd = mesh_lib.constrain(x_nd, ACT_ND)
        return (x_nd, {}) if cache is None else (x_nd, new_cache)  # training: no auxiliary outputs


class Llama(Decoder):
    """Llama-style decoder: no position table (RoPE inside the blocks), RMSNorm, untied head by default."""

    def __init__(self, s: ModelShape, *, rngs: nnx.Rngs):
        self.shape = s
        self.wte = param(rngs.params(), (s.vocab_size, s.d_model), ('vocab', 'embed'), s.init_std)
        self.blocks = stack.create(lambda r: Block(s, rngs=r), s.num_layers, rngs)
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


# --------------------------------------------------------------------------- the family's declaration


def param_specs(s: ModelShape) -> tuple[ParamSpec, ...]:
    """Every parameter of `Llama(s)` (the planner's table; tested against eval_shape).

    g = kv heads; the key/value projection holds k and v ('qkv' axis of 2) for the g heads,
    whose logical name `kv_heads` the layout splits over `tensor` where g divides it and
    replicates otherwise (Megatron's GQA).
    """
    L, d, h, g, k, f, v = s.num_layers, s.d_model, s.num_heads, s.kv_heads, s.head_dim, s.mlp_dim, s.vocab_size
    block = [
        ('attn/w_kv', (d, 2, g, k), ('embed', 'qkv', 'kv_heads', 'head_dim')),
        ('attn/w_out', (h, k, d), ('heads', 'head_dim', 'embed')),
        ('attn/w_q', (d, h, k), ('embed', 'heads', 'head_dim')),
        ('attn_norm/scale', (d,), ('embed',)),
        ('mlp/w_down', (f, d), ('mlp', 'embed')),
        ('mlp/w_gate', (d, f), ('embed', 'mlp')),
        ('mlp/w_up', (d, f), ('embed', 'mlp')),
        ('mlp_norm/scale', (d,), ('embed',)),
    ]
    if s.qkv_bias:
        block += [('attn/b_kv', (2, g, k), ('qkv', 'kv_heads', 'head_dim')),
                  ('attn/b_q', (h, k), ('heads', 'head_dim'))]
    specs = [ParamSpec('blocks/' + p, (L, *shape), ('layers', *names)) for p, shape, names in sorted(block)]
    specs += [
        ParamSpec('norm_f/scale', (d,), ('embed',)),
        ParamSpec('wte', (v, d), ('vocab', 'embed')),
    ]
    if not s.tied_embeddings:
        specs.append(ParamSpec('head', (d, v), ('embed', 'vocab')))
    return tuple(specs)


def forward_flops(s: ModelShape) -> tuple[float, float]:
    """Forward matmul FLOPs of one layer and of the head, per sequence (2 per multiply-add).

    q and the output projection d x d each, k and v d x (g K) each (GQA's smaller k/v), the
    SwiGLU's three d x f matrices; attention counted in full (all s x s scores).
    """
    t, d, f, v = s.seq_len, s.d_model, s.mlp_dim, s.vocab_size
    kv = s.kv_heads * s.head_dim
    layer = 2 * t * (2 * d * d + 2 * d * kv + 3 * d * f) + 2 * 2 * t * t * d
    return float(layer), float(2 * t * d * v)


def megatron_flops(global_batch: int, s: ModelShape, recompute: bool) -> float:
    """Megatron-LM's count for GQA and SwiGLU (flops.py), padded vocabulary."""
    return flops_lib.gated_gqa_flops_per_step(global_batch, s.seq_len, s.num_layers, s.d_model, s.vocab_size,
                                              s.kv_heads / s.num_heads, s.mlp_dim, recompute)


FAMILY = Family(name='llama', module=Llama, param_specs=param_specs, forward_flops=forward_flops,
                megatron_flops=megatron_flops, hf=hf_names.LLAMA)
