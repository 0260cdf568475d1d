"""Checkpoints: asynchronous Orbax saves, restore onto any mesh, preemption by signal.

A run's checkpoints live in `<workdir>/checkpoints/<step>/`, each with two items:

  state/  the whole train state `{'step', 'params', 'opt_state'}` as an Orbax PyTree (OCDBT):
          every process writes the shards it holds, and nothing is gathered on one host.
          Every chunk carries a CRC32C checksum, verified by the process that reads it
          (training/integrity.py).
  meta/   JSON: the format version, the step, the data position, the resolved config and the
          step's health (loss, gradient and parameter norms, all finite: a non-finite state is
          never committed).

Nothing else is needed to continue exactly: batches are a pure function of (seed, step)
(jaxfrontier/data/dataset.py) and so is the dropout randomness (jaxfrontier/training/loop.py), so the step
*is* the data position and the RNG state.

Orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>/` and renames it to `<step>/`
only once every process has finished; a step killed half-way is never listed, never restored,
and deleted when the next run starts. Restoring builds every array directly in the target
layout's shardings (`ArrayRestoreArgs(sharding=...)`), so a checkpoint written on one mesh
is read onto any other: each process reads only the slices its devices hold.

Preemption (training/preemption.py): `PreemptionWatcher` turns the configured signals (SIGTERM from Slurm at the time
limit, or an early warning such as `--signal=USR1@120`) into a flag; the loop finishes its
step, saves, waits for the commit and returns. See docs/checkpoints.md.
"""

from __future__ import annotations

import functools
import json
import logging as pylogging
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P
from orbax.checkpoint import checkpoint_managers as ocp_policies
from orbax.checkpoint._src.metadata import array_metadata_store  # pinned orbax < 0.13

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import integrity
from jaxfrontier.training import metrics as metrics_lib
from jaxfrontier.training import state as ts

State = dict[str, Any]

FORMAT = 'jaxfrontier-checkpoint'
VERSION = 1
CHECKPOINT_SUBDIR = 'checkpoints'
SUPERSEDED_SUBDIR = 'checkpoints.superseded'  # steps newer than the one a run rolled back to
# The config fields that fix the shapes of the train state; a checkpoint restores only into
# a config that agrees on all of them.
MODEL_SHAPE_FIELDS = ('num_layers', 'd_model', 'num_heads', 'seq_len', 'vocab_size', 'mlp_ratio',
                      'tied_embeddings')


class CheckpointError(config_lib.UserError):
    """A checkpoint cannot be used (corrupted, incomplete or from another model)."""


class _QuietOrbax(pylogging.Filter):
    """Drops Orbax's INFO chatter (about 20 lines per save); its warnings and errors pass."""

    def filter(self, record) -> bool:
        return record.levelno >= pylogging.WARNING or f'{os.sep}orbax{os.sep}' not in record.pathname


def quiet_orbax_logs() -> None:
    """Installs _QuietOrbax on the absl logger once per process."""
    logger = logging.get_absl_logger()
    if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
        logger.addFilter(_QuietOrbax())


