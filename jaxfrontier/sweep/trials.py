"""One trial of a sweep: its identity, its process, what it measured or why it failed; the results file.

A trial is `python -m jaxfrontier.main` with the point's `--config.*` overrides, in its own
process (under Slurm, its own `srun` step), writing to `<sweep workdir>/trials/<id>/`. The
parent reads the trial's `metrics.jsonl` and log afterwards:

  * every step is logged (`train.log_every=1`); the logged step time of step s is the wall
    time between fetching step s-1's and step s's metrics, so the mean over the measured
    steps W+1 .. W+N is (fetch(W+N) - fetch(W)) / N, whatever the per-step jitter;
  * the run has two steps more than W + N: the final evaluation is dispatched during the
    last step and would otherwise fall into the measured interval;
  * compile time and the compiled peak memory per device (XLA's memory analysis of the train
    step) come from metrics.jsonl when the trainer writes them there, else from its log lines
    `compile: X s` and `done: {...}`.

Failure categories (`status`): `invalid` (the layout breaks a config rule: found before
launching, or the trial exited 2), `skipped_plan` (the planner predicts it does not fit),
`skipped_verify` (`--verify`: its layout does not compute what one device computes),
`oom` (the log reports an allocation failure), `timeout`, `crashed` (any other non-zero exit
or signal, or no measured steps), with the last lines of the log as the error.

Results are JSON lines in `<workdir>/results.jsonl`, one per finished trial, keyed by a
stable id (a hash of everything that decides the measurement), appended by the one parent
process with a single write each; a rerun skips ids already there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import time
from typing import Any, Sequence

STATUSES = ('ok', 'invalid', 'skipped_plan', 'skipped_verify', 'oom', 'crashed', 'timeout')
FAILED = ('oom', 'crashed', 'timeout')
RAN = ('ok',) + FAILED  # statuses of trials whose process ran
EXTRA_STEPS = 2  # after the measured ones: the final evaluation falls there
PERF_KEYS = {  # record field -> metrics.jsonl key
    'tokens_per_s': 'perf/tokens_per_s',
    'tokens_per_s_per_device': 'perf/tokens_per_s_per_device',
    'tflops_per_device': 'perf/model_tflops_per_device',
    'mfu': 'perf/mfu',
    'hw_tflops_per_device': 'perf/megatron_hw_tflops_per_device',
}
_OOM = re.compile(r'RESOURCE_EXHAUSTED|[Oo]ut of memory|OutOfMemory|OOM when allocating|hipErrorOutOfMemory|'
                  r'CUDA_ERROR_OUT_OF_MEMORY|Cannot allocate memory')
_COMPILE = re.compile(r'compile: ([0-9.]+) s')
_ABSL_INFO = re.compile(r'^I\d{4} ')


@dataclasses.dataclass(frozen=True)
class Trial:
    """A point of a sweep, ready to run."""

    trial_id: str
    point: dict[str, Any]  # the swept values
    devices: int
    args: tuple[str, ...]  # --config.* overrides of this trial, after the sweep's own
    layout: dict[str, Any]  # sweep_space.layout_of
    plan: dict[str, Any] = dataclasses.field(default_factory=dict)  # the planner's prediction, if any
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the trial's whole config (calibration reads it)


def trial_id(config_spec: str, args: Sequence[str], devices: int, measure: tuple[int, int]) -> str:
    """A stable id of everything that decides a trial's measurement."""
    key = json.dumps({'config': config_spec, 'args': sorted(args), 'devices': devices, 'measure': list(measure)})
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def machine() -> str:
    """Where trials run, as results files name it (calibration refuses to mix machines)."""
    cluster = os.environ.get('SLURM_CLUSTER_NAME', '')
    return (f'{cluster}: ' if cluster else '') + f'{platform.system()} {platform.machine()}, {os.cpu_count()} cores'


