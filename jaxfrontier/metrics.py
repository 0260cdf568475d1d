"""Training metrics: FLOP counts, device peaks, throughput/MFU, and the metrics writer.

FLOP convention (used for every number this module reports):
  * Megatron's formula (Narayanan et al. 2021, eq. 3, as printed by Megatron-DeepSpeed and by
    Dash et al. 2024 on Frontier):
    `24 * f * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))`.
  * Only matrix multiplies are counted (2 FLOPs per multiply-add). Causal attention is counted
    as full (s x s) attention, although half of it is masked. Layer norms, softmax, GeLU,
    biases, dropout, the embedding lookup and the optimizer update are ignored.
  * The MLP is assumed to be 4h wide (that is where the 24 comes from).
  * V is the padded vocabulary (`config.padded_vocab`), as in Megatron.
  * Model FLOPs use f = 3 (forward + backward), whatever the remat policy: that is what the
    user gets, and it is the basis of MFU. Megatron's hardware FLOPs use f = 4 when
    activations are recomputed (one extra forward), f = 3 otherwise; this is the figure the
    paper reported as TFLOP/s per GCD and is reported here under a `megatron_hw` name.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections

from jaxfrontier import config as config_lib


# --------------------------------------------------------------------------- FLOP counts


def _megatron_formula(f: int, global_batch: int, seq_len: int, num_layers: int, d_model: int,
                      vocab_size: int) -> float:
    b, s, l, h, v = (float(x) for x in (global_batch, seq_len, num_layers, d_model, vocab_size))
    return 24.0 * f * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def megatron_flops_per_step(global_batch: int, seq_len: int, num_layers: int, d_model: int,
                            vocab_size: int, recompute: bool) -> float:
    """Megatron's hardware FLOPs of one optimizer step (the paper's TFLOP/s counter).

    `24 * f * B * s * l * h**2 * (1 + s/(6h) + V/(16 l h))` with f = 4 when activations are
    recomputed (forward, recomputed forward, backward = 2 forwards), f = 3 otherwise. Counts
    matmuls only; causal attention is counted as full attention; layer norms, softmax and
    other element-wise work are ignored; the MLP is 4h wide. Because f also multiplies the
    logits term, that term is counted at f/4 of 3 passes (Megatron-DeepSpeed's convention).

    Args:
      global_batch: B, sequences per optimizer step (all accumulation steps and replicas).
      seq_len: s, tokens per sequence.
      num_layers: l, transformer blocks.
      d_model: h, hidden size.
      vocab_size: V, the padded vocabulary.
      recompute: whether activations are recomputed in the backward pass.

    Returns:
      FLOPs per step, as a float.
    """
    return _megatron_formula(4 if recompute else 3, global_batch, seq_len, num_layers, d_model,
                             vocab_size)


def model_flops_per_step(global_batch: int, seq_len: int, num_layers: int, d_model: int,
                         vocab_size: int) -> float:
    """Model FLOPs of one optimizer step: Megatron's formula with f = 3 always (basis of MFU).

    Same convention as `megatron_flops_per_step` (matmuls only, causal attention counted as
    full, layer norms/softmax ignored, padded vocabulary V), but recomputation is never
    counted: this is the useful work of forward + backward, independent of the remat policy.
    """
    return _megatron_formula(3, global_batch, seq_len, num_layers, d_model, vocab_size)


def flops_per_step_from_config(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """Returns (model_flops, megatron_hw_flops) per optimizer step for a jaxfrontier config.

    Uses the padded vocabulary and counts recomputation (f = 4) in the hardware figure when
    `config.model.remat != 'none'`. See the module docstring for the convention.
    """
    m = config.model
    shape = dict(global_batch=config.train.global_batch, seq_len=m.seq_len,
                 num_layers=m.num_layers, d_model=m.d_model,
                 vocab_size=config_lib.padded_vocab(config))
    return (model_flops_per_step(**shape),
            megatron_flops_per_step(**shape, recompute=m.remat != 'none'))


# --------------------------------------------------------------------------- device peaks

# (device_kind substring, variants it must not match, dense bf16 peak, dense fp32 peak) per
# JAX device. First match wins, so longer names must come before their prefixes.
# fp32 is the plain (non-TF32) matrix peak; note XLA may use TF32 for fp32 dots on NVIDIA
# GPUs under the default precision, so fp32 MFU there can exceed what the table suggests.
_PEAKS = (
    ('MI250X', (), 191.5e12, 47.9e12, 'AMD MI250X, one GCD'),
    ('MI300X', (), 1307.4e12, 163.4e12, 'AMD MI300X'),
    ('A100', (), 312e12, 19.5e12, 'NVIDIA A100'),
    ('H100', ('PCIe', 'NVL'), 989.4e12, 66.9e12, 'NVIDIA H100 SXM'),
    ('H200', (), 989.4e12, 66.9e12, 'NVIDIA H200'),
)
_PEAK_DTYPES = {'bfloat16': 'bf16', 'float16': 'bf16', 'float32': 'fp32'}

_CPU_MATMUL_N = 1024


def _peak_dtype(dtype: str) -> str:
    name = getattr(dtype, 'name', str(dtype))
    if name not in _PEAK_DTYPES:
        raise ValueError(f'no peak FLOP/s for dtype {dtype!r}; use one of {sorted(_PEAK_DTYPES)}')
    return name


@functools.cache
def measure_cpu_matmul_peak(dtype: str = 'float32') -> float:
    """Measures matmul FLOP/s of one CPU JAX device; cached per dtype for the process.

    Times a jitted n x n matmul (n = 1024) on the first CPU device (one warm-up, best of five)
    and divides by the number of CPU devices in this process, because simulated CPU devices
    share the same cores.

    Args:
      dtype: 'float32', 'bfloat16' or 'float16'; the matmul runs in this dtype.

    Returns:
      FLOP/s per CPU device (> 0).
    """
    name = _peak_dtype(dtype)
    devices = jax.local_devices(backend='cpu')
    n = _CPU_MATMUL_N
    key_a, key_b = jax.random.split(jax.random.key(0))
    a_nn = jax.device_put(jax.random.normal(key_a, (n, n), dtype=name), devices[0])
    b_nn = jax.device_put(jax.random.normal(key_b, (n, n), dtype=name), devices[0])
    matmul = jax.jit(lambda x, y: jnp.einsum('ij,jk->ik', x, y))
    matmul(a_nn, b_nn).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(5):
        start = time.perf_counter()
        matmul(a_nn, b_nn).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / len(devices)


def device_peak_flops(device: Any, dtype: str) -> tuple[float, str]:
    """Dense matrix peak FLOP/s of one JAX device for a compute dtype.

    Accelerators are looked up by substring of `device.device_kind` in a table of published
    dense peaks (float16 uses the bf16 entry). CPU devices are measured once per process with
    `measure_cpu_matmul_peak`. Unknown kinds give NaN, so MFU shows as NaN rather than wrong.

    Args:
      device: a `jax.Device` (anything with `.platform` and `.device_kind`).
      dtype: 'float32', 'bfloat16' or 'float16'.

    Returns:
      (peak FLOP/s, a description of where the number came from).
    """
    name = _peak_dtype(dtype)
    if device.platform == 'cpu':
        n_cpu = len(jax.local_devices(backend='cpu'))
        return (measure_cpu_matmul_peak(name),
                f'measured: jitted {_CPU_MATMUL_N}x{_CPU_MATMUL_N} {name} matmul on one CPU '
                f'device, divided by {n_cpu} CPU devices')
    kind = str(device.device_kind)
    column = _PEAK_DTYPES[name]
    for sub, excluded, bf16, fp32, label in _PEAKS:
        if sub in kind and not any(x in kind for x in excluded):
            return (bf16 if column == 'bf16' else fp32,
                    f'table: {label} dense {column} matrix peak (device_kind {kind!r})')
    return math.nan, f'unknown device kind {kind!r} (platform {device.platform}): MFU is NaN'


# --------------------------------------------------------------------------- throughput


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


class MetricsWriter:
    """Writes scalars to `<workdir>/metrics.jsonl` and TensorBoard, and drives a progress bar.

    Only an enabled writer on process 0 does anything; elsewhere every method is a no-op.
    Non-finite values are written to the JSON file as `null` so every line is strict JSON.
    """

    def __init__(self, workdir: str, total_steps: int, enabled: bool, progress: bool,
                 initial_step: int = 0):
        self.enabled = bool(enabled) and jax.process_index() == 0
        self._jsonl = self._tb = self._bar = None
        if not self.enabled:
            return
        # Imported here so processes that never write do not pay for them.
        import tensorboardX
        import tqdm

        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
        self._tb = tensorboardX.SummaryWriter(logdir=os.path.join(workdir, 'tensorboard'))
        self._tqdm = tqdm.tqdm
        self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, disable=not progress,
                              unit='step', dynamic_ncols=True)

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Appends `{'step': step, **scalars}` (values as floats) and logs them to TensorBoard."""
        if not self.enabled:
            return
        values = {k: float(v) for k, v in scalars.items()}
        row = {'step': int(step)}
        row.update({k: v if math.isfinite(v) else None for k, v in values.items()})
        self._jsonl.write(json.dumps(row, allow_nan=False) + '\n')
        self._jsonl.flush()
        for key, value in values.items():
            self._tb.add_scalar(key, value, global_step=int(step))
        self._tb.flush()
        postfix = {}
        if 'train/loss' in values:
            postfix['loss'] = f"{values['train/loss']:.4f}"
        if 'perf/tokens_per_s' in values:
            postfix['tok/s'] = f"{values['perf/tokens_per_s']:.4g}"
        if postfix:
            self._bar.set_postfix(postfix, refresh=False)

    def advance(self, step: int) -> None:
        """Moves the progress bar to `step` completed steps."""
        if self.enabled and step > self._bar.n:
            self._bar.update(step - self._bar.n)

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


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf."""


def check_finite(step: int, loss: Any) -> None:
    """Raises NonFiniteLossError if `loss` (a scalar, host or device) is NaN or Inf."""
    value = float(loss)
    if math.isfinite(value):
        return
    raise NonFiniteLossError(
        f'training loss is {value} at step {step}; stopping. Things to try: lower the learning '
        f'rate (--config.optim.lr, or more --config.optim.warmup_steps); check the data (token '
        f'ids below model.vocab_size, no corrupt or empty token file); compute in float32 '
        f'(--config.model.dtype=float32) to rule out bfloat16/float16 overflow.'
    )
