"""Loss spikes: skip the update of a step whose loss or gradient norm jumps; roll back if they persist.

PaLM's recipe (Chowdhery et al. 2022, section 5.1): skip the steps, then restart before them and skip their data.

1. On the device, inside the jitted step (`judge`): a running estimate of the loss and of the
   (pre-clipping, global) gradient norm is kept in the train state, `state['spike']`. A step whose
   loss or gradient norm is above its limit, `mean + max(spike_sigmas * std, spike_min_rise * mean)`,
   or is not finite, keeps the old parameters and optimizer state (the select of
   training/loss_scale.py: no host round trip). Both values are global (the loss is the mean over
   the whole batch, the norm is taken over the reduced gradients), so every device and process
   takes the same decision. The estimate is an exponentially weighted mean and variance (a
   running mean for the first 1 / (1 - spike_ema) steps, so it has no start-up bias): six scalars
   that Orbax saves and restores bit for bit, unlike a host-side window; a skipped step does not
   update it, so a spike does not widen its own limit. A window median would need a buffer of
   steps and a sort in the step, and gives no scale for the margin without a second statistic.
2. On the host (`SpikeGuard`, one step behind like every metric): `spike_rollback_after` skipped
   steps within `spike_window` steps roll the run back to the newest committed checkpoint not newer
   than the first of them, and the data batches from that checkpoint through the last skipped step
   (at least `spike_skip_batches`) are skipped from then on: step s reads data step
   `s + sum of the skips recorded at or before s` (`SkipRecord.data_step`). At most
   `spike_max_rollbacks` roll-backs, then the run stops (errors.LossSpikeError, exit 3). A roll-back skips
   checkpoints known unhealthy (checkpoint/verdict.py) and any step rolled back to before: spikes that
   recur after a roll-back walk back further instead of repeating it. No checkpoint is
   committed while a skipped step is within the window (a spike is open), so every checkpoint starts
   with an empty window and a resumed run decides like an uninterrupted one; a save that fell due
   meanwhile is made when the spike closes.

The skips are recorded in `<workdir>/spikes.json` (written before the roll-back restores anything)
and with every later checkpoint's metadata (`data.skips`), so a resumed or rerun command reads the
same batches. Off by default (`train.spike_skip`): docs/training.md says why.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from jaxfrontier import errors
from jaxfrontier import logs
from jaxfrontier import files

SpikeState = dict[str, jax.Array]
RECORD_FILE = 'spikes.json'
_STATS = ('loss_mean', 'loss_var', 'grad_mean', 'grad_var')
_log = logs.process0(__name__).info


def enabled(c: ml_collections.ConfigDict) -> bool:
    return bool(c.train.spike_skip)


def abstract_state() -> dict[str, jax.ShapeDtypeStruct]:
    """`state['spike']`: the running estimate (fp32 means and variances), steps it has seen, steps skipped."""
    out = {k: jax.ShapeDtypeStruct((), jnp.float32) for k in _STATS}
    out.update(count=jax.ShapeDtypeStruct((), jnp.int32), skipped_steps=jax.ShapeDtypeStruct((), jnp.int32))
    return out


def init_state() -> SpikeState:
    return {k: jnp.zeros(s.shape, s.dtype) for k, s in abstract_state().items()}


def limit(c: ml_collections.ConfigDict, mean: jax.Array, var: jax.Array) -> jax.Array:
    """The largest value that is not a spike: `spike_sigmas` standard deviations, at least
    `spike_min_rise` of the mean (a nearly constant loss has a tiny deviation) above the mean."""
    t = c.train
    return mean + jnp.maximum(t.spike_sigmas * jnp.sqrt(var), t.spike_min_rise * jnp.abs(mean))


def _update(mean: jax.Array, var: jax.Array, x: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exponentially weighted mean and variance with weight `a` on `x` (Finch 2009, eq. 143)."""
    d = x - mean
    return mean + a * d, (1.0 - a) * (var + a * d * d)


