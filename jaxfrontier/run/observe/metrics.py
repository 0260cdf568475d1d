"""Training metrics: throughput and MFU, the metrics writer, the non-finite check.

FLOP counts are `jaxfrontier/flops.py` (the convention), device peaks `jaxfrontier/hardware.py`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from typing import Any, Mapping

import jax
import numpy as np

from jaxfrontier import errors
from jaxfrontier.run.observe import experts as experts_lib


def perf_metrics(step_time_s: float, tokens_per_step: float, n_devices: int, model_flops: float,
                 megatron_hw_flops: float, peak_flops: float) -> dict[str, float]:
    """Throughput and utilisation of one optimizer step, under `perf/` keys.

    Args:
      step_time_s: wall time of one optimizer step in seconds.
      tokens_per_step: tokens in the global batch (global_batch * seq_len).
      n_devices: JAX devices the step ran on.
      model_flops: `model_flops_per_step` (f = 3).
      megatron_hw_flops: `megatron_flops_per_step` (f = 4 with recomputation).
      peak_flops: dense peak FLOP/s of one device (`device_peak_flops`).

    Returns:
      'perf/step_time_s', 'perf/tokens_per_s', 'perf/tokens_per_s_per_device',
      'perf/model_tflops_per_device', 'perf/mfu' (model FLOPs / (time * devices * peak)) and
      'perf/megatron_hw_tflops_per_device' (the paper's counter, recomputation included).
    """
    device_seconds = step_time_s * n_devices
    return {
        'perf/step_time_s': float(step_time_s),
        'perf/tokens_per_s': tokens_per_step / step_time_s,
        'perf/tokens_per_s_per_device': tokens_per_step / device_seconds,
        'perf/model_tflops_per_device': model_flops / device_seconds / 1e12,
        'perf/mfu': model_flops / (device_seconds * peak_flops),
        'perf/megatron_hw_tflops_per_device': megatron_hw_flops / device_seconds / 1e12,
    }


# --------------------------------------------------------------------------- writer


def host_values(fetched: Mapping[str, Any]) -> dict[str, Any]:
    """Fetched step metrics as host values: scalars as floats, small arrays (the layers' aux,
    `aux/<name>/layers`: model/auxiliary.py) as nested lists of floats."""
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v, np.float64).tolist() for k, v in fetched.items()}


def _finite_or_none(value: Any) -> Any:
    """A value for strict JSON: a non-finite float as None, lists element by element."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value if math.isfinite(value) else None


def last_logged_step(path: str) -> int:
    """The largest step in a metrics.jsonl (0 if there is none)."""
    last = 0
    with contextlib.suppress(FileNotFoundError), open(path, encoding='utf-8') as f:
        for line in f:
            try:
                last = max(last, int(json.loads(line).get('step', 0)))
            except (ValueError, TypeError, AttributeError):
                continue  # a line cut short by a kill
    return last


def progress_line(step: int, total_steps: int, values: Mapping[str, float]) -> str:
    """One plain line for a logged step or evaluation (a batch job's log: no carriage returns)."""
    parts = [f'step {step}/{total_steps}']
    for key, label, fmt in (('train/loss', 'loss', '.4f'), ('eval/loss', 'eval loss', '.4f'), ('train/lr', 'lr', '.3g'),
                            ('train/grad_norm', 'grad norm', '.3g'), ('perf/tokens_per_s', 'tokens/s', ',.0f'),
                            ('perf/mfu', 'MFU', '.3f')):
        if key in values and math.isfinite(values[key]):
            parts.append(f'{label} {values[key]:{fmt}}')
    if 'perf/step_time_s' in values and step < total_steps:
        eta_s = values['perf/step_time_s'] * (total_steps - step)
        parts.append(f'ETA {int(eta_s // 3600)}:{int(eta_s % 3600 // 60):02d}:{int(eta_s % 60):02d}')
    return ', '.join(parts)


def _tensorboardx() -> Any:
    """tensorboardX, imported without torch.

    Its writer module imports torch (where installed) only to name `torch.Tensor` in type hints; that
    import took 1.3-1.8 s of every run's start on the 2-core CPU wherever torch is installed (the test
    extra, Hugging Face users, the GPU image). Scalars are all this writer passes it, so torch is hidden
    while tensorboardX loads (an import of torch then raises ImportError, which it catches) and
    visible again after; a process that imported torch already keeps it.
    """
    if 'torch' in sys.modules or 'tensorboardX' in sys.modules:
        import tensorboardX  # pylint: disable=g-import-not-at-top
        return tensorboardX
    sys.modules['torch'] = None  # type: ignore[assignment]  (Python's "import blocked" marker)
    try:
        import tensorboardX  # pylint: disable=g-import-not-at-top
    finally:
        if sys.modules.get('torch', 0) is None:
            del sys.modules['torch']
    return tensorboardX


class MetricsWriter:
    """Writes scalars to `<workdir>/metrics.jsonl` and TensorBoard, and shows progress.

    Progress is a bar where stderr is a terminal and `progress` is on; anywhere else (a Slurm
    log, a pipe, or the bar switched off) one plain line per written row (`progress_line`).
    Only an enabled writer on process 0 does anything; elsewhere every method is a no-op.
    Non-finite values are written to the JSON file as `null` so every line is strict JSON.
    Array values (lists: the layers' aux) go to the JSON file only; TensorBoard and the sinks
    get the scalars. `sinks` get every row too (`write(step, values, replayed)`,
    `summary(values)`: W&B, run/observe/wandb_log.py); their owner closes them.
    """

    def __init__(self, workdir: str, total_steps: int, enabled: bool, progress: bool, initial_step: int = 0,
                 terminal: bool | None = None, sinks: tuple = (), moe_empty_warn_steps: int = 0):
        self.enabled = bool(enabled) and jax.process_index() == 0
        self.empty_experts = experts_lib.EmptyExperts(moe_empty_warn_steps)  # MoE: a warning per dead expert
        self.total_steps = total_steps
        self.sinks = tuple(sinks) if self.enabled else ()
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self.lines = self.enabled and not (progress and terminal)
        self._jsonl = self._tb = self._bar = None
        if not self.enabled:
            return
        # Imported here so processes that never write do not pay for them.
        import tqdm
        tensorboardX = _tensorboardx()

        os.makedirs(workdir, exist_ok=True)
        path = os.path.join(workdir, 'metrics.jsonl')
        # Steps already logged by an earlier run that are run again after a resume (from a checkpoint
        # older than its last row) are marked "replayed": true, so plots can drop them.
        self.replayed_until = last_logged_step(path)
        self._jsonl = open(path, 'a', encoding='utf-8')
        self._tb = tensorboardX.SummaryWriter(logdir=os.path.join(workdir, 'tensorboard'))
        self._tqdm = tqdm.tqdm
        self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, disable=self.lines,
                              unit='step', dynamic_ncols=True)

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Appends `{'step': step, **scalars}` (values as floats, lists as lists) and logs the scalars
        to TensorBoard."""
        if not self.enabled:
            return
        arrays = {k for k, v in scalars.items() if isinstance(v, list)}
        values = {k: float(v) for k, v in scalars.items() if k not in arrays}
        row = {'step': int(step)}
        row.update({k: _finite_or_none(v if k in arrays else values[k]) for k, v in scalars.items()})
        if step <= self.replayed_until:
            row['replayed'] = True
        self._jsonl.write(json.dumps(row, allow_nan=False) + '\n')
        self._jsonl.flush()
        for sink in self.sinks:
            sink.write(int(step), values, replayed=row.get('replayed', False))
        for key, value in values.items():
            self._tb.add_scalar(key, value, global_step=int(step))
        self._tb.flush()
        for line in self.empty_experts.observe(int(step), scalars):
            self.log_line(line)
        postfix = {}
        if 'train/loss' in values:
            postfix['loss'] = f"{values['train/loss']:.4f}"
        if 'perf/tokens_per_s' in values:
            postfix['tok/s'] = f"{values['perf/tokens_per_s']:.4g}"
        epochs = {k[len('data/epoch'):].lstrip('/'): v for k, v in values.items() if k.startswith('data/epoch')}
        if epochs:  # epochs completed (per file for a blend): 1.25 = a quarter into epoch 1
            postfix['epoch'] = ' '.join(f'{k}={v:.3f}' if k else f'{v:.3f}' for k, v in epochs.items())
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)
        if self.lines and ('train/loss' in values or 'eval/loss' in values):
            print(progress_line(step, self.total_steps, values), file=sys.stderr, flush=True)

    def rewound(self, step: int) -> None:
        """The run went back to `step` (a loss-spike roll-back): the rows it writes again up to the newest
        one written are marked "replayed", as after a resume."""
        if self.enabled:
            self.replayed_until = max(self.replayed_until, last_logged_step(self._jsonl.name))
            self._bar.n = min(self._bar.n, step)

    def advance(self, step: int) -> None:
        """Moves the progress bar to `step` completed steps."""
        if self.enabled and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Hands the run's closing figures (goodput) to the sinks that keep a summary."""
        for sink in self.sinks:
            sink.summary(values)

    def log_line(self, text: str) -> None:
        """Prints a line above the progress bar without breaking it."""
        if self.enabled:
            self._tqdm.write(text)

    def close(self) -> None:
        """Closes the bar, the TensorBoard writer and the JSON file (idempotent)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._jsonl = self._tb = self._bar = None
        self.enabled = False

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# --------------------------------------------------------------------------- NaN/Inf guard


def check_finite(step: int, loss: Any, suspect: str = '') -> None:
    """Raises errors.NonFiniteLossError if `loss` (a scalar, host or device) is NaN or Inf; `suspect`: what to
    try before the learning rate (families/moe.divergence_suspect), '' for none."""
    value = float(loss)
    if not math.isfinite(value):
        first = f'first {suspect}; then ' if suspect else ''
        error = errors.NonFiniteLossError(
            f'training loss is {value} at step {step}; stopping. Things to try: {first}'
            f'lower the learning rate (--config.optim.lr, or more --config.optim.warmup_steps); check the data (token '
            f'ids below model.vocab_size, no corrupt or empty token file); compute in float32 '
            f'(--config.model.dtype=float32) to rule out bfloat16/float16 overflow.')
        error.suspect_named = bool(suspect)
        raise error
