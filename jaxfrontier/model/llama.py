"""The Llama family: token embeddings, RMSNorm pre-norm blocks with rotary attention and SwiGLU.

Llama 2/3, Mistral-style dense and Qwen2 (q/k/v biases) decoders: grouped-query attention
(`num_kv_heads` key/value heads shared by groups of query heads; 1 = multi-query), rotary
position embeddings in Hugging Face's half-split convention (model/rope.py; theta and Llama
3.1's frequency scaling configurable), a SwiGLU MLP, no biases by default, an untied head
by default.

THE MODULE IS BUILT BY THE LLAMA MODEL WORK (issue 23); this file holds its declaration.
"""

from __future__ import annotations

from jaxfrontier import flops as flops_lib
from jaxfrontier.config import ModelShape
from jaxfrontier.model.family import Family, HFNames, ParamSpec


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
    """Megatron-LM's GQA/SwiGLU count (flops.gated_gqa_flops_per_step), padded vocabulary."""
    return flops_lib.gated_gqa_flops_per_step(global_batch, s.seq_len, s.num_layers, s.d_model, s.vocab_size,
                                              s.kv_heads / s.num_heads, s.mlp_dim, recompute)


# PROVISIONAL (branch planllama, for the planner only): the Llama module is built by the llama
# model work and replaces this declaration (its module class, its Hugging Face names) at merge.
FAMILY = Family(name='llama', module=None, param_specs=param_specs, forward_flops=forward_flops,
                megatron_flops=megatron_flops,
                hf=HFNames(architecture='LlamaForCausalLM', model_type='llama', activations=('silu',),
                           layer_prefix='model.layers.{layer}.', block_names=(), top_names=()))