def log(text: str) -> None:
    """Logs `text` at INFO level, on process 0 only."""
    if jax.process_index() == 0:
        logging.info(text)


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed-looking directory `<step>/` (temporary directories excluded)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def abstract_target(layout: ts.StateLayout) -> State:
    """The train state as ShapeDtypeStructs that carry the layout's shardings."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        layout.abstract_state, layout.state_shardings)


def padded_vocab_of(config_dict: dict[str, Any]) -> int:
    """Padded vocabulary of a saved (JSON) config; see config_lib.padded_vocab."""
    m = config_dict['model']['vocab_multiple'] * config_dict['mesh']['tensor']
    return -(-config_dict['model']['vocab_size'] // m) * m


def check_model_matches(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str, fix: str) -> None:
    """Raises ConfigError naming the first model field in which `c` differs from `saved`.

    Args:
      saved: the resolved config saved with the checkpoint (JSON dict).
      c: the config being run.
      where: the checkpoint, for the message.
      fix: what to do instead of changing the field, for the message.
    """
    for field in MODEL_SHAPE_FIELDS:
        theirs, ours = saved.get('model', {}).get(field), c.model[field]
        if theirs is not None and theirs != ours:
            raise config_lib.ConfigError(
                f'model.{field}', ours, f'the checkpoint {where} was saved with model.{field} = {theirs!r}',
                f'set --config.model.{field}={theirs} to match it, or {fix}')


def path_name(path) -> str:
    """'/'-joined keys of a pytree path: ('params', 'blocks', 'attn', 'w_qkv') -> params/blocks/attn/w_qkv."""
    return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def layer_split(name: str, saved: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, int] | None:
    """(saved, target) numbers of leading layer dimensions when a block array differs only in them.

    Interleaved pipelines store block arrays [V, L / V, ...] instead of [L, ...], in the same
    layer order (params_lib.split_virtual), so the two convert by a reshape.
    """
    if not (name.startswith('blocks/') or '/blocks/' in name):
        return None
    for k_saved, k_target in ((1, 2), (2, 1), (2, 2)):
        if (saved[k_saved:] == target[k_target:] and len(saved) > k_saved and len(target) > k_target
                and math.prod(saved[:k_saved]) == math.prod(target[:k_target]) and saved != target):
            return k_saved, k_target
    return None


def _layer_split_sharding(leaf: jax.ShapeDtypeStruct, saved: tuple[int, ...], ks: int, kt: int) -> NamedSharding:
    """Where to restore a block array in its saved [L, ...] or [V, L / V, ...] shape before the reshape:
    the target's sharding of the other dimensions, and its layer sharding on the last layer dimension."""
    mesh, spec = leaf.sharding.mesh, tuple(leaf.sharding.spec) + (None,) * len(leaf.shape)
    axes = tuple(a for e in spec[:kt] for a in mesh_lib.entry_axes(e))
    layer = [None] * ks
    if axes and saved[ks - 1] % math.prod(mesh.shape[a] for a in axes) == 0:
        layer[-1] = axes[0] if len(axes) == 1 else axes
    return NamedSharding(mesh, P(*layer, *spec[kt:len(leaf.shape)]))


def plan_restore(target: Any, saved_shapes: dict[str, tuple[int, ...]], vocab: tuple[int, int],
                 where: str) -> tuple[Any, Any, dict[str, jax.ShapeDtypeStruct]]:
    """How to read each array of `target` from a checkpoint whose arrays have `saved_shapes`.

    Two differences are resolved, every other one is an error naming the array:
      vocabulary padding  the padded vocabulary depends on mesh.tensor (config_lib.padded_vocab);
                          padding rows are never read by the model (token ids < vocab_size,
                          padded logits masked), so they are dropped or zero-filled.
      ZeRO-1 padding      optimizer state padded to a multiple of the data-parallel size
                          (layout_lib.zero1_layout); the padding is zero: dropped or zero-filled.
      layer split         interleaved pipelines hold block arrays as [V, L / V, ...]: such an
                          array is read in its saved shape, then reshaped (`finish_restore`).

    Args:
      target: the abstract tree to restore (ShapeDtypeStructs with shardings).
      saved_shapes: '/'-joined leaf path -> shape, from the checkpoint's metadata.
      vocab: (saved padded vocabulary, target padded vocabulary).
      where: the checkpoint, for messages.

    Returns:
      (item, restore_args, {name: target leaf} of the arrays finish_restore must reshape).
    """
    reshaped: dict[str, jax.ShapeDtypeStruct] = {}

    def one(path, leaf):
        name = path_name(path)
        if name not in saved_shapes:
            raise CheckpointError(f'checkpoint {where} has no array {name!r}: it was written by a different '
                                  'model or version. Fix: start from a checkpoint of this model, or use a new '
                                  '--workdir.')
        saved = tuple(saved_shapes[name])
        split = layer_split(name, saved, leaf.shape)
        if split:
            reshaped[name] = leaf
            sharding = _layer_split_sharding(leaf, saved, *split)
            return (jax.ShapeDtypeStruct(saved, leaf.dtype, sharding=sharding),
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=saved, dtype=leaf.dtype))
        # ZeRO-1 pads optimizer state that no data-parallel size divides (layout_lib.zero1_layout);
        # its padding is always zero, so it too is dropped or zero-filled.
        zero1_padding = name.startswith('opt_state/')
        padded_only = len(saved) == len(leaf.shape) and all(
            s == t or (s, t) == vocab or zero1_padding for s, t in zip(saved, leaf.shape))
        if saved != leaf.shape and not padded_only:
            raise CheckpointError(f'checkpoint {where}: array {name!r} has shape {saved}, the config needs '
                                  f'{leaf.shape}. Fix: use the config the checkpoint was written with.')
        return leaf, ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape, dtype=leaf.dtype,
                                          strict=saved == leaf.shape)

    pairs = jax.tree_util.tree_map_with_path(one, target)
    is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], ocp.ArrayRestoreArgs)  # noqa: E731
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair), jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
            reshaped)


