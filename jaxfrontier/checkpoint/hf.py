"""Hugging Face GPT-2 interop: a checkpoint to a `transformers` directory, and such a directory back in.

Our GPT is GPT-2's architecture (model/gpt.py, layers.py): pre-LN blocks, LayerNorm eps 1e-5,
tanh-approximated GeLU (`jax.nn.gelu`, HF `gelu_new`), learned positions, biases everywhere,
attention scaled by 1/sqrt(head_dim), tied or untied head (HF `tie_word_embeddings`). Every
parameter maps exactly; `transformers.GPT2LMHeadModel` computes the same logits (fp32).

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

Export reads the checkpoint with TensorStore one layer's slice at a time (checkpoints store
block arrays in one-layer chunks, checkpoint/manager.py; readers.ParamReader), so host memory stays near one
layer's tensors whatever the depth.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.data import token_files as data_lib
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import run_files
from jaxfrontier.checkpoint import safetensors as safetensors_lib
from jaxfrontier.model import registry

GPT2 = registry.get('gpt').hf  # the names GPT declares (model/gpt.py FAMILY); this module converts GPT-2
LAYER_NORM_EPS = 1e-5


def is_hf_dir(path: str) -> bool:
    """A Hugging Face model directory: config.json and model.safetensors."""
    return all(os.path.isfile(os.path.join(path, f)) for f in ('config.json', 'model.safetensors'))


def _hf_2d(name: str, a: np.ndarray) -> np.ndarray:
    """One layer's parameter in HF's shape (w_qkv [d,3,H,K] -> [d, 3d], w_out [H,K,d] -> [d, d], ...)."""
    shapes = {'attn/w_qkv': (a.shape[0], -1), 'attn/b_qkv': (-1,), 'attn/w_out': (-1, a.shape[-1])}
    return a.reshape(shapes[name]) if name in shapes else a


# --------------------------------------------------------------------------- the checkpoint side


def check_gpt2(config: dict[str, Any], where: str) -> None:
    """Refuses, with one line, a model that GPT-2 cannot represent (none today: kept for new options)."""
    m = config['model']
    if m['d_model'] % m['num_heads']:
        raise CheckpointError(
            f'{where}: d_model {m["d_model"]} is not divisible by num_heads '
            f'{m["num_heads"]}, GPT-2 cannot hold it. Fix: none; export safetensors.')


def hf_config(config: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' GPT2Config fields for a saved config."""
    m = config['model']
    return {'architectures': [GPT2.architecture], 'model_type': GPT2.model_type, 'vocab_size': m['vocab_size'],
            'n_positions': m['seq_len'], 'n_ctx': m['seq_len'], 'n_embd': m['d_model'], 'n_layer': m['num_layers'],
            'n_head': m['num_heads'], 'n_inner': m['mlp_ratio'] * m['d_model'], 'activation_function': 'gelu_new',
            'layer_norm_epsilon': LAYER_NORM_EPS, 'initializer_range': m['init_std'], 'resid_pdrop': 0.0,
            'embd_pdrop': 0.0, 'attn_pdrop': 0.0, 'scale_attn_weights': True, 'use_cache': True,
            'tie_word_embeddings': bool(m['tied_embeddings']), 'bos_token_id': eot_id, 'eos_token_id': eot_id,
            'torch_dtype': 'float32'}


def _tokenizer_of(config: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(the run's tokenizer.json or None, its token-file header) from the saved data config."""
    data = config.get('data', {})
    if data.get('kind') != 'tokens':
        return None, {}
    try:
        path = data_lib.run_token_path(data)  # a blend: its first file (they share the tokenizer)
        token_file = data_lib.open_token_file(path, config['model']['vocab_size'])
    except ConfigError:
        return None, {}  # the data moved: export the weights without the tokenizer
    return data_lib.tokenizer_path(token_file), token_file.header


def _tensors(reader: readers.ParamReader, m: dict[str, Any]):
    """(HF name, shape, read()) in file order: embeddings, layer by layer, final LayerNorm, head."""
    v, d, s, f = m['vocab_size'], m['d_model'], m['seq_len'], m['mlp_ratio'] * m['d_model']
    shapes = {'ln1/scale': (d,), 'ln1/bias': (d,), 'attn/w_qkv': (d, 3 * d), 'attn/b_qkv': (3 * d,),
              'attn/w_out': (d, d), 'attn/b_out': (d,), 'ln2/scale': (d,), 'ln2/bias': (d,), 'mlp/w_in': (d, f),
              'mlp/b_in': (f,), 'mlp/w_out': (f, d), 'mlp/b_out': (d,)}
    yield 'transformer.wte.weight', (v, d), lambda: reader.read('wte', (slice(0, v),))
    yield 'transformer.wpe.weight', (s, d), lambda: reader.read('wpe')
    for layer in range(m['num_layers']):
        for ours, theirs in GPT2.block_names:
            yield (GPT2.layer_prefix.format(layer=layer) + theirs, shapes[ours],
                   lambda ours=ours, layer=layer: _hf_2d(ours, reader.layer(ours, layer)))
    for ours, theirs in GPT2.top_names:
        yield theirs, (d,), lambda ours=ours: reader.read(ours)
    if not m['tied_embeddings']:
        yield 'lm_head.weight', (v, d), lambda: reader.read('head', (slice(None), slice(0, v))).T


def export_hf(source: str, out_dir: str) -> dict[str, Any]:
    """Writes a checkpoint as a `transformers` GPT-2 directory (config.json, model.safetensors, tokenizer).

    Args:
      source: a training workdir (its newest checkpoint), its checkpoints/ directory or a step directory.
      out_dir: the directory to write; model.safetensors is replaced atomically.

    Returns:
      A summary: step, tensors written, whether a tokenizer was copied.
    """
    run_files.check_export_dir(out_dir)
    step_dir = readers.step_dir_of(source)
    meta = readers.read_meta(step_dir)
    config = meta['config']
    check_gpt2(config, step_dir)
    reader = readers.ParamReader(step_dir, config)
    tokenizer, header = _tokenizer_of(config)
    os.makedirs(out_dir, exist_ok=True)
    tensors = list(_tensors(reader, config['model']))

    def arrays():
        for name, shape, read in tensors:
            value = read()
            assert value.shape == shape, (name, value.shape, shape)
            yield value

    shapes = {name: (shape, np.dtype('float32')) for name, shape, _ in tensors}
    safetensors_lib.write_safetensors(os.path.join(out_dir, 'model.safetensors'), shapes, {'format': 'pt'}, arrays())
    eot_id = header.get('eot_id')
    with open(os.path.join(out_dir, 'config.json'), 'w') as f:
        json.dump(hf_config(config, eot_id), f, indent=2)
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(out_dir, 'tokenizer.json'))
        eot = header.get('eot_token')
        with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
            json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'model_max_length': config['model']['seq_len'],
                       **({'eos_token': eot, 'bos_token': eot} if eot else {})}, f, indent=2)
    return {'step': meta['step'], 'tensors': len(tensors), 'tokenizer': bool(tokenizer), 'source': step_dir}


