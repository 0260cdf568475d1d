"""Parameters in and out of checkpoints: safetensors export, and initial parameters for fine-tuning.

`export_params(source, out_path)` writes the parameters of a checkpoint to one safetensors
file that any framework can read: one tensor per parameter, named by its '/'-joined path in
the params tree (`blocks/attn/w_qkv`), block parameters stacked with a leading [layers]
dimension in model order (also for checkpoints of interleaved pipelines), fp32. The name map and shapes are in docs/checkpoints.md. The file is written one
tensor at a time, so the host holds at most one (stacked) parameter at once.

`load_params(source, config, layout)` reads parameters for `config.checkpoint.init_params_from`
from a safetensors file or from another run's checkpoint, directly into the layout's
shardings: every process reads only the slices its devices hold.

Export runs in one process: `python -m jaxfrontier.main --mode=export --workdir=RUN
--export_path=params.safetensors`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from jaxfrontier.training import checkpoint as ckpt_lib
from jaxfrontier.training import hf
from jaxfrontier import config as config_lib
from jaxfrontier import finite
from jaxfrontier import hf_dir
from jaxfrontier import saved_meta
from jaxfrontier.training import state as ts

FORMAT = 'jaxfrontier-params'


def flatten_names(tree: Any) -> dict[str, Any]:
    """{'/'-joined path: leaf} of a nested dict, in sorted path order."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
    return {ckpt_lib.path_name(path): leaf for path, leaf in flat}


