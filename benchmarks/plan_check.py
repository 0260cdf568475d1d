"""The planner against XLA at the paper's scale, and the layout searches, in one JSON file.

  python benchmarks/plan_check.py                     # 175B and 1T: plan, lower, compile, search
  python benchmarks/plan_check.py --models=175b --no-compile --out=/tmp/plan_check.json

For each model (configs/<model>.py, the paper's layout):
  1. the plan (bf16, MI250X GCD) and how long it takes;
  2. the real sharded train step lowered on an AbstractMesh of the full mesh (no devices);
  3. an fp32 copy with at most 2048 simulated CPU devices (data parallelism reduced) compiled
     in a subprocess: XLA's per-device memory beside the plan of the same copy, and XLA's
     collective payload per (family, mesh axes) beside the plan's. fp32 because XLA:CPU
     upcasts 16-bit work (docs/planner.md);
  4. the layout search on the paper's device count (175B: 1,024 GCDs, 1T: 3,072).
Writes everything to --out (default benchmarks/results/plan_check.json) and prints a summary.
The checked-in file is regenerated with the code it describes (tests/plan/test_calibrate.py holds its
plans equal to fresh ones); `--no-compile` leaves out step 3 (hours of XLA:CPU for 1T).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))

from jaxfrontier.plan import compile_check  # noqa: E402  pylint: disable=wrong-import-position
from jaxfrontier.plan import search as plan_search  # noqa: E402  pylint: disable=wrong-import-position
from jaxfrontier.plan import planner  # noqa: E402  pylint: disable=wrong-import-position

SEARCH_DEVICES = {'22b': 32, '175b': 1024, '1t': 3072}
GIB = 2**30


def _family(kind: str) -> str:
    return {'all-gather': 'gather', 'collective-permute': 'permute'}.get(kind, 'reduce')


def comm_table(plan: planner.Plan, collective_bytes: dict[str, float]) -> dict[str, dict[str, float]]:
    """Plan and XLA payload bytes per device per step, keyed 'family axes'."""
    table: dict[str, dict[str, float]] = {}
    for t in plan.transfers:
        row = table.setdefault(f'{_family(t.kind)} {"x".join(t.axes)}', {'plan': 0.0, 'xla': 0.0})
        row['plan'] += t.payload_bytes
    for key, value in collective_bytes.items():
        kind, axes = key.split(' ')
        row = table.setdefault(f'{_family(kind)} {axes}', {'plan': 0.0, 'xla': 0.0})
        row['xla'] += value
    return table


def check_model(name: str, compile_copy: bool) -> dict:
    c = importlib.import_module(name).get_config()
    out: dict = {'model': name}
    start = time.perf_counter()
    p = planner.plan(c, 'mi250x', name=name)
    out['plan_s'] = time.perf_counter() - start
    out['plan'] = planner.plan_to_json(p)
    start = time.perf_counter()
    compile_check.lower_abstract(c)
    out['lower_s'] = time.perf_counter() - start
    print(f'{name}: plan {p.memory.total_bytes / GIB:.2f} GiB per GCD ({"fits" if p.fits else "does NOT fit"}), '
          f'{p.time.megatron_tflops_per_device:.1f} hardware TFLOP/s per GCD predicted; '
          f'planned in {out["plan_s"]:.1f} s, lowered on an AbstractMesh of {p.layout.num_devices} devices '
          f'in {out["lower_s"]:.1f} s', flush=True)
    if compile_copy:
        copy = compile_check.cpu_copy(c)
        copy.model.dtype = 'float32'
        result = compile_check.run_in_subprocess(copy, timeout_s=3600)
        plan_copy = planner.plan(copy, 'mi250x')
        rel = compile_check.within(plan_copy.memory.total_bytes, result.memory['total'])
        out['cpu_copy'] = {'mesh': dict(copy.mesh), 'compile_s': result.compile_s, 'xla': result.memory,
                           'plan_bytes': plan_copy.memory.total_bytes, 'relative': rel,
                           'plan_memory': {k: v for k, v in plan_copy.memory.items()},
                           'communication': comm_table(plan_copy, result.collective_bytes)}
        print(f'  fp32 copy on {result.num_devices} CPU devices: XLA {result.memory["total"] / GIB:.2f} GiB, plan '
              f'{plan_copy.memory.total_bytes / GIB:.2f} GiB ({rel:+.1%}); compiled in {result.compile_s:.0f} s',
              flush=True)
        for key, row in sorted(out['cpu_copy']['communication'].items()):
            if row['xla'] > 1e6 or row['plan'] > 1e6:
                print(f'    {key:<24s} plan {row["plan"] / 1e9:10.2f} GB  XLA {row["xla"] / 1e9:10.2f} GB', flush=True)
    return out


def search_model(name: str) -> dict:
    c = importlib.import_module(name).get_config()
    start = time.perf_counter()
    plans, planned, fitting = plan_search.search(c, 'mi250x', SEARCH_DEVICES[name], top=10)
    seconds = time.perf_counter() - start
    print(f'{name} on {SEARCH_DEVICES[name]} GCDs, searched in {seconds:.1f} s:')
    print(plan_search.format_search(plans, planned, fitting), flush=True)
    return {'model': name, 'devices': SEARCH_DEVICES[name], 'search_s': seconds,
            **plan_search.search_to_json(plans, planned, fitting)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default='175b,1t')
    parser.add_argument('--compile', action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument('--search', action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'plan_check.json'))
    args = parser.parse_args()
    models = args.models.split(',')
    # The time model reads jax's saved residuals (plan/activations.py): plans are of this jax.
    results = {'command': 'python benchmarks/plan_check.py ' + ' '.join(sys.argv[1:]), 'jax': jax.__version__,
               'checks': [check_model(m, args.compile) for m in models]}
    if args.search:
        results['searches'] = [search_model(m) for m in models]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(results, f, indent=1, default=float)
    print(f'wrote {args.out}')


if __name__ == '__main__':
    main()
