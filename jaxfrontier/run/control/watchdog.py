"""Hang detection: a thread in every process that ends a stalled run with its stacks on disk and exit 5.

A collective that never returns (a peer stuck in a driver call, a lost message, a deadlock)
leaves every process waiting on the device with no error: without this the job burns its
allocation until the time limit. JAX's heartbeats only catch a process that is gone, not one
that is alive and stuck.

The loop calls `beat(step)` each time it sees a step's result (the host-side wait for that
step's metrics returned). The thread compares the time since the last beat with a limit:

- after `WARMUP_STEPS` measured steps: `train.hang_factor` x the median of the recent step
  intervals, at least `train.hang_min_s` (a save's device-to-host copy or a slow batch must not
  count as a hang), at most `train.hang_timeout_s`;
- before that (the first step, which pays for autotuning and the first collectives' set-up),
  and for an interval the loop marks as unusual (`relax`: a save, which first waits for the
  previous one's commit; an evaluation; a roll-back's restore; the final save):
  `train.hang_timeout_s`, the generous limit. With a checkpoint every step only the timeout
  applies.

Past the limit it writes `<workdir>/hang/<process>-<UTC time>.txt` (every Python thread's stack by
`faulthandler`, then the native stacks by `py-spy dump --native` or `gdb`, whichever is
installed, or a line saying neither is) and ends the process with `errors.HangError.exit_code`
(5), which the sbatch scripts' restart loop restarts from the newest checkpoint
(launch/restarts.sh). Every process has its own watchdog: all of them stall on a stuck
collective, so each writes its own stacks, unless Slurm ends it first.

`train.hang_timeout_s = 0` turns the watchdog off; `train.hang_factor = 0` keeps only the
timeout; `train.hang_native_stacks = False` skips the native stacks. The clock logic
(`StepClock`) takes the time as an argument, so tests drive it without waiting.

For tests only, `JAXFRONTIER_TEST_HANG=<dir>` injects faults at a beat (the process stalls
exactly where a stuck collective would leave it): a file `<dir>/hang-<process>-<step>` holding
`sleep`, `stop` or `kill` makes that process, on seeing step <step>'s result, rename it to
`hung-<process>-<step>` (with its pid) and sleep forever, stop itself (SIGSTOP) or kill itself
(SIGKILL). The rename makes each fault fire once per job, so a restart trains on. This is fault
injection for the test harness, not configuration; nothing else reads it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import datetime
import faulthandler
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

import ml_collections

from jaxfrontier import errors

HANG_DIR = 'hang'
WARMUP_STEPS = 3  # step intervals measured before the median is trusted
HISTORY = 101  # the median is over this many recent step intervals
POLL_S = 0.5  # how often the thread looks at the clock
NATIVE_TIMEOUT_S = 120.0  # gdb on a process with a large jaxlib can take a minute to attach and unwind
TEST_HANG_ENV = 'JAXFRONTIER_TEST_HANG'
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The watchdog's settings (config.train.hang_*); see the module docstring."""

    factor: float
    min_s: float
    timeout_s: float

    @classmethod
    def from_train(cls, t: ml_collections.ConfigDict) -> Limits:
        """From the run's `train` section."""
        return cls(float(t.hang_factor), float(t.hang_min_s), float(t.hang_timeout_s))

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


class StepClock:
    """When a stall is a hang: the intervals between step results and the limit they set.

    Times are arguments (seconds of a monotonic clock), so the rule is tested without waiting.
    The first interval (start to the first result) and any interval `relax`ed are judged by the
    timeout alone and not counted in the median.
    """

    def __init__(self, limits: Limits, now: float):
        self.limits = limits
        self.last_time, self.last_step = now, None
        self.relaxed = True
        self.intervals: collections.deque[float] = collections.deque(maxlen=HISTORY)

    def beat(self, step: int, now: float) -> None:
        """Step `step`'s result was seen at `now`."""
        if not self.relaxed:
            self.intervals.append(now - self.last_time)
        self.last_time, self.last_step, self.relaxed = now, step, False

    def relax(self) -> None:
        """The interval now running is unusual (an evaluation, a restore, the final save): timeout only."""
        self.relaxed = True

    def limit(self) -> tuple[float, str]:
        """(seconds, the rule that set them) for the interval now running."""
        lim = self.limits
        if self.relaxed or lim.factor <= 0 or len(self.intervals) < WARMUP_STEPS:
            return lim.timeout_s, f'train.hang_timeout_s={lim.timeout_s:g}'
        median = statistics.median(self.intervals)
        per_step = max(lim.min_s, lim.factor * median)
        if per_step >= lim.timeout_s:
            return lim.timeout_s, f'train.hang_timeout_s={lim.timeout_s:g}'
        rule = (f'train.hang_min_s={lim.min_s:g}' if per_step == lim.min_s else
                f'train.hang_factor={lim.factor:g} x the median step time {median:.3g} s')
        return per_step, rule

    def overdue(self, now: float) -> str | None:
        """The reason the interval now running is a hang, or None while it is within its limit."""
        seconds, rule = self.limit()
        waited = now - self.last_time
        if waited <= seconds:
            return None
        seen = 'no step result yet' if self.last_step is None else f'the last step result seen was step {self.last_step}'
        return f'no progress for {waited:.1f} s, over the limit of {seconds:.3g} s ({rule}); {seen}'


