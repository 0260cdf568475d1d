"""The GPT family's declaration: GPT-2 / Megatron's decoder (its NNX module: model/gpt.py).

Learned positions, pre-LayerNorm blocks with a fused QKV projection and a GeLU MLP mlp_ratio x
d_model wide, biases everywhere, a tied or untied head. It has no config fields of its own.

Hugging Face: `GPT2LMHeadModel`. Our GPT is GPT-2's architecture: LayerNorm eps 1e-5,
tanh-approximated GeLU (`jax.nn.gelu`, HF `gelu_new`), attention scaled by 1/sqrt(head_dim), so
every parameter maps exactly and `transformers.GPT2LMHeadModel` computes the same logits (fp32).
HF's Conv1D weights are [in, out], our layout after a reshape:

  wte [Vp, d] (rows < V)       transformer.wte.weight [V, d]
  wpe [S, d]                   transformer.wpe.weight [S, d]
  blocks/ln1/{scale,bias} [l]  transformer.h.l.ln_1.{weight,bias}
  blocks/attn/w_qkv [l] d,3,H,K transformer.h.l.attn.c_attn.weight [d, 3d]  (q | k | v, heads major)
  blocks/attn/b_qkv [l]        transformer.h.l.attn.c_attn.bias [3d]
  blocks/attn/w_out [l] H,K,d  transformer.h.l.attn.c_proj.weight [d, d]
  blocks/attn/b_out [l]        transformer.h.l.attn.c_proj.bias
  blocks/ln2 [l]               transformer.h.l.ln_2
  blocks/mlp/w_in, b_in [l]    transformer.h.l.mlp.c_fc.{weight [d, F], bias}
  blocks/mlp/w_out, b_out [l]  transformer.h.l.mlp.c_proj.{weight [F, d], bias}
  ln_f                         transformer.ln_f
  head [d, Vp] (untied)        lm_head.weight [V, d]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxfrontier import flops as flops_lib
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.families.base import Family, HFConverter, LoraTarget, ModelShape, ParamSpec

LAYER_NORM_EPS = 1e-5


def mlp_dim(m: Mapping[str, Any]) -> int:
    """GPT's width rule: mlp_ratio x d_model."""
    return m['mlp_ratio'] * m['d_model']


def param_specs(s: ModelShape) -> tuple[ParamSpec, ...]:
    """Every parameter of `GPT(s)` in params-dict order (the planner's table; tested against eval_shape)."""
    L, d, h, k, f, v = s.num_layers, s.d_model, s.num_heads, s.head_dim, s.mlp_dim, s.vocab_size
    block = [
        ('attn/b_out', (d,), ('embed',)),
        ('attn/b_qkv', (3, h, k), ('qkv', 'heads', 'head_dim')),
        ('attn/w_out', (h, k, d), ('heads', 'head_dim', 'embed')),
        ('attn/w_qkv', (d, 3, h, k), ('embed', 'qkv', 'heads', 'head_dim')),
        ('ln1/bias', (d,), ('embed',)),
        ('ln1/scale', (d,), ('embed',)),
        ('ln2/bias', (d,), ('embed',)),
        ('ln2/scale', (d,), ('embed',)),
        ('mlp/b_in', (f,), ('mlp',)),
        ('mlp/b_out', (d,), ('embed',)),
        ('mlp/w_in', (d, f), ('embed', 'mlp')),
        ('mlp/w_out', (f, d), ('mlp', 'embed')),
    ]
    specs = [ParamSpec('blocks/' + p, (L, *shape), ('layers', *names)) for p, shape, names in block]
    specs += [
        ParamSpec('ln_f/bias', (d,), ('embed',)),
        ParamSpec('ln_f/scale', (d,), ('embed',)),
        ParamSpec('wpe', (s.seq_len, d), ('positions', 'embed')),
        ParamSpec('wte', (v, d), ('vocab', 'embed')),
    ]
    if not s.tied_embeddings:
        specs.append(ParamSpec('head', (d, v), ('embed', 'vocab')))
    return tuple(specs)