def base_record(trial: Trial, status: str, **fields: Any) -> dict[str, Any]:
    return {'trial_id': trial.trial_id, 'status': status, 'point': trial.point, 'devices': trial.devices,
            **trial.layout, **{f'plan_{k}': v for k, v in trial.plan.items()}, 'args': list(trial.args),
            'finished_at': time.strftime('%Y-%m-%dT%H:%M:%S'), 'machine': machine(),
            **({'config': trial.config} if trial.config else {}), **fields}


# --------------------------------------------------------------------------- results file


def is_record(record: Any) -> bool:
    """A trial record as ResultStore.append writes one: an object with a string trial_id and status."""
    return isinstance(record, dict) and isinstance(record.get('trial_id'), str) and isinstance(record.get('status'), str)


class ResultStore:
    """`results.jsonl`: one record per finished trial; the newest record of an id wins."""

    def __init__(self, path: str):
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        if os.path.exists(path):
            with open(path, encoding='utf-8', errors='replace') as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, RecursionError):  # a line cut by a killed parent: that trial reruns
                        continue
                    if is_record(record):  # else damaged (or edited): that trial reruns too
                        self.records[record['trial_id']] = record

    def finished(self, tid: str, retry_failed: bool = False) -> dict[str, Any] | None:
        record = self.records.get(tid)
        return None if record is None or (retry_failed and record['status'] in FAILED) else record

    def append(self, record: dict[str, Any]) -> None:
        """One `write` of one line to a file opened for appending: never a half-merged record."""
        line = (json.dumps(record, allow_nan=False, default=str) + '\n').encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records[record['trial_id']] = record


# --------------------------------------------------------------------------- the process


class TrialProcess:
    """A running trial: its own process group, output to `<trial dir>/log.txt`, a deadline."""

    def __init__(self, trial: Trial, command: list[str], env: dict[str, str], trial_dir: str, timeout_s: float):
        self.trial, self.command, self.trial_dir = trial, command, trial_dir
        self.log_path = os.path.join(trial_dir, 'log.txt')
        self.started, self.start_time = time.monotonic(), time.time()
        self.deadline = self.started + timeout_s
        self.timed_out = False
        with open(self.log_path, 'w', encoding='utf-8') as log:
            log.write('$ ' + ' '.join(command) + '\n')
            log.flush()
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> int | None:
        """The exit status once the process has ended; kills it at its deadline."""
        rc = self.proc.poll()
        if rc is None and time.monotonic() > self.deadline and not self.timed_out:
            self.timed_out = True
            self.stop()
            rc = self.proc.poll()
        return rc

    def stop(self) -> None:
        """SIGTERM to the trial's process group (srun passes it to the tasks), SIGKILL after 20 s."""
        for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait_s)
                return

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.started


def _log_tail(text: str, lines: int = 12) -> str:
    """The last lines of a log that are not INFO lines (the error and its traceback)."""
    kept = [l for l in text.splitlines() if l.strip() and not _ABSL_INFO.match(l) and not l.startswith('$ ')]
    return '\n'.join(kept[-lines:])


def classify(rc: int, timed_out: bool, log_text: str, timeout_s: float) -> tuple[str, str]:
    """(status, error) of a trial process that ended without a measurement."""
    if timed_out:
        return 'timeout', f'stopped after the trial timeout of {timeout_s:g} s'
    if rc != 0 and _OOM.search(log_text):
        line = next(l for l in log_text.splitlines() if _OOM.search(l))
        return 'oom', line.strip()[:500]
    errors = [l for l in log_text.splitlines() if l.startswith('error: ')]
    if rc == 2 and errors:
        return 'invalid', errors[-1][len('error: '):]
    if rc < 0:
        how = f'killed by {signal.Signals(-rc).name}'
    elif rc > 128 and rc - 128 in signal.Signals._value2member_map_:  # a shell or srun reporting a signal
        how = f'exit status {rc} ({signal.Signals(rc - 128).name})'
    else:
        how = f'exit status {rc}'
    tail = _log_tail(log_text)
    if not tail:
        return 'crashed', how
    return 'crashed', f'{how}: {tail.splitlines()[-1]}\n{tail}'  # the exception first, then the traceback


