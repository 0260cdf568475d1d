"""Whether a saved state is healthy: finite is not enough (a finite but ruined state, issue 35).

One step with a ruinous learning rate can move the parameters a thousand times their norm and
leave every value finite: its own loss was computed before the update, so it looks normal, and only
the next step's loss is NaN. Committing that state, and rolling back or resuming to it, repeats the
failure. Two signals judge the state itself, both from scalars the train step already returns
(no change to the compiled step, and they hold with `train.spike_skip` off, where the commit rule
matters as much):

1. Every step, and before each commit (`judge`): the loss, gradient norm and parameter norm are
   finite (integrity.health), and the parameter norm grew at most `PARAM_GROWTH` (1.5x) over the
   previous step's. A sane step moves the parameters by a few percent of their norm (Adam: about
   lr x sqrt(parameters)); growing them by half in one step is already an update as large as the
   parameters. A state judged unhealthy, and every state trained from it (`Watch.tainted`), is not
   committed (either tier); the run rolls back (train.spike_skip) or stops (run/after_step.py).
2. One step later (`Watch.next_loss`): the next step's loss, computed on this state, is not finite
   -> this state is unhealthy. It may be committed already, so the verdict is recorded in
   `<workdir>/health.json` (the ledger, written atomically), which restore, roll-back and the fast
   tier read. Entries newer than a step a run resumes or rolls back to are forgotten: those step
   numbers belong to a timeline that no longer continues, and may be saved again.

The anchors judge the loss and gradients before the update (Megatron-LM's
check_for_nan_in_loss_and_grad, MaxText's and OLMo's skipped steps, training/spikes.py); none
gates a commit on the state after it, which is what this adds.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax

from jaxfrontier import errors
from jaxfrontier import files
from jaxfrontier import logs

PARAM_GROWTH = 1.5  # the most the parameter norm may grow in one healthy step
LEDGER_FILE = 'health.json'
_log = logs.process0(__name__).info


def judge(health: dict[str, Any], previous_param_norm: float | None,
          tainted: tuple[int, str] | None = None) -> dict[str, Any]:
    """`health` (integrity.health of a step) with its verdict: 'healthy' (bool) and 'reason' ('' when healthy).

    `tainted`: (step, why) of an unhealthy state this one was trained from (Watch.tainted)."""
    out = dict(health)
    norm = health.get('param_norm')
    if health.get('finite') is False:
        out.update(healthy=False, reason='not finite')
    elif (norm is not None and previous_param_norm is not None and previous_param_norm > 0
          and norm > PARAM_GROWTH * previous_param_norm):
        out.update(healthy=False, reason=growth(previous_param_norm, norm))
    elif tainted is not None:
        out.update(healthy=False, reason=f'trained from the unhealthy state of step {tainted[0]}: {tainted[1]}')
    else:
        out.update(healthy=True, reason='')
    return out


def growth(before: float, after: float) -> str:
    return (f'the parameter norm grew {after / before:.3g}x in one step ({before:.4g} -> {after:.4g}; '
            f'at most {PARAM_GROWTH}x)')


class Ledger:
    """`<workdir>/health.json`: {step: why it is unhealthy} for verdicts learned after a step was saved."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LEDGER_FILE)
        self.unhealthy: dict[int, str] = {}
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding='utf-8') as f:
                    self.unhealthy = {int(k): str(v) for k, v in json.load(f)['unhealthy'].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise errors.CheckpointError(
                    f'{self.path} cannot be read ({type(e).__name__}: {e}). Fix: move it away (the checkpoints '
                    'it marks unhealthy are then trusted again), or use a new --workdir.') from None

    def reason(self, step: int) -> str | None:
        return self.unhealthy.get(step)

    def mark(self, step: int, reason: str) -> None:
        if self.unhealthy.get(step) != reason:
            self.unhealthy[step] = reason
            self._write()

    def forget_after(self, step: int) -> None:
        """Drops the verdicts of steps newer than `step` (a resume or roll-back to `step`)."""
        if any(s > step for s in self.unhealthy):
            self.unhealthy = {s: r for s, r in self.unhealthy.items() if s <= step}
            self._write()

    def _write(self) -> None:
        if jax.process_index() == 0:
            files.write_atomic(self.path, json.dumps(
                {'unhealthy': {str(s): r for s, r in sorted(self.unhealthy.items())}}, indent=1))


class Watch:
    """The host's view of the run's steps (fed one step late, like every metric): the parameter norms
    `judge` compares with (the newest two steps seen, and the checkpoints saved or restored: a
    roll-back's first step compares with its target), and the next-loss verdict."""

    def __init__(self):
        self.recent: dict[int, float] = {}
        self.saved: dict[int, float] = {}
        self.tainted: tuple[int, str] | None = None  # the oldest unhealthy state of this timeline

    def previous_param_norm(self, step: int) -> float | None:
        """The parameter norm after step `step - 1` (None where it is unknown)."""
        return self.recent.get(step - 1, self.saved.get(step - 1))

    def checkpoint(self, step: int, param_norm: Any) -> None:
        """Step `step` was saved or restored with this parameter norm (None: not recorded)."""
        if isinstance(param_norm, (int, float)) and math.isfinite(param_norm):
            self.saved = {s: n for s, n in self.saved.items() if s < step}
            self.saved[step] = float(param_norm)

    def seen(self, step: int, loss: float, param_norm: float) -> tuple[int, str, bool] | None:
        """Step `step`'s loss and parameter norm; returns (a step whose state is now known unhealthy,
        why, whether its parameters jumped) or None. The states trained from it are unhealthy too
        (`tainted`) until a roll-back or resume (`forget`)."""
        previous = self.previous_param_norm(step)
        self.recent = {s: n for s, n in self.recent.items() if s == step - 1}
        if math.isfinite(param_norm):
            self.recent[step] = param_norm
        found = None
        if not math.isfinite(loss):
            found = (step - 1, f'the next step\'s loss, computed on it, was {loss}', False)
        elif previous and math.isfinite(param_norm) and param_norm > PARAM_GROWTH * previous:
            found = (step, growth(previous, param_norm), True)
        if found is not None and (self.tainted is None or found[0] < self.tainted[0]):
            self.tainted = found[:2]
        return found

    def forget(self) -> None:
        """A resume or roll-back: the steps seen belong to another timeline."""
        self.recent, self.tainted = {}, None