def finish_restore(restored: Any, reshaped: dict[str, jax.ShapeDtypeStruct]) -> Any:
    """Reshapes the arrays plan_restore read in another layer split into their target layout, one at a time."""

    def one(path, x):
        leaf = reshaped.get(path_name(path))
        return x if leaf is None else _reshaper(leaf.shape, leaf.sharding)(x)

    return jax.tree_util.tree_map_with_path(one, restored) if reshaped else restored


@functools.lru_cache(maxsize=None)
def _reshaper(shape: tuple[int, ...], sharding: NamedSharding):
    """One compiled reshape per (shape, sharding): a parameter and its two Adam moments share it."""
    return jax.jit(lambda a: a.reshape(shape), out_shardings=sharding, donate_argnums=0)


def saved_shapes_of(tree_metadata: Any) -> dict[str, tuple[int, ...]]:
    tree = getattr(tree_metadata, 'tree', tree_metadata)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
    return {path_name(path): tuple(leaf.shape) for path, leaf in flat}


class Checkpointer:
    """Saves and restores the train state of one run in `<workdir>/checkpoints/`.

    Usage, in the order the training loop calls it:

        ckpt = Checkpointer(config, workdir)
        state, origin = ckpt.restore_or_init(layout, init_fn, export.load_params)
        ...  state, metrics = train_step(state, batch); ckpt.save(step, state)
        ckpt.save(final_step, state, force=True); ckpt.close()

    Saves are asynchronous (config.checkpoint.async_save): `save` returns once the arrays
    are copied off the devices, so the state may then be donated to the next step. With
    config.checkpoint.enabled False every method is a no-op and nothing is restored.
    """

    def __init__(self, c: ml_collections.ConfigDict, workdir: str):
        self.c, self.cc = c, c.checkpoint
        self.directory = checkpoint_dir(workdir)
        self.enabled = bool(self.cc.enabled)
        self._mngr = None
        self._last_saved: int | None = None
        self._last_good: int | None = None  # the newest step known finite (restored or saved)
        self._rolled_back_to: int | None = None  # checkpoint.restore_step this run resumed from
        if not self.enabled:
            return
        quiet_orbax_logs()
        integrity.install_chunk_checksums()
        ensure_writable(self.directory, f'the checkpoint directory {self.directory!r}')
        policies = [ocp_policies.LatestN(n=self.cc.keep)]
        if self.cc.keep_period:
            policies.append(ocp_policies.EveryNSteps(interval_steps=self.cc.keep_period))
        options = ocp.CheckpointManagerOptions(
            create=True,
            cleanup_tmp_directories=True,  # a save killed half-way is deleted, never restored
            enable_async_checkpointing=bool(self.cc.async_save),
            preservation_policy=ocp_policies.AnyPreservationPolicy(policies),
        )
        try:
            self._mngr = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={'state': _state_handler(), 'meta': ocp.JsonCheckpointHandler()})
        except Exception as e:  # noqa: BLE001 -- any failure to read the directory is the user's to fix
            raise CheckpointError(f'cannot open the checkpoints in {self.directory}: {type(e).__name__}: {e}. '
                                  'Fix: move the damaged step directory away, or use a new --workdir.') from e
        self._last_saved = self._mngr.latest_step()

    # ------------------------------------------------------------------ restore

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return None if self._mngr is None else self._mngr.latest_step()

    def _check_listing(self) -> int | None:
        """The newest step; fails if a committed-looking step directory is not listed by Orbax."""
        latest = self._mngr.latest_step()
        on_disk = committed_steps(self.directory)
        if on_disk and (latest is None or on_disk[-1] > latest):
            raise CheckpointError(
                f'checkpoint {self.directory}/{on_disk[-1]} is not a readable Orbax checkpoint (damaged or '
                'written by another tool); refusing to start from an older state. Fix: move that directory '
                'away to resume from the previous checkpoint, or use a new --workdir.')
        return latest

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata saved with `step` (format, step, data position, config)."""
        try:
            meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
        except Exception as e:  # noqa: BLE001
            raise corrupted_error(self.directory, step, e) from e
        if not isinstance(meta, dict) or meta.get('format') != FORMAT:
            raise CheckpointError(f'checkpoint {self.directory}/{step} has no jaxfrontier metadata. '
                                  'Fix: move it away, or use a new --workdir.')
        return meta

    def restore(self, layout: ts.StateLayout, step: int | None = None, meta: dict[str, Any] | None = None) -> State:
        """Restores `step` (default: the newest) directly into `layout`'s shardings.

        Raises:
          ConfigError: the checkpoint's model differs from the config (names the field).
          CheckpointError: the checkpoint is missing, incomplete or corrupted (checksums included).
        """
        step = self._check_listing() if step is None else step
        if step is None:
            raise CheckpointError(f'no checkpoint in {self.directory}')
        where = f'{self.directory}/{step}'
        meta = self.read_meta(step) if meta is None else meta
        check_model_matches(meta['config'], self.c, where, 'use a new --workdir to start a new run')
        _check_data_position(meta, self.c, where)
        if not os.path.exists(os.path.join(where, 'state', '_METADATA')):
            raise CheckpointError(f'checkpoint {where} is corrupted: state/_METADATA (the index of its arrays) '
                                  f'is missing. Fix: {self._older_fix(step)}. Nothing was trained.')
        target = abstract_target(layout)
        try:
            saved_shapes = saved_shapes_of(self._mngr.item_metadata(step)['state'])
        except Exception as e:  # noqa: BLE001
            raise corrupted_error(self.directory, step, e, self._older_fix(step)) from e
        item, restore_args, reshaped = plan_restore(
            target, saved_shapes, (padded_vocab_of(meta['config']), config_lib.padded_vocab(self.c)), where)
        try:
            restored = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)))['state']
        except Exception as e:  # noqa: BLE001
            raise corrupted_error(self.directory, step, e, self._older_fix(step)) from e
        if 'checksums' not in meta:
            log(f'warning: checkpoint {where} was written without checksums (before they were added); '
                'its bytes were not verified')
        return finish_restore(restored, reshaped)

    def _older_fix(self, step: int) -> str:
        older = [s for s in self._mngr.all_steps() if s < step] if self._mngr is not None else []
        pick = (f'resume from an older step with --config.checkpoint.restore_step={older[-1]} '
                f'(steps: {", ".join(map(str, older))}), or ' if older else '')
        return f'{pick}move {self.directory}/{step} away, or use a new --workdir'

    def _restore_chosen(self, layout: ts.StateLayout) -> tuple[State, int] | None:
        """The checkpoint to resume from: checkpoint.restore_step, else the newest finite one.

        A checkpoint whose metadata says it is not finite is skipped with a warning; one written
        before finiteness was recorded is checked on the devices after it is read. Steps newer
        than the one resumed from are moved to <workdir>/checkpoints.superseded/ so that this
        run can save those step numbers again (and rotation cannot delete the step resumed from).
        """
        newest = self._check_listing()
        if newest is None and self.cc.restore_step < 0:
            return None
        steps = list(self._mngr.all_steps())
        wanted = self.cc.restore_step
        if wanted >= 0 and newest is not None and self.read_meta(newest).get('rolled_back_to') == wanted:
            log(f'checkpoint.restore_step={wanted}: step {newest} was trained after that roll-back; resuming it')
            wanted = -1
        if wanted >= 0:
            if wanted not in steps:
                raise config_lib.ConfigError(
                    'checkpoint.restore_step', wanted, f'{self.directory} has no checkpoint of step {wanted} '
                    f'(available: {", ".join(map(str, steps)) or "none"})',
                    'pick an available step, or -1 for the newest finite checkpoint')
            state = self.restore(layout, wanted)
            self._supersede([s for s in steps if s > wanted])
            self._rolled_back_to = wanted
            return state, wanted
        for step in sorted(steps, reverse=True):
            meta = self.read_meta(step)
            finite = meta.get('health', {}).get('finite')
            if finite is not False:
                state = self.restore(layout, step, meta)
                if finite is True or integrity.all_finite(state):
                    self._supersede([s for s in steps if s > step])
                    return state, step
                del state
            log(f'warning: checkpoint {self.directory}/{step} holds NaN/Inf values; skipping it')
        raise CheckpointError(
            f'every checkpoint in {self.directory} holds NaN/Inf values (steps {", ".join(map(str, steps))}). '
            'Fix: move that directory away to start from scratch, or continue from one anyway with '
            '--config.checkpoint.restore_step=N.')

    def _supersede(self, steps: list[int]) -> None:
        """Moves the step directories `steps` to <workdir>/checkpoints.superseded/ (process 0), then syncs."""
        if not steps:
            return
        target_dir = os.path.join(os.path.dirname(self.directory), SUPERSEDED_SUBDIR)
        if jax.process_index() == 0:
            os.makedirs(target_dir, exist_ok=True)
            for step in steps:
                target, n = os.path.join(target_dir, str(step)), 1
                while os.path.exists(target):
                    target, n = os.path.join(target_dir, f'{step}-{n}'), n + 1
                os.replace(os.path.join(self.directory, str(step)), target)
            logging.warning('moved the newer checkpoints %s to %s', steps, target_dir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            multihost_utils.sync_global_devices('jaxfrontier_supersede')
        self._mngr.reload()

    def restore_or_init(self, layout: ts.StateLayout, init_fn: Callable[[], State],
                        load_params: Callable[[str, ml_collections.ConfigDict, ts.StateLayout], Any] | None = None,
                        ) -> tuple[State, str]:
        """The newest finite checkpoint of this run (or checkpoint.restore_step), else `init_fn()`
        (with config.checkpoint.init_params_from).

        `load_params(source, config, layout)` reads config.checkpoint.init_params_from
        (`export.load_params`, passed in: export builds on this module, not the reverse).

        Returns:
          (state, a one-line description of where it came from).
        """
        chosen = self._restore_chosen(layout) if self.enabled else None
        if chosen is not None:
            state, step = chosen
            self._last_saved = self._last_good = step
            return state, f'restored step {step} from {self.directory}/{step}'
        state = init_fn()
        source = self.cc.init_params_from
        if not source:
            return state, 'initialised from scratch'
        if load_params is None:
            raise ValueError('checkpoint.init_params_from is set but no load_params was given')
        state['params'] = load_params(source, self.c, layout)
        return state, f'parameters from {source} (checkpoint.init_params_from), fresh optimizer state'

    # ------------------------------------------------------------------ save

    def due(self, step: int) -> bool:
        return bool(self.enabled and self.cc.every_steps and step % self.cc.every_steps == 0)

    def save(self, step: int, state: State, *, force: bool = False,
             metrics: dict[str, jax.Array] | None = None) -> bool:
        """Starts saving `state` as `step` if due (or `force`); returns whether it did.

        Returns once the arrays are off the devices (the write continues in the background
        when config.checkpoint.async_save), so `state` may be donated right after. A step
        already saved is not saved again. With `metrics` (the step's train metrics) the
        step's loss, gradient norm and parameter norm are fetched first (one host sync) and
        recorded; if any is not finite nothing is saved and NonFiniteLossError is raised.
        """
        if not (self.enabled and (force or self.due(step))) or self._last_saved == step:
            return False
        health = {'finite': None} if metrics is None else integrity.health(metrics)
        if health['finite'] is False:
            error = metrics_lib.NonFiniteLossError(self.nonfinite_message(step, health))
            error.names_checkpoint = True
            raise error
        meta = {'format': FORMAT, 'version': VERSION, 'step': int(step),
                'data': {'next_step': int(step), 'seed': self.c.seed, 'kind': self.c.data.kind,
                         'path': self.c.data.path, 'blend': self.c.data.get('blend', ''),
                         'global_batch': self.c.train.global_batch},
                'health': health, 'checksums': 'crc32c per chunk',
                'config': json.loads(self.c.to_json_best_effort())}
        if self._rolled_back_to is not None:
            meta['rolled_back_to'] = self._rolled_back_to
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state, save_args=layer_chunks(
            state, 2 if self.c.mesh.pipeline > 1 and self.c.pipeline.virtual_stages > 1 else 1)),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
        self._last_saved = step
        if health['finite']:
            self._last_good = step
        return True

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written (a host-side flag, no sync)."""
        return self._mngr is not None and self._mngr.is_saving_in_progress()

    def resume_hint(self) -> str:
        """Where to resume from after a divergence: the newest finite checkpoint and the command."""
        lower = f'--config.optim.lr={self.c.optim.lr / 10:g}'
        if not self.enabled or self._last_good is None:
            return f'No finite checkpoint was saved; rerun with a lower learning rate (e.g. {lower}).'
        return (f'The newest finite checkpoint is step {self._last_good} ({self.directory}/{self._last_good}): '
                f'rerun the same command with a lower learning rate, e.g. {lower}, to resume from it, or roll '
                'back further with --config.checkpoint.restore_step=N.')

    def with_resume_hint(self, error: metrics_lib.NonFiniteLossError) -> metrics_lib.NonFiniteLossError:
        """`error` (the loop's NaN check), with the checkpoint to resume from added once."""
        if getattr(error, 'names_checkpoint', False):
            return error
        return metrics_lib.NonFiniteLossError(f'{error} {self.resume_hint()}')

    def nonfinite_message(self, step: int, health: dict[str, Any]) -> str:
        values = ', '.join(f'{k} {v}' for k, v in health.items() if k != 'finite')
        return (f'training diverged at step {step} ({values}); stopping without saving that state. '
                f'{self.resume_hint()} Also worth checking: the data (token ids below model.vocab_size), '
                'and float32 compute (--config.model.dtype=float32) to rule out bf16/fp16 overflow.')

    def stop_message(self, step: int, signal_name: str) -> str:
        """The one line printed when a signal stopped the run."""
        if not self.enabled:
            return f'preempted by {signal_name} after step {step}; checkpointing is disabled, nothing was saved.'
        return (f'preempted by {signal_name} after step {step}: checkpoint committed to {self.directory}/{step}; '
                'rerun the same command to resume.')

    def wait(self) -> None:
        """Blocks until every started save is committed."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager (idempotent)."""
        if self._mngr is not None:
            self._mngr.close()
            self._mngr = None


def layer_chunks(state: State, layer_dims: int) -> Any:
    """SaveArgs storing each block array in one-layer chunks (its `layer_dims` leading dimensions split
    to 1), so one layer reads alone: the Hugging Face export streams layer by layer (training/hf.py)."""
    def one(path, x):
        blocks = 'blocks' in path_name(path).split('/') and getattr(x, 'ndim', 0) > layer_dims
        return ocp.SaveArgs(shard_axes=tuple(range(layer_dims)) if blocks else ())
    return jax.tree_util.tree_map_with_path(one, state)


def _state_handler(checksums: bool = True) -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler, with each shard written by one replica (zarr3 with a CRC32C per
    chunk; `checksums=False`: Orbax's default zarr2 without, for benchmarks/checkpoint.py).

    Replica-parallel writing (Orbax's default except when JAX_PLATFORMS names a GPU) slices
    replicated shards on the device, which costs a compile per array shape on the first save
    (19 s for 40 arrays on a loaded CPU) and buys nothing where the state is sharded.
    """
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False,
                                                   array_metadata_store=array_metadata_store.Store())),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
    )
    # zarr3, whose chunks integrity.install_chunk_checksums gives a CRC32C each.
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_zarr3=checksums)


def corrupted_error(directory: str, step: int | str, error: Exception, fix: str = '') -> CheckpointError:
    """The error for a checkpoint that Orbax or TensorStore could not read (`fix`: what to do instead)."""
    detail = ' '.join(str(error).split())[:300]
    if integrity.is_checksum_error(error):
        return CheckpointError(
            f'checkpoint {directory}/{step} fails its checksum ({detail}): its files were changed on disk. '
            f'Fix: {fix or "move that step directory away to resume from the previous checkpoint"}. '
            'Nothing was trained.')
    return CheckpointError(
        f'checkpoint {directory}/{step} cannot be read ({type(error).__name__}: {detail}); it is '
        'truncated or corrupted. Fix: move that step directory away to resume from the previous '
        'checkpoint, or use a new --workdir. Nothing was trained.')


def _check_data_position(meta: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Warns when the data stream would not continue where the checkpoint left it."""
    data = meta.get('data', {})
    ours = {'seed': c.seed, 'kind': c.data.kind, 'path': c.data.path, 'blend': c.data.get('blend', ''),
            'global_batch': c.train.global_batch}
    changed = {k: (data.get(k), v) for k, v in ours.items() if k in data and data[k] != v}
    if changed:
        log(f'warning: resuming {where} with a different data stream: '
            + ', '.join(f'{k} {old!r} -> {new!r}' for k, (old, new) in changed.items()))


def ensure_writable(directory: str, what: str) -> None:
    """Fails early, with a user message, when `directory` cannot be created or written.

    Args:
      directory: the directory to create (if needed) and probe.
      what: how the message names it, e.g. "--workdir='runs/a'".
    """
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f'.write_probe_{os.getpid()}')
        with open(probe, 'w') as f:
            f.write('ok')
        os.remove(probe)
    except OSError as e:
        raise config_lib.UserError(
            f'{what} cannot be written ({e.strerror or e}). '
            'Fix: choose a --workdir you can write to, or fix its permissions.') from None


def describe_arrays(state: State) -> tuple[int, float]:
    """(number of arrays, GiB) of a state, for log lines and benchmarks."""
    leaves = jax.tree.leaves(state)
    return len(leaves), sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves) / 2**30
