"""How well the calibrated time model ranks the CPU sweep's layouts, held out and across passes.

  python benchmarks/calibrate_crosspass.py      # ~2 min on a quiet core; runs nothing, refits the two passes

The same 24-layout sweep (benchmarks/calibrate.py) was measured twice, 3 h apart:
calibrate_cpu_sweep.jsonl (pass 1) and calibrate_cpu_sweep_pass2.jsonl (pass 2). Prints, for
pass 1, pass 2 and both (as repeats), the leave-one-out median |error| of the step time and the
Spearman rank correlation of held-out predicted vs measured throughput; then the cross-pass
check against fitting noise: fit on one pass, rank the other pass's layouts (Spearman of
predicted vs that pass's measured throughput); and the noise ceiling, how alike the two passes
rank the layouts.
"""

from __future__ import annotations

import os

import numpy as np

from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import calibrate as fit_lib
from jaxfrontier.plan import measured

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')
PASSES = {'pass 1': [os.path.join(RESULTS, 'calibrate_cpu_sweep.jsonl')],
          'pass 2': [os.path.join(RESULTS, 'calibrate_cpu_sweep_pass2.jsonl')]}
PASSES['both'] = PASSES['pass 1'] + PASSES['pass 2']


def throughput(ms: list[measured.Measurement], seconds: np.ndarray) -> np.ndarray:
    return np.array([m.tokens for m in ms]) / seconds


def main() -> None:
    prior = hw_lib.load(os.path.join(RESULTS, 'calibrate_cpu_prior.json'))
    data = {name: measured.load(paths, prior) for name, paths in PASSES.items()}
    print(f'{"data":<8s} {"LOO error":>10s} {"LOO Spearman":>13s} {"fit Spearman":>13s}')
    for name, ms in data.items():
        _, report = fit_lib.calibrate(ms, prior)
        print(f'{name:<8s} {report["holdout_median_abs_rel_error"]:>10.1%} {report["spearman_holdout"]:>13.2f} '
              f'{report["spearman_fit"]:>13.2f}   fitted: ' +
              ', '.join(f'{k} {v["value"]:.3g}' for k, v in report['fitted'].items()))
    one, two = data['pass 1'], data['pass 2']
    assert [m.work.layout for m in one] == [m.work.layout for m in two], 'the passes list the layouts alike'
    for a, b in (('pass 1', 'pass 2'), ('pass 2', 'pass 1')):
        hw = fit_lib.fit(data[a], prior).hardware
        ms = data[b]
        rho = fit_lib.spearman(throughput(ms, fit_lib.predict(ms, hw)), throughput(ms, np.array([m.measured_s for m in ms])))
        print(f'cross-pass: fit on {a}, rank {b}: Spearman {rho:.2f}')
    ceiling = fit_lib.spearman(throughput(one, np.array([m.measured_s for m in one])),
                               throughput(two, np.array([m.measured_s for m in two])))
    print(f'noise ceiling: pass 1 vs pass 2 measured throughput, Spearman {ceiling:.2f}')


if __name__ == '__main__':
    main()
