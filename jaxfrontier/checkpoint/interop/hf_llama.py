"""The Llama family <-> Hugging Face Llama, Mistral and Qwen2 (`*ForCausalLM`): configs, tensors, refusals.

Our Llama (model/llama.py) is HF's LlamaForCausalLM: RMSNorm pre-norm, rotary embeddings in
HF's half-split (`rotate_half`) convention, so q/k weights map without the permutation Meta's
original checkpoints need; grouped-query attention; SwiGLU (`hidden_act` silu); no biases,
or biases on q, k and v only, which is exactly Qwen2; an untied head by default. Mistral is
Llama's tensors under another name; its sliding-window attention is not ours and is refused.
Export writes LlamaForCausalLM, or Qwen2ForCausalLM when the model has q/k/v biases (Llama's
`attention_bias` would add one to the output projection too, which we do not have).

Names (torch Linear weights are [out, in]: ours transposed, heads flattened):

  wte [Vp, d] (rows < V)      model.embed_tokens.weight [V, d]
  blocks/attn_norm/scale [l]  model.layers.l.input_layernorm.weight [d]
  blocks/attn/w_q [l] d,H,K   model.layers.l.self_attn.q_proj.weight [H*K, d]
  blocks/attn/w_kv [l] d,2,G,K  ...self_attn.k_proj.weight [G*K, d] (index 0), v_proj.weight (index 1)
  blocks/attn/b_q [l] H,K     ...self_attn.q_proj.bias [H*K]  (qkv_bias: Qwen2)
  blocks/attn/b_kv [l] 2,G,K  ...self_attn.k_proj.bias, v_proj.bias [G*K]
  blocks/attn/w_out [l] H,K,d ...self_attn.o_proj.weight [d, H*K]
  blocks/mlp_norm/scale [l]   ...post_attention_layernorm.weight [d]
  blocks/mlp/w_gate, w_up [l] ...mlp.gate_proj.weight, up_proj.weight [F, d]
  blocks/mlp/w_down [l]       ...mlp.down_proj.weight [d, F]
  norm_f/scale                model.norm.weight [d]
  head [d, Vp] (untied)       lm_head.weight [V, d]

RoPE settings: transformers 5 keeps theta and the scaling in `rope_parameters`; version 4
wrote `rope_theta` and `rope_scaling` at the top. Both spellings are read; export writes
transformers 5's (a test loads it).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.model import hf_names

NAMES = hf_names.LLAMA  # the names Llama declares (model/llama.py FAMILY.hf)
FAMILY = 'llama'
QWEN2 = ('Qwen2ForCausalLM', 'qwen2')  # what a model with q/k/v biases exports as
MODEL_TYPES = ('llama', 'mistral', 'qwen2')  # what import reads
PREFIX = 'model.'  # on every tensor but lm_head; a LlamaModel saved alone has none
EMBED = 'embed_tokens.weight'
TOP_FIRST = ()
TOP_LAST = tuple((ours, theirs.removeprefix(PREFIX)) for ours, theirs in NAMES.top_names)
POSITION_TABLE = False  # rotary positions: any model.seq_len computes the same logits as HF
CONFIG_INTS = ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'vocab_size',
               'max_position_embeddings')
OPTIONAL_INTS = ('num_key_value_heads', 'head_dim')
NUMBERS = ('rms_norm_eps', 'rope_theta')
RMS_NORM_EPS = 1e-6  # transformers' default for the three
ROPE_THETA = 10000.0
LLAMA3_KEYS = (('rope_factor', 'factor'), ('rope_low_freq_factor', 'low_freq_factor'),
               ('rope_high_freq_factor', 'high_freq_factor'))


def num_layers(hf: dict[str, Any]) -> int:
    return hf['num_hidden_layers']


# --------------------------------------------------------------------------- our config -> HF


def check_exportable(m: dict[str, Any], where: str) -> None:
    """Refuses, with one line, a model that no HF Llama/Qwen2 config can describe."""
    if m['d_model'] % m['num_heads']:
        raise CheckpointError(f'{where}: d_model {m["d_model"]} is not divisible by num_heads {m["num_heads"]}, '
                              'which HF Llama needs. Fix: none; export safetensors.')


def hf_config(m: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' LlamaConfig (or Qwen2Config, with q/k/v biases) for a saved config's model.*."""
    layers, heads = m['num_layers'], m['num_heads']
    rope: dict[str, Any] = {'rope_type': 'default', 'rope_theta': float(m['rope_theta'])}
    if m['rope_scaling'] == 'llama3':
        rope |= {'rope_type': 'llama3', 'original_max_position_embeddings': int(m['rope_original_max_len']),
                 **{theirs: float(m[ours]) for ours, theirs in LLAMA3_KEYS}}
    architecture, model_type = QWEN2 if m['qkv_bias'] else (NAMES.architecture, NAMES.model_type)
    out = {'architectures': [architecture], 'model_type': model_type, 'vocab_size': m['vocab_size'],
           'hidden_size': m['d_model'], 'intermediate_size': config_lib.model_mlp_dim(m), 'num_hidden_layers': layers,
           'num_attention_heads': heads, 'num_key_value_heads': m.get('num_kv_heads') or heads,
           'head_dim': m['d_model'] // heads, 'hidden_act': 'silu', 'max_position_embeddings': m['seq_len'],
           'rms_norm_eps': float(m['norm_eps']), 'rope_parameters': rope,
           'tie_word_embeddings': bool(m['tied_embeddings']), 'initializer_range': m['init_std'],
           'attention_dropout': 0.0, 'use_cache': True, 'bos_token_id': eot_id, 'eos_token_id': eot_id,
           'dtype': 'float32'}
    if m['qkv_bias']:
        out |= {'use_sliding_window': False, 'sliding_window': None, 'max_window_layers': layers,
                'layer_types': ['full_attention'] * layers}
    else:
        out |= {'attention_bias': False, 'mlp_bias': False, 'pretraining_tp': 1}
    return out


