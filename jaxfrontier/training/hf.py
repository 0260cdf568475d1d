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
block arrays in one-layer chunks, training/checkpoint.py), so host memory stays near one
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
import orbax.checkpoint as ocp
import tensorstore as tstore
from etils import epath

from jaxfrontier import config as config_lib
from jaxfrontier import run_files
from jaxfrontier import saved_meta
from jaxfrontier.data import dataset as data_lib
from jaxfrontier.training import checkpoint as ckpt_lib
from jaxfrontier.training import state as ts

HF_ACTIVATIONS = ('gelu_new', 'gelu_pytorch_tanh')
LAYER_NORM_EPS = 1e-5
# (our block parameter, HF name inside transformer.h.<l>.)
BLOCK_NAMES = (('ln1/scale', 'ln_1.weight'), ('ln1/bias', 'ln_1.bias'),
               ('attn/w_qkv', 'attn.c_attn.weight'), ('attn/b_qkv', 'attn.c_attn.bias'),
               ('attn/w_out', 'attn.c_proj.weight'), ('attn/b_out', 'attn.c_proj.bias'),
               ('ln2/scale', 'ln_2.weight'), ('ln2/bias', 'ln_2.bias'),
               ('mlp/w_in', 'mlp.c_fc.weight'), ('mlp/b_in', 'mlp.c_fc.bias'),
               ('mlp/w_out', 'mlp.c_proj.weight'), ('mlp/b_out', 'mlp.c_proj.bias'))
TOP_NAMES = (('ln_f/scale', 'transformer.ln_f.weight'), ('ln_f/bias', 'transformer.ln_f.bias'))


def is_hf_dir(path: str) -> bool:
    """A Hugging Face model directory: config.json and model.safetensors."""
    return all(os.path.isfile(os.path.join(path, f)) for f in ('config.json', 'model.safetensors'))


def _hf_2d(name: str, a: np.ndarray) -> np.ndarray:
    """One layer's parameter in HF's shape (w_qkv [d,3,H,K] -> [d, 3d], w_out [H,K,d] -> [d, d], ...)."""
    shapes = {'attn/w_qkv': (a.shape[0], -1), 'attn/b_qkv': (-1,), 'attn/w_out': (-1, a.shape[-1])}
    return a.reshape(shapes[name]) if name in shapes else a


# --------------------------------------------------------------------------- the checkpoint side


def step_dir_of(source: str, fix: str = 'train first, or name a training workdir, its checkpoints/ directory '
                'or one step directory.') -> str:
    """The newest committed step directory of a workdir, its checkpoints/ directory, or a step directory.

    Raises:
      CheckpointError: when there is no committed checkpoint there; its message ends in `fix`.
    """
    source = os.path.abspath(source)
    if os.path.isdir(os.path.join(source, 'state')):
        return source
    for directory in (ckpt_lib.checkpoint_dir(source), source):
        steps = ckpt_lib.committed_steps(directory)
        if steps:
            return os.path.join(directory, str(steps[-1]))
    raise ckpt_lib.CheckpointError(f'no committed checkpoint under {source}. Fix: {fix}')


def read_item(step_dir: str, item: str, handler: Any, call) -> Any:
    """`call(handler, <step_dir>/<item>)`, with any failure reported as a corrupted checkpoint."""
    try:
        return call(handler, epath.Path(step_dir) / item)
    except Exception as e:  # noqa: BLE001 -- whatever Orbax or TensorStore raise
        raise ckpt_lib.corrupted_error(os.path.dirname(step_dir), os.path.basename(step_dir), e) from e
    finally:
        handler.close()


def read_meta(step_dir: str, fix: str = 'name one.') -> dict[str, Any]:
    """The JSON saved with a checkpoint step (format, step, config)."""
    meta = read_item(step_dir, 'meta', ocp.JsonCheckpointHandler(), lambda h, path: h.restore(path))
    if not isinstance(meta, dict) or meta.get('format') != ckpt_lib.FORMAT:
        raise ckpt_lib.CheckpointError(f'{step_dir} is not a jaxfrontier checkpoint. Fix: {fix}')
    return saved_meta.check(meta, step_dir)


