"""Checks of a Hugging Face model directory and of safetensors headers, before anything reads the weights.

`checkpoint.init_params_from=<dir>` (training, sample, eval) reads a directory someone else
wrote. A truncated model.safetensors, a config.json that is not JSON or lacks a field, or a
tensor of the wrong shape used to end in a traceback from the safetensors library, `json` or
a reshape; a directory with a config.json but no weights was taken for a checkpoint ("no
committed checkpoint ... train first"). `check(path)` reads the config and the safetensors
header (its JSON only: the 8-byte length, then the entries, each checked against the file's
size) and raises one UserError line naming the file, the field or tensor, and the fix.
The architecture is config.json's `model_type` (else its `architectures`): each family's
converter (its declaration's `hf`, families/; `converters()`) names the integer fields it needs
and the tensors and shapes it expects. Only JSON and headers are read here (no weights, no JAX work),
and the fuzz suite feeds it anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from typing import Any

import ml_dtypes
import numpy as np

from jaxfrontier import families
from jaxfrontier.errors import CheckpointError
from jaxfrontier.families import HFConverter
from jaxfrontier.families.base import Layout

ITEMSIZE = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'I64': 8, 'I32': 4, 'I16': 2, 'I8': 1, 'U8': 1, 'BOOL': 1,
            'U16': 2, 'U32': 4, 'U64': 8, 'F8_E4M3': 1, 'F8_E5M2': 1}
DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16}  # read_tensor
READABLE = tuple(DTYPES)
INDEX = 'model.safetensors.index.json'  # a model saved in shards: {"weight_map": {tensor: file}}
SHARD = re.compile(r'[\w-][\w.-]*\.safetensors')  # a shard the index may name: a file beside it, no path
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
SAVE_FIX = 'save the model again with transformers\' save_pretrained (safe_serialization=True, float32)'


def converters() -> tuple[HFConverter, ...]:
    """The Hugging Face converter of every registered family that has one."""
    return tuple(f.hf for f in families.all_families() if f.hf is not None)


def looks_like_hf(path: str) -> bool:
    """A directory meant as a Hugging Face model: model.safetensors (or its shards' index), or a config.json with a
    model_type."""
    if not os.path.isdir(path):
        return False
    if any(os.path.isfile(os.path.join(path, f)) for f in ('model.safetensors', INDEX)):
        return True
    try:
        with open(os.path.join(path, 'config.json'), 'rb') as f:
            config = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and 'model_type' in config


def _shape(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in value):
        return None
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor of a directory's safetensors files lies (read_tensor reads it)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, every entry checked against the file's bytes."""
    return {name: (t.dtype, t.shape) for name, t in read_safetensors_entries(path).items()}


def read_safetensors_entries(path: str) -> dict[str, Tensor]:
    """{tensor name: Tensor} of a safetensors file, every entry checked against the file's bytes.

    Raises:
      CheckpointError: the file is missing, truncated, or its header is not a valid safetensors header.
    """
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f'{path} is not a readable safetensors file: {problem}. Fix: {SAVE_FIX}')

    try:
        size = os.path.getsize(path)
        with open(path, 'rb') as f:
            first = f.read(8)
            if len(first) < 8:
                raise bad(f'{size} bytes, shorter than the 8-byte header length')
            n = int.from_bytes(first, 'little')
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise bad(f'its header claims {n:,} bytes but the file has {size - 8:,} after the length')
            raw = f.read(n)
    except OSError as e:
        raise bad(e.strerror or str(e)) from None
    try:
        header = json.loads(raw.decode('utf-8'))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad('its header is not JSON') from None
    if not isinstance(header, dict):
        raise bad(f'its header is a JSON {type(header).__name__}, not an object')
    out, spans, data = {}, [], size - 8 - n
    for name, entry in header.items():
        if name == '__metadata__':
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise bad('__metadata__ is not an object of strings')
            continue
        if not isinstance(entry, dict):
            raise bad(f'entry {name!r} is not an object')
        dtype, shape, offsets = entry.get('dtype'), _shape(entry.get('shape')), entry.get('data_offsets')
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise bad(f'tensor {name!r} has dtype {dtype!r}')
        if shape is None:
            raise bad(f'tensor {name!r} has shape {entry.get("shape")!r}')
        if (not isinstance(offsets, list) or len(offsets) != 2 or
                not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise bad(f'tensor {name!r} has data_offsets {offsets!r}')
        start, stop = offsets
        if not 0 <= start <= stop <= data or stop - start != math.prod(shape) * ITEMSIZE[dtype]:
            raise bad(f'tensor {name!r} ({dtype} {list(shape)}) has data_offsets {offsets} in {data:,} bytes of '
                      'data (truncated?)')
        spans.append((start, stop, name))
        out[name] = Tensor(path, dtype, shape, 8 + n + start)
    end = 0
    for start, stop, name in sorted(spans):  # the tensors tile the data, as the library requires
        if start != end:
            raise bad(f'tensor {name!r} starts at byte {start:,} of the data, not at {end:,} (a gap or an overlap)')
        end = stop
    if end != data:
        raise bad(f'its tensors cover {end:,} of its {data:,} bytes of data')
    return out


def converter_of(config: dict[str, Any], where: str) -> HFConverter:
    """The family converter that reads config.json's `model_type` (else its `architectures`)."""
    model_type = config.get('model_type')
    if model_type is None and isinstance(config.get('architectures'), list):
        by_arch = {arch: kind for c in converters() for arch, kind in c.reads}
        model_type = next((by_arch[a] for a in config['architectures'] if isinstance(a, str) and a in by_arch), None)
    for converter in converters():
        if model_type in converter.model_types:
            return converter
    known = ', '.join(t for c in converters() for t in c.model_types)
    archs = ', '.join(arch for c in converters() for arch, _ in c.reads)
    raise CheckpointError(f'{where}: model_type {model_type!r} is not an architecture jaxfrontier reads ({known}). '
                          f'Fix: use a model directory of one of {archs}.')


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_config(path: str) -> dict[str, Any]:
    """config.json of a Hugging Face model directory, with the integer fields its family's converter needs.

    Raises:
      CheckpointError: not JSON, not an object, an architecture we do not read, or a field
        missing or not a positive integer.
    """
    file = os.path.join(path, 'config.json')
    try:
        with open(file, 'rb') as f:
            config = json.loads(f.read(MAX_HEADER_BYTES).decode('utf-8'))
    except OSError as e:
        raise CheckpointError(f'cannot read {file}: {e.strerror or e}. Fix: {SAVE_FIX}') from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(f'{file} is not JSON. Fix: {SAVE_FIX}') from None
    if not isinstance(config, dict):
        raise CheckpointError(f'{file} is a JSON {type(config).__name__}, not an object. Fix: {SAVE_FIX}')
    converter = converter_of(config, file)
    config.setdefault('model_type', converter.model_types[0])
    for key in converter.config_ints:
        if not _is_int(config.get(key)):
            raise CheckpointError(f'{file}: {key} = {config.get(key)!r}, not a positive integer. Fix: {SAVE_FIX}')
    for key in converter.optional_ints:
        if config.get(key) is not None and not _is_int(config[key]):
            raise CheckpointError(f'{file}: {key} = {config[key]!r}, not a positive integer or null. Fix: {SAVE_FIX}')
    for key in converter.numbers:
        if key in config and (not isinstance(config[key], (int, float)) or isinstance(config[key], bool)):
            raise CheckpointError(f'{file}: {key} = {config[key]!r}, not a number. Fix: {SAVE_FIX}')
    return config


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors of a config.json (names without the family's prefix, e.g. `transformer.`) and their
    shapes; the vocabulary rows are a lower bound."""
    converter = converter_of(config, 'config.json')
    prefix = converter.layer_prefix.removeprefix(converter.prefix)
    shapes = dict(converter.top_shapes(config))
    per_layer = layer_shapes(converter.layer_layouts(config)[0])
    for layer in range(converter.num_layers(config)):
        shapes |= {prefix.format(layer=layer) + name: shape for name, shape in per_layer.items()}
    return shapes


def layer_shapes(layout: Layout) -> dict[str, tuple[int, ...]]:
    """{HF name after the layer prefix: shape} of one layer's layout."""
    return {theirs: shape for _, theirs, shape in layout}


def layout_of(converter: HFConverter, config: dict[str, Any], names) -> Layout:
    """The layout of one layer's tensors a directory uses: the converter's first whose layer-0 tensors are all
    among `names` (without the base model's prefix), else the first (what export writes; check names what it lacks)."""
    layouts = converter.layer_layouts(config)
    first = converter.layer_prefix.removeprefix(converter.prefix).format(layer=0)
    return next((layout for layout in layouts if all(first + theirs in names for _, theirs, _ in layout)), layouts[0])


def weights(path: str) -> dict[str, Tensor]:
    """Every tensor of a directory's weights: model.safetensors, or the shards model.safetensors.index.json maps.

    Raises:
      CheckpointError: no weights, an index that is not {"weight_map": {tensor: file beside it}}, a damaged
        shard, or a tensor its shard does not hold.
    """
    single, index = os.path.join(path, 'model.safetensors'), os.path.join(path, INDEX)
    if os.path.isfile(single):
        return read_safetensors_entries(single)
    if not os.path.isfile(index):
        others = sorted(f for f in os.listdir(path) if f.endswith(('.bin', '.pt', '.h5', '.msgpack', '.index.json')))
        found = f' (it has {", ".join(others[:3])}: not read)' if others else ''
        raise CheckpointError(f'{path} has a config.json but no model.safetensors{found} nor {INDEX}. Fix: {SAVE_FIX}')
    try:
        with open(index, 'rb') as f:
            weight_map = json.loads(f.read(MAX_HEADER_BYTES).decode('utf-8')).get('weight_map')
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and SHARD.fullmatch(v)
                                                   for v in weight_map.values()):
        raise CheckpointError(f'{index} is not an object whose weight_map maps tensors to .safetensors files beside '
                              f'it. Fix: {SAVE_FIX}')
    shards = {file: read_safetensors_entries(os.path.join(path, file)) for file in sorted(set(weight_map.values()))}
    for name, file in weight_map.items():
        if name not in shards[file]:
            raise CheckpointError(f'{index} maps tensor {name!r} to {file}, which does not hold it. Fix: {SAVE_FIX}')
    return {name: shards[file][name] for name, file in weight_map.items()}


def read_tensor(t: Tensor) -> np.ndarray:
    """One tensor (checked by read_safetensors_entries) as fp32; little-endian, as safetensors stores it."""
    with open(t.file, 'rb') as f:
        f.seek(t.offset)
        data = f.read(math.prod(t.shape) * ITEMSIZE[t.dtype])
    return np.frombuffer(data, DTYPES[t.dtype]).reshape(t.shape).astype(np.float32)


def names_where(path: str) -> str:
    """The file that lists a directory's tensors: model.safetensors, else the shards' index."""
    single = os.path.join(path, 'model.safetensors')
    return single if os.path.isfile(single) else os.path.join(path, INDEX)


def check(path: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(config, its tensors) of a Hugging Face model directory, or one CheckpointError line."""
    config = read_config(path)
    converter = converter_of(config, path)
    header = weights(path)
    names = {name.removeprefix(converter.prefix): entry for name, entry in header.items()}
    layers = converter.num_layers(config)
    prefix = converter.layer_prefix.removeprefix(converter.prefix)
    per_layer = layer_shapes(layout_of(converter, config, names))
    # lazily: a config may claim 10^9 layers; the first one the file lacks ends the walk
    expected = itertools.chain(converter.top_shapes(config).items(), (
        (prefix.format(layer=layer) + name, shape) for layer in range(layers) for name, shape in per_layer.items()))
    for name, shape in expected:
        if name not in names:
            raise CheckpointError(f'{names_where(path)} has no tensor {name!r} (nor {converter.prefix}{name}) that its '
                                  f'config.json ({layers} layers) needs. Fix: {SAVE_FIX}')
        dtype, saved = names[name].dtype, names[name].shape
        vocab_rows = name in (converter.embed, 'lm_head.weight')
        if saved != shape and not (vocab_rows and len(saved) == 2 and saved[0] >= shape[0] and saved[1] == shape[1]):
            raise CheckpointError(f'{names[name].file}: tensor {name!r} has shape {list(saved)}, its config.json needs '
                                  f'{list(shape)}. Fix: {SAVE_FIX}')
        if dtype not in READABLE:
            raise CheckpointError(f'{names[name].file}: tensor {name!r} is {dtype}; jaxfrontier reads '
                                  f'{", ".join(READABLE)}. Fix: {SAVE_FIX}')
    return config, header