def native_stacks(pid: int, out: TextIO, timeout_s: float = NATIVE_TIMEOUT_S) -> None:
    """Appends every thread's native stack of process `pid` to `out` (a file), by py-spy or gdb.

    The tool writes straight to the file: this process may be the one it stops (gdb halts every
    thread of its target), so no thread here could drain a pipe (a full pipe deadlocked gdb) or
    enforce a timeout; `timeout -s KILL`, a process of its own, does.
    """
    if shutil.which('py-spy'):
        cmd = ['py-spy', 'dump', '--native', '--pid', str(pid)]
    elif shutil.which('gdb'):
        cmd = ['gdb', '-p', str(pid), '-batch', '-nx', '-iex', 'set debuginfod enabled off', '-ex',
               'set pagination off', '-ex', 'thread apply all bt']
    else:
        out.write('native stacks: neither py-spy nor gdb is installed (pip install py-spy to get them)\n')
        return
    if pid == os.getpid():  # Yama's ptrace_scope=1 lets only ancestors attach: allow our own child
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
    out.write(f'native stacks by {" ".join(cmd)}:\n')
    out.flush()
    code = subprocess.run(['timeout', '-s', 'KILL', f'{timeout_s:g}', *cmd], stdout=out,
                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False).returncode
    out.write(f'\n{cmd[0]} exited with status {code}' + (f' (killed after {timeout_s:g} s)' if code in (137, -9)
                                                         else '') + '\n')


def write_stacks(path: str, header: str, native: Callable[[int, TextIO], None] = native_stacks) -> None:
    """`header`, every Python thread's stack and the native stacks of this process, to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        f.write(header + '\n\nPython stacks (faulthandler, all threads):\n')
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.write('\n')
        f.flush()
        native(os.getpid(), f)


def _no_native_stacks(pid: int, out: TextIO) -> None:  # pylint: disable=unused-argument
    out.write('native stacks: not written (train.hang_native_stacks=False)\n')


def stacks_path(workdir: str, process: int, now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return os.path.join(workdir, HANG_DIR, f'{process}-{now.strftime("%Y%m%dT%H%M%S.%fZ")}.txt')


def _injected_hang(action: str) -> None:
    """Test fault injection (module docstring): the stack a hang dump shows for an injected stall."""
    if action == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == 'stop':
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        while True:
            time.sleep(3600)


def maybe_inject(directory: str | None, process: int, step: int) -> None:
    """Fires the test fault `<directory>/hang-<process>-<step>` once, if it exists (module docstring)."""
    if not directory:
        return
    path = os.path.join(directory, f'hang-{process}-{step}')
    try:
        with open(path, encoding='utf-8') as f:
            action = f.read().strip()
        os.rename(path, os.path.join(directory, f'hung-{process}-{step}'))
    except FileNotFoundError:
        return
    with open(os.path.join(directory, f'hung-{process}-{step}'), 'w', encoding='utf-8') as f:
        f.write(f'{os.getpid()}\n')
    sys.stderr.write(f'test fault injection: process {process} at step {step}: {action} (pid {os.getpid()})\n')
    sys.stderr.flush()
    _injected_hang(action)


class Watchdog:
    """The thread. `beat(step)` after each step result, `relax()` before an unusual interval, `stop()`.

    Args:
      t: the run's `train` section (hang_*).
      workdir: where `hang/` is written.
      process: this process's index (the stack file's name).
      on_hang: what ends the process (tests replace it); default: one line on stderr, exit 5.
      native: writes the native stacks of a pid to a file (tests replace it); default `native_stacks`.
    """

    def __init__(self, t: ml_collections.ConfigDict, workdir: str, process: int,
                 on_hang: Callable[[str], None] | None = None, native: Callable[[int, TextIO], None] = native_stacks):
        self.limits = Limits.from_train(t)
        self.workdir, self.process = workdir, process
        self.on_hang = on_hang or _exit_hung
        self.native = native if t.hang_native_stacks else _no_native_stacks
        self.inject_dir = os.environ.get(TEST_HANG_ENV)  # tests only: see the module docstring
        self._lock = threading.Lock()
        self._clock = StepClock(self.limits, time.monotonic())
        self._stop = threading.Event()
        self._thread = None
        if self.limits.enabled:
            self._thread = threading.Thread(target=self._run, name='jaxfrontier-watchdog', daemon=True)
            self._thread.start()

    def beat(self, step: int) -> None:
        maybe_inject(self.inject_dir, self.process, step)
        with self._lock:
            self._clock.beat(step, time.monotonic())

    def relax(self) -> None:
        with self._lock:
            self._clock.relax()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                reason = self._clock.overdue(time.monotonic())
            if reason is not None and not self._stop.is_set():
                path = stacks_path(self.workdir, self.process)
                header = f'hang detected in process {self.process} (pid {os.getpid()}): {reason}'
                try:
                    write_stacks(path, header, self.native)
                    where = f'stacks of process {self.process} in {path}'
                except OSError as e:  # a full or lost file system must not keep a hung process alive
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    where = f'stacks of process {self.process} on stderr ({path}: {e.strerror})'
                self.on_hang(f'{errors.HangError.describe(reason)}; {where}')
                return


def _exit_hung(message: str) -> None:
    """One line on stderr, then exit 5 at once: the main thread is stuck and cannot unwind."""
    sys.stdout.flush()
    sys.stderr.write(f'error: {message}\n')
    sys.stderr.flush()
    os._exit(errors.HangError.exit_code)  # pylint: disable=protected-access