# --------------------------------------------------------------------------- the Hugging Face side


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    with open(os.path.join(hf_dir, 'config.json')) as f:
        return json.load(f)


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields for a HF GPT-2 config; refuses what our model cannot compute."""
    def refuse(key, value, fix):
        raise ConfigError('checkpoint.init_params_from', where,
                                     f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)

    if hf.get('model_type') != GPT2.model_type:
        refuse('model_type', hf.get('model_type'), 'use a GPT-2 model directory')
    if hf.get('activation_function', 'gelu_new') not in GPT2.activations:
        refuse('activation_function', hf.get('activation_function'), f'use one with {GPT2.activations}')
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
    return {'num_layers': hf['n_layer'], 'd_model': d, 'num_heads': hf['n_head'], 'vocab_size': hf['vocab_size'],
            'mlp_ratio': inner // d, 'tied_embeddings': bool(hf.get('tie_word_embeddings', True)),
            'seq_len': hf['n_positions']}


def _check_matches(fields: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    for key, theirs in fields.items():
        ours = c.model[key]
        if key == 'seq_len' and ours <= theirs:
            continue  # a shorter context takes the first positions
        if ours != theirs:
            raise ConfigError(f'model.{key}', ours, f'the Hugging Face model {where} has {theirs}',
                                         f'set --config.model.{key}={theirs}')


def _hf_reader(f, keys: set[str]):
    """name -> array of a HF safetensors file, with or without the `transformer.` prefix."""
    def get(name: str, index: tuple = ()):
        key = name if name in keys else name.removeprefix('transformer.')
        if key not in keys:
            raise CheckpointError(
                f'the Hugging Face model has no tensor {name!r}. Fix: save a '
                'GPT2LMHeadModel with save_pretrained.')
        return f.get_slice(key)[index] if index else f.get_tensor(key)
    return get


def _callback(name: str, target: tuple[int, ...], get, c: ml_collections.ConfigDict):
    """make_array_from_callback's callback filling shards of our parameter `name` from HF tensors."""
    v, d = c.model.vocab_size, c.model.d_model
    if name.startswith('blocks/'):
        theirs = dict(GPT2.block_names)[name.removeprefix('blocks/')]
        lead = 2 if c.mesh.pipeline > 1 and c.pipeline.virtual_stages > 1 else 1  # [V, L / V, ...] or [L, ...]
        per_layer = target[lead:]

        def block(index):  # reads only the layers of this shard, one at a time
            layers_ = np.arange(int(np.prod(target[:lead]))).reshape(target[:lead])[index[:lead]]
            rows = [get(GPT2.layer_prefix.format(layer=l) + theirs).reshape(per_layer)[index[lead:]] for l in layers_.ravel()]
            return np.stack(rows).reshape(*layers_.shape, *rows[0].shape)
        return block
    if name in ('wte', 'head'):
        def vocab(index):
            full = np.zeros((target[0], d) if name == 'wte' else (d, target[1]), np.float32)
            if name == 'wte':
                full[:v] = get('transformer.wte.weight')[:v]
            else:
                full[:, :v] = get('lm_head.weight')[:v].T
            return full[index]
        return vocab
    if name == 'wpe':
        return lambda index: get('transformer.wpe.weight')[:target[0]][index]
    return lambda index: get(dict(GPT2.top_names)[name])[index]


def load_hf(hf_dir: str, c: ml_collections.ConfigDict, target: Any) -> dict[str, Any]:
    """Reads a `transformers` GPT-2 directory into the shardings of `target`, the abstract parameters
    (checkpoint.init_params_from)."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top

    _check_matches(model_fields(read_hf_config(hf_dir), hf_dir), c, hf_dir)
    with safe_open(os.path.join(hf_dir, 'model.safetensors'), framework='numpy') as f:
        get = _hf_reader(f, set(f.keys()))
        return jax.tree_util.tree_map_with_path(lambda path, leaf: jax.make_array_from_callback(
            leaf.shape, leaf.sharding, _callback(format_lib.path_name(path), tuple(leaf.shape), get, c),
            dtype=leaf.dtype), target)