# --------------------------------------------------------------------------- HF config -> ours


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
    """The sliding window some layer attends with, or None (Mistral: any window; Qwen2: only if used)."""
    window = hf.get('sliding_window')
    if window is None or hf['model_type'] == 'llama':
        return None
    if hf['model_type'] == 'qwen2':
        if not hf.get('use_sliding_window'):
            return None
        types = hf.get('layer_types')
        if isinstance(types, list):
            return window if 'sliding_attention' in types else None
        first = hf.get('max_window_layers', hf['num_hidden_layers'])
        return window if not isinstance(first, int) or first < hf['num_hidden_layers'] else None
    return window


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


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields for a HF Llama / Mistral / Qwen2 config; refuses what our Llama cannot compute.

    The integer fields are already checked (hf_files.read_config); everything else here.
    """
    refuse = _refuser(where)
    model_type = hf['model_type']
    if hf.get('hidden_act', 'silu') not in NAMES.activations:
        refuse('hidden_act', hf.get('hidden_act'), 'use a model with silu (SwiGLU)')
    if hf.get('attention_bias') and model_type != 'qwen2':
        refuse('attention_bias', hf['attention_bias'], 'jaxfrontier has biases on q, k and v only (Qwen2), not on '
               'the output projection: use a model without attention_bias')
    if hf.get('mlp_bias'):
        refuse('mlp_bias', hf['mlp_bias'], 'use a model without MLP biases')
    d, heads, layers = hf['hidden_size'], hf['num_attention_heads'], hf['num_hidden_layers']
    kv_heads = hf.get('num_key_value_heads') or heads
    if d % heads:
        refuse('hidden_size', d, f'use a model whose hidden_size divides by num_attention_heads ({heads})')
    if hf.get('head_dim') not in (None, d // heads):
        refuse('head_dim', hf['head_dim'], f'jaxfrontier\'s head width is hidden_size / num_attention_heads = '
               f'{d // heads}: use a model with that head_dim')
    if heads % kv_heads:
        refuse('num_key_value_heads', kv_heads, f'use a model whose num_attention_heads ({heads}) it divides')
    window = _sliding_window(hf)
    if window is not None:
        refuse('sliding_window', window, 'sliding-window attention is not implemented: use a model that attends '
               'to the whole context in every layer (sliding_window null, or use_sliding_window false)')
    if hf.get('pretraining_tp', 1) not in (1, None):
        refuse('pretraining_tp', hf['pretraining_tp'], 'use a model with pretraining_tp 1')
    eps = _positive(hf.get('rms_norm_eps', RMS_NORM_EPS), 'rms_norm_eps', refuse)
    return {'family': FAMILY, 'num_layers': layers, 'd_model': d, 'num_heads': heads, 'num_kv_heads': kv_heads,
            'mlp_dim': hf['intermediate_size'], 'qkv_bias': model_type == 'qwen2', 'norm_eps': eps,
            **_rope_fields(hf, refuse), 'vocab_size': hf['vocab_size'],
            'tied_embeddings': bool(hf.get('tie_word_embeddings', False)), 'seq_len': hf['max_position_embeddings']}


# --------------------------------------------------------------------------- tensors


def top_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers (names after PREFIX; lm_head when untied), vocabulary rows a lower bound."""
    d, v = hf['hidden_size'], hf['vocab_size']
    shapes = {EMBED: (v, d), 'norm.weight': (d,)}
    if not hf.get('tie_word_embeddings', False):
        shapes['lm_head.weight'] = (v, d)
    return shapes


