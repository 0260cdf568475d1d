"""Checks of a Hugging Face GPT-2 directory and of safetensors headers, before anything reads the weights.

`checkpoint.init_params_from=<dir>` (training, sample, eval) reads a directory someone else
wrote. A truncated model.safetensors, a config.json that is not JSON or lacks a field, or a
tensor of the wrong shape used to end in a traceback from the safetensors library, `json` or
a reshape; a directory with a config.json but no weights was taken for a checkpoint ("no
committed checkpoint ... train first"). `check(path)` reads the config and the safetensors
header (its JSON only: the 8-byte length, then the entries, each checked against the file's
size) and raises one UserError line naming the file, the field or tensor, and the fix.
No JAX and no numpy: it runs before either is needed, and the fuzz suite feeds it anything.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from jaxfrontier.errors import CheckpointError

ITEMSIZE = {'F64': 8, 'F32': 4, 'F16': 2, 'BF16': 2, 'I64': 8, 'I32': 4, 'I16': 2, 'I8': 1, 'U8': 1, 'BOOL': 1,
            'U16': 2, 'U32': 4, 'U64': 8, 'F8_E4M3': 1, 'F8_E5M2': 1}
READABLE = ('F64', 'F32', 'F16')  # what the numpy reader gives as floats
MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
CONFIG_INTS = ('n_embd', 'n_layer', 'n_head', 'vocab_size', 'n_positions')
SAVE_FIX = 'save the model again with transformers\' save_pretrained (safe_serialization=True, float32)'


def looks_like_hf(path: str) -> bool:
    """A directory that is meant as a Hugging Face model: model.safetensors, or a config.json with a model_type."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, 'model.safetensors')):
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


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} of a safetensors file, every entry checked against the file's bytes.

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
        out[name] = (dtype, shape)
    end = 0
    for start, stop, name in sorted(spans):  # the tensors tile the data, as the library requires
        if start != end:
            raise bad(f'tensor {name!r} starts at byte {start:,} of the data, not at {end:,} (a gap or an overlap)')
        end = stop
    if end != data:
        raise bad(f'its tensors cover {end:,} of its {data:,} bytes of data')
    return out


def read_config(path: str) -> dict[str, Any]:
    """config.json of a Hugging Face GPT-2 directory, with the integer fields our reader needs.

    Raises:
      CheckpointError: not JSON, not an object, or a field missing or not a positive integer.
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
    for key in CONFIG_INTS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f'{file}: {key} = {value!r}, not a positive integer. Fix: {SAVE_FIX}')
    inner = config.get('n_inner')
    if inner is not None and (not isinstance(inner, int) or isinstance(inner, bool) or inner < 1):
        raise CheckpointError(f'{file}: n_inner = {inner!r}, not a positive integer or null. Fix: {SAVE_FIX}')
    for key in ('layer_norm_epsilon',):
        if key in config and (not isinstance(config[key], (int, float)) or isinstance(config[key], bool)):
            raise CheckpointError(f'{file}: {key} = {config[key]!r}, not a number. Fix: {SAVE_FIX}')
    return config


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """GPT-2's tensor names (without `transformer.`) and shapes; the vocabulary rows are a lower bound."""
    d, v, s, layers = config['n_embd'], config['vocab_size'], config['n_positions'], config['n_layer']
    f = config.get('n_inner') or 4 * d
    shapes = {'wte.weight': (v, d), 'wpe.weight': (s, d), 'ln_f.weight': (d,), 'ln_f.bias': (d,)}
    per_layer = {'ln_1.weight': (d,), 'ln_1.bias': (d,), 'attn.c_attn.weight': (d, 3 * d),
                 'attn.c_attn.bias': (3 * d,), 'attn.c_proj.weight': (d, d), 'attn.c_proj.bias': (d,),
                 'ln_2.weight': (d,), 'ln_2.bias': (d,), 'mlp.c_fc.weight': (d, f), 'mlp.c_fc.bias': (f,),
                 'mlp.c_proj.weight': (f, d), 'mlp.c_proj.bias': (d,)}
    for layer in range(layers):
        shapes |= {f'h.{layer}.{name}': shape for name, shape in per_layer.items()}
    if not config.get('tie_word_embeddings', True):
        shapes['lm_head.weight'] = (v, d)
    return shapes


def check(path: str) -> tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """(config, safetensors header) of a Hugging Face GPT-2 directory, or one CheckpointError line."""
    weights = os.path.join(path, 'model.safetensors')
    if not os.path.isfile(weights):
        others = sorted(f for f in os.listdir(path) if f.endswith(('.bin', '.pt', '.h5', '.msgpack', '.index.json')))
        found = f' (it has {", ".join(others[:3])}: not read)' if others else ''
        raise CheckpointError(f'{path} has a config.json but no model.safetensors{found}. Fix: {SAVE_FIX}')
    config = read_config(path)
    header = read_safetensors_header(weights)
    names = {name.removeprefix('transformer.'): entry for name, entry in header.items()}
    for name, shape in expected_shapes(config).items():
        if name not in names:
            raise CheckpointError(f'{weights} has no tensor {name!r} (nor transformer.{name}) that its config.json '
                             f'({config["n_layer"]} layers) needs. Fix: {SAVE_FIX}')
        dtype, saved = names[name]
        vocab_rows = name in ('wte.weight', 'lm_head.weight')
        if saved != shape and not (vocab_rows and len(saved) == 2 and saved[0] >= shape[0] and saved[1] == shape[1]):
            raise CheckpointError(f'{weights}: tensor {name!r} has shape {list(saved)}, its config.json needs '
                             f'{list(shape)}. Fix: {SAVE_FIX}')
        if dtype not in READABLE:
            raise CheckpointError(f'{weights}: tensor {name!r} is {dtype}; jaxfrontier reads F32, F16 or F64. Fix: '
                             f'{SAVE_FIX}')
    return config, header
