"""Restore: the checkpoint a run resumes from, read onto its mesh, else its initial state.

`Restoring` is the restore half of `manager.Checkpointer` (which sets `c`, `cc`, `directory`,
`enabled`, `_mngr`, `_last_good` and `_rolled_back_to`): choosing the checkpoint
(`checkpoint.restore_step`, else the newest finite one), reading it into a target's shardings
(reshard.py), moving superseded steps away, and the messages that name the checkpoint to resume
from (divergence, preemption).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import logs
from jaxfrontier.checkpoint import saved_meta
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import integrity
from jaxfrontier.checkpoint import lora_base
from jaxfrontier.checkpoint import reshard
from jaxfrontier.checkpoint import verdict
from jaxfrontier.families import moe as moe_lib

State = dict[str, Any]

_logger = logs.process0(__name__)
_log = _logger.info


class Restoring:
    """Restore, roll-back and resume messages of a Checkpointer (see the module docstring)."""

    c: ml_collections.ConfigDict
    cc: ml_collections.ConfigDict
    directory: str
    enabled: bool
    _mngr: Any
    _last_good: int | None
    _rolled_back_to: int | None
    watch: verdict.Watch
    health_ledger: verdict.Ledger

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return None if self._mngr is None else self._mngr.latest_step()

    def _check_listing(self) -> int | None:
        """The newest step; fails if a committed-looking step directory is not listed by Orbax."""
        latest = self._mngr.latest_step()
        on_disk = format_lib.committed_steps(self.directory)
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
            raise format_lib.corrupted_error(self.directory, step, e) from e
        if not isinstance(meta, dict) or meta.get('format') != format_lib.FORMAT:
            raise CheckpointError(
                f'checkpoint {self.directory}/{step} has no jaxfrontier metadata. '
                'Fix: move it away, or use a new --workdir.')
        return saved_meta.check(meta, f'checkpoint {self.directory}/{step}')  # damaged fields: one line

    def restore(self, target: State, step: int | None = None, meta: dict[str, Any] | None = None) -> State:
        """Restores `step` (default: the newest) directly into the shardings of `target`.

        Args:
          target: the abstract train state, ShapeDtypeStructs with shardings (target.abstract_target).
          step: the step to read (default: the newest).
          meta: its metadata, when already read.

        Raises:
          ConfigError: the checkpoint's model differs from the config (names the field).
          CheckpointError: the checkpoint is missing, incomplete or corrupted (checksums included).
        """
        step = self._check_listing() if step is None else step
        if step is None:
            raise CheckpointError(f'no checkpoint in {self.directory}')
        where = f'{self.directory}/{step}'
        meta = self.read_meta(step) if meta is None else meta
        format_lib.check_model_matches(meta['config'], self.c, where, 'use a new --workdir to start a new run')
        format_lib.check_optimizer_matches(meta['config'], self.c, where)
        format_lib.check_routing_matches(meta['config'], self.c, where)
        format_lib.check_lora_matches(meta['config'], self.c, where)
        if format_lib.FROZEN in target:  # LoRA: the adapters restore onto the base they were trained over only
            lora_base.check(meta.get('lora_base'), self.cc.init_params_from, where, self.base_record()['fingerprint'])
            target = format_lib.persistent(target)
        _check_data_position(meta, self.c, where)
        if not os.path.exists(os.path.join(where, 'state', '_METADATA')):
            raise CheckpointError(
                f'checkpoint {where} is corrupted: state/_METADATA (the index of its arrays) '
                f'is missing. Fix: {self._older_fix(step)}. Nothing was trained.')
        try:
            saved_shapes = reshard.saved_shapes_of(self._mngr.item_metadata(step)['state'])
        except Exception as e:  # noqa: BLE001
            raise format_lib.corrupted_error(self.directory, step, e, self._older_fix(step)) from e
        _check_optional_parts(saved_shapes, target, self.c, where)
        item, restore_args, reshaped = reshard.plan_restore(
            target, saved_shapes, (format_lib.padded_vocab_of(meta['config']), config_lib.padded_vocab(self.c)), where)
        try:
            restored = self._mngr.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)))['state']
        except Exception as e:  # noqa: BLE001
            raise format_lib.corrupted_error(self.directory, step, e, self._older_fix(step)) from e
        self.watch.forget()  # a resume or roll-back: a new timeline from this step
        self.watch.checkpoint(step, meta.get('health', {}).get('param_norm'))
        if 'checksums' not in meta:
            _log(f'warning: checkpoint {where} was written without checksums (before they were added); '
                 'its bytes were not verified')
        return reshard.finish_restore(restored, reshaped)

    def _older_fix(self, step: int) -> str:
        older = [s for s in self._mngr.all_steps() if s < step] if self._mngr is not None else []
        pick = (f'resume from an older step with --config.checkpoint.restore_step={older[-1]} '
                f'(steps: {", ".join(map(str, older))}), or ' if older else '')
        return f'{pick}move {self.directory}/{step} away, or use a new --workdir'

    def _restore_chosen(self, target: State) -> tuple[State, int] | None:
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
            _log(f'checkpoint.restore_step={wanted}: step {newest} was trained after that roll-back; resuming it')
            wanted = -1
        if wanted >= 0:
            if wanted not in steps:
                raise ConfigError(
                    'checkpoint.restore_step', wanted, f'{self.directory} has no checkpoint of step {wanted} '
                    f'(available: {", ".join(map(str, steps)) or "none"})',
                    'pick an available step, or -1 for the newest finite checkpoint')
            state = self.restore(target, wanted)
            self._supersede([s for s in steps if s > wanted])
            self.health_ledger.forget_after(wanted)
            self._rolled_back_to = wanted
            return state, wanted
        for step in sorted(steps, reverse=True):
            meta = self.read_meta(step)
            health = meta.get('health', {})
            why = self.unhealthy(step, health)
            if why:
                _log(f'warning: checkpoint {self.directory}/{step} is unhealthy ({why}); skipping it')
                continue
            finite = health.get('finite')
            if finite is not False:
                state = self.restore(target, step, meta)
                if finite is True or integrity.all_finite(state):
                    self._supersede([s for s in steps if s > step])
                    self.health_ledger.forget_after(step)
                    return state, step
                del state
            _log(f'warning: checkpoint {self.directory}/{step} holds NaN/Inf values; skipping it')
        raise CheckpointError(
            f'no checkpoint in {self.directory} is healthy (steps {", ".join(map(str, steps))}: NaN/Inf values or '
            f'unhealthy, as logged above). Fix: move that directory away to start from scratch, or continue from '
            'one anyway with --config.checkpoint.restore_step=N.')

    def unhealthy(self, step: int, health: dict[str, Any] | None = None) -> str | None:
        """Why checkpoint `step` is unhealthy (its saved verdict, else the ledger's), or None."""
        if health is not None and health.get('healthy') is False:
            return str(health.get('reason', 'unhealthy'))
        why = self.health_ledger.reason(step)
        return None if why is None else f'{why}; recorded in {self.health_ledger.path}'

    def _supersede(self, steps: list[int]) -> None:
        """Moves the step directories `steps` to <workdir>/checkpoints.superseded/ (process 0), then syncs."""
        if not steps:
            return
        target_dir = os.path.join(os.path.dirname(self.directory), format_lib.SUPERSEDED_SUBDIR)
        if jax.process_index() == 0:
            os.makedirs(target_dir, exist_ok=True)
            for step in steps:
                target, n = os.path.join(target_dir, str(step)), 1
                while os.path.exists(target):
                    target, n = os.path.join(target_dir, f'{step}-{n}'), n + 1
                os.replace(os.path.join(self.directory, str(step)), target)
            _logger.warning('moved the newer checkpoints %s to %s', steps, target_dir)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            multihost_utils.sync_global_devices('jaxfrontier_supersede')
        self._mngr.reload()

    def newest_step_at_most(self, step: int) -> int | None:
        """The newest committed step <= `step` not known unhealthy (None: there is none, or checkpointing is off)."""
        steps = [s for s in self._mngr.all_steps() if s <= step and self.health_ledger.reason(s) is None
                 ] if self._mngr is not None else []
        return max(steps) if steps else None

    def rewind(self, target: State, step: int) -> State:
        """A roll-back inside a running run (training/spikes.py): `step` restored into `target`'s
        shardings, newer steps moved to checkpoints.superseded/ (as a resume from restore_step does).
        The caller has waited for its saves to commit."""
        newer = [s for s in self._mngr.all_steps() if s > step]
        state = self.restore(target, step)
        self._supersede(newer)
        self.health_ledger.forget_after(step)
        self._last_saved = self._last_good = step
        return state

    def base_record(self) -> dict[str, Any]:
        """LoRA's base (config.checkpoint.init_params_from): its path and fingerprint (lora_base.py), read once."""
        if getattr(self, '_base_record', None) is None:
            self._base_record = lora_base.record(self.cc.init_params_from)
        return self._base_record

    def restore_or_init(self, target: State, init_fn: Callable[[], State],
                        load_params: Callable[[str, ml_collections.ConfigDict, Any], Any] | None = None,
                        ) -> tuple[State, str]:
        """The newest finite checkpoint of this run (or checkpoint.restore_step), else `init_fn()`
        (with config.checkpoint.init_params_from). Under LoRA (the target holds a frozen base) the
        base is read from config.checkpoint.init_params_from either way (`with_base`), and `init_fn`
        builds the adapters' state without one.

        Args:
          target: the abstract train state, ShapeDtypeStructs with shardings (target.abstract_target).
          init_fn: builds the initial train state (one jitted init).
          load_params: `load_params(source, config, params target)` reads
            config.checkpoint.init_params_from (`init_from.load_params`, passed in: it builds on
            this module, not the reverse).

        Returns:
          (state, a one-line description of where it came from).
        """
        chosen = self._restore_chosen(target) if self.enabled else None
        source = self.cc.init_params_from
        if source and load_params is None:
            raise ValueError('checkpoint.init_params_from is set but no load_params was given')
        if chosen is not None:
            state, step = chosen
            self._last_saved = self._last_good = step
            return self.with_base(state, target, load_params), f'restored step {step} from {self.directory}/{step}'
        state = init_fn()
        if format_lib.FROZEN in target:
            return (self.with_base(state, target, load_params),
                    f'LoRA adapters initialised (b = 0) over the base {source} (checkpoint.init_params_from)')
        if not source:
            return state, 'initialised from scratch'
        state['params'] = load_params(source, self.c, target['params'])
        return state, f'parameters from {source} (checkpoint.init_params_from), fresh optimizer state'

    def with_base(self, state: State, target: State, load_params) -> State:
        """`state` with LoRA's frozen base read from config.checkpoint.init_params_from into `target`'s
        shardings (a target without one: `state` as it is)."""
        if format_lib.FROZEN not in target:
            return state
        return {**state, format_lib.FROZEN: load_params(self.cc.init_params_from, self.c, target[format_lib.FROZEN])}

    # ------------------------------------------------------------------ messages

    def resume_hint(self, suspect_named: bool = False) -> str:
        """Where to resume from after a divergence: the newest finite checkpoint and the command; first the
        suspect a config has beside the learning rate (families/moe.divergence_suspect), unless `suspect_named`."""
        lower = f'--config.optim.lr={self.c.optim.lr / 10:g}'
        suspect = moe_lib.divergence_suspect(self.c.model)  # a moving router bias: suspected before the lr
        first = f'The first suspect is {suspect}. ' if suspect and not suspect_named else ''
        change = 'that change, else a lower learning rate' if suspect else 'a lower learning rate'
        if not self.enabled or self._last_good is None:
            return f'{first}There is no healthy checkpoint to resume from; rerun with {change} (e.g. {lower}).'
        return (f'{first}The newest healthy checkpoint is step {self._last_good} ({self.directory}/{self._last_good}): '
                f'rerun the same command with {change}, e.g. {lower}, to resume from it, or roll '
                'back further with --config.checkpoint.restore_step=N.')

    def with_resume_hint(self, error: errors.NonFiniteLossError) -> errors.NonFiniteLossError:
        """`error` (the loop's NaN check), with the checkpoint to resume from added once."""
        if getattr(error, 'names_checkpoint', False):
            return error
        return errors.NonFiniteLossError(f'{error} {self.resume_hint(getattr(error, "suspect_named", False))}')

    def nonfinite_message(self, step: int, health: dict[str, Any]) -> str:
        values = ', '.join(f'{k} {v}' for k, v in health.items() if k not in ('finite', 'healthy', 'reason'))
        return (f'training diverged at step {step} ({values}); stopping without saving that state. '
                f'{self.resume_hint()} Also worth checking: the data (token ids below model.vocab_size), '
                'and float32 compute (--config.model.dtype=float32) to rule out bf16/fp16 overflow.')

    def stop_message(self, step: int, signal_name: str) -> str:
        """The one line printed when a signal stopped the run."""
        if not self.enabled:
            return f'preempted by {signal_name} after step {step}; checkpointing is disabled, nothing was saved.'
        return (f'preempted by {signal_name} after step {step}: checkpoint committed to {self.directory}/{step}; '
                'rerun the same command to resume.')


def _check_optional_parts(saved_shapes: dict[str, Any], target: State, c: ml_collections.ConfigDict,
                          where: str) -> None:
    """The part of the state that `train.spike_skip` adds (the running loss estimate, 'spike') saved
    but not wanted, or the reverse: one line naming the setting (Orbax would call it corrupted)."""
    saved = any(name.split('/')[0] == 'spike' for name in saved_shapes)
    if saved != ('spike' in target):
        raise ConfigError('train.spike_skip', c.train.spike_skip,
                          f'the checkpoint {where} was saved with train.spike_skip = {saved} (its state '
                          f'{"holds" if saved else "lacks"} the running loss estimate)',
                          f'set --config.train.spike_skip={saved} to resume it, or start a new --workdir from its '
                          f'parameters with --config.checkpoint.init_params_from={where}')


def _check_data_position(meta: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Warns when the data stream would not continue where the checkpoint left it."""
    data = meta.get('data', {})
    ours = {'seed': c.seed, 'kind': c.data.kind, 'path': c.data.path, 'blend': c.data.get('blend', ''),
            'global_batch': c.train.global_batch}
    changed = {k: (data.get(k), v) for k, v in ours.items() if k in data and data[k] != v}
    if changed:
        _log(f'warning: resuming {where} with a different data stream: '
             + ', '.join(f'{k} {old!r} -> {new!r}' for k, (old, new) in changed.items()))
