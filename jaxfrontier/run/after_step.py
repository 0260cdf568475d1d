"""What follows each dispatched train step, decided in the loop's order (run/loop.py).

  report            the previous step's metrics, fetched while this step runs (its row, the spike
                    guard's decision, the verdict on the state it started from, the watchdog's beat)
  save_or_roll_back a save of both checkpoint tiers when due and the state is healthy (checkpoint/verdict.py;
                    none while a loss spike is open), or the
                    roll-back persistent spikes call for (training/spikes.py)
  should_stop       a preemption signal every process agrees on (run/control/preemption.py)
  evaluate_if_due   the evaluation every `train.eval_every` steps and after the last one
  final_save        the last step's save, waited for until committed

Each wait is put in its goodput span (run/observe/goodput.py): a save's or an evaluation's wait
for its step is `sync`, the save itself `checkpoint`, the evaluation `eval`; before each of them
the watchdog is relaxed, so a slow file system or a long evaluation is not taken for a hang.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxfrontier import errors
from jaxfrontier.checkpoint import manager as checkpoint_lib
from jaxfrontier.checkpoint.format import FROZEN
from jaxfrontier.checkpoint.fast import tiers
from jaxfrontier.run.control import preemption as preemption_lib
from jaxfrontier.run.control import watchdog as watchdog_lib
from jaxfrontier.run.observe import goodput
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.run.observe import report
from jaxfrontier.training import spikes

State = dict[str, Any]
Pending = tuple[int, dict[str, Any], Any]  # a step reported one step late: (steps done, its metrics, its evaluation)


@dataclasses.dataclass
class AfterStep:
    """The decisions after each step of one run, over the services the loop built.

    `steps`, `eval_every`: `train.steps` and `train.eval_every`. `commits`: the loop's commit log
    (`started(step, state)` when a save starts, `poll(committed=...)` after each step). `evaluate`:
    params -> the evaluation's device arrays (training/evaluation.py with the run's sources bound).
    `target`: the abstract state a roll-back restores onto.
    """

    steps: int
    eval_every: int
    checkpointer: checkpoint_lib.Checkpointer
    fast: tiers.FastTier
    guard: spikes.SpikeGuard
    target: Any
    commits: Any
    preemption: preemption_lib.PreemptionWatcher
    watchdog: watchdog_lib.Watchdog
    ledger: goodput.Ledger
    writer: metrics_lib.MetricsWriter
    reporter: report.Reporter
    evaluate: Callable[[Any], dict[str, jax.Array]]

    def report(self, pending: Pending | None, last: bool = False) -> None:
        """Fetches and reports a step one step late: its row, the spike guard's decision, the watchdog's beat.

        `last`: the run's final step (after the loop: the interval now running holds the final save,
        so it is relaxed, not beaten)."""
        if last:
            self.watchdog.relax()  # the last result and the final save, waited for until committed
        if pending is None:
            return
        with self.ledger.span('wait'):
            jax.block_until_ready(pending[1])
        found = self.checkpointer.observe(*pending[:2])  # before the report, which stops on a NaN loss
        if found is not None:
            self.fast.discard_after(found[0] - 1)  # that state's fast step and those trained from it
        seen = self.reporter.report(*pending, last=last)
        self.guard.observe(pending[0] - 1, seen.get('spike/skipped', 0.0) > 0, seen)
        if found is not None and found[2]:
            self._ruined(*found[:2])
        if not last:
            self.watchdog.beat(pending[0])

    def _ruined(self, step: int, why: str) -> None:
        """Step `step`'s update left an unhealthy state, parameters jumped (checkpoint/verdict.py): roll back
        before it at once (train.spike_skip), else stop the run (exit 3) naming the checkpoint to resume from."""
        if not self.guard.on:
            error = errors.NonFiniteLossError(self.checkpointer.unhealthy_message(step, why))
            error.names_checkpoint = True
            raise error
        self.guard.ruined(step - 1, why)

    def _skips(self) -> list[dict[str, Any]] | None:
        return self.guard.record and self.guard.record.as_json()

    def save_or_roll_back(self, step: int, state: State, metrics: dict[str, jax.Array]) -> tuple[State, int] | None:
        """After step `step` (0-based) is dispatched: its save when due, or a roll-back; returns the
        roll-back's (state, step) or None. Before the next step is dispatched (it donates `state`).

        No save while a loss spike is open; the last step's flag is always fetched, so a roll-back it calls
        for is made before the run ends. A non-finite step is not saved (the checkpointer raises)."""
        done = step + 1
        due = self.checkpointer.due(done) or self.fast.due(done) or done == self.steps
        save, forced = self.guard.save_decision(step, due, lambda: metrics['spike/skipped'])
        if self.guard.rollback_due():  # the step in flight is dropped with the state it came from
            self.watchdog.relax()  # the interval now running holds the saves' wait and the restore
            with self.ledger.span('checkpoint'):
                self.commits.poll(committed=True)
                rolled = self._roll_back(state)
                self.commits.poll(committed=True)
            return rolled
        if save:
            self.watchdog.relax()  # Orbax first waits for the previous save's commit: a slow file system, not a hang
            with self.ledger.span('sync'):
                jax.block_until_ready(state)
            with self.ledger.span('checkpoint'):
                saved = self.checkpointer.save(done, state, force=forced, metrics=metrics, data_skips=self._skips())
                self.fast.save(done, state, metrics, self._skips(), health=self.checkpointer.judge(done, metrics))
            if saved:
                self.commits.started(done, state)
        self.commits.poll()
        return None

    def _roll_back(self, current: State) -> tuple[State, int]:
        """Back to the checkpoint before persistent spikes (guard.roll_back), logged as one metrics row;
        LoRA's frozen base (never checkpointed) carried over from the `current` state."""
        state, back_to, skip = self.guard.roll_back(self.checkpointer, self.target)
        if FROZEN in current:
            state = {**state, FROZEN: current[FROZEN]}
        self.fast.discard_after(back_to)  # the fast tier's newer steps hold the data the roll-back skips
        self.writer.write(skip.spike_steps[-1], {
            'spike/rollback': len(self.guard.record.skips), 'spike/rollback_to': back_to,
            'data/skip_from': skip.data_from, 'data/skip_to': skip.data_to})
        self.writer.rewound(back_to)
        self.reporter.restart_clock()
        return state, back_to

    def should_stop(self, done: int) -> bool:
        """Whether a preemption stops the run after step `done` (not after the last: it ends anyway)."""
        with self.ledger.span('wait'):  # with several processes a barrier: waiting for the others
            return self.preemption.should_stop(done) and done < self.steps

    def evaluate_if_due(self, done: int, params: Any, metrics: dict[str, jax.Array]) -> dict[str, jax.Array] | None:
        """The evaluation after step `done` when due (every `eval_every` steps and after the last), fetched."""
        if not (done == self.steps or (self.eval_every and done % self.eval_every == 0)):
            return None
        with self.ledger.span('sync'):
            jax.block_until_ready(metrics)
        self.watchdog.relax()  # the interval now running holds the evaluation
        with self.ledger.span('eval'):
            return jax.block_until_ready(self.evaluate(params))

    def final_save(self, done: int, state: State, metrics: dict[str, jax.Array] | None) -> bool:
        """The final save (end of training or preemption), waited for until committed; none inside a loss
        spike. Returns whether step `done` was saved."""
        saved = not self.guard.is_open(done - 1)
        with self.ledger.span('checkpoint'):
            if saved and self.checkpointer.save(done, state, force=True, metrics=metrics, data_skips=self._skips()):
                self.commits.started(done, state)
            self.checkpointer.wait()
            self.commits.poll(committed=True)
        return saved
