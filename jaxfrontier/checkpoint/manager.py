"""The Orbax manager of a run's checkpoints: asynchronous saves, their health, and commits.

Saves are Orbax PyTrees (OCDBT) with a JSON `meta` item (the package docstring,
jaxfrontier/checkpoint/__init__.py); every chunk carries a CRC32C (integrity.py), and a step whose
loss, gradient or parameter norm is not finite is never committed. Restoring is `restore.py`,
which `Checkpointer` inherits.
"""

from __future__ import annotations

import asyncio.base_events
import json
import math
import logging as pylogging
import os
import sys
import traceback
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from orbax.checkpoint import checkpoint_managers as ocp_policies
from orbax.checkpoint._src.metadata import array_metadata_store  # pinned orbax < 0.13

from jaxfrontier.errors import CheckpointError, UserError
from jaxfrontier import errors
from jaxfrontier import logs
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import integrity
from jaxfrontier.checkpoint import restore
from jaxfrontier.checkpoint import verdict

State = dict[str, Any]

log = logs.process0(__name__).info  # process 0 only


_ORBAX = f'{os.sep}orbax{os.sep}'
_ORBAX_READ = '_read_array_index_and_device_put'  # serialization.py: one array index of a restore


class _QuietOrbax(pylogging.Filter):
    """Drops Orbax's INFO chatter (about 20 lines per save), and its records of a write that failed
    for lack of space; its other warnings and errors pass, and so does every record not Orbax's.

    A save that fills the disk is logged by Orbax with a traceback from each thread it passes
    through (`_SignalingThread.run()` in futures/future.py, the background commit in
    async_checkpointer.py, `wait_until_finished` in checkpoint_manager.py), then raised to the
    training loop, which ends the run with one `error: no space left ...` line (run/control/disk.py).
    When the disk fails several of a save's TensorStore writes (`write_fragment` tasks in
    serialization.py), the first failure is raised and the others are left unawaited; asyncio
    logs each, when collected, as `Task exception was never retrieved` with its traceback. So a
    record is Orbax's when Orbax logged it (the absl logger) or its exception was raised in Orbax's
    code (the asyncio logger). Of those, only records whose exception or text `errors.disk_full`
    recognises are dropped (an OSError ENOSPC / EDQUOT in the chain, or errors.DISK_FULL_TEXTS),
    so any other failure still shows. A restore is the same: when one of its reads fails (a truncated
    or corrupted file) the first failure is raised, and the restore reports it in one line; the
    other reads that failed are logged by asyncio as never retrieved, each with the array's whole
    TensorStore spec (a hundred lines). Those records, raised in Orbax's read of an array index, are
    dropped too.
    """

    def filter(self, record) -> bool:
        exception = record.exc_info[1] if record.exc_info else None
        logged_by_orbax = _ORBAX in record.pathname
        if not (logged_by_orbax or (exception is not None and any(
                _ORBAX in f.filename for f in traceback.extract_tb(exception.__traceback__)))):
            return True
        if logged_by_orbax and record.levelno < pylogging.WARNING:
            return False
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit: the handler reports that itself
            message = str(record.msg)
        if exception is not None and any(f.name == _ORBAX_READ for f in traceback.extract_tb(exception.__traceback__)):
            return False  # a read the failed restore left behind: the first failure was raised (one line)
        return errors.disk_full(exception) is None and not any(t in message for t in errors.DISK_FULL_TEXTS)


def _closed_loop_wakeup(unraisable) -> bool:
    """Whether an unraisable exception is a TensorStore callback waking an event loop Orbax closed.

    Orbax runs a save's coroutine on a fresh asyncio loop and closes it as soon as the coroutine
    ends (asyncio_utils.run_sync). When one TensorStore write fails (a full disk fails them all),
    the `gather` raises at once; the writes still in flight finish later on TensorStore's C++
    threads, whose done-callbacks call `loop.call_soon_threadsafe` on the closed loop and print
    `RuntimeError: Event loop is closed` (one traceback per write, dozens per save). Nobody awaits
    those results any more and the first failure is raised to the loop, so they carry nothing.
    Keeping the loop open would mean changing Orbax; instead exactly this is recognised: a
    RuntimeError with that text, not tied to an object, whose every frame is asyncio's own
    `call_soon_threadsafe` (called from native code, so no Python frame of any caller).
    """
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == 'Event loop is closed'
            and unraisable.object is None and bool(frames) and frames[0].name == 'call_soon_threadsafe'
            and all(f.filename == asyncio.base_events.__file__ for f in frames))