def layer_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One layer's tensors, named after the layer prefix (biases as the config declares them)."""
    d, f, heads = hf['hidden_size'], hf['intermediate_size'], hf['num_attention_heads']
    head_dim = hf.get('head_dim') or d // heads
    q, kv = heads * head_dim, (hf.get('num_key_value_heads') or heads) * head_dim
    shapes = {'input_layernorm.weight': (d,), 'self_attn.q_proj.weight': (q, d), 'self_attn.k_proj.weight': (kv, d),
              'self_attn.v_proj.weight': (kv, d), 'self_attn.o_proj.weight': (d, q),
              'post_attention_layernorm.weight': (d,), 'mlp.gate_proj.weight': (f, d), 'mlp.up_proj.weight': (f, d),
              'mlp.down_proj.weight': (d, f)}
    if hf['model_type'] == 'qwen2' or hf.get('attention_bias'):
        shapes |= {'self_attn.q_proj.bias': (q,), 'self_attn.k_proj.bias': (kv,), 'self_attn.v_proj.bias': (kv,)}
    return shapes


def to_hf(name: str, a: np.ndarray) -> list[np.ndarray]:
    """One layer of our block parameter `name` as its HF tensors (NAMES.block_names order)."""
    if name == 'attn/w_kv':  # [d, 2, G, K] -> k, v [G*K, d]
        return [a[:, i].reshape(a.shape[0], -1).T for i in range(2)]
    if name == 'attn/b_kv':  # [2, G, K] -> k, v [G*K]
        return [a[i].reshape(-1) for i in range(2)]
    if name == 'attn/w_q':  # [d, H, K] -> [H*K, d]
        return [a.reshape(a.shape[0], -1).T]
    if name == 'attn/b_q':  # [H, K] -> [H*K]
        return [a.reshape(-1)]
    if name == 'attn/w_out':  # [H, K, d] -> [d, H*K]
        return [a.reshape(-1, a.shape[-1]).T]
    if name.startswith('mlp/w_'):  # [in, out] -> [out, in]
        return [a.T]
    return [a]  # the norms' scales


def from_hf(name: str, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """One layer of our block parameter `name` (shape `shape`) from its HF tensors (to_hf's inverse)."""
    if name == 'attn/w_kv':
        d, _, g, k = shape
        return np.stack([t.T.reshape(d, g, k) for t in arrays], axis=1)
    if name == 'attn/b_kv':
        return np.stack([t.reshape(shape[1:]) for t in arrays])
    if name in ('attn/w_q', 'attn/w_out') or name.startswith('mlp/w_'):
        return arrays[0].T.reshape(shape)
    return arrays[0].reshape(shape)
