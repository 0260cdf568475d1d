"""The GPT family <-> Hugging Face GPT-2 (`GPT2LMHeadModel`): configs, tensors, refusals.

One converter module per family (this one, hf_llama.py); checkpoint/interop/hf.py is the driver that
streams a checkpoint through it one layer at a time. Our GPT is GPT-2's architecture
(model/gpt.py, layers.py): pre-LN blocks, LayerNorm eps 1e-5, tanh-approximated GeLU
(`jax.nn.gelu`, HF `gelu_new`), learned positions, biases everywhere, attention scaled by
1/sqrt(head_dim), tied or untied head (HF `tie_word_embeddings`). Every parameter maps
exactly; `transformers.GPT2LMHeadModel` computes the same logits (fp32).

Names (HF Conv1D weights are [in, out], which is our layout after a reshape):

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

from typing import Any

import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.model import hf_names

NAMES = hf_names.GPT2  # the names GPT declares (model/gpt.py FAMILY.hf)
FAMILY = 'gpt'
MODEL_TYPES = (NAMES.model_type,)
PREFIX = 'transformer.'  # on every tensor but lm_head; a GPT2Model saved alone has none
EMBED = 'wte.weight'  # [V, d], after PREFIX
TOP_FIRST = (('wpe', 'wpe.weight'),)  # (ours, HF after PREFIX), written after the embedding
TOP_LAST = tuple((ours, theirs.removeprefix(PREFIX)) for ours, theirs in NAMES.top_names)  # after the layers
POSITION_TABLE = True  # learned positions: model.seq_len may not exceed n_positions
CONFIG_INTS = ('n_embd', 'n_layer', 'n_head', 'vocab_size', 'n_positions')  # required positive integers
OPTIONAL_INTS = ('n_inner',)  # positive integers or null
NUMBERS = ('layer_norm_epsilon',)  # numbers where present
LAYER_NORM_EPS = 1e-5


def num_layers(hf: dict[str, Any]) -> int:
    return hf['n_layer']


# --------------------------------------------------------------------------- configs


def check_exportable(m: dict[str, Any], where: str) -> None:
    """Refuses, with one line, a model that GPT-2 cannot represent."""
    if m['d_model'] % m['num_heads']:
        raise CheckpointError(
            f'{where}: d_model {m["d_model"]} is not divisible by num_heads '
            f'{m["num_heads"]}, GPT-2 cannot hold it. Fix: none; export safetensors.')


def hf_config(m: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' GPT2Config fields for a saved config's model.*."""
    return {'architectures': [NAMES.architecture], 'model_type': NAMES.model_type, 'vocab_size': m['vocab_size'],
            'n_positions': m['seq_len'], 'n_ctx': m['seq_len'], 'n_embd': m['d_model'], 'n_layer': m['num_layers'],
            'n_head': m['num_heads'], 'n_inner': config_lib.model_mlp_dim(m), 'activation_function': 'gelu_new',
            'layer_norm_epsilon': LAYER_NORM_EPS, 'initializer_range': m['init_std'], 'resid_pdrop': 0.0,
            'embd_pdrop': 0.0, 'attn_pdrop': 0.0, 'scale_attn_weights': True, 'use_cache': True,
            'tie_word_embeddings': bool(m['tied_embeddings']), 'bos_token_id': eot_id, 'eos_token_id': eot_id,
            'torch_dtype': 'float32'}


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields for a HF GPT-2 config; refuses what our model cannot compute."""
    def refuse(key, value, fix):
        raise ConfigError('checkpoint.init_params_from', where,
                          f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)

    if hf.get('activation_function', 'gelu_new') not in NAMES.activations:
        refuse('activation_function', hf.get('activation_function'), f'use one with {NAMES.activations}')
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
    return {'family': FAMILY, 'num_layers': hf['n_layer'], 'd_model': d, 'num_heads': hf['n_head'],
            'vocab_size': hf['vocab_size'], 'mlp_ratio': inner // d,
            'tied_embeddings': bool(hf.get('tie_word_embeddings', True)), 'seq_len': hf['n_positions']}


# --------------------------------------------------------------------------- tensors


def top_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors outside the layers (names after PREFIX; lm_head when untied), vocabulary rows a lower bound."""
    d, v = hf['n_embd'], hf['vocab_size']
    shapes = {'wte.weight': (v, d), 'wpe.weight': (hf['n_positions'], d), 'ln_f.weight': (d,), 'ln_f.bias': (d,)}
    if not hf.get('tie_word_embeddings', True):
        shapes['lm_head.weight'] = (v, d)
    return shapes


def layer_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One layer's tensors, named after the layer prefix."""
    d = hf['n_embd']
    f = hf.get('n_inner') or 4 * d
    return {'ln_1.weight': (d,), 'ln_1.bias': (d,), 'attn.c_attn.weight': (d, 3 * d), 'attn.c_attn.bias': (3 * d,),
            'attn.c_proj.weight': (d, d), 'attn.c_proj.bias': (d,), 'ln_2.weight': (d,), 'ln_2.bias': (d,),
            'mlp.c_fc.weight': (d, f), 'mlp.c_fc.bias': (f,), 'mlp.c_proj.weight': (f, d), 'mlp.c_proj.bias': (d,)}


def to_hf(name: str, a: np.ndarray) -> list[np.ndarray]:
    """One layer of our block parameter `name` as its HF tensors (NAMES.block_names order)."""
    shapes = {'attn/w_qkv': (a.shape[0], -1), 'attn/b_qkv': (-1,), 'attn/w_out': (-1, a.shape[-1])}
    return [a.reshape(shapes[name]) if name in shapes else a]


def from_hf(name: str, arrays: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """One layer of our block parameter `name` (shape `shape`) from its HF tensors."""
    del name
    return arrays[0].reshape(shape)