def _unflatten(names: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, leaf in names.items():
        node = out
        *parents, last = name.split('/')
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


def resolve_step_dir(source: str) -> str:
    """The step directory a source names: a workdir, its checkpoints/ directory, or a step directory.

    Raises:
      CheckpointError: when there is no committed checkpoint there.
    """
    return hf.step_dir_of(source, fix='name a training workdir, its checkpoints/ directory, one step directory '
                                      'in it, or a .safetensors file.')


def _read_meta(step_dir: str) -> dict[str, Any]:
    return hf.read_meta(step_dir, fix='name a jaxfrontier checkpoint.')


def saved_tree(step_dir: str) -> dict[str, Any]:
    """The saved train state's tree of array metadata (shape, dtype), read without the arrays."""
    return hf.read_item(step_dir, 'state', ocp.PyTreeCheckpointHandler(), lambda h, path: h.metadata(path).tree)


def _restore_params(step_dir: str, item: dict[str, Any], restore_args: dict[str, Any]) -> dict[str, Any]:
    args = ocp.args.PyTreeRestore(item={'params': item}, restore_args={'params': restore_args}, partial_restore=True)
    handler = ocp.PyTreeCheckpointHandler()
    return hf.read_item(step_dir, 'state', handler, lambda h, path: h.restore(path, args=args))['params']


# --------------------------------------------------------------------------- export


def _check_out_path(out_path: str) -> None:
    """Fails with one line when `out_path` is a directory or its directory cannot be written."""
    if os.path.isdir(out_path):
        raise config_lib.UserError(f'--export_path={out_path!r} is a directory. '
                                   'Fix: name a file, e.g. --export_path=params.safetensors.')
    directory = os.path.dirname(os.path.abspath(out_path))
    try:
        os.makedirs(directory, exist_ok=True)
        open(f'{out_path}.tmp{os.getpid()}', 'wb').close()  # pylint: disable=consider-using-with
        os.remove(f'{out_path}.tmp{os.getpid()}')
    except OSError as e:
        raise config_lib.UserError(f'--export_path={out_path!r} cannot be written ({e.strerror or e}). '
                                   'Fix: choose a path in a directory you can write to.') from None


def _nonfinite_error(step_dir: str, name: str, count: int, size: int) -> ckpt_lib.CheckpointError:
    older = ckpt_lib.committed_steps(os.path.dirname(step_dir))
    older = [s for s in older if str(s) != os.path.basename(step_dir)]
    pick = f' (e.g. --workdir={os.path.dirname(step_dir)}/{older[-1]})' if older else ''
    return ckpt_lib.CheckpointError(
        f'{step_dir}: parameter {name!r} has {count} of {size} values NaN or Inf; refusing to export them. '
        f'Fix: export an older step directory{pick}, or pass --export_allow_nonfinite to write them anyway.')


def export_params(source: str, out_path: str, allow_nonfinite: bool = False) -> dict[str, tuple[int, ...]]:
    """Writes the parameters of a checkpoint to a safetensors file, one tensor at a time.

    Args:
      source: a training workdir (its newest checkpoint), its checkpoints/ directory, or
        one step directory.
      out_path: the .safetensors file to write (replaced atomically).
      allow_nonfinite: write parameters that hold NaN or Inf instead of refusing.

    Returns:
      {name: shape} of the tensors written.

    Raises:
      UserError: `out_path` is a directory or cannot be written.
      CheckpointError: no checkpoint, a corrupted one, or NaN/Inf parameters (unless allowed).
    """
    _check_out_path(out_path)
    step_dir = resolve_step_dir(source)
    meta = _read_meta(step_dir)
    saved = {name: (tuple(m.shape), np.dtype(m.dtype))  # {name: (shape, dtype)} of the saved parameters
             for name, m in flatten_names(saved_tree(step_dir)['params']).items()}
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
            value = flatten_names(_restore_params(step_dir, _unflatten(names), _unflatten(
                {name: ocp.RestoreArgs(restore_type=np.ndarray)})))[name]
            bad = int(value.size - np.count_nonzero(np.isfinite(value)))
            if bad and not allow_nonfinite:
                raise _nonfinite_error(step_dir, name, bad, int(value.size))
            yield value

    hf.write_safetensors(out_path, shapes, metadata, arrays())
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
    if ckpt_lib.layer_split(name, saved, target) == (1, 2):
        return _split_reader(read, target)
    if len(saved) == len(target) and all(a == b or (a, b) == vocab for a, b in zip(saved, target)):
        return _padded_reader(read, saved, target, leaf.dtype)
    raise ckpt_lib.CheckpointError(f'{where}: parameter {name!r} has shape {saved}, the config needs {target}. '
                                   'Fix: use the config the parameters were trained with.')


def load_safetensors(path: str, c: ml_collections.ConfigDict, layout: ts.StateLayout) -> dict[str, Any]:
    """Reads a safetensors file (export_params' name map) into the layout's shardings."""
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top

    target = flatten_names(ckpt_lib.abstract_target(layout)['params'])
    try:
        f = safe_open(path, framework='numpy')
    except Exception as e:  # noqa: BLE001
        detail = ' '.join(str(e).split())  # one line, whatever the library says
        raise ckpt_lib.CheckpointError(f'cannot read {path} as safetensors ({type(e).__name__}: {detail}). '
                                       'Fix: name a file written by --mode=export (docs/checkpoints.md).') from e
    metadata = f.metadata() or {}
    saved_vocab = target_vocab = config_lib.padded_vocab(c)
    if 'config' in metadata:
        saved_config = saved_meta.parse_config(metadata['config'], path)  # damaged metadata: one line
        ckpt_lib.check_model_matches(saved_config, c, path, 'choose a file of the same model')
        saved_vocab = ckpt_lib.padded_vocab_of(saved_config)
    missing = sorted(set(target) - set(f.keys()))
    if missing:
        raise ckpt_lib.CheckpointError(f'{path} has no parameter {missing[0]!r}. Fix: use parameters '
                                       'of a model with the same structure (docs/checkpoints.md).')
    readers = {name: _reader(f, name, tuple(f.get_slice(name).get_shape()), leaf, (saved_vocab, target_vocab), path)
               for name, leaf in target.items()}
    return _unflatten({name: jax.make_array_from_callback(leaf.shape, leaf.sharding, readers[name], dtype=leaf.dtype)
                       for name, leaf in target.items()})


def load_checkpoint_params(source: str, c: ml_collections.ConfigDict, layout: ts.StateLayout) -> dict[str, Any]:
    """Reads only the parameters of another run's checkpoint into the layout's shardings."""
    step_dir = resolve_step_dir(source)
    meta = _read_meta(step_dir)
    ckpt_lib.check_model_matches(meta['config'], c, step_dir, 'choose a checkpoint of the same model')
    target = {'params': ckpt_lib.abstract_target(layout)['params']}
    vocab = (ckpt_lib.padded_vocab_of(meta['config']), config_lib.padded_vocab(c))
    item, restore_args, reshaped = ckpt_lib.plan_restore(
        target, ckpt_lib.saved_shapes_of(saved_tree(step_dir)), vocab, step_dir)
    return ckpt_lib.finish_restore({'params': _restore_params(step_dir, item['params'], restore_args['params'])},
                                   reshaped)['params']


def load_params(source: str, c: ml_collections.ConfigDict, layout: ts.StateLayout) -> dict[str, Any]:
    """Initial parameters for config.checkpoint.init_params_from: a .safetensors file, a Hugging Face
    GPT-2 directory or a checkpoint."""
    if not os.path.exists(source):
        raise config_lib.ConfigError('checkpoint.init_params_from', source, 'no such file or directory',
                                     'name a training workdir, a checkpoint directory or a .safetensors file')
    if os.path.isfile(source):
        return finite.check(load_safetensors(source, c, layout), source)
    if hf_dir.looks_like_hf(source):  # a transformers GPT-2 directory (config.json + model.safetensors)
        hf_dir.check(source)  # a damaged one: one line
        return finite.check(hf.load_hf(source, c, layout), source)
    return finite.check(load_checkpoint_params(source, c, layout), source)
