"""Safetensors: the writer, a checkpoint's parameters exported to one file, and that file read back.

`export_params(source, out_path)` writes the parameters of a checkpoint to one safetensors
file that any framework can read: one tensor per parameter, named by its '/'-joined path in
the params tree (`blocks/attn/w_qkv`), block parameters stacked with a leading [layers]
dimension in model order (also for checkpoints of interleaved pipelines), fp32. The name map and shapes are in docs/checkpoints.md. The file is written one
tensor at a time, so the host holds at most one (stacked) parameter at once.

`load_safetensors(path, config, target)` reads such a file for `config.checkpoint.init_params_from`
(init_from.py) directly into the target's shardings: every process reads only the slices its
devices hold.

Export runs in one process: `python -m jaxfrontier.main --mode=export --workdir=RUN
--export_path=params.safetensors`.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from jaxfrontier.errors import CheckpointError, UserError
from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier import files
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import reshard
from jaxfrontier.checkpoint import run_files
from jaxfrontier.checkpoint import saved_meta
from jaxfrontier.checkpoint.interop import export_target
from jaxfrontier.checkpoint.interop import lora_merge

FORMAT = 'jaxfrontier-params'


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
    run_files.remove_stale_temporaries(path)
    files.write_atomic(path, itertools.chain(
        [_safetensors_header(shapes, metadata)],
        (np.ascontiguousarray(value.reshape(shape), dtype=dtype.newbyteorder('<')).tobytes()
         for (shape, dtype), value in zip(shapes.values(), arrays))))


# --------------------------------------------------------------------------- export


def _check_out_path(out_path: str) -> None:
    """Fails with one line when `out_path` is a directory or its directory cannot be written."""
    if os.path.isdir(out_path):
        raise UserError(f'--export_path={out_path!r} is a directory. '
                                   'Fix: name a file, e.g. --export_path=params.safetensors.')
    directory = os.path.dirname(os.path.abspath(out_path))
    try:
        os.makedirs(directory, exist_ok=True)
        open(f'{out_path}.tmp{os.getpid()}', 'wb').close()  # pylint: disable=consider-using-with
        os.remove(f'{out_path}.tmp{os.getpid()}')
    except OSError as e:
        raise UserError(f'--export_path={out_path!r} cannot be written ({e.strerror or e}). '
                                   'Fix: choose a path in a directory you can write to.') from None


def _nonfinite_error(step_dir: str, name: str, count: int, size: int) -> CheckpointError:
    older = format_lib.committed_steps(os.path.dirname(step_dir))
    older = [s for s in older if str(s) != os.path.basename(step_dir)]
    pick = f' (e.g. --workdir={os.path.dirname(step_dir)}/{older[-1]})' if older else ''
    return CheckpointError(
        f'{step_dir}: parameter {name!r} has {count} of {size} values NaN or Inf; refusing to export them. '
        f'Fix: export an older step directory{pick}, or pass --export_allow_nonfinite to write them anyway.')


def export_params(source: str, out_path: str, allow_nonfinite: bool = False, *, bases: tuple[str, ...] = ()
                  ) -> dict[str, tuple[int, ...]]:
    """Writes the parameters of a checkpoint to a safetensors file, one tensor at a time.

    Args:
      source: a training workdir (its newest checkpoint), its checkpoints/ directory, or
        one step directory.
      out_path: the .safetensors file to write (replaced atomically; never the run's base, a file in what a run
        rotates or one of a workdir's own files: export_target.check_file).
      allow_nonfinite: write parameters that hold NaN or Inf instead of refusing.
      bases: more base models the export must not replace (the command's `checkpoint.init_params_from`).

    Returns:
      {name: shape} of the tensors written.

    Raises:
      UserError: `out_path` is refused, is a directory or cannot be written (DiskFullError: no space for it).
      CheckpointError: no checkpoint, a corrupted one, or NaN/Inf parameters (unless allowed).
    """
    export_target.check_file(out_path, source=source, bases=bases)
    _check_out_path(out_path)
    try:
        return _export(source, out_path, allow_nonfinite)
    except OSError as e:  # a full disk or a read-only file system mid-way: write_atomic left nothing behind
        error = export_target.write_error(e, out_path)
        if error is None:
            raise
        raise error from None


def _export(source: str, out_path: str, allow_nonfinite: bool) -> dict[str, tuple[int, ...]]:
    step_dir = readers.resolve_step_dir(source)
    meta = readers.read_checkpoint_meta(step_dir)
    if lora_merge.lora_of(meta['config']) is not None:  # the adapters merged into their base
        return _export_merged(step_dir, meta, out_path, allow_nonfinite)
    saved = {name: (tuple(m.shape), np.dtype(m.dtype))  # {name: (shape, dtype)} of the saved parameters
             for name, m in readers.flatten_names(readers.saved_tree(step_dir)['params']).items()}
    # Interleaved pipelines store block arrays [V, L / V, ...]; the file has them [L, ...].
    merge = meta['config']['mesh']['pipeline'] > 1 and meta['config']['pipeline']['virtual_stages'] > 1
    shapes = {name: ((shape[0] * shape[1], *shape[2:]) if merge and name.startswith('blocks/') else shape, dtype)
              for name, (shape, dtype) in saved.items()}  # model order [L, ...] (params_lib.merge_virtual)
    metadata = {'format': FORMAT, 'step': str(meta['step']), 'source': step_dir,
                'config': json.dumps(meta['config'], sort_keys=True),
                'vocab_size': str(meta['config']['model']['vocab_size'])}

    def arrays():
        for name, (_, dtype) in shapes.items():
            names = {name: jax.ShapeDtypeStruct(saved[name][0], dtype)}
            value = readers.flatten_names(readers.restore_params(step_dir, readers.unflatten(names), readers.unflatten(
                {name: ocp.RestoreArgs(restore_type=np.ndarray)})))[name]
            bad = int(value.size - np.count_nonzero(np.isfinite(value)))
            if bad and not allow_nonfinite:
                raise _nonfinite_error(step_dir, name, bad, int(value.size))
            yield value

    write_safetensors(out_path, shapes, metadata, arrays())
    return {name: shape for name, (shape, _) in shapes.items()}


def _export_merged(step_dir: str, meta: dict[str, Any], out_path: str, allow_nonfinite: bool
                   ) -> dict[str, tuple[int, ...]]:
    """export_params of a LoRA checkpoint: the base's parameters with the adapters merged in (lora_merge.py),
    one stacked parameter at a time, recorded as a model without LoRA (a start for init_params_from)."""
    config = lora_merge.base_config(meta['config'])
    c = ml_collections.ConfigDict(config)
    reader, v = lora_merge.merged_reader(step_dir, meta), c.model.vocab_size
    specs = families.get(c.model.family).param_specs(config_lib.model_shape(c))
    shapes = {p.path: (p.shape, np.dtype('float32')) for p in specs}
    metadata = {'format': FORMAT, 'step': str(meta['step']), 'source': step_dir,
                'config': json.dumps(config, sort_keys=True), 'vocab_size': str(v)}

    def read(p) -> np.ndarray:
        if p.is_block:
            return np.stack([reader.layer(p.path.removeprefix('blocks/'), layer) for layer in range(p.shape[0])])
        if p.path in ('wte', 'head'):  # the real vocabulary rows; the padding zero, as a fresh model's
            out = np.zeros(p.shape, np.float32)
            rows = (slice(0, v),) if p.path == 'wte' else (slice(None), slice(0, v))
            out[rows] = reader.read(p.path, rows)
            return out
        return reader.read(p.path)

    def arrays():
        for p in specs:
            value = np.asarray(read(p), np.float32)
            bad = int(value.size - np.count_nonzero(np.isfinite(value)))
            if bad and not allow_nonfinite:
                raise _nonfinite_error(step_dir, p.path, bad, int(value.size))
            yield value

    write_safetensors(out_path, shapes, metadata, arrays())
    return {name: shape for name, (shape, _) in shapes.items()}


# --------------------------------------------------------------------------- load


def _padded_reader(read, saved_shape: tuple[int, ...], target_shape: tuple[int, ...], dtype: Any):
    """Wraps `read(index) -> array` so a target larger or smaller than the saved tensor is
    truncated or zero-padded (used only for the vocabulary padding)."""

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        bounds = [s.indices(n) for s, n in zip(index, target_shape)]
        out = np.zeros([stop - start for start, stop, _ in bounds], dtype)
        clipped = tuple(slice(min(start, n), min(stop, n)) for (start, stop, _), n in zip(bounds, saved_shape))
        part = read(clipped)
        out[tuple(slice(0, p) for p in part.shape)] = part
        return out

    return callback


def _split_reader(read, target_shape: tuple[int, ...]):
    """Wraps `read(index)` of a [L, ...] tensor to fill shards of its [V, L / V, ...] form."""
    virtual, per_chunk = target_shape[:2]

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        (v0, v1, _), (j0, j1, _) = index[0].indices(virtual), index[1].indices(per_chunk)
        return np.stack([read((slice(v * per_chunk + j0, v * per_chunk + j1), *index[2:])) for v in range(v0, v1)])

    return callback


def _reader(f, name: str, saved: tuple[int, ...], leaf: Any, vocab: tuple[int, int], where: str):
    """The make_array_from_callback callback for one target parameter, or an error naming it."""
    read = lambda index: f.get_slice(name)[index]  # noqa: E731
    target = tuple(leaf.shape)
    if saved == target:
        return read
    if reshard.layer_split(name, saved, target) == (1, 2):
        return _split_reader(read, target)
    if len(saved) == len(target) and all(a == b or (a, b) == vocab for a, b in zip(saved, target)):
        return _padded_reader(read, saved, target, leaf.dtype)
    raise CheckpointError(
        f'{where}: parameter {name!r} has shape {saved}, the config needs {target}. '
        'Fix: use the config the parameters were trained with.')


def load_safetensors(path: str, c: ml_collections.ConfigDict, target: Any) -> dict[str, Any]:
    """Reads a safetensors file (export_params' name map) into the shardings of `target` (abstract params)."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top

    target = readers.flatten_names(target)
    try:
        f = safe_open(path, framework='numpy')
    except Exception as e:  # noqa: BLE001
        detail = ' '.join(str(e).split())  # one line, whatever the library says
        raise CheckpointError(
            f'cannot read {path} as safetensors ({type(e).__name__}: {detail}). '
            'Fix: name a file written by --mode=export (docs/checkpoints.md).') from e
    metadata = f.metadata() or {}
    saved_vocab = target_vocab = config_lib.padded_vocab(c)
    if 'config' in metadata:
        saved_config = saved_meta.parse_config(metadata['config'], path)  # damaged metadata: one line
        format_lib.check_model_matches(saved_config, c, path, 'choose a file of the same model')
        saved_vocab = format_lib.padded_vocab_of(saved_config)
    missing = sorted(set(target) - set(f.keys()))
    if missing:
        raise CheckpointError(
            f'{path} has no parameter {missing[0]!r}. Fix: use parameters '
            'of a model with the same structure (docs/checkpoints.md).')
    callbacks = {name: _reader(f, name, tuple(f.get_slice(name).get_shape()), leaf, (saved_vocab, target_vocab), path)
                 for name, leaf in target.items()}
    return readers.unflatten({name: jax.make_array_from_callback(leaf.shape, leaf.sharding, callbacks[name],
                                                                 dtype=leaf.dtype)
                              for name, leaf in target.items()})