def _abandoned_orbax_read(unraisable) -> bool:
    """Whether an unraisable exception is an Orbax read abandoned by a restore that failed.

    A restore reads every array index in one `gather` on a loop Orbax closes when it raises
    (asyncio_utils.run_sync): the first failed read (a corrupted or truncated file) is raised to the
    restore, which reports it in one line (format.corrupted_error); the reads still suspended are
    closed whenever the garbage collector finds them, sometimes much later. Orbax's
    `_read_array_index_and_device_put` catches BaseException around its read and raises a new
    Exception, so closing it turns GeneratorExit into an error Python can only print, with the
    array's whole TensorStore spec (about 100 lines each, dozens per restore). Exactly that is
    recognised: the coroutine of that function in Orbax's code, its exception caused by GeneratorExit.
    """
    code = getattr(unraisable.object, 'cr_code', None)
    return (code is not None and code.co_name == _ORBAX_READ and _ORBAX in code.co_filename
            and isinstance(getattr(unraisable.exc_value, '__cause__', None), GeneratorExit))


def _unraisable_hook(previous):
    def hook(unraisable) -> None:
        if not (_closed_loop_wakeup(unraisable) or _abandoned_orbax_read(unraisable)):
            previous(unraisable)
    hook.drops_closed_loop_wakeups = True
    return hook


def quiet_orbax_logs() -> None:
    """Installs _QuietOrbax on the absl logger and on asyncio's, and the filters of Orbax's leftovers on
    sys.unraisablehook (_closed_loop_wakeup, _abandoned_orbax_read), once per process."""
    for logger in (logging.get_absl_logger(), pylogging.getLogger('asyncio')):
        if not any(isinstance(f, _QuietOrbax) for f in logger.filters):
            logger.addFilter(_QuietOrbax())
    if not getattr(sys.unraisablehook, 'drops_closed_loop_wakeups', False):
        sys.unraisablehook = _unraisable_hook(sys.unraisablehook)


