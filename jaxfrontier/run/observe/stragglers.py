"""Stragglers: each process's step time, and a warning naming a process slower than the rest.

The processes of a job are coupled by the step's collectives, so every one of them sees the same
pace: the slowest one's. What differs is how each spends it. A process's host work per step (data
reading, dispatch, metrics: the step span minus its wait for the devices) is its own; its wait is
the devices' time plus the time it waits for the others. The slowest process waits least. So a
process's own step time is its host work plus the smallest wait of any process (the devices'
share that no one can avoid):

    own_p = host_p + min_q wait_q

Healthy processes all come out near the devices' step time; a process whose host is slow (a
file system, a busy CPU, a slow data shard) comes out at the job's actual pace. A process is
named when own_p > train.straggler_factor x the median of the other processes' own times. The
dispatch of a step and the preemption barrier count as waiting; the wait for a step before a save
or an evaluation counts as neither (every process waits for it alike). The first two steps are not
timed: the first fetch waits for the last process to start. A device slower than its peers keeps
every host waiting alike and is not seen here (a profile of every process is:
train.profile_all_processes).

Every `train.log_every` steps each process puts two floats (its host and wait seconds per step since
the last time) on the JAX coordination service (host-side: nothing runs on the devices); process 0
reads the previous round's values, which every process wrote before the steps it has since
finished needed it, so it seldom waits, and that wait counts as waiting. It writes
`<workdir>/process_times.jsonl` (every process's numbers) and `straggler/*` metrics.
"""

from __future__ import annotations

import json
import os
import statistics
from typing import Any

import jax
import ml_collections

from jaxfrontier import logs
from jaxfrontier.run.observe import goodput

_PREFIX = 'jaxfrontier/stragglers'
_GET_TIMEOUT_MS = 60_000
_warn = logs.process0(__name__).warning


def own_step_times(host_s: list[float], wait_s: list[float]) -> list[float]:
    """Each process's own step time: its host seconds per step plus the smallest wait of any process."""
    floor = min(wait_s)
    return [h + floor for h in host_s]


def stragglers(own_s: list[float], factor: float) -> list[int]:
    """The processes whose own step time exceeds `factor` x the median of the other processes' (the
    others': with two processes, the one against the other, which the median of both, their mean,
    would hide until 3 x at a factor of 1.5)."""
    return [p for p, t in enumerate(own_s) if t > factor * _median_of_others(own_s, p)]


def _median_of_others(own_s: list[float], p: int) -> float:
    return statistics.median(own_s[:p] + own_s[p + 1:]) if len(own_s) > 1 else own_s[p]


def warning_line(step: int, own_s: list[float], slow: list[int], factor: float) -> str:
    """`straggler: steps up to 40: process 3 0.512 s (2.9 x) per step against the median 0.176 s ...`."""
    median = statistics.median(own_s)
    named = ', '.join(f'process {p} {own_s[p]:.3f} s ({own_s[p] / _median_of_others(own_s, p):.1f} x)'
                      for p in slow[:8])
    more = f' and {len(slow) - 8} more' if len(slow) > 8 else ''
    return (f'straggler: steps up to {step}: {named}{more} per step against the median {median:.3f} s of '
            f'{len(own_s)} processes (train.straggler_factor = {factor}); its host work (data reading, '
            'dispatch) holds every process back: see <workdir>/process_times.jsonl')


class Watch:
    """Exchanges the processes' step times every `train.log_every` steps (no-op with one process)."""

    def __init__(self, t: ml_collections.ConfigDict, workdir: str, ledger: goodput.Ledger):
        """`t`: the run's `train` section (straggler_factor, log_every); `ledger`: the attempt's goodput ledger."""
        self.on = jax.process_count() > 1 and t.straggler_factor > 0
        self.every, self.factor, self.ledger = t.log_every, float(t.straggler_factor), ledger
        self.path = os.path.join(workdir, 'process_times.jsonl')
        self.process, self.count = jax.process_index(), jax.process_count()
        self._last = (0.0, 0.0, 0)  # step seconds, wait seconds, step count at the last round
        self._ticks = 0
        self._rounds = 0  # rounds put: the key (every process counts alike; a roll-back repeats steps)
        self._previous: tuple[int, int] | None = None  # the last round's (number, step)
        self._metrics: dict[str, float] = {}

    def tick(self, done: int) -> None:
        """After step `done` (every process calls this alike): every `log_every` steps a round."""
        if not self.on:
            return
        self._ticks += 1
        # A save's or an evaluation's wait for its step is device time every process waits for alike
        # (it only stops overlapping the host's work): neither host work nor waiting, left out.
        step_s = self.ledger.step_seconds() - self.ledger.synced_s
        wait_s, steps = self.ledger.waited_s, done
        if self._ticks <= 2:  # the clock starts after the second step: the first two hold the start-up skew
            self._last = (step_s, wait_s, steps)  # (the first fetch waits for the last process to start)
            return
        if done % self.every:
            return
        n = max(steps - self._last[2], 1)
        host = (step_s - self._last[0] - (wait_s - self._last[1])) / n
        wait = (wait_s - self._last[1]) / n
        self._last = (step_s, wait_s, steps)
        client = _client()
        self._rounds += 1
        client.key_value_set(f'{_PREFIX}/{self._rounds}/{self.process}', json.dumps([host, wait]))
        if self.process == 0 and self._previous is not None:
            with self.ledger.span('wait'):
                values = self._gather(client, self._previous[0])
            self._judge(self._previous[1], values)
        self._previous = (self._rounds, done)

    def finish(self) -> None:
        """After the last step (every process): process 0 judges the last round."""
        if self.on and self.process == 0 and self._previous is not None:
            self._judge(self._previous[1], self._gather(_client(), self._previous[0]))
            self._previous = None

    def _gather(self, client: Any, number: int) -> list[list[float]]:
        values = []
        for p in range(self.count):
            key = f'{_PREFIX}/{number}/{p}'
            values.append(json.loads(client.blocking_key_value_get(key, _GET_TIMEOUT_MS)))
            client.key_value_delete(key)  # the service keeps no history
        return values

    def _judge(self, step: int, values: list[list[float]]) -> None:
        host_s, wait_s = [v[0] for v in values], [v[1] for v in values]
        own = own_step_times(host_s, wait_s)
        slow = stragglers(own, self.factor)
        with open(self.path, 'a', encoding='utf-8') as f:
            f.write(json.dumps({'step': step, 'own_s': own, 'host_s': host_s, 'wait_s': wait_s,
                                'stragglers': slow}) + '\n')
        slowest = max(range(len(own)), key=own.__getitem__)
        self._metrics = {'straggler/step_time_s_median': statistics.median(own),
                         'straggler/step_time_s_max': own[slowest], 'straggler/slowest_process': slowest,
                         'straggler/count': len(slow)}
        if slow:
            _warn(warning_line(step, own, slow, self.factor))

    def metrics(self) -> dict[str, float]:
        """The last round's `straggler/*` (once: for the next metrics row)."""
        out, self._metrics = self._metrics, {}
        return out


def _client() -> Any:
    from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top  (no public API)
    return global_state.client