def forward_flops(s: ModelShape) -> tuple[float, float]:
    """Forward matmul FLOPs of one layer and of the head, per sequence (2 per multiply-add).

    Attention is counted as computed: all s x s scores, although half are masked.
    """
    t, d, f, v = s.seq_len, s.d_model, s.mlp_dim, s.vocab_size
    layer = 2 * t * (3 * d * d + d * d + 2 * d * f) + 2 * 2 * t * t * d
    return float(layer), float(2 * t * d * v)


def megatron_flops(global_batch: int, s: ModelShape, recompute: bool) -> float:
    """Megatron's published formula (flops.py; it assumes GPT's 4h-wide MLP), padded vocabulary."""
    return flops_lib.megatron_flops_per_step(global_batch, s.seq_len, s.num_layers, s.d_model, s.vocab_size,
                                             recompute)


# --------------------------------------------------------------------------- Hugging Face GPT-2


def _check_exportable(m: dict[str, Any], where: str) -> None:
    """Refuses, with one line, a model that GPT-2 cannot represent."""
    if m['d_model'] % m['num_heads']:
        raise CheckpointError(
            f'{where}: d_model {m["d_model"]} is not divisible by num_heads '
            f'{m["num_heads"]}, GPT-2 cannot hold it. Fix: none; export safetensors.')