class Checkpointer(restore.Restoring):
    """Saves and restores the train state of one run in `<workdir>/checkpoints/`.

    Usage, in the order the training loop calls it:

        ckpt = Checkpointer(config, workdir)
        state, origin = ckpt.restore_or_init(target, init_fn, init_from.load_params)
        ...  state, metrics = train_step(state, batch); ckpt.save(step, state)
        ckpt.save(final_step, state, force=True); ckpt.close()

    Under LoRA (training/state.py) the state's frozen base is never saved: a checkpoint holds the
    adapters and their optimizer state, and records the base (lora_base.py), which a restore reads
    again from `checkpoint.init_params_from` after checking it is the same.

    Saves are asynchronous (config.checkpoint.async_save): `save` returns once the arrays
    are copied off the devices, so the state may then be donated to the next step. With
    config.checkpoint.enabled False every method is a no-op and nothing is restored.

    It takes the run's whole resolved config, not only its `checkpoint` section (which alone
    decides when and how it saves): the config is saved whole in every step's `meta`, with the
    data position (seed, data source, global batch), and a restore compares the saved model,
    optimizer and data position with it (restore.py), as `init_params_from` converts parameters
    for its model.
    """

    def __init__(self, c: ml_collections.ConfigDict, workdir: str):
        self.c, self.cc = c, c.checkpoint
        self.directory = format_lib.checkpoint_dir(workdir)
        self.enabled = bool(self.cc.enabled)
        self._mngr = None
        self._last_saved: int | None = None
        self._last_good: int | None = None  # the newest step known finite (restored or saved)
        self._rolled_back_to: int | None = None  # checkpoint.restore_step this run resumed from
        self.watch = verdict.Watch()  # the parameter norms a step's verdict compares with (verdict.py)
        self.health_ledger = verdict.Ledger(os.path.dirname(self.directory))  # verdicts learned after a save
        self._judged: tuple[Any, dict[str, Any]] | None = None
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
            raise CheckpointError(
                f'cannot open the checkpoints in {self.directory}: {type(e).__name__}: {e}. '
                'Fix: move the damaged step directory away, or use a new --workdir.') from e
        self._last_saved = self._mngr.latest_step()

    # ------------------------------------------------------------------ save

    def due(self, step: int) -> bool:
        return bool(self.enabled and self.cc.every_steps and step % self.cc.every_steps == 0)

    def save(self, step: int, state: State, *, force: bool = False,
             metrics: dict[str, jax.Array] | None = None, data_skips: list[dict[str, Any]] | None = None) -> bool:
        """Starts saving `state` as `step` if due (or `force`); returns whether it did.

        Returns once the arrays are off the devices (the write continues in the background
        when config.checkpoint.async_save), so `state` may be donated right after. A step
        already saved is not saved again. With `metrics` (the step's train metrics) the
        step's loss, gradient norm and parameter norm are fetched first (one host sync) and
        recorded; if any is not finite nothing is saved and NonFiniteLossError is raised.
        `data_skips`: the data skipped after loss spikes (training/spikes.py), saved as `data.skips`.
        """
        if not (self.enabled and (force or self.due(step))) or self._last_saved == step:
            return False
        lora = format_lib.FROZEN in state  # LoRA: the adapters and their optimizer state, never the base
        state = format_lib.persistent(state)
        health = {'finite': None} if metrics is None else self.judge(step, metrics)
        if health['finite'] is False:
            if not _finite(health.get('loss')):  # the loss of this step was computed on the previous state
                self._mark_unhealthy(step - 1, f'the next step\'s loss, computed on it, was {health["loss"]}')
            error = errors.NonFiniteLossError(self.nonfinite_message(step, health))
            error.names_checkpoint = True
            raise error
        if health.get('healthy') is False:
            log(f'checkpoint: step {step} not saved: its state is unhealthy ({health["reason"]}); the newest '
                f'healthy checkpoint stays {"step " + str(self._last_good) if self._last_good is not None else "none"}')
            return False
        meta = {'format': format_lib.FORMAT, 'version': format_lib.VERSION, 'step': int(step),
                'data': {'next_step': int(step), 'seed': self.c.seed, 'kind': self.c.data.kind,
                         'path': self.c.data.path, 'blend': self.c.data.get('blend', ''),
                         'global_batch': self.c.train.global_batch},
                'health': health, 'checksums': 'crc32c per chunk',
                'config': json.loads(self.c.to_json_best_effort())}
        if data_skips:
            meta['data']['skips'] = data_skips
        if lora:
            meta['lora_base'] = self.base_record()
        if self._rolled_back_to is not None:
            meta['rolled_back_to'] = self._rolled_back_to
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state, save_args=layer_chunks(
            state, 2 if self.c.mesh.pipeline > 1 and self.c.pipeline.virtual_stages > 1 else 1)),
                                                      meta=ocp.args.JsonSave(meta)), force=True)
        self._last_saved = step
        if health['finite']:
            self._last_good = step
            self.watch.checkpoint(step, health.get('param_norm'))
        return True

    def judge(self, step: int, metrics: dict[str, jax.Array]) -> dict[str, Any]:
        """Step `step`'s health and verdict (verdict.judge; fetched once for both tiers' saves)."""
        key = (step, id(metrics.get('train/loss')))
        if self._judged is None or self._judged[0] != key:
            self._judged = (key, verdict.judge(integrity.health(metrics), self.watch.previous_param_norm(step),
                                               self.watch.tainted))
        return self._judged[1]

    def observe(self, step: int, metrics: dict[str, jax.Array]) -> tuple[int, str, bool] | None:
        """Step `step`'s metrics, reported (one step late): the reference of the next verdict, and the
        verdicts it gives (verdict.Watch.seen): (a step now known unhealthy, why, whether its
        parameters jumped), recorded in the ledger, or None."""
        if 'train/loss' not in metrics or 'train/param_norm' not in metrics:  # a step that reports neither
            return None
        loss, norm = (float(v) for v in jax.device_get((metrics['train/loss'], metrics['train/param_norm'])))
        found = self.watch.seen(step, loss, norm)
        if found is not None:
            self._mark_unhealthy(*found[:2])
        return found

    def unhealthy_message(self, step: int, why: str) -> str:
        """The one line of a run stopped by an unhealthy (finite) state, spike handling off."""
        return (f'training diverged at step {step}: its state is unhealthy ({why}); stopping without saving it or '
                f'anything trained from it. {self.resume_hint()}')

    def _mark_unhealthy(self, step: int, why: str) -> None:
        """Records in the ledger that the state after `step` is unhealthy, learned after it may have been saved."""
        if not self.enabled or self.health_ledger.reason(step) is not None:
            return
        self.health_ledger.mark(step, why)
        if self._last_good is not None and self._last_good >= step:
            self._last_good = self.newest_step_at_most(step - 1)
        if step == self._last_saved or step in self._mngr.all_steps():
            log(f'checkpoint: step {step} is unhealthy ({why}); recorded in {self.health_ledger.path}: resume and '
                'roll-back skip it')

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written (a host-side flag, no sync)."""
        return self._mngr is not None and self._mngr.is_saving_in_progress()

    def wait(self) -> None:
        """Blocks until every started save is committed."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager (idempotent)."""
        if self._mngr is not None:
            self._mngr.close()
            self._mngr = None


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def layer_chunks(state: State, layer_dims: int) -> Any:
    """SaveArgs storing each block array in one-layer chunks (its `layer_dims` leading dimensions split
    to 1), so one layer reads alone: the Hugging Face export streams layer by layer (checkpoint/interop/hf.py)."""
    def one(path, x):
        blocks = 'blocks' in format_lib.path_name(path).split('/') and getattr(x, 'ndim', 0) > layer_dims
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
        raise UserError(
            f'{what} cannot be written ({e.strerror or e}). '
            'Fix: choose a --workdir you can write to, or fix its permissions.') from None


def describe_arrays(state: State) -> tuple[int, float]:
    """(number of arrays, GiB) of a state, for log lines and benchmarks."""
    leaves = jax.tree.leaves(state)
    return len(leaves), sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves) / 2**30
