"""The layout sweep (issue 35): every layout of 8 simulated devices computes what one device does, or is refused.

  PYTHONPATH=$PWD nice python benchmarks/layout_sweep.py [--only=SUBSTRING ...] [--redo] [--timeout_s=1200]
  PYTHONPATH=$PWD python benchmarks/layout_sweep.py --table     # the tables only, from the results

Cases: every mesh of pipeline x data x fsdp x context x tensor in {1, 2} with at most 8 devices
(26 meshes), every pipeline schedule where pipeline = 2 (staggered 1F1B, 1F1B lockstep, GPipe,
interleaved V = 2; 2 micro-batches, the fewest a 2-stage pipeline takes), GPT and Llama
(tests/layout_check.py's model, 4 layers, and its LLAMA fields): 118 cases.

Each case runs in a subprocess of its own with a timeout, so a deadlock or an XLA abort is recorded
as a failure instead of stopping the sweep. The subprocess first asks the three entry points'
config checks (training's `run.validation.validate_run`, `--mode=plan`'s `planner.plan`,
`--mode=verify`'s `shrink.shrink`): a layout this jax cannot run must be refused there, before
anything compiles, with the same one line by all three. Otherwise it compiles and runs:

- the loop's programs (`training.step.compile_steps`: the train step with explicit shardings and
  donated state, and the eval step): three steps; the step-0 loss (its metric), the step-0
  gradients (read back from Adam's first moment: tests/layout_once.py), the parameters after
  three steps, and the eval loss of those parameters;
- `--mode=verify`'s and the layout tests' loss-and-gradients program (`make_loss_and_grads` jitted
  alone, without shardings): the step-0 loss and gradients;

and compares each with the one-device reference (the same programs on one device, once per family,
in a subprocess, cached; gradients: its train step's) with tests/layout_check.py's tolerances:
loss rtol 2e-6, gradients and parameters atol 2e-6 + rtol 2e-5 elementwise, GPT's key bias as there
(its gradient ~0, its parameter not compared); the eval loss within verify's fp32 loss tolerance (1e-5 relative).

Results: benchmarks/results/layout_sweep.json (one record per case, written after each, so an
interrupted sweep resumes where it stopped), benchmarks/results/layout_sweep.md (every case), and
the summary table docs/architecture.md ("Layouts that run") is made from (`--table` prints it).
XLA:CPU generates unoptimised code here, as in the tests (tests/conftest.py): the programs,
their shardings and collectives are a user's; only the compile is faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'tests'))  # the layout tests' model, batches and tolerances

import jax  # noqa: E402
import numpy as np  # noqa: E402

import layout_check as lc  # noqa: E402
import layout_once  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.errors import ConfigError  # noqa: E402
from jaxfrontier.model import params as params_lib  # noqa: E402
from jaxfrontier.plan import planner, shrink  # noqa: E402
from jaxfrontier.run import validation  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402
from jaxfrontier.training import step as step_lib  # noqa: E402

RESULTS = os.path.join(ROOT, 'benchmarks', 'results', 'layout_sweep.json')
TABLE = os.path.join(ROOT, 'benchmarks', 'results', 'layout_sweep.md')
AXES = ('pipeline', 'data', 'fsdp', 'context', 'tensor')
SCHEDULES = (('1f1b', 1), ('1f1b_lockstep', 1), ('gpipe', 1), ('interleaved', 2))
FAMILIES = ('gpt', 'llama')
LAYERS, ACCUM_PIPELINED = 4, 2
EVAL_RTOL = 1e-5  # plan/verify.py's fp32 loss tolerance


def meshes() -> list[dict[str, int]]:
    """The 26 meshes: every axis 1 or 2, at most 8 devices."""
    return [dict(zip(AXES, sizes)) for sizes in itertools.product((1, 2), repeat=len(AXES)) if math.prod(sizes) <= 8]


def layout_name(mesh: dict[str, int]) -> str:
    return ' '.join(f'{a[0]}{n}' for a, n in mesh.items())


def cases() -> dict[str, dict]:
    """Every case by name: '<family> <p d f c t> <schedule>'."""
    out = {}
    for mesh in meshes():
        schedules = SCHEDULES if mesh['pipeline'] > 1 else (('-', 1),)
        for family in FAMILIES:
            for schedule, virtual in schedules:
                name = f'{family} {layout_name(mesh)} {schedule}'
                out[name] = dict(family=family, mesh=mesh, schedule=schedule, virtual=virtual)
    return out


# ----------------------------------------------------------------------------------------- one case (child)


def make_config(case: dict):
    """tests/layout_check.make_config's model and optimizer for `case`, not yet validated (a refusal is a result)."""
    mesh, pipelined = case['mesh'], case['mesh']['pipeline'] > 1
    c = config_lib.base_config()
    c.model.update(num_layers=LAYERS, d_model=64, num_heads=8, seq_len=lc.SEQ, vocab_size=250, vocab_multiple=32,
                   dtype='float32', remat='none', attention='xla', tied_embeddings=False,
                   **(lc.LLAMA if case['family'] == 'llama' else {}))
    c.mesh.update(**mesh)
    if pipelined:
        c.pipeline.update(schedule=case['schedule'], virtual_stages=case['virtual'])
    accum = ACCUM_PIPELINED if pipelined else 1
    dp = mesh['data'] * mesh['fsdp']
    c.train.update(global_batch=lc.GLOBAL_BATCH, micro_batch=lc.GLOBAL_BATCH // (dp * accum), accum_steps=accum,
                   steps=3)
    c.optim.update(lr=1e-3, min_lr=1e-4, warmup_steps=0, eps=1e-5)
    c.data.kind = 'synthetic'
    return c


