"""The training loop `train_and_evaluate(config, workdir)`.

It reads top to bottom: validate -> mesh -> data -> state -> compile -> loop -> final
evaluation. The steps it runs are built in step.py (pure functions, jitted once with donated
state and explicit shardings); this module owns what touches the workdir and the clock: the
lock, checkpoints, metrics, profiling, preemption.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax
import ml_collections

from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.checkpoint import manager as checkpoint_lib
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.checkpoint.fast import tiers
from jaxfrontier.run.control import preemption as preemption_lib
from jaxfrontier.run.control import disk
from jaxfrontier.training import evaluation
from jaxfrontier.run.observe import goodput
from jaxfrontier.run.control import interrupt
from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import files
from jaxfrontier import logs
from jaxfrontier.data import loader as data_lib
from jaxfrontier.errors import NonFiniteLossError
from jaxfrontier.model import registry as model_registry
from jaxfrontier import hardware
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.run.observe import memory_check
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.run.observe import profile as profile_lib
from jaxfrontier.training import spikes
from jaxfrontier.run.observe import stragglers
from jaxfrontier.training import state as ts
from jaxfrontier.run import validation
from jaxfrontier.run.control import watchdog as watchdog_lib
from jaxfrontier.run.observe import wandb_log
from jaxfrontier.run.control import workdir_lock
from jaxfrontier.model import params as params_lib

State = dict[str, Any]
_log = logs.process0(__name__).info  # process 0 only; lines name this module
_warn = logs.process0(__name__).warning


def _memory_summary(compiled) -> dict[str, float]:
    mem = step_lib.memory_bytes(compiled)
    if not mem:
        return {}
    return {'memory/peak_gib_per_device': mem['total'] / 2**30, 'memory/temp_gib_per_device': mem['temporaries'] / 2**30}


class _Reporter:
    """Turns fetched step metrics into log records: perf numbers, NaN check, writer output.

    A row's step time is the time between seeing two steps finished (their metrics fetched),
    divided by the steps between them; the first row after start-up or a restore only starts
    the clock. That holds only if nothing else waited for the newer step before: the loop
    reports a step right after dispatching the next one, before a save or an evaluation syncs.
    """

    def __init__(self, c: ml_collections.ConfigDict, writer: metrics_lib.MetricsWriter, n_devices: int,
                 pipeline_schedule=None, first_row: dict[str, float] | None = None):
        self.c, self.writer, self.n_devices = c, writer, n_devices
        self.first_row = dict(first_row or {})  # written once, with the first record: compile time, memory
        self.model_flops, self.hw_flops = model_registry.flops_per_step_from_config(c)
        self.peak, self.peak_source = hardware.device_peak_flops(jax.devices()[0], c.model.dtype)
        if jax.devices()[0].platform == 'cpu':  # said once: the MFU of every step line rests on it
            _log(f'MFU: against {self.peak / 1e12:.3f} TFLOP/s per device ({self.peak_source}), a rate this '
                 'machine reaches rather than a datasheet peak: it reads high beside a GPU\'s; compare CPU runs '
                 'by tokens/s')
        self.tokens_per_step = c.train.global_batch * c.model.seq_len
        self.constants = {'pipeline/bubble': pipeline_schedule.bubble} if pipeline_schedule is not None else {}
        self.last_time, self.last_step, self.last_record = None, None, {}
        self.extras = []  # callables adding to every written row (goodput, stragglers)

    def report(self, step: int, metrics: dict[str, jax.Array], evals: dict[str, jax.Array] | None,
               last: bool = False) -> dict[str, float]:
        """`evals`: the step's evaluation (evaluation.evaluate), logged in one line. `last`: the run's final
        step (its end, or a preemption's): always written, so the `done:` line and metrics.jsonl end at the
        step the final checkpoint holds. A step skipped as a loss spike (training/spikes.py) is always
        written, and its non-finite loss does not stop the run (its update was not applied). Returns the
        step's fetched metrics."""
        scalars = metrics_lib.host_values(jax.device_get(metrics))  # the layers' aux as lists
        # A spike limit is infinite until train.spike_warmup steps were seen: not written before.
        scalars = {k: v for k, v in scalars.items() if not (k.startswith('spike/') and v == float('inf'))}
        now = time.perf_counter()
        skipped = scalars.get('spike/skipped', 0.0) > 0
        if not skipped:
            metrics_lib.check_finite(step, scalars['train/loss'])
        self.writer.advance(step)
        due = (last or step % self.c.train.log_every == 0 or step == self.c.train.steps
               or evals is not None or skipped)
        if self.last_time is None:  # the first step's time includes start-up: not a rate
            self.last_time, self.last_step = now, step
        elif due:
            step_time = (now - self.last_time) / (step - self.last_step)
            scalars.update(self.constants)
            scalars.update(metrics_lib.perf_metrics(step_time, self.tokens_per_step, self.n_devices,
                                                    self.model_flops, self.hw_flops, self.peak))
            self.last_time, self.last_step = now, step
        if evals is not None:
            scalars.update({k: float(v) for k, v in jax.device_get(evals).items()})
            _log(evaluation.eval_line(step, scalars))
        if due:
            scalars.update(self.first_row)
            self.first_row = {}
            for extra in self.extras:
                scalars.update(extra())
            self.writer.write(step, scalars)
            self.last_record = {'step': step, **scalars}
        return scalars


class _PhaseTimer:
    """Seconds of each start-up phase (those `main` timed before the loop, then the loop's own)."""

    def __init__(self, before: dict[str, float]):
        self.phases, self.last = dict(before), time.perf_counter()

    def done(self, name: str) -> float:
        """Ends phase `name` now; returns its seconds."""
        now = time.perf_counter()
        self.phases[name], self.last = now - self.last, now
        return self.phases[name]

    def summary(self) -> str:
        return (f'start-up: {sum(self.phases.values()):.1f} s before the first step: '
                + ', '.join(f'{k} {v:.1f} s' for k, v in self.phases.items()))

    def metrics(self) -> dict[str, float]:
        return {f'startup/{k}_s': v for k, v in self.phases.items()}


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
            self.gib = checkpoint_lib.describe_arrays(state)[1]
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


def _observe(guard: spikes.SpikeGuard, pending: tuple, seen: dict[str, float]) -> None:
    """Tells the spike guard the reported step's decision (`pending`: (its count of steps done, ...))."""
    guard.observe(pending[0] - 1, seen.get('spike/skipped', 0.0) > 0, seen)


def _roll_back(guard: spikes.SpikeGuard, checkpointer, fast, target, writer, reporter) -> tuple[State, int]:
    """Back to the checkpoint before persistent spikes (guard.roll_back), logged as one metrics row."""
    state, back_to, skip = guard.roll_back(checkpointer, target)
    fast.discard_after(back_to)  # the fast tier's newer steps hold the data the roll-back skips
    writer.write(skip.spike_steps[-1], {'spike/rollback': len(guard.record.skips), 'spike/rollback_to': back_to,
                                        'data/skip_from': skip.data_from, 'data/skip_to': skip.data_to})
    writer.rewound(back_to)
    reporter.last_time = None  # the next row only restarts the step clock
    return state, back_to


def _wandb_sink(c: ml_collections.ConfigDict, workdir: str, handlers: contextlib.ExitStack) -> wandb_log.WandbSink:
    """The W&B run of this workdir (process 0), finished when the run ends (as failed on an exception)."""
    sink = wandb_log.WandbSink(c, workdir)
    handlers.push(lambda kind, value, tb: sink.close(failed=kind is not None))
    return sink


def write_resolved_config(c: ml_collections.ConfigDict, workdir: str) -> None:
    if jax.process_index() == 0:
        files.write_atomic(os.path.join(workdir, 'config.json'), c.to_json_best_effort(indent=2, sort_keys=True))


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str, *, validated: bool = False,
                       startup: dict[str, float] | None = None, started: float | None = None) -> dict[str, float]:
    """Trains `c` on all devices, writing metrics to `workdir`; returns the last log record.

    `validated`: `validation.validate_run(c)` already ran (main does, before JAX starts); otherwise it
    runs here. `startup`: seconds of the phases before this call (main times flags, imports,
    distributed init and the preflight), logged with the loop's own in one `start-up:` line and
    written with the first metrics row (`startup/<phase>_s`). `started`: the process's start on
    `time.perf_counter` (main's), where goodput's wall time begins (run/observe/goodput.py; None: this
    call). The run holds
    `<workdir>/workdir.lock` from before its first write to the end
    (run/control/workdir_lock.py): a second run on the same workdir refuses to start.
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
    phase = _PhaseTimer(startup)
    # 1. validate everything before writing or compiling anything
    if validated:
        config_lib.check_device_count(c, jax.device_count())
    else:
        validation.validate_run(c, jax.device_count())
    # Preemption signals and Ctrl-C are handled from here, not from the first step: one that arrives
    # while the run starts (mesh, data, restore, compile: minutes for a large model) stops it after
    # its first step with a committed checkpoint, like one that arrives later (was: SIGTERM swallowed
    # by JAX's notifier with several processes, Ctrl-C a KeyboardInterrupt traceback).
    preemption = handlers.enter_context(preemption_lib.PreemptionWatcher(c.checkpoint))
    handlers.enter_context(interrupt.first_interrupt_stops(preemption))
    checkpoint_lib.ensure_writable(workdir, f'--workdir={workdir!r}')
    locks.append(workdir_lock.acquire_for_job(workdir, c.train.workdir_lease_s))

    # 2. mesh
    mesh = mesh_lib.mesh_from_config(c)
    _log(f'mesh: {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} devices '
         f'({jax.process_count()} process(es))')
    phase.done('lock_and_mesh')

    # 3. data
    train_source, val_source = data_lib.make_datasets(c, workdir)
    _log(f'data: train {train_source.describe()}; validation {val_source.describe()}')
    tail_warning = data_lib.tail_split_warning(c)
    if tail_warning:
        _warn(f'warning: {tail_warning}')
    phase.done('data')

    # 4. state, built abstractly, then restored from the newest checkpoint or materialised sharded
    layout = ts.make_placement(c, mesh)
    sched = layout.pipeline_schedule
    if sched is not None:
        _log(f'pipeline: {sched.name}, P={sched.num_stages} stages x V={sched.virtual} chunks, '
             f'M={sched.num_micro} micro-batches, {sched.num_ticks} ticks, bubble {sched.bubble:.1%}, '
             f'at most {sched.act_slots} stashed micro-batches per stage')
    checkpointer = checkpoint_lib.Checkpointer(c, workdir)
    fast = tiers.FastTier(c, mesh)  # node-local every few steps, with a peer's copy (docs/checkpoints.md)
    target = target_lib.abstract_target(layout.abstract_state, layout.state_shardings)
    fast_restored = fast.restore(target, checkpointer.latest_step())  # only when newer than the persistent tier's
    state, origin = fast_restored or checkpointer.restore_or_init(
        target, lambda: ts.init_train_state(c, layout), init_from.load_params)
    if not fast_restored:
        fast.discard_after(int(state['step']))  # steps of a timeline this run does not continue
    _log(f'state: {params_lib.count_params(state["params"]):,} parameters; zero1={c.sharding.zero1}; {origin}')
    phase.done('restore' if origin.startswith('restored') else 'init')
    write_resolved_config(c, workdir)  # only now: a refused resume leaves the old config.json
    if int(state['step']) >= c.train.steps:  # nothing to do: say so instead of `done: {}`
        fast.close()
        checkpointer.close()
        message = (f'nothing ran: the checkpoint restored is at step {int(state["step"])} and train.steps = '
                   f'{c.train.steps}. To train further, raise --config.train.steps above {int(state["step"])}.')
        if jax.process_index() == 0:
            print(message, flush=True)
        return {'restored_step': int(state['step']), 'steps_run': 0}
    sinks = ()
    if wandb_log.enabled(c):
        sinks = (_wandb_sink(c, workdir, handlers),) if jax.process_index() == 0 else ()
        phase.done('wandb')

    # 5. compile
    train_step, eval_step, batch_sharding = step_lib.compile_steps(c, layout)
    compile_s = phase.done('compile')
    ledger = goodput.Ledger(workdir, started, write=jax.process_index() == 0)  # start-up until the first step
    ledger.phases(phase.phases)
    memory = _memory_summary(train_step)
    _log(f'compile: {compile_s:.1f} s; ' + ', '.join(f'{k} {v:.3f}' for k, v in memory.items()))
    _log(phase.summary())
    memory_check.check_fits(train_step, c, layout.abstract_state, layout.state_shardings)

    # 6. loop: dispatch step s, then fetch step s-1's metrics while step s runs; save every N
    done = int(state['step'])
    restored_skips = (spikes.skips_in_meta(fast.restored_meta if fast_restored else checkpointer.read_meta(done))
                      if spikes.enabled(c) and origin.startswith('restored') else None)
    guard = spikes.SpikeGuard(c, workdir, restored_skips)  # loss spikes: skip, roll back (training/spikes.py)
    writer = metrics_lib.MetricsWriter(workdir, c.train.steps, enabled=jax.process_index() == 0,
                                       progress=c.train.progress, initial_step=done, sinks=sinks)
    reporter = _Reporter(c, writer, jax.device_count(), layout.pipeline_schedule,
                         first_row={'compile/time_s': compile_s, **memory, **phase.metrics()})
    watch = stragglers.Watch(c, workdir, ledger)
    reporter.extras = [ledger.metrics, watch.metrics]
    profiler = profile_lib.StepProfiler(c, workdir)
    pending, stop, step_metrics, final_saved, newest = None, False, None, True, None
    commits = _CommitLog(checkpointer)
    # A stuck step ends the process with its stacks on disk (exit 5, run/control/watchdog.py).
    watchdog = watchdog_lib.Watchdog(c, workdir, jax.process_index())
    try:
        # Goodput (run/observe/goodput.py): the loop is step time, but for its waits for a save or an
        # evaluation; those wait for the step first, as step time, so their spans hold only their own.
        with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules), ledger.span('step'):
            step = done
            while step < c.train.steps:
                ledger.step(step + 1)
                data_step = guard.data_step(step)  # the step itself unless loss spikes made it skip data
                batch = data_lib.make_global_batch(train_source, data_step, batch_sharding, c.train.global_batch)
                with profiler.step(step), ledger.span('wait'):  # a full device queue holds the dispatch back
                    state, step_metrics = train_step(state, batch)
                # The previous step's metrics, fetched first while this step runs: the reporter's clock
                # reads when that step is seen finished. After a save (which waits for this step) the
                # next fetch would return at once, and the step time of one row would be that gap.
                if pending is not None:
                    with ledger.span('wait'):
                        jax.block_until_ready(pending[1])
                    _observe(guard, pending, reporter.report(*pending))
                    watchdog.beat(pending[0])
                step_metrics = {**step_metrics, **train_source.epochs(data_step, c.train.global_batch)}
                if guard.on:
                    step_metrics['data/step'] = data_step
                done = step + 1
                profiler.after(done, step_metrics)
                # No save while a loss spike is open; the last step's flag is always fetched, so a
                # roll-back it calls for is made before the run ends.
                due = checkpointer.due(done) or fast.due(done) or done == c.train.steps
                save, forced = guard.save_decision(step, due, lambda: step_metrics['spike/skipped'])
                if guard.rollback_due():  # the step in flight is dropped with the state it came from
                    watchdog.relax()  # the interval now running holds the saves' wait and the restore
                    with ledger.span('checkpoint'):
                        commits.poll(committed=True)
                        state, step = _roll_back(guard, checkpointer, fast, target, writer, reporter)
                        commits.poll(committed=True)
                    pending = None
                    continue
                # Before the next step is dispatched (it donates `state`); a non-finite step is not saved.
                if save:
                    watchdog.relax()  # Orbax first waits for the previous save's commit: a slow file system, not a hang
                    with ledger.span('sync'):
                        jax.block_until_ready(state)
                    with ledger.span('checkpoint'):
                        saved = checkpointer.save(done, state, force=forced, metrics=step_metrics,
                                                  data_skips=guard.record and guard.record.as_json())
                        fast.save(done, state, step_metrics, guard.record and guard.record.as_json())
                    if saved:
                        commits.started(done, state)
                commits.poll()
                with ledger.span('wait'):  # with several processes a barrier: waiting for the others
                    stop = preemption.should_stop(done) and done < c.train.steps
                eval_due = done == c.train.steps or (c.train.eval_every and done % c.train.eval_every == 0)
                evals = None
                if eval_due and not stop:
                    with ledger.span('sync'):
                        jax.block_until_ready(step_metrics)
                    watchdog.relax()  # the interval now running holds the evaluation
                    with ledger.span('eval'):
                        evals = jax.block_until_ready(
                            evaluation.evaluate(eval_step, state['params'], val_source, c, batch_sharding))
                watch.tick(done)
                pending = (done, step_metrics, evals)
                step = done
                if stop:
                    break
            watchdog.relax()  # the last result and the final save, waited for until committed
            if pending is not None:
                with ledger.span('wait'):
                    jax.block_until_ready(pending[1])
                _observe(guard, pending, reporter.report(*pending, last=True))
            watch.finish()
            # 7. final save (end of training or preemption), waited for until committed; none inside a spike
            final_saved = not guard.is_open(done - 1)
            with ledger.span('checkpoint'):
                if final_saved and checkpointer.save(done, state, force=True, metrics=step_metrics,
                                                     data_skips=guard.record and guard.record.as_json()):
                    commits.started(done, state)
                checkpointer.wait()
                commits.poll(committed=True)
            newest = checkpointer.latest_step()
    except NonFiniteLossError as e:  # seen one step late: name the checkpoint to resume from
        raise checkpointer.with_resume_hint(e) from None
    finally:
        watchdog.stop()
        profiler.close()
        writer.close()
        fast.close()
        checkpointer.close()
    peaks = [hardware.memory_stats(d).get('peak_bytes_in_use') for d in jax.local_devices()]
    if any(p is not None for p in peaks):  # accelerators: the allocator's measured peak
        memory['memory/measured_peak_gib_per_device'] = max(p for p in peaks if p is not None) / 2**30
    record = {**reporter.last_record, **memory}
    final = ledger.metrics(finished=True)  # goodput.json; the summary of the W&B run
    writer.summary(final)
    record.update(final)  # the last row's figures, now with the final save's
    _log(ledger.summary())
    if not final_saved:
        record['spike_open_at_step'] = done
        _log(f'no checkpoint of step {done}: a loss spike is open (a step skipped within the last '
             f'{c.train.spike_window}); the newest checkpoint is step {newest}, rerunning '
             'the same command resumes from it')
    if stop:
        record['preempted_at_step'] = done
        if jax.process_index() == 0 and final_saved:
            print(checkpointer.stop_message(done, preemption.received), flush=True)
        elif jax.process_index() == 0:
            print(f'preempted by {preemption.received} after step {done} inside a loss spike: no checkpoint '
                  f'saved after step {newest}; rerun the same command to resume.', flush=True)
    _log('done: ' + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))
    return record