def _hf_config(m: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' GPT2Config fields for a saved config's model.*."""
    return {'architectures': [HF.architecture], 'model_type': HF.model_type, 'vocab_size': m['vocab_size'],
            'n_positions': m['seq_len'], 'n_ctx': m['seq_len'], 'n_embd': m['d_model'], 'n_layer': m['num_layers'],
            'n_head': m['num_heads'], 'n_inner': m.get('mlp_dim') or mlp_dim(m), 'activation_function': 'gelu_new',
            'layer_norm_epsilon': LAYER_NORM_EPS, 'initializer_range': m['init_std'], 'resid_pdrop': 0.0,
            'embd_pdrop': 0.0, 'attn_pdrop': 0.0, 'scale_attn_weights': True, 'use_cache': True,
            'tie_word_embeddings': bool(m['tied_embeddings']), 'bos_token_id': eot_id, 'eos_token_id': eot_id,
            'torch_dtype': 'float32'}


def _model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields for a HF GPT-2 config; refuses what our model cannot compute."""
    def refuse(key, value, fix):
        raise ConfigError('checkpoint.init_params_from', where,
                          f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)

    if hf.get('activation_function', 'gelu_new') not in HF.activations:
        refuse('activation_function', hf.get('activation_function'), f'use one with {HF.activations}')
    if abs(hf.get('layer_norm_epsilon', LAYER_NORM_EPS) - LAYER_NORM_EPS) > 1e-12:
        refuse('layer_norm_epsilon', hf.get('layer_norm_epsilon'), f'use one with {LAYER_NORM_EPS}')
    for key in ('scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn'):
        if hf.get(key):
            refuse(key, hf[key], 'use a model without it')
    if hf.get('scale_attn_weights', True) is not True:
        refuse('scale_attn_weights', hf['scale_attn_weights'], 'use a model with scaled attention')
    d = hf['n_embd']
    inner = hf.get('n_inner') or 4 * d
    if inner % d:
        refuse('n_inner', inner, 'use a model whose n_inner is a multiple of n_embd')
    return {'family': 'gpt', 'num_layers': hf['n_layer'], 'd_model': d, 'num_heads': hf['n_head'],
            'vocab_size': hf['vocab_size'], 'mlp_ratio': inner // d,
            'tied_embeddings': bool(hf.get('tie_word_embeddings', True)), 'seq_len': hf['n_positions']}


def _top_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    d, v = hf['n_embd'], hf['vocab_size']
    shapes = {'wte.weight': (v, d), 'wpe.weight': (hf['n_positions'], d), 'ln_f.weight': (d,), 'ln_f.bias': (d,)}
    if not hf.get('tie_word_embeddings', True):
        shapes['lm_head.weight'] = (v, d)
    return shapes


def _layer_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    d = hf['n_embd']
    f = hf.get('n_inner') or 4 * d
    return {'ln_1.weight': (d,), 'ln_1.bias': (d,), 'attn.c_attn.weight': (d, 3 * d), 'attn.c_attn.bias': (3 * d,),
            'attn.c_proj.weight': (d, d), 'attn.c_proj.bias': (d,), 'ln_2.weight': (d,), 'ln_2.bias': (d,),
            'mlp.c_fc.weight': (d, f), 'mlp.c_fc.bias': (f,), 'mlp.c_proj.weight': (f, d), 'mlp.c_proj.bias': (d,)}


def _to_hf(name: str, a: np.ndarray) -> list[np.ndarray]:
    shapes = {'attn/w_qkv': (a.shape[0], -1), 'attn/b_qkv': (-1,), 'attn/w_out': (-1, a.shape[-1])}
    return [a.reshape(shapes[name]) if name in shapes else a]


def _from_hf(name: str, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    del name
    return arrays[0].reshape(shape)


HF = HFConverter(
    architecture='GPT2LMHeadModel',
    model_type='gpt2',
    activations=('gelu_new', 'gelu_pytorch_tanh'),  # jax.nn.gelu: the tanh approximation
    layer_prefix='transformer.h.{layer}.',
    block_names=(('ln1/scale', 'ln_1.weight'), ('ln1/bias', 'ln_1.bias'),
                 ('attn/w_qkv', 'attn.c_attn.weight'), ('attn/b_qkv', 'attn.c_attn.bias'),
                 ('attn/w_out', 'attn.c_proj.weight'), ('attn/b_out', 'attn.c_proj.bias'),
                 ('ln2/scale', 'ln_2.weight'), ('ln2/bias', 'ln_2.bias'),
                 ('mlp/w_in', 'mlp.c_fc.weight'), ('mlp/b_in', 'mlp.c_fc.bias'),
                 ('mlp/w_out', 'mlp.c_proj.weight'), ('mlp/b_out', 'mlp.c_proj.bias')),
    top_names=(('ln_f/scale', 'transformer.ln_f.weight'), ('ln_f/bias', 'transformer.ln_f.bias')),
    prefix='transformer.',
    embed='wte.weight',
    reads=(('GPT2LMHeadModel', 'gpt2'),),
    position_table=True,
    top_first=(('wpe', 'wpe.weight'),),
    config_ints=('n_embd', 'n_layer', 'n_head', 'vocab_size', 'n_positions'),
    optional_ints=('n_inner',),
    numbers=('layer_norm_epsilon',),
    num_layers=lambda hf: hf['n_layer'],
    check_exportable=_check_exportable,
    hf_config=_hf_config,
    model_fields=_model_fields,
    top_shapes=_top_shapes,
    layer_shapes=_layer_shapes,
    to_hf=_to_hf,
    from_hf=_from_hf,
)

# LoRA targets (families/lora.py): q, k, v are the slices of the fused w_qkv; GPT-2 holds them in one Conv1D
# (c_attn, [in, out]), so no PEFT names: a GPT's adapters export merged (--export_format=hf).
LORA_TARGETS = (LoraTarget('q', 'attn/w_qkv', 1, 0), LoraTarget('k', 'attn/w_qkv', 1, 1),
                LoraTarget('v', 'attn/w_qkv', 1, 2), LoraTarget('o', 'attn/w_out', 2),
                LoraTarget('up', 'mlp/w_in', 1), LoraTarget('down', 'mlp/w_out', 1))

FAMILY = Family(name='gpt', module='jaxfrontier.model.gpt:GPT', mlp_dim=mlp_dim, param_specs=param_specs,
                forward_flops=forward_flops, megatron_flops=megatron_flops, hf=HF, lora_targets=LORA_TARGETS)
