"""Goodput: where a run's wall time went, per attempt and over restarts (`<workdir>/goodput.json`).

A run is one or more attempts (a preemption, a crash or a requeue ends one; rerunning the same
command starts the next from the newest checkpoint). Each attempt's wall time, from the
process's start (`main`'s clock) to its `done:` line, is split into

  startup     flags, imports, distributed init, lock, mesh, data, state init, memory check
  compile     the train and eval steps' compilation (`startup/compile_s`)
  checkpoint  restoring, the blocking part of each save (the device-to-host copy), the final wait
  eval        the evaluations (waited for where they run, so their time is theirs)
  productive  train steps run for the first time
  replayed    train steps run again: those between the checkpoint an attempt restored and the
              step an earlier attempt had reached (or a loss-spike roll-back had)

and `other` (wall minus the parts: logging between stages). Goodput is productive / wall.

The loop marks its stretches with `span(kind)`; a moment belongs to the innermost open span, so
a save inside the step span counts as checkpoint, not step time. Every part is measured, none is
derived from the wall time: `other` is what no span covered, and a stage that grew outside the
spans shows there. Only process 0 writes the file; it does so with every metrics row, so an
attempt killed outright keeps its figures up to its last row and the next attempt knows the step
it had reached.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Callable, Iterator

from jaxfrontier import logs
from jaxfrontier import files

PARTS = ('startup', 'compile', 'checkpoint', 'eval', 'productive', 'replayed')
FILE = 'goodput.json'
_warn = logs.process0(__name__).warning


def read(workdir: str) -> dict[str, Any]:
    """The goodput record of earlier attempts ({} if none, or if the file is unreadable: warned)."""
    path = os.path.join(workdir, FILE)
    try:
        with open(path, encoding='utf-8') as f:
            record = json.load(f)
        if not isinstance(record, dict) or not isinstance(record.get('attempts'), list):
            raise ValueError('not a goodput record')
        for a in record['attempts']:
            if not (isinstance(a, dict) and all(isinstance(a.get(f'{k}_s'), (int, float)) for k in PARTS)):
                raise ValueError('an attempt without its parts')
        return record
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as e:
        _warn(f'warning: {path} is unreadable ({e}); goodput counts from this attempt on')
        return {}


def totals(attempts: list[dict[str, Any]]) -> dict[str, float]:
    """The parts, wall and replayed steps summed over attempts, with their goodput."""
    out = {f'{k}_s': sum(a[f'{k}_s'] for a in attempts) for k in (*PARTS, 'wall', 'other')}
    out['replayed_steps'] = sum(a.get('replayed_steps', 0) for a in attempts)
    out['goodput'] = out['productive_s'] / out['wall_s'] if out['wall_s'] > 0 else math.nan
    return out


class Ledger:
    """This attempt's seconds by part, and the file that keeps every attempt's.

    Args:
      workdir: where goodput.json lives.
      started: the attempt's start on `clock` (main's first line; None: now).
      write: whether this process writes goodput.json (process 0).
      clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, workdir: str, started: float | None, write: bool, clock: Callable[[], float] = time.perf_counter):
        self.path, self.write, self.clock = os.path.join(workdir, FILE), write, clock
        self.earlier = read(workdir).get('attempts', []) if write else []
        self.reached = max((a.get('end_step', 0) for a in self.earlier), default=0)
        self.started = clock() if started is None else started
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.waited_s = 0.0  # time the step span spent waiting for the devices or the others (stragglers.py)
        self.synced_s = 0.0  # of the step span, waiting for a step to end before a save or an evaluation
        self.replayed_steps, self.start_step, self.end_step = 0, None, None
        self._stack: list[str] = ['startup']  # from here to the first step: start-up (memory check, writers)
        self._mark = self.clock()
        self._replaying = False

    def phases(self, phases: dict[str, float]) -> None:
        """Credits the start-up phases timed before the loop (`startup/<phase>_s`): compile to compile,
        restore to checkpoint, the rest to startup."""
        for name, seconds in phases.items():
            part = {'compile': 'compile', 'restore': 'checkpoint'}.get(name, 'startup')
            self.seconds[part] += seconds

    def _credit(self, now: float) -> None:
        if self._stack:
            kind = self._stack[-1]
            if kind in ('step', 'wait', 'sync'):
                kind = 'replayed' if self._replaying else 'productive'
            self.seconds[kind] += now - self._mark
            if self._stack[-1] == 'wait':
                self.waited_s += now - self._mark
            elif self._stack[-1] == 'sync':
                self.synced_s += now - self._mark
        self._mark = now

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Time inside is `kind`'s ('step': productive or replayed by the step running; 'wait': the
        step's, also counted as waiting for the devices or the other processes; 'sync': the step's, also
        counted as the wait for a step to end that a save or an evaluation needs) unless an inner span
        claims it."""
        assert kind in (*PARTS, 'step', 'wait', 'sync'), kind
        self._credit(self.clock())
        self._stack.append(kind)
        try:
            yield
        finally:
            self._credit(self.clock())
            self._stack.pop()

    def step(self, number: int) -> None:
        """Train step `number` (1-based: the count of steps done once it ends) is dispatched now."""
        self._credit(self.clock())
        if self.start_step is None:
            self.start_step = number - 1
            self._stack.remove('startup')
        self._replaying = number <= self.reached
        self.replayed_steps += self._replaying
        self.reached = max(self.reached, number)
        self.end_step = number

    def step_seconds(self) -> float:
        """Seconds of train steps so far (productive and replayed)."""
        self._credit(self.clock())
        return self.seconds['productive'] + self.seconds['replayed']

    def attempt(self, finished: bool = False) -> dict[str, Any]:
        """This attempt's record until now."""
        self._credit(self.clock())
        wall = self.clock() - self.started
        record = {'attempt': len(self.earlier) + 1, 'start_step': self.start_step, 'end_step': self.end_step,
                  'finished': finished, 'wall_s': wall, **{f'{k}_s': v for k, v in self.seconds.items()},
                  'other_s': wall - sum(self.seconds.values()), 'replayed_steps': self.replayed_steps}
        record['goodput'] = record['productive_s'] / wall if wall > 0 else math.nan
        return record

    def metrics(self, finished: bool = False) -> dict[str, float]:
        """`goodput/<part>_s` of this attempt and `goodput/total/<part>_s` over all attempts, with each
        one's `goodput` fraction and replayed steps (a metrics row; the file is written too)."""
        current = self.attempt(finished)
        total = totals([*self.earlier, current])
        if self.write:
            self._save(current, total)
        keys = (*(f'{k}_s' for k in (*PARTS, 'other', 'wall')), 'replayed_steps', 'goodput')
        return {**{f'goodput/{k}': float(current[k]) for k in keys},
                **{f'goodput/total/{k}': float(total[k]) for k in keys}}

    def _save(self, current: dict[str, Any], total: dict[str, float]) -> None:
        record = {'attempts': [*self.earlier, current], 'total': total}
        files.write_atomic(self.path, json.dumps(record, indent=1))

    def summary(self) -> str:
        """The closing line: this attempt, then every attempt's total where there were several."""
        current = self.attempt(finished=True)
        text = 'goodput: ' + _describe(current)
        if self.earlier:
            text += f'; over {len(self.earlier) + 1} attempts: ' + _describe(totals([*self.earlier, current]))
        return text


def _describe(r: dict[str, Any]) -> str:
    parts = ', '.join(f'{name} {r[f"{k}_s"]:.1f} s' for k, name in (
        ('startup', 'start-up'), ('compile', 'compile'), ('checkpoint', 'checkpoints'), ('eval', 'evaluation'),
        ('replayed', f'{r["replayed_steps"]} replayed steps'), ('other', 'other')))
    return f'{r["goodput"]:.1%} productive ({r["productive_s"]:.1f} s of {r["wall_s"]:.1f} s; {parts})'
