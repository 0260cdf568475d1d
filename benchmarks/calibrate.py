"""Calibrating the planner on this machine and on the paper's numbers; the tables of docs/planner.md.

  python benchmarks/calibrate.py                      # sweep (24 layouts, ~20 min on 2 quiet cores) + fits
  python benchmarks/calibrate.py --results=/tmp/calib_sweep/results.jsonl   # fit an existing sweep

1. CPU: a sweep of tensor 1, 2, 4 x pipeline 1, 2 x micro-batch 1, 2 x remat none, full of
   configs/tiny.py widened to 4 x 256, sequence 256 (fsdp 1) on 8 simulated CPU devices (`python -m jaxfrontier.sweep`), its
   records copied to benchmarks/results/calibrate_cpu_sweep.jsonl (the test suite refits them),
   the starting description (`local`, this host's measured matmul peak) to
   calibrate_cpu_prior.json, then `python -m jaxfrontier.calibrate` -> calibrate_cpu.json and
   calibrate_cpu.report.json.
2. The paper: benchmarks/results/frontier_paper.jsonl (22B, 175B, 1T on MI250X) calibrates
   `mi250x` -> calibrate_mi250x_paper.json; leave-one-out is "fit two, predict the third".
3. Scaling predicted (`python -m jaxfrontier.scaling --plan_only`): 175B on 128..1,024 and 1T on
   512..3,072 GCDs, weak and strong, on `mi250x` and on the paper-calibrated description.
Prints the Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, 'benchmarks', 'results')
# configs/tiny.py widened (4 layers x 256, sequence 256) so that a step is mostly compute, not the
# fixed cost of running 8 simulated devices on the host's threads, which no layout changes.
SWEEP = ['--config=configs/tiny.py', '--config.mesh.fsdp=1', '--config.model.num_layers=4',
         '--config.model.d_model=256', '--config.model.seq_len=256', '--devices=8', '--space=tensor=1,2,4',
         '--space=pipeline=1,2', '--space=micro_batch=1,2', '--space=remat=none,full', '--warmup=3', '--steps=10']
SCALING = {'175b': '128,256,512,1024', '1t': '512,1024,1536,3072'}


def run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f'{" ".join(args)} failed:\n{proc.stderr[-3000:]}')
    return proc.stdout


def cpu(results: str, workdir: str) -> dict:
    if not results:
        run('-m', 'jaxfrontier.sweep', *SWEEP, f'--workdir={workdir}')
        results = os.path.join(workdir, 'results.jsonl')
    sweep_copy = os.path.join(OUT, 'calibrate_cpu_sweep.jsonl')
    with open(sweep_copy, 'w', encoding='utf-8') as g:
        for path in results.split(','):  # several passes: repeats of a layout are combined by calibrate
            with open(path, encoding='utf-8') as f:
                g.writelines(line for line in f if json.loads(line)['status'] == 'ok')
    prior = os.path.join(OUT, 'calibrate_cpu_prior.json')
    if not os.path.exists(prior):  # the host's matmul peak, measured once (a process with one CPU device)
        run('-c', f'from jaxfrontier import hardware as h; h.save(h.local(), {prior!r})')
    hw = os.path.join(OUT, 'calibrate_cpu.json')
    print(run('-m', 'jaxfrontier.calibrate', f'--results={sweep_copy}', f'--hardware={prior}', f'--out={hw}'))
    with open(os.path.join(OUT, 'calibrate_cpu.report.json'), encoding='utf-8') as f:
        return json.load(f)


def paper() -> dict:
    hw = os.path.join(OUT, 'calibrate_mi250x_paper.json')
    print(run('-m', 'jaxfrontier.calibrate', f'--results={os.path.join(OUT, "frontier_paper.jsonl")}',
              '--hardware=mi250x', '--across_models', f'--out={hw}'))
    with open(os.path.join(OUT, 'calibrate_mi250x_paper.report.json'), encoding='utf-8') as f:
        return json.load(f)


def scaling(hardware: str, workdir: str) -> dict:
    out = {}
    for model, counts in SCALING.items():
        wd = os.path.join(workdir, f'scaling_{model}_{os.path.basename(hardware)}')
        run('-m', 'jaxfrontier.scaling', f'--config=configs/{model}.py', f'--device_counts={counts}', '--plan_only',
            f'--hardware={hardware}', f'--workdir={wd}')
        with open(os.path.join(wd, 'scaling.csv'), encoding='utf-8') as f:
            out[model] = f.read()
    return out


def table(report: dict) -> str:
    lines = ['| trial | layout | measured s | uncalibrated s | held-out s | held-out error |',
             '|---|---|---|---|---|---|']
    for t in report['per_trial']:
        lines.append(f'| {t["name"]} | {t["layout"]} | {t["measured_s"]:.4g} | {t["uncalibrated_s"]:.4g} | '
                     f'{t["holdout_s"]:.4g} | {t["holdout_s"] / t["measured_s"] - 1:+.1%} |')
    lines.append(f'\nmedian |error|: held out {report["holdout_median_abs_rel_error"]:.1%}, fitted '
                 f'{report["fit_median_abs_rel_error"]:.1%}, '
                 f'uncalibrated {report["uncalibrated_median_abs_rel_error"]:.1%}; '
                 f'Spearman of throughput: held out {report["spearman_holdout"]:.2f}, uncalibrated '
                 f'{report["spearman_uncalibrated"]:.2f}; fitted {", ".join(report["fitted"])}')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--results', default='', help='existing sweep results.jsonl files, comma-separated '
                        '(skips the sweep; a second pass of the same layouts adds repeats)')
    parser.add_argument('--workdir', default='/tmp/jf_calibrate')
    parser.add_argument('--parts', default='cpu,paper,scaling')
    args = parser.parse_args()
    parts = args.parts.split(',')
    if 'cpu' in parts:
        print(table(cpu(args.results, os.path.join(args.workdir, 'sweep'))))
    if 'paper' in parts:
        print(table(paper()))
    if 'scaling' in parts:
        for hw in ('mi250x', os.path.join(OUT, 'calibrate_mi250x_paper.json')):
            for model, text in scaling(hw, args.workdir).items():
                print(f'{model} on {os.path.basename(hw)}:\n{text}')


if __name__ == '__main__':
    main()
