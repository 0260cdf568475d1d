"""The planner's proof: lower and compile the real sharded train step, compare with the estimate.

Two checks, neither needing the target hardware:

  lower_abstract(config)   traces and lowers `training.step.make_train_step` for the config's full mesh on
                           an `AbstractMesh` (no devices): every sharding and divisibility error
                           of the layout surfaces here, in seconds, for any mesh size.
  compile_on_cpu(config)   compiles it for simulated CPU devices (the process must have at least
                           as many; `run_in_subprocess` starts one that has) and reads XLA's
                           per-device memory analysis and the collectives of the optimised HLO.

`cpu_copy(config, max_devices)` shrinks the data-parallel axes of a mesh too large to simulate
(per-device memory does not depend on them, except the ZeRO-1 shards of the optimizer state,
which the planner then computes for the same copy).

XLA:CPU is not XLA:GPU: it upcasts 16-bit dots and element-wise ops to fp32 and emits
all-reduce + dynamic-slice where GPUs get a reduce-scatter. Agreement is therefore stated for
fp32 configs (docs/planner.md, tests/plan/test_planner.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time

import jax
import ml_collections
from jax.sharding import AbstractMesh, AxisType

from jaxfrontier import config as config_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.families import moe as families_moe
from jaxfrontier.plan import hlo_collectives
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import pipeline
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts

MAX_CPU_DEVICES = 2048


def lower_abstract(c: ml_collections.ConfigDict, platform: str = 'cpu'):
    """Lowers the train step for the config's full mesh on an AbstractMesh; returns `jax.stages.Lowered`.

    Raises whatever tracing or sharding raises: an indivisible sharding, a bad rule, a shape
    mismatch. `platform` only picks the lowering rules (the mesh has no devices).
    """
    shape = config_lib.mesh_shape(c)
    mesh = AbstractMesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
    layout = ts.make_placement(c, mesh)
    step, state, batch = step_lib.jit_train_step(c, layout)
    with jax.sharding.use_abstract_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return step.trace(state, batch).lower(lowering_platforms=(platform,))


def compile_on_cpu(c: ml_collections.ConfigDict):
    """Compiles the train step on the first `num_devices(c)` CPU devices; returns `jax.stages.Compiled`."""
    n = config_lib.num_devices(c)
    devices = jax.devices('cpu')
    if len(devices) < n:
        raise RuntimeError(f'the mesh needs {n} CPU devices, this process has {len(devices)}: '
                           'use run_in_subprocess or set --xla_force_host_platform_device_count')
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), devices[:n])
    layout = ts.make_placement(c, mesh)
    step, state, batch = step_lib.jit_train_step(c, layout)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return step.lower(state, batch).compile()


def pipeline_branch_weights(c: ml_collections.ConfigDict):
    """Per-device branch weights of the pipeline's forward (3 kinds) and backward (5 kinds) switch.

    Weight of kind b = share of (tick, stage) slots running b: the average device's count of a
    branch is the tick count times this. None without a pipeline.
    """
    return None if c.mesh.pipeline == 1 else pipeline.build_schedule(layout_lib.Layout.from_config(c)).hlo_weights


def dispatch_branch_weights(c: ml_collections.ConfigDict):
    """The sent MoE dispatch's `lax.cond` (model/layers/moe_dispatch.py, forward and backward): its branch 0,
    the all_to_all or ragged path, runs; branch 1, the exact gather fallback for a buffer that would
    overflow, counts 0 (its frequency is aux/moe_dispatch_fallback, and the plan charges the sent path).
    None where nothing is sent (a dense model, EP 1, gather)."""
    s = families_moe.shape_of(c.model, c.model.mlp_dim)
    if s is None or c.mesh.expert <= 1 or families_moe.resolve_dispatch(s, c.mesh.expert) == 'gather':
        return None
    return lambda n: [1.0, 0.0] if n == 2 else [1.0] * n


def branch_weights(c: ml_collections.ConfigDict):
    """hlo_collectives branch weights of a train step: the pipeline's switches by the schedule (3, 5 or 7, 4
    branches), the MoE dispatch's fallback (2 branches) at 0; None where neither is in the program."""
    pipe, moe = pipeline_branch_weights(c), dispatch_branch_weights(c)
    if pipe is None or moe is None:
        return pipe or moe
    return lambda n: moe(n) if n == 2 else pipe(n)


def collectives(c: ml_collections.ConfigDict, compiled) -> list[hlo_collectives.Collective]:
    """Collectives of a compiled train step (`branch_weights`: pipeline branches by the schedule, the MoE
    dispatch's fallback not taken)."""
    return hlo_collectives.collectives(compiled.as_text(), config_lib.mesh_shape(c), branch_weights=branch_weights(c))


def cpu_copy(c: ml_collections.ConfigDict, max_devices: int = MAX_CPU_DEVICES) -> ml_collections.ConfigDict:
    """A copy of `c` whose mesh fits `max_devices`, shrinking the batch axes (mesh.data, then fsdp) and the batch.

    Micro-batch and accumulation stay, so every device sees the same work as in `c`.
    """
    c = ml_collections.ConfigDict(c.to_dict())
    for axis in axes_lib.of_role('batch'):
        while config_lib.num_devices(c) > max_devices and c.mesh[axis.name] > 1:
            size = c.mesh[axis.name]
            c.mesh[axis.name] = max(d for d in range(1, size) if size % d == 0)
    if config_lib.num_devices(c) > max_devices:
        raise ConfigError('mesh', config_lib.mesh_shape(c),
                                     f'even without data parallelism the mesh needs more than {max_devices} devices',
                                     'check a layout with fewer tensor x pipeline devices')
    c.train.global_batch = c.train.micro_batch * c.train.accum_steps * config_lib.data_parallel_size(c)
    return c


@dataclasses.dataclass(frozen=True)
class CpuResult:
    """What a CPU compile reports: XLA's memory analysis and collective payloads by axis."""

    num_devices: int
    compile_s: float
    memory: dict[str, int]
    collective_bytes: dict[str, int]  # 'kind axes' -> payload bytes per device per step

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def cpu_result(c: ml_collections.ConfigDict) -> CpuResult:
    """Compiles `c` on this process's CPU devices and summarises the result."""
    start = time.perf_counter()
    compiled = compile_on_cpu(c)
    seconds = time.perf_counter() - start
    totals = hlo_collectives.bytes_by_axis(collectives(c, compiled))
    return CpuResult(config_lib.num_devices(c), seconds, step_lib.memory_bytes(compiled),
                     {f'{kind} {"x".join(axes)}': int(v) for (kind, axes), v in totals.items()})


_CHILD = """
import json, sys
import ml_collections
from jaxfrontier.plan import compile_check
c = ml_collections.ConfigDict(json.loads(sys.stdin.read()))
print('RESULT ' + compile_check.cpu_result(c).to_json())
"""


def run_in_subprocess(c: ml_collections.ConfigDict, timeout_s: float = 1800) -> CpuResult:
    """`cpu_result(c)` in a fresh Python with `num_devices(c)` simulated CPU devices."""
    n = config_lib.num_devices(c)
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    flags = [f for f in env.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    env['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={n}'])
    proc = subprocess.run([sys.executable, '-c', _CHILD], input=c.to_json_best_effort(), env=env,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith('RESULT '):
            return CpuResult(**json.loads(line[len('RESULT '):]))
    raise RuntimeError(f'CPU compile of {n} devices failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}')


def within(estimate: float, measured: float) -> float:
    """Relative difference of an estimate from a measurement."""
    return (estimate - measured) / measured if measured else math.inf
