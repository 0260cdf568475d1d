"""What the loop reports: each fetched step as a metrics row (`Reporter`), and the start-up phases (`PhaseTimer`).

A row's perf numbers are `metrics.perf_metrics` (FLOP counts from `jaxfrontier/flops.py`, device
peaks from `jaxfrontier/hardware.py`); the start-up phases go to the `start-up:` line the loop logs
and, as `startup/<phase>_s`, to the first row.
"""

from __future__ import annotations

import time

import jax
import ml_collections

from jaxfrontier import hardware
from jaxfrontier import logs
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.training import evaluation

_log = logs.process0(__name__).info


class Reporter:
    """Turns fetched step metrics into log records: perf numbers, NaN check, writer output.

    A row's step time is the time between seeing two steps finished (their metrics fetched),
    divided by the steps between them; the first row after start-up or a restore only starts
    the clock. That holds only if nothing else waited for the newer step before: the loop
    reports a step right after dispatching the next one, before a save or an evaluation syncs.

    Args:
      t: the run's `train` section (log_every, steps, global_batch).
      writer: where rows go.
      n_devices: devices the step runs on.
      seq_len: tokens per row (`model.seq_len`).
      dtype: the compute dtype (`model.dtype`): the device peak MFU is against.
      flops: (model, hardware) FLOPs per step (`config.flops_per_step`).
      bubble: the pipeline schedule's bubble fraction, written with every perf row (None: no pipeline).
      first_row: written once, with the first record: compile time, memory, start-up phases.
    """

    def __init__(self, t: ml_collections.ConfigDict, writer: metrics_lib.MetricsWriter, n_devices: int, *,
                 seq_len: int, dtype: str, flops: tuple[float, float], bubble: float | None = None,
                 first_row: dict[str, float] | None = None, suspect: str = ''):
        self.log_every, self.steps, self.writer, self.n_devices = t.log_every, t.steps, writer, n_devices
        self.suspect = suspect  # of a non-finite loss, before the learning rate (families/moe.divergence_suspect)
        self.first_row = dict(first_row or {})
        self.model_flops, self.hw_flops = flops
        self.peak, self.peak_source = hardware.device_peak_flops(jax.devices()[0], dtype)
        if jax.devices()[0].platform == 'cpu':  # said once: the MFU of every step line rests on it
            _log(f'MFU: against {self.peak / 1e12:.3f} TFLOP/s per device ({self.peak_source}), a rate this '
                 'machine reaches rather than a datasheet peak: it reads high beside a GPU\'s; compare CPU runs '
                 'by tokens/s')
        self.tokens_per_step = t.global_batch * seq_len
        self.constants = {'pipeline/bubble': bubble} if bubble is not None else {}
        self.last_time, self.last_step, self.last_record = None, None, {}
        self.extras = []  # callables adding to every written row (goodput, stragglers)

    def restart_clock(self) -> None:
        """The next row only starts the step clock again (after a roll-back's restore)."""
        self.last_time = None

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
            metrics_lib.check_finite(step, scalars['train/loss'], self.suspect)
        self.writer.advance(step)
        due = last or step % self.log_every == 0 or step == self.steps or evals is not None or skipped
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


class PhaseTimer:
    """Seconds of each start-up phase (those `main` timed before the loop, then the loop's own)."""

    def __init__(self, before: dict[str, float]):
        self.phases, self.last = dict(before), time.perf_counter()

    def done(self, name: str) -> float:
        """Ends phase `name` now; returns its seconds."""
        now = time.perf_counter()
        self.phases[name], self.last = now - self.last, now
        return self.phases[name]

    def summary(self) -> str:
        """The `start-up:` line: every phase's seconds and their sum."""
        return (f'start-up: {sum(self.phases.values()):.1f} s before the first step: '
                + ', '.join(f'{k} {v:.1f} s' for k, v in self.phases.items()))

    def metrics(self) -> dict[str, float]:
        """`startup/<phase>_s` of every phase, for the first metrics row."""
        return {f'startup/{k}_s': v for k, v in self.phases.items()}