def read_metrics(trial_dir: str) -> list[dict[str, Any]]:
    path = os.path.join(trial_dir, 'metrics.jsonl')
    if not os.path.exists(path):
        return []
    with open(path, encoding='utf-8') as f:
        return [json.loads(line) for line in f if line.strip()]


def measure(rows: list[dict[str, Any]], log_text: str, warmup: int, steps: int) -> dict[str, Any]:
    """Throughput over the measured steps, compile time and memory, from a trial's outputs.

    Raises:
      ValueError: fewer than `steps` measured steps were logged.
    """
    measured = [r for r in rows if warmup < r.get('step', 0) <= warmup + steps and r.get('perf/step_time_s')]
    if len(measured) != steps:
        raise ValueError(f'{len(measured)} of the {steps} measured steps (after {warmup} warm-up) are in '
                         'metrics.jsonl')
    times = [r['perf/step_time_s'] for r in measured]
    step_time = sum(times) / steps
    out: dict[str, Any] = {'step_time_s': step_time, 'step_time_min_s': min(times), 'step_time_max_s': max(times),
                           'step_time_median_s': statistics.median(times)}
    for field, key in PERF_KEYS.items():  # each is (a constant per step) / step time: rescale to the mean
        values = [r.get(key) for r in measured]
        out[field] = None if None in values else sum(v * t for v, t in zip(values, times)) / steps / step_time
    out['loss'] = measured[-1].get('train/loss')
    extra = {k: v for r in rows for k, v in r.items() if k.startswith(('compile/', 'memory/'))}
    done = _done_record(log_text)
    compile_s = extra.get('compile/time_s')
    if compile_s is None:
        found = _COMPILE.findall(log_text)
        compile_s = float(found[-1]) if found else None
    out['compile_time_s'] = compile_s
    out['peak_memory_gib'] = extra.get('memory/peak_gib_per_device', done.get('memory/peak_gib_per_device'))
    measured_peak = extra.get('memory/measured_peak_gib_per_device', done.get('memory/measured_peak_gib_per_device'))
    if measured_peak is not None:  # the allocator's peak, where the trainer reports it (accelerators)
        out['measured_peak_memory_gib'] = measured_peak
    return out


def _done_record(log_text: str) -> dict[str, Any]:
    for line in reversed(log_text.splitlines()):
        if 'done: {' in line:
            try:
                return json.loads(line.split('done: ', 1)[1])
            except json.JSONDecodeError:
                return {}
    return {}


def finish(tp: TrialProcess, rc: int, warmup: int, steps: int, timeout_s: float) -> dict[str, Any]:
    """The record of an ended trial process."""
    with open(tp.log_path, encoding='utf-8', errors='replace') as f:
        log_text = f.read()
    sweep_dir = os.path.dirname(os.path.dirname(tp.trial_dir))  # <workdir>/trials/<id>
    fields = {'returncode': rc, 'start_time': tp.start_time, 'wall_s': tp.wall_s,
              'log': os.path.relpath(tp.log_path, sweep_dir)}
    if rc == 0 and not tp.timed_out:
        try:
            return base_record(tp.trial, 'ok', **measure(read_metrics(tp.trial_dir), log_text, warmup, steps),
                               **fields)
        except ValueError as e:
            return base_record(tp.trial, 'crashed', error=f'exit status 0 but {e}', **fields)
    status, error = classify(rc, tp.timed_out, log_text, timeout_s)
    return base_record(tp.trial, status, error=error, **fields)


def objective(record: dict[str, Any], key: str) -> float | None:
    """The record's value of `key` if it ran and measured it, else None."""
    value = record.get(key) if record.get('status') == 'ok' else None
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