class ParamReader:
    """Reads slices of a checkpoint's parameters straight from TensorStore, never a whole stacked array."""

    def __init__(self, step_dir: str, config: dict[str, Any]):
        self.state_dir = os.path.join(step_dir, 'state')
        with open(os.path.join(self.state_dir, '_METADATA')) as f:
            meta = json.load(f)
        self.zarr = 'zarr3' if meta.get('use_zarr3') else 'zarr'
        self.ocdbt = bool(meta.get('use_ocdbt', True))
        self.layers = config['model']['num_layers']
        self.virtual = config['pipeline']['virtual_stages'] if config['mesh']['pipeline'] > 1 else 1
        self.context = tstore.Context({'cache_pool': {'total_bytes_limit': 0}})

    def open(self, name: str):
        key = 'params.' + name.replace('/', '.')
        if self.ocdbt:
            kvstore = {'driver': 'ocdbt', 'base': f'file://{self.state_dir}/', 'path': key}
        else:
            kvstore = {'driver': 'file', 'path': os.path.join(self.state_dir, key)}
        try:
            return tstore.open({'driver': self.zarr, 'kvstore': kvstore}, read=True, context=self.context).result()
        except Exception as e:  # noqa: BLE001
            raise ckpt_lib.corrupted_error(os.path.dirname(os.path.dirname(self.state_dir)),
                                           os.path.basename(os.path.dirname(self.state_dir)), e) from e

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return np.asarray(self.open(name)[index].read().result())

    def layer(self, name: str, layer: int) -> np.ndarray:
        """Layer `layer` (model order) of block parameter `blocks/<name>`, also from [V, L / V, ...] arrays."""
        if self.virtual > 1:
            per = self.layers // self.virtual
            return self.read(f'blocks/{name}', (layer // per, layer % per))
        return self.read(f'blocks/{name}', (layer,))


def check_gpt2(config: dict[str, Any], where: str) -> None:
    """Refuses, with one line, a model that GPT-2 cannot represent (none today: kept for new options)."""
    m = config['model']
    if m['d_model'] % m['num_heads']:
        raise ckpt_lib.CheckpointError(f'{where}: d_model {m["d_model"]} is not divisible by num_heads '
                                       f'{m["num_heads"]}, GPT-2 cannot hold it. Fix: none; export safetensors.')


def hf_config(config: dict[str, Any], eot_id: int | None) -> dict[str, Any]:
    """transformers' GPT2Config fields for a saved config."""
    m = config['model']
    return {'architectures': ['GPT2LMHeadModel'], 'model_type': 'gpt2', 'vocab_size': m['vocab_size'],
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
    except config_lib.ConfigError:
        return None, {}  # the data moved: export the weights without the tokenizer
    return data_lib.tokenizer_path(token_file), token_file.header


_SAFETENSORS_DTYPES = {'float32': 'F32', 'bfloat16': 'BF16', 'float16': 'F16', 'int32': 'I32'}


def _safetensors_header(shapes: dict[str, tuple[tuple[int, ...], np.dtype]], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {'__metadata__': metadata}
    offset = 0
    for name, (shape, dtype) in shapes.items():
        size = int(np.prod(shape)) * dtype.itemsize
        header[name] = {'dtype': _SAFETENSORS_DTYPES[dtype.name], 'shape': list(shape),
                        'data_offsets': [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(',', ':')).encode()
    raw += b' ' * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, 'little') + raw


def write_safetensors(path: str, shapes: dict[str, tuple[tuple[int, ...], np.dtype]], metadata: dict[str, str],
                      arrays) -> None:
    """Writes a safetensors file through `<path>.tmp<pid>`, replacing `path` atomically.

    `arrays` yields one array per entry of `shapes` ({name: (shape, dtype)}), in the same order;
    each is written as soon as it comes, so the host holds one tensor at a time.
    """
    tmp = f'{path}.tmp{os.getpid()}'
    run_files.remove_stale_temporaries(path)
    try:
        with open(tmp, 'wb') as f:
            f.write(_safetensors_header(shapes, metadata))
            for (shape, dtype), value in zip(shapes.values(), arrays):
                f.write(np.ascontiguousarray(value.reshape(shape), dtype=dtype.newbyteorder('<')).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _tensors(reader: ParamReader, m: dict[str, Any]):
    """(HF name, shape, read()) in file order: embeddings, layer by layer, final LayerNorm, head."""
    v, d, s, f = m['vocab_size'], m['d_model'], m['seq_len'], m['mlp_ratio'] * m['d_model']
    shapes = {'ln1/scale': (d,), 'ln1/bias': (d,), 'attn/w_qkv': (d, 3 * d), 'attn/b_qkv': (3 * d,),
              'attn/w_out': (d, d), 'attn/b_out': (d,), 'ln2/scale': (d,), 'ln2/bias': (d,), 'mlp/w_in': (d, f),
              'mlp/b_in': (f,), 'mlp/w_out': (f, d), 'mlp/b_out': (d,)}
    yield 'transformer.wte.weight', (v, d), lambda: reader.read('wte', (slice(0, v),))
    yield 'transformer.wpe.weight', (s, d), lambda: reader.read('wpe')
    for layer in range(m['num_layers']):
        for ours, theirs in BLOCK_NAMES:
            yield (f'transformer.h.{layer}.{theirs}', shapes[ours],
                   lambda ours=ours, layer=layer: _hf_2d(ours, reader.layer(ours, layer)))
    for ours, theirs in TOP_NAMES:
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
    step_dir = step_dir_of(source)
    meta = read_meta(step_dir)
    config = meta['config']
    check_gpt2(config, step_dir)
    reader = ParamReader(step_dir, config)
    tokenizer, header = _tokenizer_of(config)
    os.makedirs(out_dir, exist_ok=True)
    tensors = list(_tensors(reader, config['model']))

    def arrays():
        for name, shape, read in tensors:
            value = read()
            assert value.shape == shape, (name, value.shape, shape)
            yield value

    write_safetensors(os.path.join(out_dir, 'model.safetensors'),
                      {name: (shape, np.dtype('float32')) for name, shape, _ in tensors}, {'format': 'pt'}, arrays())
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
        raise config_lib.ConfigError('checkpoint.init_params_from', where,
                                     f'its config.json has {key} = {value!r}, which jaxfrontier cannot compute', fix)

    if hf.get('model_type') != 'gpt2':
        refuse('model_type', hf.get('model_type'), 'use a GPT-2 model directory')
    if hf.get('activation_function', 'gelu_new') not in HF_ACTIVATIONS:
        refuse('activation_function', hf.get('activation_function'), f'use one with {HF_ACTIVATIONS}')
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
            raise config_lib.ConfigError(f'model.{key}', ours, f'the Hugging Face model {where} has {theirs}',
                                         f'set --config.model.{key}={theirs}')


def _hf_reader(f, keys: set[str]):
    """name -> array of a HF safetensors file, with or without the `transformer.` prefix."""
    def get(name: str, index: tuple = ()):
        key = name if name in keys else name.removeprefix('transformer.')
        if key not in keys:
            raise ckpt_lib.CheckpointError(f'the Hugging Face model has no tensor {name!r}. Fix: save a '
                                           'GPT2LMHeadModel with save_pretrained.')
        return f.get_slice(key)[index] if index else f.get_tensor(key)
    return get


def _callback(name: str, target: tuple[int, ...], get, c: ml_collections.ConfigDict):
    """make_array_from_callback's callback filling shards of our parameter `name` from HF tensors."""
    v, d = c.model.vocab_size, c.model.d_model
    if name.startswith('blocks/'):
        theirs = dict(BLOCK_NAMES)[name.removeprefix('blocks/')]
        lead = 2 if c.mesh.pipeline > 1 and c.pipeline.virtual_stages > 1 else 1  # [V, L / V, ...] or [L, ...]
        per_layer = target[lead:]

        def block(index):  # reads only the layers of this shard, one at a time
            layers_ = np.arange(int(np.prod(target[:lead]))).reshape(target[:lead])[index[:lead]]
            rows = [get(f'transformer.h.{l}.{theirs}').reshape(per_layer)[index[lead:]] for l in layers_.ravel()]
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
    return lambda index: get(dict(TOP_NAMES)[name])[index]


def load_hf(hf_dir: str, c: ml_collections.ConfigDict, layout: ts.StateLayout) -> dict[str, Any]:
    """Reads a `transformers` GPT-2 directory into the layout's shardings (checkpoint.init_params_from)."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top

    _check_matches(model_fields(read_hf_config(hf_dir), hf_dir), c, hf_dir)
    target = ckpt_lib.abstract_target(layout)['params']
    with safe_open(os.path.join(hf_dir, 'model.safetensors'), framework='numpy') as f:
        get = _hf_reader(f, set(f.keys()))
        return jax.tree_util.tree_map_with_path(lambda path, leaf: jax.make_array_from_callback(
            leaf.shape, leaf.sharding, _callback(ckpt_lib.path_name(path), tuple(leaf.shape), get, c),
            dtype=leaf.dtype), target)
