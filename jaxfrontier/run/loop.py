"""The training loop `train_and_evaluate(config, workdir)`.

It reads top to bottom in named stages: lock -> mesh -> data -> state (restored or initialised)
-> compile -> loop -> final save. Each stage is a function here and logs its one line from this
module's logger. The steps it runs are built in training/step.py (pure functions, jitted once
with donated state and explicit shardings); the decisions after each step (save or roll back,
stop, evaluate) are run/after_step.py's; the rows it reports are run/observe/report.py's. Each
service takes its own config section: the checkpoint tiers `checkpoint` (the persistent one also
the resolved config, which it saves with every step and compares on restore), the data `data` and
a `BatchSpec`, the spike guard, reporter, stragglers, profiler, watchdog and W&B `train`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Any

import jax
import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import files
from jaxfrontier import logs
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import manager as checkpoint_lib
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.checkpoint.format import FROZEN, persistent
from jaxfrontier.checkpoint.fast import tiers
from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.data import dpo as dpo_data
from jaxfrontier.data import loader as data_lib
from jaxfrontier.errors import NonFiniteLossError
from jaxfrontier.families import moe as moe_lib
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.model import params as params_lib
from jaxfrontier.run import after_step
from jaxfrontier.run import validation
from jaxfrontier.run.control import disk
from jaxfrontier.run.control import interrupt
from jaxfrontier.run.control import preemption as preemption_lib
from jaxfrontier.run.control import watchdog as watchdog_lib
from jaxfrontier.run.control import workdir_lock
from jaxfrontier.run.observe import goodput
from jaxfrontier.run.observe import memory_check
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.run.observe import profile as profile_lib
from jaxfrontier.run.observe import report
from jaxfrontier.run.observe import stragglers
from jaxfrontier.run.observe import wandb_log
from jaxfrontier.training import dpo
from jaxfrontier.training import evaluation
from jaxfrontier.training import spikes
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib

State = dict[str, Any]
_log = logs.process0(__name__).info  # process 0 only; lines name this module
_warn = logs.process0(__name__).warning


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, *, validated: bool = False,
                       startup: dict[str, float] | None = None, started: float | None = None) -> dict[str, float]:
    """Trains `c` on all devices, writing metrics to `workdir`; returns the last log record.

    `validated`: `validation.validate_run(c)` already ran (main does, before JAX starts); then only the
    device count is checked here, otherwise the whole validation runs here. `startup`: seconds of the
    phases before this call (main times flags, imports, distributed init and the preflight), logged with
    the loop's own in one `start-up:` line and written with the first metrics row (`startup/<phase>_s`).
    `started`: the process's start on `time.perf_counter` (main's), where goodput's wall time begins
    (run/observe/goodput.py; None: this call). The run holds `<workdir>/workdir.lock` from before its
    first write to the end (run/control/workdir_lock.py): a second run on the same workdir refuses to start.
    """
    locks: list[workdir_lock.WorkdirLock] = []
    try:
        with contextlib.ExitStack() as handlers:  # the preemption handlers, restored on the way out
            return _train_and_evaluate(c, workdir, locks, validated, dict(startup or {}), handlers, started)
    except Exception as e:  # pylint: disable=broad-except  (a full disk or device: one line, not tracebacks)
        if memory_check.is_out_of_memory(e):
            raise memory_check.out_of_memory_error(e) from e
        full = errors.disk_full(e)
        if full is not None:
            raise disk.disk_full_error(full, workdir) from e
        raise
    finally:
        for lock in locks:
            lock.release()


def _train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, locks: list, validated: bool,
                        startup: dict[str, float], handlers: contextlib.ExitStack,
                        started: float | None) -> dict[str, float]:
    started = time.perf_counter() - sum(startup.values()) if started is None else started
    phase = report.PhaseTimer(startup)
    _validate(c, validated)  # before anything is written or compiled
    preemption = _lock(c, workdir, locks, handlers)  # 1. lock (signals handled from here)
    mesh = _mesh(c)  # 2. mesh
    phase.done('lock_and_mesh')
    train_source, val_source = _data(c, workdir)  # 3. data
    phase.done('data')
    with contextlib.ExitStack() as closing:  # the checkpoint tiers, then the loop's services: closed in reverse
        start = _state(c, workdir, mesh, closing)  # 4. state, restored or initialised
        phase.done('restore' if start.restored else 'init')
        write_resolved_config(c, workdir)  # only now: a refused resume leaves the old config.json
        if start.step >= c.train.steps:
            closing.close()
            return _nothing_ran(c, start.step)
        sinks = _wandb_sinks(c, workdir, handlers, phase)
        steps = _compile(c, start, phase)  # 5. compile
        ledger = goodput.Ledger(workdir, started, write=jax.process_index() == 0)  # start-up until the first step
        ledger.phases(phase.phases)
        memory = _check_memory(c, steps, start.layout, phase)
        after, watch, profiler = _services(c, workdir, start, steps, val_source, sinks, ledger, preemption,
                                           {'compile/time_s': steps.compile_s, **memory, **phase.metrics()}, closing)
        try:  # 6. loop, 7. final save
            # Goodput (run/observe/goodput.py): the loop is step time, but for its waits for a save or an
            # evaluation; those wait for the step first, as step time, so their spans hold only their own.
            with jax.set_mesh(mesh), mesh_lib.use_rules(start.layout.rules), ledger.span('step'):
                state, done, metrics, stop = _loop(c, start.state, after, watch, profiler, steps, train_source)
                saved = after.final_save(done, state, metrics)
                newest = start.checkpointer.latest_step()
        except NonFiniteLossError as e:  # seen one step late: name the checkpoint to resume from
            raise start.checkpointer.with_resume_hint(e) from None
    return _done(c, after, memory, done, saved, newest, stop)


def _loop(c: ml_collections.ConfigDict, state: State, after: after_step.AfterStep, watch: stragglers.Watch,
          profiler: profile_lib.StepProfiler, steps: _Steps,
          train_source: Any) -> tuple[State, int, dict[str, jax.Array], bool]:
    """Loop: dispatch step s, then fetch step s-1's metrics while step s runs; save, stop or evaluate
    when due. Returns (state, steps done, the last step's metrics, whether a preemption stopped it)."""
    guard, ledger, t = after.guard, after.ledger, c.train
    step = done = int(state['step'])
    pending, stop, metrics = None, False, None
    while step < t.steps:
        ledger.step(step + 1)
        data_step = guard.data_step(step)  # the step itself unless loss spikes made it skip data
        batch = data_lib.make_global_batch(train_source, data_step, steps.batch_sharding, t.global_batch)
        with profiler.step(step), ledger.span('wait'):  # a full device queue holds the dispatch back
            state, metrics = steps.train(state, batch)
        # The previous step's metrics, fetched first while this step runs: the reporter's clock reads when
        # that step is seen finished. After a save (which waits for this step) the next fetch would return
        # at once, and the step time of one row would be that gap.
        after.report(pending)
        metrics = {**metrics, **train_source.epochs(data_step, t.global_batch)}
        if guard.on:
            metrics['data/step'] = data_step
        done = step + 1
        profiler.after(done, metrics)
        rolled = after.save_or_roll_back(step, state, metrics)
        if rolled is not None:  # the step in flight is dropped with the state it came from
            (state, step), pending = rolled, None
            continue
        stop = after.should_stop(done)
        evals = None if stop else after.evaluate_if_due(done, ts.model_params(state), metrics)
        watch.tick(done)
        pending, step = (done, metrics, evals), done
        if stop:
            break
    after.report(pending, last=True)
    watch.finish()
    return state, done, metrics, stop


# --------------------------------------------------------------------------- the stages, in order


def _validate(c: ml_collections.ConfigDict, validated: bool) -> None:
    """Everything is checked before anything is written or compiled: by main before JAX started
    (`validated`: then only the device count, which needs JAX), else here."""
    if validated:
        config_lib.check_device_count(c, jax.device_count(), jax.default_backend())
    else:
        validation.validate_run(c, jax.device_count(), jax.default_backend())


def _lock(c: ml_collections.ConfigDict, workdir: str, locks: list,
          handlers: contextlib.ExitStack) -> preemption_lib.PreemptionWatcher:
    """Preemption signals and Ctrl-C handled from here, then the workdir checked and locked.

    From here, not from the first step: a signal that arrives while the run starts (mesh, data,
    restore, compile: minutes for a large model) stops it after its first step with a committed
    checkpoint, like one that arrives later (SIGTERM is not left to JAX's notifier, which swallows
    it with several processes, nor Ctrl-C to a KeyboardInterrupt traceback)."""
    preemption = handlers.enter_context(preemption_lib.PreemptionWatcher(c.checkpoint))
    handlers.enter_context(interrupt.first_interrupt_stops(preemption))
    checkpoint_lib.ensure_writable(workdir, f'--workdir={workdir!r}')
    lock = workdir_lock.acquire_for_job(workdir, c.train.workdir_lease_s)
    locks.append(lock)
    _log(f'lock: {lock.path} held for this run (lease {lock.lease_s:g} s, renewed while it runs)')
    return preemption


def _mesh(c: ml_collections.ConfigDict) -> jax.sharding.Mesh:
    mesh = mesh_lib.mesh_from_config(c)
    _log(f'mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} devices '
         f'({jax.process_count()} process(es))')
    return mesh


def _data(c: ml_collections.ConfigDict, workdir: str) -> tuple[Any, Any]:
    """(train, validation) sources of the `data` section, windows as the model and batch need."""
    if c.train.objective == 'dpo':  # whole preference pairs, not windows of a stream (data/dpo.py)
        train_source, val_source = dpo_data.make_sources(c.data, c.model.vocab_size, c.seed)
    else:
        train_source, val_source = data_lib.make_datasets(c.data, workdir, data_lib.BatchSpec.of(c))
    packing = (f'packed documents (attention within each, end-of-text id {c.data.eot_id})' if c.data.pack_documents
               else 'windows across documents (pack_documents=False)')
    _log(f'data: train {train_source.describe()}; validation {val_source.describe()}; {packing}')
    tail_warning = data_lib.tail_split_warning(c.data)
    if tail_warning:
        _warn(f'warning: {tail_warning}')
    return train_source, val_source


@dataclasses.dataclass(frozen=True)
class _Start:
    """The state the loop starts from, and the checkpoint tiers that hold (and will hold) it."""

    layout: ts.StatePlacement
    checkpointer: checkpoint_lib.Checkpointer
    fast: tiers.FastTier
    target: Any  # the abstract state with its shardings: what a restore (or a roll-back) reads onto
    state: State
    restored: bool
    from_fast: bool  # restored from the fast tier

    @property
    def step(self) -> int:
        return int(self.state['step'])


def _state(c: ml_collections.ConfigDict, workdir: str, mesh: jax.sharding.Mesh,
           closing: contextlib.ExitStack) -> _Start:
    """The state, built abstractly, then restored from the newest checkpoint or materialised sharded."""
    layout = ts.make_placement(c, mesh)
    sched = layout.pipeline_schedule
    if sched is not None:
        _log(f'pipeline: {sched.name}, P={sched.num_stages} stages x V={sched.virtual} chunks, '
             f'M={sched.num_micro} micro-batches, {sched.num_ticks} ticks, bubble {sched.bubble:.1%}, '
             f'at most {sched.act_slots} stashed micro-batches per stage')
    checkpointer = checkpoint_lib.Checkpointer(c, workdir)  # the resolved config: saved whole, compared on restore
    closing.callback(checkpointer.close)
    # LoRA: the base each checkpoint tier records (a step over another base is refused; lora_base.py)
    base = checkpointer.base_record()['fingerprint'] if layout.lora else ''
    fast = tiers.FastTier(c.checkpoint, mesh, base)  # node-local every few steps, with a peer's copy (docs/checkpoints.md)
    closing.callback(fast.close)
    target = target_lib.abstract_target(layout.abstract_state, layout.state_shardings)
    fast_restored = fast.restore(target, checkpointer.latest_step(), checkpointer.health_ledger.unhealthy)  # only when newer than the persistent tier's
    if fast_restored:  # LoRA: its frozen base read again (the tiers hold the adapters alone)
        fast_restored = (checkpointer.with_base(fast_restored[0], target, init_from.load_params), fast_restored[1])
    state, origin = fast_restored or checkpointer.restore_or_init(
        target, lambda: ts.init_train_state(c, layout, frozen=False), init_from.load_params)
    if not fast_restored:
        fast.discard_after(int(state['step']))  # steps of a timeline this run does not continue
    trained = params_lib.count_params(state['params'])
    what = (f'{trained:,} trained (LoRA adapters) over {params_lib.count_params(state[FROZEN]):,} frozen'
            if layout.lora else f'{trained:,}')
    _log(f'state: {what} parameters in float32, computing in {c.model.dtype} (model.dtype), remat {c.model.remat}; '
         f'zero1={c.sharding.zero1}; {origin}')
    return _Start(layout, checkpointer, fast, target, state, origin.startswith('restored'), bool(fast_restored))


def write_resolved_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        files.write_atomic(os.path.join(workdir, 'config.json'), c.to_json_best_effort(indent=2, sort_keys=True))


def _nothing_ran(c: ml_collections.ConfigDict, step: int) -> dict[str, float]:
    """The checkpoint restored is at train.steps or beyond: said so instead of `done: {}`."""
    message = (f'nothing ran: the checkpoint restored is at step {step} and train.steps = {c.train.steps}. '
               f'To train further, raise --config.train.steps above {step}.')
    if jax.process_index() == 0:
        print(message, flush=True)
    return {'restored_step': step, 'steps_run': 0}


def _wandb_sinks(c: ml_collections.ConfigDict, workdir: str, handlers: contextlib.ExitStack,
                 phase: report.PhaseTimer) -> tuple[wandb_log.WandbSink, ...]:
    """The W&B run of this workdir (process 0), finished when the run ends (as failed on an exception)."""
    if not wandb_log.enabled(c.train):
        return ()
    sinks = ()
    if jax.process_index() == 0:
        sink = wandb_log.WandbSink(c.train, workdir, json.loads(c.to_json_best_effort()))
        handlers.push(lambda kind, value, tb: sink.close(failed=kind is not None))
        sinks = (sink,)
    phase.done('wandb')
    return sinks


@dataclasses.dataclass(frozen=True)
class _Steps:
    """The compiled steps and how a global batch is sharded."""

    train: Any
    eval: Any
    batch_sharding: Any
    compile_s: float


def _compile(c: ml_collections.ConfigDict, start: _Start, phase: report.PhaseTimer) -> _Steps:
    if c.train.objective == 'dpo':  # the reference: the start's parameters re-read, or LoRA's base (training/dpo.py)
        reference = None if start.layout.lora else init_from.load_params(c.checkpoint.init_params_from, c,
                                                                         start.target['params'])
        train_step, eval_step, batch_sharding = dpo.compile_steps(c, start.layout, reference)
    else:
        train_step, eval_step, batch_sharding = step_lib.compile_steps(c, start.layout)
    return _Steps(train_step, eval_step, batch_sharding, phase.done('compile'))


def _check_memory(c: ml_collections.ConfigDict, steps: _Steps, layout: ts.StatePlacement,
                  phase: report.PhaseTimer) -> dict[str, float]:
    """The compile's line with the step's memory, the start-up line; refuses a step that cannot fit."""
    memory = memory_check.summary(steps.train)
    _log(f'compile: {steps.compile_s:.1f} s; ' + ', '.join(f'{k} {v:.3f}' for k, v in memory.items()))
    _log(phase.summary())
    memory_check.check_fits(steps.train, c.train, layout.abstract_state, layout.state_shardings)
    return memory


def _services(c: ml_collections.ConfigDict, workdir: str, start: _Start, steps: _Steps, val_source: Any,
              sinks: tuple, ledger: goodput.Ledger, preemption: preemption_lib.PreemptionWatcher,
              first_row: dict[str, float], closing: contextlib.ExitStack) -> tuple[
                  after_step.AfterStep, stragglers.Watch, profile_lib.StepProfiler]:
    """What observes and steers the loop, each from its own config section; closed by `closing`."""
    t, process = c.train, jax.process_index()
    skips = None
    if spikes.enabled(c) and start.restored:
        skips = spikes.skips_in_meta(start.fast.restored_meta if start.from_fast else
                                     start.checkpointer.read_meta(start.step))
    suspect = moe_lib.divergence_suspect(c.model)  # a divergence's suspect before the learning rate, or ''
    guard = spikes.SpikeGuard(t, workdir, skips, suspect)  # loss spikes: skip, roll back (training/spikes.py)
    writer = metrics_lib.MetricsWriter(workdir, t.steps, enabled=process == 0, progress=t.progress,
                                       initial_step=start.step, sinks=sinks,
                                       moe_empty_warn_steps=t.moe_empty_warn_steps)
    closing.callback(writer.close)
    sched = start.layout.pipeline_schedule
    reporter = report.Reporter(t, writer, jax.device_count(), seq_len=c.model.seq_len, dtype=c.model.dtype,
                               flops=config_lib.flops_per_step(c),
                               bubble=None if sched is None else sched.bubble, first_row=first_row, suspect=suspect)
    watch = stragglers.Watch(t, workdir, ledger)
    reporter.extras = [ledger.metrics, watch.metrics]
    profiler = profile_lib.StepProfiler(t, workdir)
    closing.callback(profiler.close)
    # A stuck step ends the process with its stacks on disk (exit 5, run/control/watchdog.py).
    watchdog = watchdog_lib.Watchdog(t, workdir, process)
    closing.callback(watchdog.stop)
    evaluate = functools.partial(dpo.evaluate if c.train.objective == 'dpo' else evaluation.evaluate, steps.eval,
                                 source=val_source,
                                 batch_sharding=steps.batch_sharding, eval_batches=t.eval_batches,
                                 global_batch=t.global_batch, packing=packing_lib.from_config(c))
    after = after_step.AfterStep(t.steps, t.eval_every, start.checkpointer, start.fast, guard, start.target,
                                 _CommitLog(start.checkpointer), preemption, watchdog, ledger, writer, reporter,
                                 evaluate)
    return after, watch, profiler


class _CommitLog:
    """Logs `checkpoint: step N committed` once a started save is known to be on disk.

    Known: Orbax reports no save in progress (asked after every step: a host-side flag, no
    sync), the next save starts (Orbax waits for the previous one first), or the final wait.
    """

    def __init__(self, checkpointer: checkpoint_lib.Checkpointer):
        self.checkpointer, self.pending, self.gib = checkpointer, None, None

    def started(self, step: int, state: State) -> None:
        self.poll(committed=True)
        if self.gib is None:
            self.gib = checkpoint_lib.describe_arrays(persistent(state))[1]
        self.pending = (step, time.perf_counter())

    def poll(self, committed: bool = False) -> None:
        if self.pending is None:
            return
        if not committed and self.checkpointer.saving():
            return
        step, t0 = self.pending
        self.pending = None
        _log(f'checkpoint: step {step} committed, {self.gib:.3f} GiB, {time.perf_counter() - t0:.1f} s after '
             'its save started')


def _done(c: ml_collections.ConfigDict, after: after_step.AfterStep, memory: dict[str, float], done: int,
          saved: bool, newest: int | None, stop: bool) -> dict[str, float]:
    """The run's record (the last row's figures, the memory, the final goodput) and its closing lines."""
    record = {**after.reporter.last_record, **memory, **memory_check.measured_peak(jax.local_devices())}
    final = after.ledger.metrics(finished=True)  # goodput.json; the summary of the W&B run
    after.writer.summary(final)
    record.update(final)  # the last row's figures, now with the final save's
    _log(after.ledger.summary())
    if not saved:
        record['spike_open_at_step'] = done
        _log(f'no checkpoint of step {done}: a loss spike is open (a step skipped within the last '
             f'{c.train.spike_window}); the newest checkpoint is step {newest}, rerunning '
             'the same command resumes from it')
    if stop:
        record['preempted_at_step'] = done
        received = after.preemption.received
        if jax.process_index() == 0 and saved:
            print(after.checkpointer.stop_message(done, received), flush=True)
        elif jax.process_index() == 0:
            print(f'preempted by {received} after step {done} inside a loss spike: no checkpoint '
                  f'saved after step {newest}; rerun the same command to resume.', flush=True)
    # Six significant digits, not four decimals: a final learning rate of 1e-5 is not 0.0 (issue 39).
    _log('done: ' + json.dumps({k: float(f'{v:.6g}') if isinstance(v, float) else v for k, v in record.items()}))
    return record
