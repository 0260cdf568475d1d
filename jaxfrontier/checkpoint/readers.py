"""Reading a checkpoint without its manager: step directories, metadata, parameter slices.

What export (safetensors, Hugging Face), inference and `checkpoint.init_params_from` read: a
source names a workdir (its newest checkpoint), its checkpoints/ directory or one step
directory; its `meta` item is JSON, its parameters are read whole by Orbax (`restore_params`,
`load_checkpoint_params`, onto any mesh) or slice by slice straight from TensorStore
(`ParamReader`: checkpoints store block arrays in one-layer chunks, manager.layer_chunks).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as tstore
from etils import epath

from jaxfrontier.errors import CheckpointError
from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import reshard
from jaxfrontier.checkpoint import saved_meta


def step_dir_of(source: str, fix: str = 'train first, or name a training workdir, its checkpoints/ directory '
                'or one step directory.') -> str:
    """The newest committed step directory of a workdir, its checkpoints/ directory, or a step directory.

    Raises:
      CheckpointError: when there is no committed checkpoint there; its message ends in `fix`.
    """
    source = os.path.abspath(source)
    if os.path.isdir(os.path.join(source, 'state')):
        return source
    for directory in (format_lib.checkpoint_dir(source), source):
        steps = format_lib.committed_steps(directory)
        if steps:
            return os.path.join(directory, str(steps[-1]))
    raise CheckpointError(f'no committed checkpoint under {source}. Fix: {fix}')


def read_item(step_dir: str, item: str, handler: Any, call) -> Any:
    """`call(handler, <step_dir>/<item>)`, with any failure reported as a corrupted checkpoint."""
    try:
        return call(handler, epath.Path(step_dir) / item)
    except Exception as e:  # noqa: BLE001 -- whatever Orbax or TensorStore raise
        raise format_lib.corrupted_error(os.path.dirname(step_dir), os.path.basename(step_dir), e) from e
    finally:
        handler.close()


def read_meta(step_dir: str, fix: str = 'name one.') -> dict[str, Any]:
    """The JSON saved with a checkpoint step (format, step, config)."""
    meta = read_item(step_dir, 'meta', ocp.JsonCheckpointHandler(), lambda h, path: h.restore(path))
    if not isinstance(meta, dict) or meta.get('format') != format_lib.FORMAT:
        raise CheckpointError(f'{step_dir} is not a jaxfrontier checkpoint. Fix: {fix}')
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
            raise format_lib.corrupted_error(
                os.path.dirname(os.path.dirname(self.state_dir)),
                os.path.basename(os.path.dirname(self.state_dir)), e) from e

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return np.asarray(self.open(name)[index].read().result())

    def layer(self, name: str, layer: int) -> np.ndarray:
        """Layer `layer` (model order) of block parameter `blocks/<name>`, also from [V, L / V, ...] arrays."""
        if self.virtual > 1:
            per = self.layers // self.virtual
            return self.read(f'blocks/{name}', (layer // per, layer % per))
        return self.read(f'blocks/{name}', (layer,))


def flatten_names(tree: Any) -> dict[str, Any]:
    """{'/'-joined path: leaf} of a nested dict, in sorted path order."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
    return {format_lib.path_name(path): leaf for path, leaf in flat}


def unflatten(names: dict[str, Any]) -> dict[str, Any]:
    """The nested dict of {'/'-joined path: leaf} (flatten_names' inverse)."""
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
    return step_dir_of(source, fix='name a training workdir, its checkpoints/ directory, one step directory '
                                   'in it, or a .safetensors file.')


def read_checkpoint_meta(step_dir: str) -> dict[str, Any]:
    """read_meta, for a source that could also have been a .safetensors file."""
    return read_meta(step_dir, fix='name a jaxfrontier checkpoint.')


def saved_tree(step_dir: str) -> dict[str, Any]:
    """The saved train state's tree of array metadata (shape, dtype), read without the arrays."""
    return read_item(step_dir, 'state', ocp.PyTreeCheckpointHandler(), lambda h, path: h.metadata(path).tree)


def restore_params(step_dir: str, item: dict[str, Any], restore_args: dict[str, Any]) -> dict[str, Any]:
    """The parameters `item` of a step directory's state (a partial Orbax restore with `restore_args`)."""
    args = ocp.args.PyTreeRestore(item={'params': item}, restore_args={'params': restore_args}, partial_restore=True)
    handler = ocp.PyTreeCheckpointHandler()
    return read_item(step_dir, 'state', handler, lambda h, path: h.restore(path, args=args))['params']


def load_checkpoint_params(source: str, c: ml_collections.ConfigDict, target: Any) -> dict[str, Any]:
    """Reads only the parameters of another run's checkpoint into the shardings of `target` (abstract params)."""
    step_dir = resolve_step_dir(source)
    meta = read_checkpoint_meta(step_dir)
    format_lib.check_model_matches(meta['config'], c, step_dir, 'choose a checkpoint of the same model')
    target = {'params': target}
    vocab = (format_lib.padded_vocab_of(meta['config']), config_lib.padded_vocab(c))
    item, restore_args, reshaped = reshard.plan_restore(
        target, reshard.saved_shapes_of(saved_tree(step_dir)), vocab, step_dir)
    return reshard.finish_restore({'params': restore_params(step_dir, item['params'], restore_args['params'])},
                                  reshaped)['params']
