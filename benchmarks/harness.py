"""Build, compile and time the real train step of a config (shared by the benchmarks).

Timing: warm-up steps first (compilation excluded), then `steps` steps, each blocked on its
loss; the median is reported. FLOP convention: model FLOPs are Megatron's formula with f = 3
(no recomputation counted), MFU = model FLOPs / (step time x devices x device peak); the
paper's hardware figure (f = 4 with recomputation) is reported beside it, labelled as such.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, sources
from jaxfrontier import hardware
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.run.observe import metrics as metrics_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts


def time_train_step(c: ml_collections.ConfigDict, steps: int = 5, warmup: int = 2) -> dict[str, Any]:
    """Median step time and derived throughput of config `c` on the present devices."""
    n = config_lib.num_devices(c)
    config_lib.validate(c, n if n <= jax.device_count() else jax.device_count())
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:n])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    t0, cpu0 = time.perf_counter(), time.process_time()
    train_step, _, batch_sharding = step_lib.compile_steps(c, layout)
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    mem = train_step.memory_analysis()
    source = sources.SyntheticSource(c.model.vocab_size, c.model.seq_len, c.seed, sources.TRAIN)
    times = []
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        for i in range(warmup + steps):
            batch = loader.make_global_batch(source, i, batch_sharding, c.train.global_batch)
            jax.block_until_ready(batch)
            start = time.perf_counter()
            state, metrics = train_step(state, batch)
            loss = float(metrics['train/loss'])
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    model_flops, hw_flops = config_lib.flops_per_step(c)
    peak, peak_source = hardware.device_peak_flops(jax.devices()[0], c.model.dtype)
    out = {
        'devices': n,
        'mesh': {k: int(v) for k, v in config_lib.mesh_shape(c).items()},
        'compile_s': compile_s,
        'compile_cpu_s': compile_cpu_s,  # this process's CPU seconds: what a shared machine's load leaves alone
        'median_step_s': step_s,
        'loss': loss,
        **metrics_lib.perf_metrics(step_s, c.train.global_batch * c.model.seq_len, n,
                                   model_flops, hw_flops, peak),
        'peak_flops_per_device': peak,
        'peak_source': peak_source,
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
