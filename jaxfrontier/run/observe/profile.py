"""A `jax.profiler` trace of chosen train steps (`train.profile_start`, `train.profile_steps`).

The trace of steps [profile_start, profile_start + profile_steps) goes to `<workdir>/profile/`
(process 0; with `train.profile_all_processes` every other process writes
`<workdir>/profile/process_<i>/`). Open it with TensorBoard's profile plugin (XProf) or
Perfetto: docs/PERFORMANCE.md, "Profiling". Each step is a `StepTraceAnnotation`, so the
profile's step view splits device time per step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
import ml_collections
from absl import logging


class StepProfiler:
    """Starts the trace before step `profile_start` is dispatched, stops it once the last traced step is done."""

    def __init__(self, t: ml_collections.ConfigDict, workdir: str):
        """`t`: the run's `train` section (profile_start, profile_steps, profile_all_processes)."""
        process = jax.process_index()
        self.start, self.stop = t.profile_start, t.profile_start + t.profile_steps
        self.enabled = t.profile_steps > 0 and (process == 0 or t.profile_all_processes)
        base = os.path.join(workdir, 'profile')
        self.directory = os.path.join(base, f'process_{process}') if process else base
        self.active = False

    @contextlib.contextmanager
    def step(self, step: int):
        """Wraps the dispatch of train step `step` (0-based)."""
        if self.enabled and step == self.start:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.active = True
        if not self.active:
            yield
            return
        with jax.profiler.StepTraceAnnotation('train', step_num=step):
            yield

    def after(self, done: int, outputs: Any) -> None:
        """Called with the number of finished steps and that step's outputs; ends the trace when due."""
        if self.active and done >= self.stop:
            jax.block_until_ready(outputs)  # the trace must hold the last step's device work
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            logging.info('profile: steps %d..%d traced to %s', self.start, self.stop - 1, self.directory)
