"""Hugging Face interop: a checkpoint to a `transformers` directory, and such a directory back in.

The driver, the same for every family; what differs lives in each family's declaration, its
converter (`Family.hf`, families/base.py `HFConverter`, numpy only). A converter declares the HF
config from our model fields and back (refusing what the family cannot express), the tensor
names and shapes (hf_files.expected_shapes), and one layer's tensors ours -> HF and HF -> ours.
The converter is chosen by the saved config's `model.family` on export and by config.json's
`model_type` (or `architectures`) on import.

Both directions stream one layer at a time, so host memory stays near one layer's tensors
whatever the depth:
- Export reads the checkpoint with TensorStore one layer's slice of one parameter at a time
  (checkpoints store block arrays in one-layer chunks, checkpoint/manager.py;
  readers.ParamReader), converts it and writes it to the safetensors file before reading the
  next (safetensors.write_safetensors takes a generator; the header is computed from shapes).
  A LoRA checkpoint's layers come merged into its base (lora_merge.py), layer by layer too.
- Import reads one layer of one HF tensor (hf_files.read_tensor: a seek and a read, from
  model.safetensors or the shard its index names; F32, F16, BF16 or F64), places that layer on
  the devices in the parameter's sharding minus its layer axes, and writes it into the stacked parameter on the
  devices (a jitted, donated update), so no host array holds more than one layer.
The embedding and head (vocabulary x width) are read whole; the padded vocabulary rows are
dropped on export and zero on import.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.data import token_files as data_lib
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint.interop import export_target
from jaxfrontier.checkpoint.interop import hf_files
from jaxfrontier.checkpoint.interop import lora_merge
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint.interop import safetensors as safetensors_lib

HEAD = 'lm_head.weight'  # every family's untied head: outside the base model's prefix


def _block_names(layout) -> dict[str, list[str]]:
    """Our block parameter -> its HF tensors after the layer prefix, in the order of one layer's layout
    (HFConverter.layer_layouts)."""
    out: dict[str, list[str]] = {}
    for ours, theirs, _ in layout:
        out.setdefault(ours, []).append(theirs)
    return out


# --------------------------------------------------------------------------- the checkpoint side


def converter_of_family(family: str, where: str) -> families.HFConverter:
    converter = families.get(family).hf if family in families.names() else None
    if converter is None:
        raise CheckpointError(f'{where}: model family {family!r} has no Hugging Face converter. Fix: export '
                              'safetensors (--export_format=safetensors).')
    return converter


def _tokenizer_of(config: dict[str, Any]) -> tuple[str | None, dict[str, Any], str]:
    """(the run's tokenizer.json or None, its token-file header, why a tokenizer the data names is not copied).

    The export goes on without a tokenizer when the run's token file moved, when its header names a tokenizer
    token_files refuses (not a plain file beside the .bin: a received header must not copy another file into an
    export that may be uploaded), or when the file it names is gone; the third value says which, for one line.
    """
    data = config.get('data', {})
    if data.get('kind') != 'tokens':
        return None, {}, ''
    try:
        path = data_lib.run_token_path(data)  # a blend: its first file (they share the tokenizer)
        token_file = data_lib.open_token_file(path, config['model']['vocab_size'])
    except ConfigError as e:
        return None, {}, str(e)
    tokenizer = data_lib.tokenizer_path(token_file)
    if tokenizer and not os.path.isfile(tokenizer):
        return None, token_file.header, (f'the header of {token_file.path} names the tokenizer {tokenizer}, which '
                                         'does not exist')
    return tokenizer, token_file.header, ''


def _tensors(converter, reader: readers.ParamReader, m: dict[str, Any], hf: dict[str, Any]):
    """[((HF name, shape), ...), read()] in file order: the embedding, the converter's first tensors, layer by
    layer, its last tensors, the head; read() gives that group's HF tensors from one read of ours."""
    v, prefix = m['vocab_size'], converter.prefix
    layout = converter.layer_layouts(hf)[0]
    tops, per_layer = converter.top_shapes(hf), hf_files.layer_shapes(layout)
    groups = [(((prefix + converter.embed, tops[converter.embed]),), lambda: [reader.read('wte', (slice(0, v),))])]
    groups += [(((prefix + theirs, tops[theirs]),), lambda ours=ours: [reader.read(ours)])
               for ours, theirs in converter.top_first]
    blocks = list(_block_names(layout).items())
    for layer in range(m['num_layers']):
        names = converter.layer_prefix.format(layer=layer)
        groups += [(tuple((names + t, per_layer[t]) for t in theirs),
                    lambda ours=ours, layer=layer: converter.to_hf(ours, reader.layer(ours, layer)))
                   for ours, theirs in blocks]
    groups += [(((prefix + theirs, tops[theirs]),), lambda ours=ours: [reader.read(ours)])
               for ours, theirs in converter.top_last]
    if not m['tied_embeddings']:
        groups.append((((HEAD, tops[HEAD]),), lambda: [reader.read('head', (slice(None), slice(0, v))).T]))
    return groups


def export_hf(source: str, out_dir: str, max_positions: int = 0, *, force: bool = False,
              bases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Writes a checkpoint as a `transformers` directory (config.json, model.safetensors, tokenizer).

    Args:
      source: a training workdir (its newest checkpoint), its checkpoints/ directory or a step directory.
      out_dir: the directory to write, whole or not at all (export_target.py: never the run's base, a workdir or
        another model's directory).
      max_positions: a rotary model's `max_position_embeddings` (0: `_max_positions` chooses).
      force: replace a directory that holds only a previous Hugging Face export of ours.
      bases: more base models the export must not write over (the command's `checkpoint.init_params_from`).

    Returns:
      A summary: step, tensors written, whether a tokenizer was copied (and why not, where the data names
      one), the architecture, max_positions.
    """
    export_target.check_dir(out_dir, 'hf', source=source, force=force, bases=bases)
    step_dir = readers.step_dir_of(source)
    meta = readers.read_meta(step_dir)
    config = meta['config']
    m = config['model']
    converter = converter_of_family(m.get('family', families.DEFAULT_FAMILY), step_dir)
    converter.check_exportable(m, step_dir)
    reader = lora_merge.merged_reader(step_dir, meta)  # LoRA: the base with the adapters merged in
    tokenizer, header, no_tokenizer = _tokenizer_of(config)
    if no_tokenizer:
        logging.warning(f'export: no tokenizer copied into {out_dir} (the weights and config.json are exported): '
                        f'{no_tokenizer}; then export again, or copy the tokenizer.json you trust into it')
    hf = converter.hf_config(m, header.get('eot_id'))
    positions = m['seq_len']
    if not converter.position_table and 'max_position_embeddings' in hf:
        positions = hf['max_position_embeddings'] = max_positions or _max_positions(config)
    groups = _tensors(converter, reader, m, hf)
    shapes = {name: shape for names, _ in groups for name, shape in names}

    def arrays():
        for names, read in groups:
            values = read()  # one layer of one of our parameters: its HF tensors
            for (name, shape), value in zip(names, values, strict=True):
                assert value.shape == shape, (name, value.shape, shape)
                yield value

    with export_target.staged(out_dir, 'hf', step=meta['step']) as stage:
        safetensors_lib.write_safetensors(os.path.join(stage, 'model.safetensors'),
                                          {name: (shape, np.dtype('float32')) for name, shape in shapes.items()},
                                          {'format': 'pt'}, arrays())
        with open(os.path.join(stage, 'config.json'), 'w') as f:
            json.dump(hf, f, indent=2)
        if tokenizer:
            shutil.copyfile(tokenizer, os.path.join(stage, 'tokenizer.json'))
            eot = header.get('eot_token')
            with open(os.path.join(stage, 'tokenizer_config.json'), 'w') as f:
                template = (header.get('sft') or {}).get('chat_template')  # prepare --sft's: chat as trained
                json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'model_max_length': positions,
                           **({'eos_token': eot, 'bos_token': eot} if eot else {}),
                           **({'chat_template': template} if template else {})}, f, indent=2)
    return {'step': meta['step'], 'tensors': len(shapes), 'tokenizer': bool(tokenizer), 'source': step_dir,
            'architecture': hf['architectures'][0], 'max_positions': positions, 'no_tokenizer': no_tokenizer}


def _max_positions(config: dict[str, Any]) -> int:
    """A rotary model's `max_position_embeddings`: the imported directory's (a run that continued a Hugging
    Face model, still readable there) where larger than the training context, else the training context.
    A fine-tune at a shorter context does not shrink the model's advertised one (issue 39)."""
    seq_len = config['model']['seq_len']
    start = (config.get('checkpoint') or {}).get('init_params_from') or ''
    if not (start and hf_files.looks_like_hf(start)):
        return seq_len
    try:
        imported = read_hf_config(start).get('max_position_embeddings')
    except (OSError, ValueError):
        return seq_len
    return max(seq_len, imported) if isinstance(imported, int) else seq_len


# --------------------------------------------------------------------------- the Hugging Face side


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    with open(os.path.join(hf_dir, 'config.json')) as f:
        return json.load(f)


def model_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model.* fields (`family` included) for a HF config.json; refuses what our model cannot compute."""
    converter = hf_files.converter_of(hf, where)
    return converter.model_fields({'model_type': converter.model_types[0]} | hf, where)


def _ours(key: str, c: ml_collections.ConfigDict) -> Any:
    """Our value of model.`key` as the HF side states it (0 means a rule's value: the MLP width, or one of the
    family's, `Family.effective`)."""
    if key == 'mlp_dim':
        return config_lib.mlp_dim(c)
    family = families.get(c.model.family)
    if family.effective is not None and key in family.fields:
        return family.effective(c.model)[key]
    return c.model[key]


def check_matches(fields: dict[str, Any], c: ml_collections.ConfigDict, where: str, position_table: bool) -> None:
    """One ConfigError line for the first model.* field of `c` that differs from the HF model's."""
    for key, theirs in fields.items():
        ours = _ours(key, c)
        if key == 'seq_len' and (ours <= theirs or not position_table):
            continue  # a shorter context takes the first positions; rotary positions have no table
        same = math.isclose(ours, theirs, rel_tol=1e-9) if isinstance(theirs, float) else ours == theirs
        if not same:
            rule = f' (ours: {ours}, by the family\'s rule)' if ours != c.model[key] else ''
            raise ConfigError(f'model.{key}', c.model[key], f'the Hugging Face model {where} has {theirs!r}{rule}',
                              f'set --config.model.{key}={theirs} (or start from --config=configs/hf.py:path={where})')


def _hf_reader(tensors: dict[str, hf_files.Tensor], prefix: str):
    """name -> fp32 array of a HF directory's tensors, with or without the base model's prefix."""
    def get(name: str) -> np.ndarray:
        key = name if name in tensors else name.removeprefix(prefix)
        if key not in tensors:
            raise CheckpointError(f'the Hugging Face model has no tensor {name!r}. Fix: save the model with '
                                  'transformers\' save_pretrained.')
        return hf_files.read_tensor(tensors[key])
    return get


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype, sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _set_layer(lead: int, sharding) -> Callable[..., jax.Array]:
    """stacked, one layer, its index -> stacked with that layer written (donated: updated in place)."""
    def update(stacked, layer, *index):
        starts = (*index, *(0,) * layer.ndim)
        return jax.lax.dynamic_update_slice(stacked, layer.reshape((1,) * lead + layer.shape), starts)
    return jax.jit(update, donate_argnums=0, out_shardings=sharding)


def _stacked(leaf, lead: int, read_layer: Callable[[int], np.ndarray]) -> jax.Array:
    """A block parameter [L, ...] (or [V, L / V, ...]: lead 2) built on the devices one layer at a time."""
    spec = tuple(leaf.sharding.spec) + (None,) * (len(leaf.shape) - len(leaf.sharding.spec))
    one = NamedSharding(leaf.sharding.mesh, PartitionSpec(*spec[lead:]))
    stacked = _zeros(tuple(leaf.shape), leaf.dtype, leaf.sharding)()
    for layer in range(math.prod(leaf.shape[:lead])):
        host = np.asarray(read_layer(layer), leaf.dtype)  # one layer of one parameter
        value = jax.make_array_from_callback(host.shape, one, lambda index, host=host: host[index])
        index = np.unravel_index(layer, leaf.shape[:lead])
        stacked = _set_layer(lead, leaf.sharding)(stacked, value, *(np.int32(i) for i in index))
    return stacked


def load_hf(hf_dir: str, c: ml_collections.ConfigDict, target: Any) -> dict[str, Any]:
    """Reads a `transformers` directory into the shardings of `target`, the abstract parameters
    (checkpoint.init_params_from); its config must match `c`'s model (one line names the field)."""
    hf = read_hf_config(hf_dir)
    converter = hf_files.converter_of(hf, hf_dir)
    fields = model_fields(hf, hf_dir)
    check_matches({k: v for k, v in fields.items() if k not in converter.unmatched}, c, hf_dir,
                  converter.position_table)
    v, prefix = c.model.vocab_size, converter.prefix
    lead = 2 if c.mesh.pipeline > 1 and c.pipeline.virtual_stages > 1 else 1  # [V, L / V, ...] or [L, ...]
    top = {ours: prefix + theirs for ours, theirs in converter.top_first + converter.top_last}
    tensors = hf_files.weights(hf_dir)
    names = {name.removeprefix(prefix) for name in tensors}
    blocks = _block_names(hf_files.layout_of(converter, {'model_type': converter.model_types[0]} | hf, names))
    get = _hf_reader(tensors, prefix)

    def load(path, leaf):
        name = format_lib.path_name(path)
        if name.startswith('blocks/'):
            ours = name.removeprefix('blocks/')
            per_layer = tuple(leaf.shape[lead:])
            return _stacked(leaf, lead, lambda layer: converter.from_hf(ours, [
                get(converter.layer_prefix.format(layer=layer) + t) for t in blocks[ours]], per_layer))
        if name in ('wte', 'head'):
            full = np.zeros(leaf.shape, np.float32)
            if name == 'wte':
                full[:v] = get(prefix + converter.embed)[:v]
            else:
                full[:, :v] = get(HEAD)[:v].T
        else:  # a position table keeps its first seq_len rows
            full = get(top[name])[:leaf.shape[0]]
        return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: full[index],
                                            dtype=leaf.dtype)

    return jax.tree_util.tree_map_with_path(load, target)
