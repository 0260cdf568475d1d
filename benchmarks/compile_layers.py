"""Compile time against depth: the rolled, grouped and unrolled layer stacks (issue 27, item 3).

  JAX_PLATFORMS=cpu python benchmarks/compile_layers.py                 # layers 8 16 32 64 x unroll 1 4 8 all
  JAX_PLATFORMS=cpu python benchmarks/compile_layers.py --layers=8 --unrolls=1,4,all --steps=2   # a quick look

`model.scan_unroll=k` runs the layer scan over groups of k layers (k = 1: rolled; `all`: every
layer unrolled, the GPU default): XLA compiles `model.stack.layer_bodies(layers, k)` copies of
the layer. Each row is one (layers, k) in a fresh process with the compilation cache off: the
train and eval steps' compile time (AOT, `training.step.compile_steps`) and the median step
time after warm-up (benchmarks/harness.py; one device, a small width, fp32). Then the least-
squares fit compile_s = base_s + per_body_s x bodies + per_body2_s x bodies^2 (relative errors) and
its worst relative residual: the relation plan/compile_time.py charges a layout (its CPU_FIT).
Step times show what unrolling buys at run time (GPUs: docs/PERFORMANCE.md, "GPU defaults").
`--refit` recomputes the fit of the rows already in --out without compiling.

Needs a quiet machine: compile and step times are wall-clock. Rows go to --out (JSON lines),
the fit last. On a shared machine fit the CPU seconds (--fit_on=compile_cpu_s): the load
stretches the wall clock, not the compiler's work.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_row(layers: int, unroll: int, args: argparse.Namespace) -> dict:
    """Compile and time one stack in this process (run by `main` in a child process per row)."""
    from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top  (JAX after the env)
    config_lib.set_cpu_device_count(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness  # pylint: disable=g-import-not-at-top
    from jaxfrontier.model import stack  # pylint: disable=g-import-not-at-top

    c = config_lib.base_config()
    c.model.update(num_layers=layers, d_model=args.d_model, num_heads=4, seq_len=args.seq_len, vocab_size=256,
                   vocab_multiple=128, dtype='float32', remat=args.remat, attention='xla', scan_unroll=unroll)
    c.train.update(global_batch=args.batch, micro_batch=args.batch, accum_steps=1)
    result = harness.time_train_step(c, steps=args.steps, warmup=1)
    return {'layers': layers, 'scan_unroll': unroll, 'bodies': stack.layer_bodies(layers, unroll),
            'remat': args.remat, 'd_model': args.d_model, 'compile_s': result['compile_s'],
            'compile_cpu_s': result['compile_cpu_s'],
            'median_step_s': result['median_step_s'], 'tokens_per_s': result['perf/tokens_per_s']}


def fit(rows: list[dict], key: str = 'compile_s') -> dict:
    """seconds = base_s + per_body_s x bodies + per_body2_s x bodies^2, fitted to the relative error.

    A straight line does not describe XLA:CPU: 1 / 16 / 32 / 64 unrolled copies compile in about
    4 / 24 / 72 / 300 s, so the passes whose work grows with the square of the program size dominate
    past ~16 copies. Each row weighs by its relative error (1 / seconds), so the short rolled compiles
    are not drowned by the long unrolled ones.
    """
    bodies = np.array([r['bodies'] for r in rows], float)
    seconds = np.array([r[key] for r in rows], float)
    design = np.stack([np.ones_like(bodies), bodies, bodies ** 2], 1)
    weight = 1.0 / seconds
    (base_s, per_body_s, per_body2_s), *_ = np.linalg.lstsq(design * weight[:, None], seconds * weight, rcond=None)
    predicted = design @ np.array([base_s, per_body_s, per_body2_s])
    return {'fit': f'{key} = base_s + per_body_s * bodies + per_body2_s * bodies^2 (relative least squares)',
            'base_s': float(base_s), 'per_body_s': float(per_body_s), 'per_body2_s': float(per_body2_s),
            'rows': len(rows), 'max_abs_rel_residual': float(np.max(np.abs(predicted - seconds) / seconds))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--layers', default='8,16,32,64', help='comma-separated layer counts')
    p.add_argument('--unrolls', default='1,4,8,all', help='layers per scan iteration; all: every layer unrolled')
    p.add_argument('--d_model', type=int, default=64)
    p.add_argument('--seq_len', type=int, default=64)
    p.add_argument('--batch', type=int, default=4)
    p.add_argument('--remat', default='full', help='model.remat of every row (the default config: full)')
    p.add_argument('--steps', type=int, default=5, help='timed steps per row after one warm-up step')
    p.add_argument('--fit_on', choices=('compile_s', 'compile_cpu_s'), default='compile_s',
                   help='wall-clock compile seconds (a quiet machine), or the process CPU seconds (a shared one)')
    p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'compile_layers.jsonl'))
    p.add_argument('--refit', action='store_true', help='fit the rows already in --out again (no compiles)')
    p.add_argument('--row', default='', help=argparse.SUPPRESS)  # 'layers,unroll': one row, in this process
    args = p.parse_args()
    if args.row:
        layers, unroll = map(int, args.row.split(','))
        print(json.dumps(one_row(layers, unroll, args)))
        return
    if args.refit:
        with open(args.out, encoding='utf-8') as f:
            rows = [r for r in map(json.loads, f) if 'bodies' in r]
        _finish(rows, args)
        return
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
    for var in ('JAX_COMPILATION_CACHE_DIR', 'XLA_FLAGS'):  # cold compiles, one device
        env.pop(var, None)
    rows = []
    for layers in map(int, args.layers.split(',')):
        unrolls = sorted({layers if u == 'all' else min(int(u), layers) for u in args.unrolls.split(',')})
        for unroll in unrolls:
            cmd = [sys.executable, os.path.abspath(__file__), f'--row={layers},{unroll}', *sys.argv[1:]]
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"layers {layers:3d}  scan_unroll {unroll:3d}  bodies {r['bodies']:3d}  compile {r['compile_s']:7.1f} s"
                  f" ({r['compile_cpu_s']:7.1f} CPU s)"
                  f"  step {r['median_step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    _finish(rows, args)


def _finish(rows: list[dict], args: argparse.Namespace) -> None:
    summary = fit(rows, args.fit_on)
    print(f"fit: {args.fit_on} = {summary['base_s']:.2f} + {summary['per_body_s']:.3f} x bodies "
          f"+ {summary['per_body2_s']:.4f} x bodies^2 "
          f"(worst residual {summary['max_abs_rel_residual']:.1%} over {len(rows)} rows)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        for row in [*rows, summary]:
            f.write(json.dumps(row) + '\n')


if __name__ == '__main__':
    main()