def entry_checks(c) -> dict[str, str]:
    """What training, --mode=plan and --mode=verify say of the config before compiling: 'ok' or their line."""
    out = {}
    for path, check in (('train', lambda: validation.validate_run(c.copy_and_resolve_references(),
                                                                  config_lib.num_devices(c))),
                        ('plan', lambda: planner.plan(c.copy_and_resolve_references())),
                        ('verify', lambda: shrink.shrink(c.copy_and_resolve_references()))):
        try:
            check()
            out[path] = 'ok'
        except ConfigError as e:
            out[path] = str(e)
    return out


def run_programs(c) -> dict:
    """Both programs' results (see the module docstring), as NumPy."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    placement = ts.make_placement(c, mesh)
    train, evaluate, batch_sharding = step_lib.compile_steps(c, placement)
    data = [jax.device_put(b, batch_sharding) for b in lc.batches(c.train.global_batch)]
    state = ts.init_train_state(c, placement)
    with jax.set_mesh(mesh), mesh_lib.use_rules(placement.rules):
        direct = jax.jit(step_lib.make_loss_and_grads(c, placement))(state['params'], data[0], 0)
        state, metrics = train(state, data[0])
        loss, grad_norm = jax.device_get((metrics['train/loss'], metrics['train/grad_norm']))
        mu = jax.device_get(layout_once._first_moment(state['opt_state'], layout_once.MOMENTS['adamw'][0]))
        grads = layout_once.step0_gradients(c, mu, float(grad_norm), state['params'])
        for batch in data[1:]:
            state, _ = train(state, batch)
        eval_loss = float(jax.device_get(evaluate(state['params'], data[0])))
    merge = lambda tree: params_lib.merge_virtual(jax.tree.map(np.asarray, jax.device_get(tree)))  # noqa: E731
    return {'loss': float(loss), 'grads': merge(grads), 'params': merge(state['params']), 'eval_loss': eval_loss,
            'direct_loss': float(jax.device_get(direct[0])), 'direct_grads': merge(direct[1])}


def worst(actual, expected) -> tuple[float, float, str]:
    """(largest |a - e|, largest excess over atol + rtol |e| (<= 0: within), where) over two trees."""
    top, excess, where = 0.0, -np.inf, ''
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        diff = np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64))
        over = float(np.max(diff - (lc.TREE_ATOL + lc.TREE_RTOL * np.abs(e)))) if diff.size else -np.inf
        top = max(top, float(np.max(diff)) if diff.size else 0.0)
        if over > excess:
            excess, where = over, jax.tree_util.keystr(path)
    return top, excess, where


def compare(result: dict, ref: dict) -> dict:
    """The worst differences from the reference, and whether every one is within layout_check's tolerances."""
    out, problems = {}, []
    for name, loss in (('loss', result['loss']), ('direct_loss', result['direct_loss'])):
        out[name] = abs(loss - ref['loss']) / abs(ref['loss'])
        if not out[name] <= lc.LOSS_RTOL:
            problems.append(f'{name} off by {out[name]:.1e} (rtol {lc.LOSS_RTOL:g})')
    out['eval_loss'] = abs(result['eval_loss'] - ref['eval_loss']) / abs(ref['eval_loss'])
    if not out['eval_loss'] <= EVAL_RTOL:
        problems.append(f'eval loss off by {out["eval_loss"]:.1e} (rtol {EVAL_RTOL:g})')
    params, ref_params = lc.without_key_bias(result['params']), lc.without_key_bias(ref['params'])
    trees = (('grads', result['grads'], ref['grads']), ('direct_grads', result['direct_grads'], ref['grads']),
             ('params', params, ref_params))
    for name, actual, expected in trees:
        top, excess, where = worst(actual, expected)
        out[name] = top
        if not excess <= 0:
            problems.append(f'{name} {where} off by {top:.1e} past atol {lc.TREE_ATOL:g} + rtol {lc.TREE_RTOL:g}')
    attn = result['grads']['blocks']['attn']
    if 'b_qkv' in attn and not np.max(np.abs(attn['b_qkv'][:, 1])) < 1e-6:
        problems.append('the key bias gradient does not vanish')
    return {'differences': out, 'problems': problems}


