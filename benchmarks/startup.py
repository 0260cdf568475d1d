"""Time to the first step of a run, with a cold and a warm compilation cache (docs/PERFORMANCE.md).

  python benchmarks/startup.py [--config=configs/tiny.py] [--rounds=2] [--out=startup.jsonl]

Each round runs `python -m jaxfrontier.main --config=... --config.train.steps=1` twice in a
fresh workdir: first with empty cache directories (cold: the compilation cache and the user cache
$XDG_CACHE_HOME, where `data.cache_dir=auto` keeps the built-in corpus), then with the caches the
first run filled (warm). A run's wall time is measured from outside the process; its `start-up:` line
gives the phases (flags and imports, distributed init, preflight, lock and mesh, data, init,
compile). Rounds alternate on the shared machine; the result is the median of each.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(config: str, cache: str, workdir: str, extra: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_COMPILATION_CACHE_DIR=cache, PYTHONPATH=ROOT,
               XDG_CACHE_HOME=os.path.join(os.path.dirname(cache), 'user_cache'))
    env.pop('XLA_FLAGS', None)
    cmd = [sys.executable, '-m', 'jaxfrontier.main', f'--config={config}', f'--workdir={workdir}',
           '--config.train.steps=1', '--config.train.eval_batches=1', '--config.checkpoint.enabled=False', *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    line = next((ln for ln in proc.stderr.splitlines() if 'start-up:' in ln), '')
    phases = {k: float(v) for k, v in re.findall(r'(\w+) ([\d.]+) s', line.split('first step:', 1)[-1])}
    return {'wall_s': wall, 'startup_s': float(re.search(r'start-up: ([\d.]+) s', line).group(1)) if line else None,
            'phases_s': phases, 'cache_entries': len(os.listdir(cache))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument('--config', default='configs/tiny.py')
    ap.add_argument('--rounds', type=int, default=2)
    ap.add_argument('--out', default='')
    ap.add_argument('extra', nargs='*', help='--config.x=y overrides')
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        tmp = tempfile.mkdtemp(prefix='jf_startup_')
        cache = os.path.join(tmp, 'cache')
        os.makedirs(cache)
        for kind in ('cold', 'warm'):
            row = {'round': r, 'cache': kind, 'config': args.config, **run(args.config, cache, os.path.join(tmp, kind),
                                                                              args.extra)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    for key, what in (('wall_s', 'process wall'), ('startup_s', "the trainer's start-up phases")):
        med = {k: statistics.median(r[key] for r in rows if r['cache'] == k) for k in ('cold', 'warm')}
        print(f'time to first step ({what}, median of {args.rounds}): cold {med["cold"]:.1f} s, '
              f'warm {med["warm"]:.1f} s, warm/cold {med["warm"] / med["cold"]:.2f}')
    for kind in ('cold', 'warm'):
        phases = {p: statistics.median(r['phases_s'].get(p, 0.0) for r in rows if r['cache'] == kind)
                  for p in rows[0]['phases_s']}
        print(f'{kind} phases (medians): ' + ', '.join(f'{p} {v:.2f} s' for p, v in phases.items()))
    if args.out:
        with open(args.out, 'w') as f:
            f.writelines(json.dumps(r) + '\n' for r in rows)


if __name__ == '__main__':
    main()
