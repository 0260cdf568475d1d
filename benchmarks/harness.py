"""Build, compile and time the real train step of a config (shared by the benchmarks).

Timing: warm-up steps first (compilation excluded), then `steps` steps, each blocked on its
loss; the median is reported. FLOP convention: model FLOPs are Megatron's formula with f = 3
(no recomputation counted), MFU = model FLOPs / (step time x devices x device peak); the
paper's hardware figure (f = 4 with recomputation) is reported beside it, labelled as such.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, sources
from jaxfrontier import hardware
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import attention as attention_lib
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts


BATCHES = 4  # distinct synthetic batches a timed run cycles through


@dataclasses.dataclass
class TrainStep:
    """A config's compiled train step, ready to run on its synthetic batches (`build_train_step`)."""
    step: Callable[[], float]  # runs one step on the next batch, blocks on its loss and returns it
    compiled: Any  # the compiled train step (memory analysis, HLO)
    compile_s: float
    compile_cpu_s: float  # this process's CPU seconds: what a shared machine's load leaves alone
    params: int
    peak_flops: float
    peak_source: str
    attention: str  # the kernel model.attention resolved to on this backend
    scan_unroll: int  # model.scan_unroll resolved on this backend


def build_train_step(c: ml_collections.ConfigDict) -> TrainStep:
    """Builds, initialises and compiles config `c`'s train step on the present devices."""
    n = config_lib.num_devices(c)
    config_lib.validate(c, n if n <= jax.device_count() else jax.device_count())
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:n])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    t0, cpu0 = time.perf_counter(), time.process_time()
    train_step, _, batch_sharding = step_lib.compile_steps(c, layout)
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    source = sources.SyntheticSource(c.model.vocab_size, c.model.seq_len, c.seed, sources.TRAIN)
    # A few batches made ahead and cycled, so that a timed step holds no data work (as its peers').
    batches = [jax.block_until_ready(loader.make_global_batch(source, i, batch_sharding, c.train.global_batch))
               for i in range(BATCHES)]
    box = {'state': state, 'i': 0}

    def step() -> float:
        batch = batches[box['i'] % BATCHES]
        box['i'] += 1
        with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
            box['state'], metrics = train_step(box['state'], batch)
        return float(metrics['train/loss'])

    peak, peak_source = hardware.device_peak_flops(jax.devices()[0], c.model.dtype)
    shape = config_lib.model_shape(c, jax.default_backend())
    return TrainStep(step, train_step, compile_s, compile_cpu_s,
                     sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state['params'])), peak, peak_source,
                     attention_lib.resolve_impl(c.model.attention, c.model.dtype), shape.scan_unroll)


def time_train_step(c: ml_collections.ConfigDict, steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Median step time and derived throughput of config `c` on the present devices."""
    run = build_train_step(c)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = run.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    n = config_lib.num_devices(c)
    model_flops, hw_flops = config_lib.flops_per_step(c)
    mem = run.compiled.memory_analysis()
    out = {
        'devices': n,
        'mesh': {k: int(v) for k, v in config_lib.mesh_shape(c).items()},
        'compile_s': run.compile_s,
        'compile_cpu_s': run.compile_cpu_s,  # this process's CPU seconds: what a shared machine's load leaves alone
        'median_step_s': step_s,
        'loss': loss,
        **metrics_lib.perf_metrics(step_s, c.train.global_batch * c.model.seq_len, n,
                                   model_flops, hw_flops, run.peak_flops),
        'peak_flops_per_device': run.peak_flops,
        'peak_source': run.peak_source,
        'flop_convention': 'model FLOPs = Megatron formula with f=3; megatron_hw uses f=4 with remat',
        'temp_gib_per_device': mem.temp_size_in_bytes / 2**30 if mem else float('nan'),
        'peak_gib_per_device': (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                                - mem.alias_size_in_bytes) / 2**30 if mem else float('nan'),
    }
    return out


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain-text table of the given columns."""
    cells = [[_fmt(r.get(col)) for col in columns] for r in rows]
    widths = [max(len(col), *(len(row[i]) for row in cells)) for i, col in enumerate(columns)]
    print('  '.join(col.rjust(w) for col, w in zip(columns, widths)))
    for row in cells:
        print('  '.join(cell.rjust(w) for cell, w in zip(row, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f'{value:.4g}' if np.isfinite(value) else 'nan'
    return str(value)