def judge(c: ml_collections.ConfigDict, s: SpikeState, loss: jax.Array, grad_norm: jax.Array,
          overflow: jax.Array | None = None) -> tuple[jax.Array, SpikeState, dict[str, jax.Array]]:
    """Whether this step is a spike (its update is to be skipped), the next estimate, the metrics.

    Args:
      c: the run's config (train.spike_*).
      s: the estimate before this step (`state['spike']`).
      loss: the step's loss over the global batch (replicated).
      grad_norm: the global norm of the step's reduced, unclipped gradients (replicated).
      overflow: float16's loss scaler skips this step already (its gradients overflowed): not a spike.

    Returns:
      (skip: bool scalar, the next `state['spike']`, metrics `spike/*`).
    """
    loss, grad_norm = loss.astype(jnp.float32), grad_norm.astype(jnp.float32)
    loss_limit, grad_limit = limit(c, s['loss_mean'], s['loss_var']), limit(c, s['grad_mean'], s['grad_var'])
    finite_grad = jnp.isfinite(grad_norm)
    bad = ~jnp.isfinite(loss) | (~finite_grad if overflow is None else ~finite_grad & ~overflow)
    armed = s['count'] >= c.train.spike_warmup
    high = (loss > loss_limit) | (finite_grad & (grad_norm > grad_limit))
    skip = bad | (armed & high)
    learn = ~skip & finite_grad if overflow is None else ~skip & ~overflow
    a = jnp.maximum(1.0 / (s['count'] + 1).astype(jnp.float32), 1.0 - c.train.spike_ema)
    loss_mean, loss_var = _update(s['loss_mean'], s['loss_var'], loss, a)
    grad_mean, grad_var = _update(s['grad_mean'], s['grad_var'], grad_norm, a)
    new = dict(zip(_STATS, (loss_mean, loss_var, grad_mean, grad_var)))
    nxt = {k: jnp.where(learn, new[k], s[k]) for k in _STATS}
    nxt['count'] = s['count'] + learn.astype(jnp.int32)
    nxt['skipped_steps'] = s['skipped_steps'] + skip.astype(jnp.int32)
    metrics = {'spike/skipped': skip.astype(jnp.int32), 'spike/skipped_steps': nxt['skipped_steps'],
               'spike/loss_limit': jnp.where(armed, loss_limit, jnp.inf),
               'spike/grad_norm_limit': jnp.where(armed, grad_limit, jnp.inf)}
    return skip, nxt, metrics


# --------------------------------------------------------------------------- host side


@dataclasses.dataclass(frozen=True)
class Skip:
    """One roll-back: from train step `at_step` on, data steps [data_from, data_to) are not read."""

    at_step: int
    data_from: int
    data_to: int
    spike_steps: tuple[int, ...]  # the skipped steps that caused it (0-based, the loop's step)

    def as_json(self) -> dict[str, Any]:
        return {'at_step': self.at_step, 'data_from': self.data_from, 'data_to': self.data_to,
                'spike_steps': list(self.spike_steps)}


def _skips_from(items: Any, where: str) -> list[Skip]:
    try:
        out = [Skip(int(d['at_step']), int(d['data_from']), int(d['data_to']), tuple(int(s) for s in d['spike_steps']))
               for d in items]
    except (TypeError, KeyError, ValueError) as e:
        raise errors.CheckpointError(f'{where} is damaged ({type(e).__name__}: {e}). Fix: restore it from the '
                                     'checkpoint metadata (data.skips) or use a new --workdir.') from None
    if any(s.at_step < 0 or s.data_to <= s.data_from for s in out):
        raise errors.CheckpointError(f'{where} holds an impossible skip. Fix: restore it from the checkpoint '
                                     'metadata (data.skips) or use a new --workdir.')
    return out


def skips_in_meta(meta: dict[str, Any]) -> Any:
    """A checkpoint's `data.skips` (None where it has none; SkipRecord checks what it holds)."""
    data = meta.get('data')
    return data.get('skips') if isinstance(data, dict) else None


