"""The Llama family's declaration (its NNX module: model/llama.py).

Llama 2/3, Mistral-style dense, Qwen2 (q/k/v biases) and Qwen3 (QK-norm, a head width of its own)
decoders: grouped-query attention (`num_kv_heads` key/value heads shared by groups of query heads;
1 = multi-query), rotary position embeddings in Hugging Face's half-split convention (theta and
Llama 3.1's frequency scaling configurable), RMSNorm pre-norm blocks, a SwiGLU MLP, no biases by
default, an untied head by default. Each head is `head_dim` = K wide: d_model / num_heads unless set
(Qwen3-30B-A3B: d 2048, 32 heads of 128: q is 4096 wide); `qk_norm` RMS-normalises each head's q and
k over their K dimensions (a scale [K] each, shared by the heads) before RoPE.

Hugging Face: our Llama is HF's LlamaForCausalLM. The half-split rotary convention (`rotate_half`)
lets q/k weights map without the permutation Meta's original checkpoints need; SwiGLU is `hidden_act`
silu; q/k/v biases are Qwen2; QK-norm is Qwen3, the one import whose head_dim may differ from
hidden_size / heads (128 where config.json has none). Mistral is Llama's tensors under another name;
sliding windows (Mistral's; Qwen2's and Qwen3's where used) are refused. Export writes Qwen3ForCausalLM
with QK-norm, Qwen2ForCausalLM with q/k/v biases (`attention_bias` would bias the output projection
too, which we do not have), else LlamaForCausalLM. torch Linear weights are [out, in]: ours
transposed, heads flattened:

  wte [Vp, d] (rows < V)      model.embed_tokens.weight [V, d]
  blocks/attn_norm/scale [l]  model.layers.l.input_layernorm.weight [d]
  blocks/attn/w_q [l] d,H,K   model.layers.l.self_attn.q_proj.weight [H*K, d]
  blocks/attn/w_kv [l] d,2,G,K  ...self_attn.k_proj.weight [G*K, d] (index 0), v_proj.weight (index 1)
  blocks/attn/b_q, b_kv [l]   ...self_attn.{q,k,v}_proj.bias (qkv_bias: Qwen2)
  blocks/attn/q_norm, k_norm/scale [l] K  ...self_attn.{q,k}_norm.weight [K] (qk_norm: Qwen3)
  blocks/attn/w_out [l] H,K,d ...self_attn.o_proj.weight [d, H*K]
  blocks/mlp_norm/scale [l]   ...post_attention_layernorm.weight [d]
  blocks/mlp/w_gate, w_up [l] ...mlp.gate_proj.weight, up_proj.weight [F, d]
  blocks/mlp/w_down [l]       ...mlp.down_proj.weight [d, F]
  norm_f/scale                model.norm.weight [d]
  head [d, Vp] (untied)       lm_head.weight [V, d]

RoPE settings: transformers 5 keeps theta and the scaling in `rope_parameters`; version 4 wrote
`rope_theta` and `rope_scaling` at the top. Both are read; export writes transformers 5's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxfrontier import flops as flops_lib
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.families import moe as moe_lib
from jaxfrontier.families.base import Family, HFConverter, ModelShape, ParamSpec, ShrunkHeads

ROPE_SCALINGS = ('none', 'llama3')  # model.rope_scaling: 'llama3' is transformers' name of Llama 3.1's

# The family's model.* fields (base_config's model section has them; docs/models.md lists them).
FIELDS = dict(
    # Key/value heads (grouped-query attention; 1 = multi-query); 0 = num_heads.
    num_kv_heads=0,
    qkv_bias=False,  # biases on the q, k and v projections (Qwen2)
    head_dim=0,  # each head's width K; 0 = d_model / num_heads (set apart from it, q is num_heads * K wide: Qwen3)
    qk_norm=False,  # RMSNorm over each head's q and k before RoPE (Qwen3's q_norm, k_norm)
    norm_eps=1e-5,  # RMSNorm epsilon
    rope_theta=10000.0,  # rotary embedding base
    # 'llama3' applies Llama 3.1's frequency scaling with the four rope_* below.
    rope_scaling='none',
    rope_factor=8.0,
    rope_low_freq_factor=1.0,
    rope_high_freq_factor=4.0,
    rope_original_max_len=8192,
    # With model.mlp_dim 0, the MLP is 2/3 of 4 * d_model wide, times ffn_dim_multiplier where set
    # (0 = none), rounded up to multiple_of (Meta's rule, `llama_mlp_dim`).
    ffn_dim_multiplier=0.0,
    multiple_of=256,
)
SHAPE_FIELDS = ('num_kv_heads', 'qkv_bias', 'head_dim', 'qk_norm', 'ffn_dim_multiplier', 'multiple_of')


@dataclasses.dataclass(frozen=True)
class LlamaShape(ModelShape):
    """ModelShape with the Llama family's own numbers."""

    num_kv_heads: int = 0  # key/value heads; 0: num_heads (`kv_heads`)
    qkv_bias: bool = False
    qk_norm: bool = False
    explicit_head_dim: int = 0  # model.head_dim; 0: d_model / num_heads (`head_dim`)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1's RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or None for plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    moe: moe_lib.MoEShape | None = None  # the mixture-of-experts MLP (families/moe.py); None: dense

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads where that is 0 (multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        """Each head's width K: model.head_dim where set (Qwen3), else d_model / num_heads."""
        return self.explicit_head_dim or self.d_model // self.num_heads


def llama_mlp_dim(d_model: int, ffn_dim_multiplier: float, multiple_of: int) -> int:
    """Meta's rule for the SwiGLU width: 2/3 of 4 d, times the multiplier, rounded up to multiple_of.

    Llama 3.1 8B: d 4096, multiplier 1.3, multiple_of 1024 -> 14,336 (the published width).
    """
    hidden = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


def mlp_dim(m: Mapping[str, Any]) -> int:
    return llama_mlp_dim(m['d_model'], m.get('ffn_dim_multiplier', 0.0), m.get('multiple_of', 256))


def _width(m: Mapping[str, Any]) -> int:
    return m.get('mlp_dim') or mlp_dim(m)


def _effective(m: Mapping[str, Any]) -> dict[str, Any]:
    return {f: m[f] for f in FIELDS} | {'num_kv_heads': m['num_kv_heads'] or m['num_heads'],
                                        'head_dim': m['head_dim'] or m['d_model'] // m['num_heads']}


def check(m: Mapping[str, Any], require: Callable[..., None]) -> None:
    """The family's fields: kv heads dividing the heads, an even head width, RoPE and norm numbers in range."""
    require(isinstance(m.qk_norm, bool), 'model.qk_norm', m.qk_norm, 'must be True or False',
            'set True (Qwen3) or False')
    require(isinstance(m.num_kv_heads, int) and m.num_kv_heads >= 0, 'model.num_kv_heads', m.num_kv_heads,
            'must be an integer >= 0', 'set 0 (as many as model.num_heads) or the key/value heads')
    kv = m.num_kv_heads or m.num_heads
    require(m.num_heads % kv == 0, 'model.num_kv_heads', m.num_kv_heads,
            f'must divide model.num_heads = {m.num_heads} (each kv head serves a group of query heads)',
            f'choose a divisor of {m.num_heads}, e.g. {math.gcd(m.num_heads, kv)}')
    require(isinstance(m.head_dim, int) and not isinstance(m.head_dim, bool) and m.head_dim >= 0, 'model.head_dim',
            m.head_dim, 'must be an integer >= 0', 'set 0 (d_model / num_heads) or each head\'s width, e.g. 128')
    if m.head_dim:
        require(m.head_dim % 2 == 0, 'model.head_dim', m.head_dim, 'must be even for rotary embeddings (they '
                'rotate pairs of dimensions)', f'choose an even head width, e.g. {m.head_dim + 1}')
    else:
        require((m.d_model // m.num_heads) % 2 == 0, 'model.d_model', m.d_model,
                f'the head dimension d_model / num_heads = {m.d_model // m.num_heads} must be even for rotary '
                'embeddings (they rotate pairs of dimensions)', 'choose d_model and num_heads with an even quotient')
    require(m.rope_scaling in ROPE_SCALINGS, 'model.rope_scaling', m.rope_scaling, 'unknown RoPE scaling',
            f'use one of {ROPE_SCALINGS}')
    for field, low, example in (('norm_eps', 0.0, 1e-5), ('rope_theta', 1.0, 500000.0)):
        require(math.isfinite(m[field]) and m[field] > low, f'model.{field}', m[field],
                f'must be a finite number > {low}', f'set model.{field} to e.g. {example}')
    require(math.isfinite(m.ffn_dim_multiplier) and m.ffn_dim_multiplier >= 0, 'model.ffn_dim_multiplier',
            m.ffn_dim_multiplier, 'must be a finite number >= 0', 'set 0 (none) or e.g. 1.3')
    require(isinstance(m.multiple_of, int) and m.multiple_of >= 1, 'model.multiple_of', m.multiple_of,
            'must be a positive integer', 'set e.g. 256')
    if m.rope_scaling == 'llama3':
        require(math.isfinite(m.rope_factor) and m.rope_factor >= 1, 'model.rope_factor', m.rope_factor,
                'must be a finite number >= 1 (how much longer the context becomes)', 'set e.g. 8.0')
        low, high = m.rope_low_freq_factor, m.rope_high_freq_factor
        require(math.isfinite(low) and math.isfinite(high) and 0 < low < high, 'model.rope_high_freq_factor',
                high, f'must be finite and above model.rope_low_freq_factor = {low} > 0',
                'use e.g. rope_low_freq_factor=1.0, rope_high_freq_factor=4.0')
        require(isinstance(m.rope_original_max_len, int) and m.rope_original_max_len >= 1,
                'model.rope_original_max_len', m.rope_original_max_len, 'must be a positive integer',
                'set the context length the model was pre-trained at, e.g. 8192')


def _shape_fields_of(m: Mapping[str, Any]) -> dict[str, Any]:
    scaling = None if m['rope_scaling'] == 'none' else (
        float(m['rope_factor']), float(m['rope_low_freq_factor']), float(m['rope_high_freq_factor']),
        int(m['rope_original_max_len']))
    return dict(num_kv_heads=m['num_kv_heads'] or m['num_heads'], qkv_bias=m['qkv_bias'], qk_norm=m['qk_norm'],
                explicit_head_dim=m['head_dim'], norm_eps=m['norm_eps'], rope_theta=m['rope_theta'],
                rope_scaling=scaling)


def param_specs(s: LlamaShape) -> tuple[ParamSpec, ...]:
    """Every parameter of `Llama(s)` (the planner's table; tested against eval_shape).

    g = kv heads, k = each head's width (`head_dim`); the key/value projection holds k and v ('qkv'
    axis of 2) for the g heads, whose logical name `kv_heads` the layout splits over `tensor` where g
    divides it and replicates otherwise (Megatron's GQA). QK-norm's scales [k] are whole on every device.
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
    if s.qk_norm:
        block += [('attn/k_norm/scale', (k,), ('head_dim',)), ('attn/q_norm/scale', (k,), ('head_dim',))]
    specs = [ParamSpec('blocks/' + p, (L, *shape), ('layers', *names)) for p, shape, names in sorted(block)]
    specs += [ParamSpec('norm_f/scale', (d,), ('embed',)), ParamSpec('wte', (v, d), ('vocab', 'embed'))]
    if not s.tied_embeddings:
        specs.append(ParamSpec('head', (d, v), ('embed', 'vocab')))
    return tuple(specs)


def forward_flops(s: LlamaShape) -> tuple[float, float]:
    """Forward matmul FLOPs of one layer and of the head, per sequence (2 per multiply-add).

    q and the output projection d x (h K) each (d x d unless the head width is set apart), k and v
    d x (g K) each (GQA's smaller k/v), the SwiGLU's three d x f matrices; attention counted in full
    (all s x s scores, h K wide). QK-norm is element-wise: not counted.
    """
    t, d, f, v = s.seq_len, s.d_model, s.mlp_dim, s.vocab_size
    q, kv = s.num_heads * s.head_dim, s.kv_heads * s.head_dim
    layer = 2 * t * (2 * d * q + 2 * d * kv + 3 * d * f) + 2 * 2 * t * t * q
    return float(layer), float(2 * t * d * v)


def megatron_flops(global_batch: int, s: LlamaShape, recompute: bool) -> float:
    """Megatron-LM's count for GQA and SwiGLU (flops.py), padded vocabulary, q h K wide."""
    return flops_lib.gated_gqa_flops_per_step(global_batch, s.seq_len, s.num_layers, s.d_model, s.vocab_size,
                                              s.kv_heads / s.num_heads, s.mlp_dim, recompute,
                                              query_projection_size=s.num_heads * s.head_dim)


def _proxy_fields(choice: tuple[bool, bool, bool], sizes: Mapping[str, int]) -> dict[str, Any]:
    grouped, qk_norm, apart = choice
    return {'num_kv_heads': sizes['g'] if grouped else sizes['h'], 'qk_norm': qk_norm} | (
        {'explicit_head_dim': sizes['k'], 'd_model': sizes['d_apart']} if apart else {})


def shrink(s: LlamaShape, tensor: int) -> ShrunkHeads:
    """The verify check's heads: two query heads per tensor shard (a swapped head order shows) where the
    grouping allows it, the same query heads per key/value head, and key/value heads that divide tensor
    exactly where the config's do (split, else replicated).

    The smallest k/v head count g' >= 1 with r g' a multiple of tensor (r = heads / kv_heads) and
    g' % tensor == 0 as in the config, preferring r g' >= 2 tensor; the config's own kv_heads
    always qualifies (it is valid), so one is found. A head width apart from d_model / num_heads
    stays apart (plan/shrink.py sets model.head_dim: `head_dim_field`); one equal to it is the rule's (0).
    """
    heads, kv_heads = s.num_heads, s.kv_heads
    ratio, split = heads // kv_heads, kv_heads % tensor == 0
    kept = {'query heads per key/value head': ratio, 'key/value heads split over tensor': split}
    apart = s.head_dim != s.d_model // s.num_heads  # q projects to num_heads * head_dim != d_model
    if apart:
        kept['head width apart from d_model / num_heads'] = True
    fields, field = ({}, 'head_dim') if apart else ({'head_dim': 0}, '')
    if kv_heads == heads:
        return ShrunkHeads(2 * tensor, {'num_kv_heads': 2 * tensor} | fields, kept, field)
    fits = [g for g in range(1, kv_heads + 1) if (ratio * g) % tensor == 0 and (g % tensor == 0) == split]
    g = next((g for g in fits if ratio * g >= 2 * tensor), fits[0])
    return ShrunkHeads(ratio * g, {'num_kv_heads': g} | fields, kept, field)


# ------------------------------------------------------------------- Hugging Face Llama / Mistral / Qwen2 / Qwen3

QWEN2 = ('Qwen2ForCausalLM', 'qwen2')  # what a model with q/k/v biases exports as
QWEN3 = ('Qwen3ForCausalLM', 'qwen3')  # what a model with QK-norm exports as
RMS_NORM_EPS, ROPE_THETA = 1e-6, 10000.0  # transformers' defaults
QWEN3_HEAD_DIM = 128  # Qwen3Config's head_dim where config.json has none (not hidden_size / heads)
ATTENTION_KINDS = ('full_attention', 'sliding_attention')  # `layer_types` entries (Qwen2, Qwen3)
LLAMA3_KEYS = (('rope_factor', 'factor'), ('rope_low_freq_factor', 'low_freq_factor'),
               ('rope_high_freq_factor', 'high_freq_factor'))


def _head_dim_of(m: Mapping[str, Any]) -> int:
    """A saved config's head width (one from before model.head_dim: d_model / num_heads)."""
    return m.get('head_dim') or m['d_model'] // m['num_heads']


def _check_exportable(m: dict[str, Any], where: str) -> None:
    d, h, k = m['d_model'], m['num_heads'], _head_dim_of(m)
    for bad, problem in (
            (d % h, f'd_model {d} is not divisible by num_heads {h}, which HF Llama needs'),
            (k != d // h and not m.get('qk_norm'), f'head_dim {k} is not d_model / num_heads = {d // h}: of the '
             'Hugging Face architectures jaxfrontier writes only Qwen3 (qk_norm) has a head width of its own'),
            (m.get('qk_norm') and m['qkv_bias'], 'qk_norm with qkv_bias: Qwen3 biases q, k, v and the output '
             'projection, or none of them')):
        if bad:
            raise CheckpointError(f'{where}: {problem}. Fix: none; export safetensors.')


def _hf_config(m: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' LlamaConfig (Qwen2Config with q/k/v biases, Qwen3Config with QK-norm) for a saved
    config's model.*."""
    layers, heads = m['num_layers'], m['num_heads']
    rope: dict[str, Any] = {'rope_type': 'default', 'rope_theta': float(m['rope_theta'])}
    if m['rope_scaling'] == 'llama3':
        rope |= {'rope_type': 'llama3', 'original_max_position_embeddings': int(m['rope_original_max_len']),
                 **{theirs: float(m[ours]) for ours, theirs in LLAMA3_KEYS}}
    qwen3 = bool(m.get('qk_norm'))
    architecture, model_type = QWEN3 if qwen3 else QWEN2 if m['qkv_bias'] else (HF.architecture, HF.model_type)
    out = {'architectures': [architecture], 'model_type': model_type, 'vocab_size': m['vocab_size'],
           'hidden_size': m['d_model'], 'intermediate_size': _width(m), 'num_hidden_layers': layers,
           'num_attention_heads': heads, 'num_key_value_heads': m.get('num_kv_heads') or heads,
           'head_dim': _head_dim_of(m), 'hidden_act': 'silu', 'max_position_embeddings': m['seq_len'],
           'rms_norm_eps': float(m['norm_eps']), 'rope_parameters': rope,
           'tie_word_embeddings': bool(m['tied_embeddings']), 'initializer_range': m['init_std'],
           'attention_dropout': 0.0, 'use_cache': True, 'bos_token_id': eot_id, 'eos_token_id': eot_id,
           'dtype': 'float32'}
    if m['qkv_bias'] or qwen3:
        return out | {'use_sliding_window': False, 'sliding_window': None, 'max_window_layers': layers,
                      'layer_types': ['full_attention'] * layers} | ({'attention_bias': False} if qwen3 else {})
    return out | {'attention_bias': False, 'mlp_bias': False, 'pretraining_tp': 1}


def _refuser(where: str):
    def refuse(key, value, fix):
        raise ConfigError('checkpoint.init_params_from', where,
                          f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)
    return refuse


def _positive(value: Any, key: str, refuse) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        refuse(key, value, 'use a positive number (save the model again with transformers)')
    return float(value)


def _sliding_window(hf: dict[str, Any]) -> Any:
    """The sliding window some layer attends with, or None (Mistral: any window; Qwen2, Qwen3: only if used)."""
    window = hf.get('sliding_window')
    if window is None or hf['model_type'] == 'llama':
        return None
    if hf['model_type'] in ('qwen2', 'qwen3'):
        if not hf.get('use_sliding_window'):
            return None
        types = hf.get('layer_types')
        if isinstance(types, list):
            return window if 'sliding_attention' in types else None
        first = hf.get('max_window_layers', hf['num_hidden_layers'])
        return window if not isinstance(first, int) or first < hf['num_hidden_layers'] else None
    return window


def _check_attention(hf: dict[str, Any], refuse) -> None:
    """Every layer attends to the whole context: known `layer_types`, no sliding window in some layers or all."""
    types, window = hf.get('layer_types'), _sliding_window(hf)
    if types is not None and (not isinstance(types, list) or not all(t in ATTENTION_KINDS for t in types)):
        i = [i for i, t in enumerate(types) if t not in ATTENTION_KINDS][0] if isinstance(types, list) else None
        refuse('layer_types' if i is None else f'layer_types[{i}]', types if i is None else types[i],
               f'use a model whose layer_types are all {ATTENTION_KINDS[0]!r}')
    fix = 'sliding-window attention is not implemented: use a model that attends to the whole context in every layer'
    if window is not None and isinstance(types, list) and 'full_attention' in types:
        refuse('layer_types', f'{types.count("sliding_attention")} sliding_attention and '
               f'{types.count("full_attention")} full_attention layers', f'{fix} (use_sliding_window false)')
    if window is not None:
        refuse('sliding_window', window, f'{fix} (sliding_window null, or use_sliding_window false)')


def _hf_head_dim(hf: dict[str, Any]) -> int:
    """config.json's head_dim, else transformers' default (Qwen3's 128, others' hidden_size / heads)."""
    qwen3 = hf['model_type'] == 'qwen3'
    return hf.get('head_dim') or (QWEN3_HEAD_DIM if qwen3 else hf['hidden_size'] // hf['num_attention_heads'])


def _rope_fields(hf: dict[str, Any], refuse) -> dict[str, Any]:
    """Our rope_* fields from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4)."""
    params = {}
    for key in ('rope_scaling', 'rope_parameters'):  # the newer spelling wins
        value = hf.get(key)
        if value is not None and not isinstance(value, dict):
            refuse(key, value, 'use an object or null (save the model again with transformers)')
        params |= value or {}
    theta = _positive(params.get('rope_theta', hf.get('rope_theta', ROPE_THETA)), 'rope_theta', refuse)
    kind = params.get('rope_type', params.get('type', 'default'))
    if kind == 'default':
        return {'rope_theta': theta, 'rope_scaling': 'none'}
    if kind != 'llama3':
        refuse('rope_type', kind, "use a model with rope_type 'default' or 'llama3' (Llama 3.1's scaling)")
    fields = {ours: _positive(params.get(theirs), theirs, refuse) for ours, theirs in LLAMA3_KEYS}
    original = params.get('original_max_position_embeddings')
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        refuse('original_max_position_embeddings', original, 'use a positive integer')
    if fields['rope_high_freq_factor'] <= fields['rope_low_freq_factor']:
        refuse('high_freq_factor', fields['rope_high_freq_factor'], 'use one above low_freq_factor')
    return {'rope_theta': theta, 'rope_scaling': 'llama3', **fields, 'rope_original_max_len': original}


def _model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields for a HF Llama / Mistral / Qwen2 / Qwen3 config (integers checked by hf_files.read_config)."""
    refuse = _refuser(where)
    model_type = hf['model_type']
    if hf.get('hidden_act', 'silu') not in HF.activations:
        refuse('hidden_act', hf.get('hidden_act'), 'use a model with silu (SwiGLU)')
    if hf.get('attention_bias') and model_type != 'qwen2':
        refuse('attention_bias', hf['attention_bias'], 'jaxfrontier has biases on q, k and v only (Qwen2), not on '
               'the output projection: use a model without attention_bias')
    if hf.get('mlp_bias'):
        refuse('mlp_bias', hf['mlp_bias'], 'use a model without MLP biases')
    d, heads, layers = hf['hidden_size'], hf['num_attention_heads'], hf['num_hidden_layers']
    kv_heads, head_dim = hf.get('num_key_value_heads') or heads, _hf_head_dim(hf)
    if d % heads:
        refuse('hidden_size', d, f'use a model whose hidden_size divides by num_attention_heads ({heads})')
    if (model_type != 'qwen3' and head_dim != d // heads) or head_dim % 2:
        refuse('head_dim', head_dim, f'jaxfrontier reads a head width apart from hidden_size / num_attention_heads = '
               f'{d // heads} only from Qwen3, and an even one (RoPE rotates pairs): use a model with such a head_dim')
    if heads % kv_heads:
        refuse('num_key_value_heads', kv_heads, f'use a model whose num_attention_heads ({heads}) it divides')
    _check_attention(hf, refuse)
    if hf.get('pretraining_tp', 1) not in (1, None):
        refuse('pretraining_tp', hf['pretraining_tp'], 'use a model with pretraining_tp 1')
    eps = _positive(hf.get('rms_norm_eps', RMS_NORM_EPS), 'rms_norm_eps', refuse)
    return {'family': 'llama', 'num_layers': layers, 'd_model': d, 'num_heads': heads, 'num_kv_heads': kv_heads,
            'head_dim': head_dim, 'mlp_dim': hf['intermediate_size'], 'qkv_bias': model_type == 'qwen2',
            'qk_norm': model_type == 'qwen3', 'norm_eps': eps, **_rope_fields(hf, refuse),
            'vocab_size': hf['vocab_size'], 'tied_embeddings': bool(hf.get('tie_word_embeddings', False)),
            'seq_len': hf['max_position_embeddings']}


def _top_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    d, v = hf['hidden_size'], hf['vocab_size']
    shapes = {HF.embed: (v, d), 'norm.weight': (d,)}
    return shapes | ({} if hf.get('tie_word_embeddings', False) else {'lm_head.weight': (v, d)})


def _layer_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One layer's tensors (biases as the config declares them; Qwen3's q_norm and k_norm)."""
    d, f, heads = hf['hidden_size'], hf['intermediate_size'], hf['num_attention_heads']
    head_dim = _hf_head_dim(hf)
    q, kv = heads * head_dim, (hf.get('num_key_value_heads') or heads) * head_dim
    shapes = {'input_layernorm.weight': (d,), 'self_attn.q_proj.weight': (q, d), 'self_attn.k_proj.weight': (kv, d),
              'self_attn.v_proj.weight': (kv, d), 'self_attn.o_proj.weight': (d, q),
              'post_attention_layernorm.weight': (d,), 'mlp.gate_proj.weight': (f, d), 'mlp.up_proj.weight': (f, d),
              'mlp.down_proj.weight': (d, f)}
    if hf['model_type'] == 'qwen2' or hf.get('attention_bias'):
        shapes |= {'self_attn.q_proj.bias': (q,), 'self_attn.k_proj.bias': (kv,), 'self_attn.v_proj.bias': (kv,)}
    if hf['model_type'] == 'qwen3':
        shapes |= {'self_attn.q_norm.weight': (head_dim,), 'self_attn.k_norm.weight': (head_dim,)}
    return shapes


def _to_hf(name: str, a: np.ndarray) -> list[np.ndarray]:
    if name == 'attn/w_kv':  # [d, 2, G, K] -> k, v [G*K, d]
        return [a[:, i].reshape(a.shape[0], -1).T for i in range(2)]
    if name == 'attn/b_kv':  # [2, G, K] -> k, v [G*K]
        return [a[i].reshape(-1) for i in range(2)]
    if name in ('attn/w_q', 'attn/w_out'):  # [d, H, K] -> [H*K, d]; [H, K, d] -> [d, H*K]
        return [a.reshape(a.shape[0], -1).T if name == 'attn/w_q' else a.reshape(-1, a.shape[-1]).T]
    if name == 'attn/b_q':  # [H, K] -> [H*K]
        return [a.reshape(-1)]
    return [a.T if name.startswith('mlp/w_') else a]  # [in, out] -> [out, in]; the norms' scales


def _from_hf(name: str, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """`_to_hf`'s inverse."""
    if name == 'attn/w_kv':
        d, _, g, k = shape
        return np.stack([t.T.reshape(d, g, k) for t in arrays], axis=1)
    if name == 'attn/b_kv':
        return np.stack([t.reshape(shape[1:]) for t in arrays])
    if name in ('attn/w_q', 'attn/w_out') or name.startswith('mlp/w_'):
        return arrays[0].T.reshape(shape)
    return arrays[0].reshape(shape)


HF = HFConverter(
    architecture='LlamaForCausalLM',
    model_type='llama',
    activations=('silu',),  # SwiGLU's gate
    layer_prefix='model.layers.{layer}.',
    block_names=(('attn_norm/scale', 'input_layernorm.weight'), ('attn/w_q', 'self_attn.q_proj.weight'),
                 ('attn/w_kv', 'self_attn.k_proj.weight'), ('attn/w_kv', 'self_attn.v_proj.weight'),
                 ('attn/b_q', 'self_attn.q_proj.bias'),
                 ('attn/b_kv', 'self_attn.k_proj.bias'), ('attn/b_kv', 'self_attn.v_proj.bias'),
                 ('attn/q_norm/scale', 'self_attn.q_norm.weight'), ('attn/k_norm/scale', 'self_attn.k_norm.weight'),
                 ('attn/w_out', 'self_attn.o_proj.weight'), ('mlp_norm/scale', 'post_attention_layernorm.weight'),
                 ('mlp/w_gate', 'mlp.gate_proj.weight'), ('mlp/w_up', 'mlp.up_proj.weight'),
                 ('mlp/w_down', 'mlp.down_proj.weight')),
    top_names=(('norm_f/scale', 'model.norm.weight'),),
    prefix='model.',
    embed='embed_tokens.weight',
    reads=(('LlamaForCausalLM', 'llama'), ('MistralForCausalLM', 'mistral'), QWEN2, QWEN3),
    position_table=False,
    config_ints=('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'vocab_size',
                 'max_position_embeddings'),
    optional_ints=('num_key_value_heads', 'head_dim'),
    numbers=('rms_norm_eps', 'rope_theta'),
    num_layers=lambda hf: hf['num_hidden_layers'],
    check_exportable=_check_exportable,
    hf_config=_hf_config,
    model_fields=_model_fields,
    top_shapes=_top_shapes,
    layer_shapes=_layer_shapes,
    to_hf=_to_hf,
    from_hf=_from_hf,
)

FAMILY = moe_lib.with_moe(Family(
    name='llama', module='jaxfrontier.model.llama:Llama', mlp_dim=mlp_dim, param_specs=param_specs,
    forward_flops=forward_flops, megatron_flops=megatron_flops, fields=FIELDS, shape_fields=SHAPE_FIELDS,
    max_sizes={'num_kv_heads': 2**16, 'head_dim': 2**16, 'multiple_of': 2**24, 'rope_original_max_len': 2**31},
    effective=_effective, check=check, shape_type=LlamaShape, shape_fields_of=_shape_fields_of, hf=HF,
    # What changes the numbers, not the size (the verify check keeps them; `shrink` keeps the grouping).
    verify_kept=('qkv_bias', 'qk_norm', 'norm_eps', 'rope_theta', 'rope_scaling', 'rope_factor', 'rope_low_freq_factor',
                 'rope_high_freq_factor', 'rope_original_max_len'), shrink=shrink,
    lora_targets=HF.lora_targets(contracted={'attn/w_out': 2}),  # q k v o gate up down (k, v: w_kv)
    proxy_choice=lambda s: (s.kv_heads < s.num_heads, s.qk_norm, s.head_dim != s.d_model // s.num_heads),
    proxy_fields=_proxy_fields,
), dense_width=_width)  # MoE layers where model.moe_experts > 0 (families/moe.py; model/layers/moe.py)