def run_case(name: str, cache_dir: str) -> dict:
    """One case in this process: the entry points' checks, then the programs against the reference."""
    is_reference = name not in cases()  # '<family> reference': the one-device run every case is compared with
    spec = reference_case(name.split()[0]) if is_reference else cases()[name]
    c = make_config(spec)
    said = entry_checks(c)
    if set(said.values()) != {'ok'}:
        lines = set(said.values())
        if len(lines) == 1:
            return {'result': 'refused', 'detail': lines.pop(), 'entry_checks': said}
        return {'result': 'failed', 'detail': 'training, plan and verify disagree', 'entry_checks': said}
    result = run_programs(c)
    if is_reference:
        np.save(reference_path(cache_dir, spec['family']), result, allow_pickle=True)
        return {'result': 'reference', 'loss': result['loss']}
    ref = np.load(reference_path(cache_dir, spec['family']), allow_pickle=True).item()
    verdict = compare(result, ref)
    if verdict['problems']:
        return {'result': 'failed', 'detail': '; '.join(verdict['problems']), **verdict}
    return {'result': 'equal', **verdict}


def reference_case(family: str) -> dict:
    return dict(family=family, mesh=dict.fromkeys(AXES, 1), schedule='-', virtual=1)


def reference_path(cache_dir: str, family: str) -> str:
    return os.path.join(cache_dir, f'reference_{family}.npy')


# --------------------------------------------------------------------------------------- the sweep (parent)


def child(name: str, cache_dir: str, timeout_s: float) -> dict:
    """Runs one case in a subprocess; a timeout or a crash is the case's failure, with its last words."""
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
               XLA_FLAGS='--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0')
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), '--case', name, '--cache_dir', cache_dir],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {'result': 'failed', 'detail': f'no result after {timeout_s:.0f} s (a hang)',
                'seconds': time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and lines[-1].startswith('{'):
        return {**json.loads(lines[-1]), 'seconds': seconds}
    said = [x for x in proc.stderr.strip().splitlines() if x.strip() and not x.startswith(('  ', '    @', '***'))]
    key = [x for x in said if 'Check failed' in x or 'timeout' in x.lower() or 'Error' in x]
    return {'result': 'failed', 'detail': f'exit {proc.returncode}: {(key or said or ["no output"])[-1][:300]}',
            'seconds': seconds}


def load_results() -> dict:
    if not os.path.exists(RESULTS):
        return {}
    with open(RESULTS, encoding='utf-8') as f:
        return json.load(f)['cases']


def save_results(results: dict) -> None:
    record = {'jax': jax.__version__, 'devices': 8, 'platform': 'cpu (simulated devices)',
              'method': 'benchmarks/layout_sweep.py docstring: both programs vs one device, layout_check tolerances',
              'cases': {k: results[k] for k in sorted(results, key=_order)}}
    tmp = RESULTS + f'.tmp{os.getpid()}'
    with open(tmp, 'w', encoding='utf-8') as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, RESULTS)