class SkipRecord:
    """The data skips of a run, oldest first: `<workdir>/spikes.json`, merged with a checkpoint's `data.skips`."""

    def __init__(self, workdir: str, from_checkpoint: list[dict[str, Any]] | None = None):
        self.path = os.path.join(workdir, RECORD_FILE)
        skips: list[Skip] = []
        if os.path.exists(self.path):
            try:
                with open(self.path, encoding='utf-8') as f:
                    skips = _skips_from(json.load(f)['skips'], self.path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise errors.CheckpointError(f'{self.path} cannot be read ({type(e).__name__}: {e}). Fix: move '
                                             'it away to use the checkpoint metadata (data.skips) instead.') from None
        for s in _skips_from([] if from_checkpoint is None else from_checkpoint, 'the checkpoint metadata data.skips'):
            if s not in skips:  # a workdir copied without its spikes.json
                skips.append(s)
        self.skips = sorted(skips, key=lambda s: (s.at_step, s.data_from))

    def data_step(self, step: int) -> int:
        """The data step (batch index of the source) that train step `step` reads."""
        return step + sum(s.data_to - s.data_from for s in self.skips if s.at_step <= step)

    def add(self, skip: Skip) -> None:
        """Records `skip` in the list and, on process 0, atomically in `spikes.json`."""
        self.skips.append(skip)
        self.skips.sort(key=lambda s: (s.at_step, s.data_from))
        if jax.process_index() == 0:
            files.write_atomic(self.path, json.dumps({'skips': self.as_json()}, indent=1))

    def as_json(self) -> list[dict[str, Any]]:
        return [s.as_json() for s in self.skips]


class SpikeGuard:
    """The host side of spike handling for one run (a no-op unless `train.spike_skip`).

    The loop tells it each step's skip flag in order (`observe`, from the metrics it fetches one step
    behind, or at a save, which waits for its step anyway); it answers which data step a train step
    reads, whether a checkpoint may be committed, and whether to roll back (`roll_back`). Steps are
    the loop's 0-based steps; messages and the record name metrics.jsonl's rows (step + 1).
    """

    def __init__(self, t: ml_collections.ConfigDict, workdir: str, checkpoint_skips: list | None = None,
                 suspect: str = ''):
        """`t`: the run's `train` section (spike_*); `checkpoint_skips`: the restored checkpoint's `data.skips`;
        `suspect`: what to try before the learning rate when it stops (families/moe.divergence_suspect)."""
        self.t, self.on = t, bool(t.spike_skip)
        self.first = f'first suspect {suspect}, then ' if suspect else ''
        self.record = SkipRecord(workdir, checkpoint_skips) if self.on else None
        self.recent: list[int] = []  # skipped steps within the window, oldest first
        self.seen = -1  # the newest step observed
        self.owed = False  # a save fell due while a spike was open
        self.forced: tuple[int, str] | None = None  # (step, why): an unhealthy state rolls back now (`ruined`)

    def data_step(self, step: int) -> int:
        return self.record.data_step(step) if self.on else step

    def observe(self, step: int, skipped: bool, values: dict[str, float] | None = None) -> None:
        """Step `step`'s decision (taken on the device); a step already observed is ignored."""
        if not self.on or step <= self.seen:
            return
        self.seen = step
        self.recent = [s for s in self.recent if s > step - self.t.spike_window]
        if skipped:
            self.recent.append(step)
            v = values or {}
            _log(f'spike: step {step + 1} skipped (data step {self.data_step(step)}): loss {v.get("train/loss")} '
                 f'(limit {v.get("spike/loss_limit")}), grad norm {v.get("train/grad_norm")} '
                 f'(limit {v.get("spike/grad_norm_limit")}); {len(self.recent)} within {self.t.spike_window} steps')

    def is_open(self, step: int) -> bool:
        """Whether a skipped step is within the window after step `step`: no checkpoint then."""
        return bool(self.on and any(s > step - self.t.spike_window for s in self.recent))

    def ruined(self, step: int, why: str) -> None:
        """Step `step`'s update left an unhealthy state (checkpoint/verdict.py): roll back before it now
        (unless roll-backs are off), skipping its batch as a spike's."""
        _log(f'spike: step {step + 1} left an unhealthy state ({why}); rolling back before it')
        self.recent = sorted(set(self.recent) | {step})
        self.forced = (step, why)

    def rollback_due(self) -> bool:
        n = self.t.spike_rollback_after
        return bool(self.on and n and (self.forced is not None or len(self.recent) >= n))

    def save_decision(self, step: int, due: bool, skipped_flag) -> tuple[bool, bool]:
        """(save now, forced) after step `step`, whose save is `due`: none while a spike is open, a save
        owed from then once it closes. `skipped_flag()` fetches the step's flag (a sync: only when
        there is a save to decide, which waits for the step anyway)."""
        if not self.on:
            return due, False
        if not (due or self.owed):
            return False, False
        self.observe(step, bool(skipped_flag()))
        if self.is_open(step):
            self.owed = self.owed or due
            return False, False
        forced, self.owed = self.owed, False
        return True, forced

    def roll_back(self, checkpointer, target: Any) -> tuple[Any, int, Skip]:
        """Records the data to skip and restores the newest checkpoint not newer than the first
        skipped step of the window. Returns (state, its step, the skip).

        Raises:
          errors.LossSpikeError: `spike_max_rollbacks` were made already, or there is no such checkpoint.
        """
        first, last, t = self.recent[0], self.recent[-1], self.t
        rows = ', '.join(str(s + 1) for s in self.recent)
        what = (f'step {self.forced[0] + 1} left an unhealthy state ({self.forced[1]})' if self.forced else
                f'{len(self.recent)} steps skipped as loss spikes within {t.spike_window} steps (steps {rows})')
        made = len(self.record.skips)
        if made >= t.spike_max_rollbacks:
            raise errors.LossSpikeError(
                f'{what} after {made} roll-back(s) (train.spike_max_rollbacks = {t.spike_max_rollbacks}); stopping. '
                f'The skipped data is listed in {self.record.path}. Fix: {self.first}lower the learning rate (e.g. '
                '--config.optim.lr) or check the data at those steps, allow more roll-backs with '
                '--config.train.spike_max_rollbacks, or widen the margin with --config.train.spike_sigmas.')
        checkpointer.wait()
        back_to = checkpointer.newest_step_at_most(first)  # committed and not known unhealthy
        tried = {s.at_step for s in self.record.skips}
        while back_to is not None and back_to in tried:  # spikes recurred after a roll-back to it: further back
            _log(f'spike: step {back_to} was rolled back to before and spikes recurred after it; walking back further')
            back_to = checkpointer.newest_step_at_most(back_to - 1)
        if back_to is None:
            raise errors.LossSpikeError(
                f'{what}, and no healthy committed checkpoint at or before step {first} that was not rolled back to '
                f'already (steps {", ".join(map(str, sorted(tried))) or "none"}); stopping. Fix: {self.first}lower the '
                'learning rate (e.g. --config.optim.lr) and rerun to resume from the newest healthy checkpoint, save '
                'more often (--config.checkpoint.every_steps), or skip without rolling back '
                '(--config.train.spike_rollback_after=0).')
        data_from = self.data_step(back_to)
        data_to = max(self.data_step(last) + 1, data_from + t.spike_skip_batches)
        skip = Skip(back_to, data_from, data_to, tuple(s + 1 for s in self.recent))
        self.record.add(skip)  # before the restore: a run killed now resumes with the skip
        _log(f'spike: {what}; rolling back to step {back_to} (roll-back {made + 1} of at most '
             f'{t.spike_max_rollbacks}), skipping data steps [{data_from}, {data_to}); recorded in {self.record.path}')
        state = checkpointer.rewind(target, back_to)
        self.recent, self.seen, self.owed, self.forced = [], back_to - 1, False, None
        return state, back_to, skip
