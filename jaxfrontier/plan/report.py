"""`--mode=plan`: the plan of a config, its compile check, and the layout search, as text and JSON.

  python -m jaxfrontier.main --config=configs/1t.py --mode=plan [--hardware=h100]
  python -m jaxfrontier.main --config=configs/175b.py --mode=plan --plan_check=compile
  python -m jaxfrontier.main --config=configs/175b.py --mode=plan --search --search_devices=1024

Exit code: 0 when the layout fits (with --search: when one does), 1 when not (the last line names a
layout of the same devices that fits, as training's memory refusal does), 2 for a config mistake.

Checks (`--plan_check`): `lower` traces and lowers the real sharded train step on an
AbstractMesh of the config's full size (seconds, no devices); `compile` also compiles a copy
with at most 2048 simulated CPU devices (data parallelism reduced, compute in fp32 where
XLA:CPU and GPUs agree; minutes) and prints XLA's per-device memory beside the plan of the
same copy. docs/planner.md says how far the two agree.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import ml_collections

from jaxfrontier.plan import compile_check
from jaxfrontier.plan import compile_time
from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import search as plan_search
from jaxfrontier.plan import planner
from jaxfrontier.plan import preflight


def lower_check(c: ml_collections.ConfigDict) -> tuple[str, dict[str, Any]]:
    """Lowers the train step on an AbstractMesh of the config's size; a line and a record."""
    n = config_lib.num_devices(c)
    start = time.perf_counter()
    try:
        compile_check.lower_abstract(c)
    except Exception as e:  # pylint: disable=broad-except  (any tracing or sharding error is the answer)
        message = ' '.join(str(e).split())[:600]
        return (f'lowering on an AbstractMesh of {n:,} devices FAILED: {type(e).__name__}: {message}',
                {'lowered': False, 'error': f'{type(e).__name__}: {message}'})
    seconds = time.perf_counter() - start
    return (f'lowered the sharded train step on an AbstractMesh of {n:,} devices in {seconds:.1f} s',
            {'lowered': True, 'lower_s': seconds})


def cpu_check(c: ml_collections.ConfigDict, hardware: hw_lib.Hardware) -> tuple[str, dict[str, Any]]:
    """Compiles an fp32 copy on <= 2048 simulated CPU devices; XLA's memory beside the plan's."""
    copy = compile_check.cpu_copy(c)
    copy.model.dtype = 'float32'  # XLA:CPU upcasts 16-bit work; fp32 is where it and GPUs agree
    result = compile_check.run_in_subprocess(copy)
    estimate = planner.plan(copy, hardware).memory.total_bytes
    rel = compile_check.within(estimate, result.memory['total'])
    gib = hw_lib.GIB
    shape = ' x '.join(f'{k} {v}' for k, v in config_lib.mesh_shape(copy).items())
    line = (f'compiled an fp32 copy ({shape}) on {result.num_devices} CPU devices in {result.compile_s:.0f} s: '
            f'XLA {result.memory["total"] / gib:.2f} GiB per device, plan {estimate / gib:.2f} GiB ({rel:+.1%})')
    return line, {'copy_mesh': config_lib.mesh_shape(copy), 'xla': result.memory, 'estimate_bytes': estimate,
                  'relative': rel, 'compile_s': result.compile_s, 'collective_bytes': result.collective_bytes}


@dataclasses.dataclass(frozen=True)
class Report:
    """What `--mode=plan` prints, and whether the layout fits (the exit code: 0 fits, 1 does not)."""

    text: str
    fits: bool


def report(c: ml_collections.ConfigDict, **kwargs: Any) -> str:
    """Everything `--mode=plan` prints (`make`'s text)."""
    return make(c, **kwargs).text


def make(c: ml_collections.ConfigDict, *, hardware: str = 'mi250x', search: bool = False,
         search_devices: int = 0, check: str = 'lower', json_path: str = '') -> Report:
    """The plan (or the search) as text, and whether it fits; also writes the JSON to `json_path` when given.

    A layout that does not fit ends with the line training's memory refusal gives (plan/preflight.py):
    a layout of the same devices that fits, as --config overrides, or that none does.
    """
    hw = hw_lib.get(hardware)
    if search:
        plans, planned, fitting = plan_search.search(c, hw, search_devices)
        text = f'hardware {hw.name}: {hw.description}\n' + (
            f'calibration {planner.calibration_line(hw)}\n' if hw.calibration else '')
        text += plan_search.format_search(plans, planned, fitting)
        record = {**plan_search.search_to_json(plans, planned, fitting), 'hardware': hw.name,
                  **({'hardware_calibration': hw.calibration} if hw.calibration else {})}
        text += f'\nevery plan as JSON: {json_path}' if json_path else '\nevery plan as JSON: --plan_json=FILE'
        fits = fitting > 0
        if not fits:
            n = search_devices or config_lib.num_devices(c)
            text += (f'\nnone fits: no layout of {n:,} x {hw.name} holds this model and batch. Fix: more devices '
                     '(--search_devices=N), devices with more memory (--hardware), or a smaller model')
    else:
        p = planner.plan(c, hw)
        text, record, fits = planner.format_plan(p), planner.plan_to_json(p), p.fits
        compiled = compile_time.estimate(c.model.num_layers, c.model.scan_unroll, c.mesh.pipeline, hw)
        text += '\n' + compiled.line()
        record['compile_time'] = dataclasses.asdict(compiled)
        if check in ('lower', 'compile'):
            line, record['lower'] = lower_check(c)
            text += '\ncheck: ' + line
        if check == 'compile':
            line, record['compile'] = cpu_check(c, hw)
            text += '\ncheck: ' + line
        if not fits:
            text += (f'\ndoes not fit: {p.memory.total_bytes / hw_lib.GIB:,.1f} GiB per device on '
                     f'{config_lib.num_devices(c):,} x {hw.name} ({hw.memory_gib:.0f} GiB each). Fix: '
                     f'{preflight.suggestion(c, hw, config_lib.num_devices(c))}')
    if json_path:
        with open(json_path, 'w', encoding='utf-8') as f:
            json.dump(record, f, indent=1, default=float)
    return Report(text, fits)