def _order(name: str):
    family, *sizes, schedule = name.split()
    return (sizes, [s for s, _ in SCHEDULES].index(schedule) if schedule != '-' else -1, family)


def cell(r: dict) -> str:
    """'equal: loss <relative>, grads <absolute>, params <absolute>' (the worst of both programs), or the line."""
    if r['result'] == 'equal':
        d = r['differences']
        return (f'equal: loss {max(d["loss"], d["direct_loss"]):.0e}, grads {max(d["grads"], d["direct_grads"]):.0e}, '
                f'params {d["params"]:.0e}')
    return f'{r["result"]}: {r["detail"]}'


def tables(results: dict) -> tuple[str, str]:
    """(every case, one row each; the summary: one row per layout and schedule, GPT and Llama side by side)."""
    counts = {k: sum(r['result'] == k for r in results.values()) for k in ('equal', 'refused', 'failed')}
    total = f'{len(results)} of {len(cases())} cases: {counts["equal"]} equal to one device, ' \
            f'{counts["refused"]} refused up front, {counts["failed"]} failed.'
    full = ['| family | layout (p d f c t) | schedule | result | seconds |', '|---|---|---|---|---|']
    for name in sorted(results, key=_order):
        family, *sizes, schedule = name.split()
        r = results[name]
        full.append(f'| {family} | {" ".join(sizes)} | {schedule} | {cell(r)} | {r.get("seconds", 0):.0f} |')
    rows = ['| layout (p d f c t) | schedule | GPT | Llama |', '|---|---|---|---|']
    for key in sorted({tuple(n.split()[1:]) for n in results}, key=lambda k: _order('x ' + ' '.join(k))):
        got = [results.get(' '.join((f, *key))) for f in FAMILIES]
        rows.append(f'| {" ".join(key[:-1])} | {key[-1]} | ' + ' | '.join(cell(r) if r else 'not run' for r in got)
                    + ' |')
    return total + '\n\n' + '\n'.join(full) + '\n', total + '\n\n' + '\n'.join(rows) + '\n'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--only', nargs='*', default=[], help='cases whose name contains all of these')
    parser.add_argument('--redo', action='store_true', help='run cases already in the results again')
    parser.add_argument('--timeout_s', type=float, default=1200.0)
    parser.add_argument('--table', action='store_true', help='print the summary table only')
    parser.add_argument('--case', help=argparse.SUPPRESS)  # the child: one case
    parser.add_argument('--cache_dir', default=os.path.join(tempfile.gettempdir(), 'jaxfrontier_layout_sweep'))
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.cache_dir)), flush=True)
        return 0
    results = load_results()
    if args.table:
        print(tables(results)[1])
        return 0
    os.makedirs(args.cache_dir, exist_ok=True)
    for family in FAMILIES:
        if not os.path.exists(reference_path(args.cache_dir, family)):
            ref = child(f'{family} reference', args.cache_dir, args.timeout_s)
            if ref['result'] != 'reference':
                print(f'reference {family}: {ref}', file=sys.stderr)
                return 1
    todo = [n for n in cases() if all(s in n for s in args.only) and (args.redo or n not in results)]
    for i, name in enumerate(todo):
        results[name] = child(name, args.cache_dir, args.timeout_s)
        save_results(results)
        print(f'[{i + 1}/{len(todo)}] {name}: {cell(results[name])} ({results[name]["seconds"]:.0f} s)', flush=True)
    full, summary = tables(results)
    with open(TABLE, 'w', encoding='utf-8') as f:
        f.write('# Layout sweep (benchmarks/layout_sweep.py)\n\n' + full)
    print(summary)
    return 0


if __name__ == '__main__':
    sys.exit(main())
