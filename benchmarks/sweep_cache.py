"""A sweep's wall time with and without the persistent compilation cache (issue 27, docs/PERFORMANCE.md).

  python benchmarks/sweep_cache.py [--config=configs/tiny.py] [--space tensor=1,2,4 --space micro_batch=1,2]

Runs the same sweep (`python -m jaxfrontier.sweep`, 6 trials by default, each its own process) three
times in fresh workdirs:
  off   -- `--config.train.compile_cache=off`: every trial compiles everything;
  cold  -- a new, empty cache directory: what a first sweep costs with the default `auto` cache
           (trials of different layouts share few programs, so this is close to `off`);
  warm  -- the same sweep again on the cache `cold` filled: a re-run, a resumed sweep after a crash,
           or a second sweep over other settings of the same layouts.
Reports the sweep's wall time and the trials' summed `compile_time_s` (the trainer's AOT compile of the
train and eval steps; a cache hit is a load, not a compile). Needs a quiet machine: wall-clock.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sweep(config: str, spaces: list[str], workdir: str, cache: str | None, warmup: int, steps: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
    for var in ('JAX_COMPILATION_CACHE_DIR', 'XLA_FLAGS'):
        env.pop(var, None)
    cmd = [sys.executable, '-m', 'jaxfrontier.sweep', f'--config={config}', f'--workdir={workdir}',
           f'--warmup={warmup}', f'--steps={steps}', '--noplan_filter']
    for s in spaces:
        cmd += ['--space', s]
    cmd.append(f'--config.train.compile_cache={cache or "off"}')
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])
    with open(os.path.join(workdir, 'results.jsonl'), encoding='utf-8') as f:
        records = [json.loads(line) for line in f if line.strip()]
    ok = [r for r in records if r.get('status') == 'ok']
    return {'wall_s': wall, 'trials': len(records), 'ok': len(ok),
            'compile_s_sum': sum(r.get('compile_time_s') or 0.0 for r in ok),
            'cache_entries': len(os.listdir(cache)) if cache else 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--config', default='configs/tiny.py')
    ap.add_argument('--space', action='append', default=[], help='as jaxfrontier.sweep (default tensor=1,2,4 '
                    'and micro_batch=1,2: 6 trials)')
    ap.add_argument('--warmup', type=int, default=1)
    ap.add_argument('--steps', type=int, default=2)
    ap.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'sweep_cache.json'))
    args = ap.parse_args()
    spaces = args.space or ['tensor=1,2,4', 'micro_batch=1,2']
    with tempfile.TemporaryDirectory(prefix='jf_sweep_cache_') as tmp:
        cache = os.path.join(tmp, 'cache')
        os.makedirs(cache)
        rows = {}
        for name, cache_dir in (('off', None), ('cold', cache), ('warm', cache)):
            rows[name] = sweep(args.config, spaces, os.path.join(tmp, name), cache_dir, args.warmup, args.steps)
            r = rows[name]
            print(f"{name:5s} wall {r['wall_s']:7.1f} s  trials {r['ok']}/{r['trials']} ok  "
                  f"compile (summed) {r['compile_s_sum']:7.1f} s  cache entries {r['cache_entries']}", flush=True)
    summary = {'config': args.config, 'space': spaces, 'warmup': args.warmup, 'steps': args.steps, **rows,
               'warm_over_off_wall': rows['warm']['wall_s'] / rows['off']['wall_s'],
               'cold_over_off_wall': rows['cold']['wall_s'] / rows['off']['wall_s']}
    print(f"warm / off: {summary['warm_over_off_wall']:.2f} of the wall time; "
          f"cold / off: {summary['cold_over_off_wall']:.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, 'w', encoding='utf-8') as f:
        json.dump(summary, f, indent=1)


if __name__ == '__main__':
    main()
