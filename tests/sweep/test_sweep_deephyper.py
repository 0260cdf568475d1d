"""Bayesian optimisation with DeepHyper (`--method=deephyper`, the `tune` extra that .ci/run installs).

Three evaluations, each a real trial of the sweep on 4 simulated CPU devices, recorded and
reported like a grid sweep's; a rerun with the same seed replays them from results.jsonl.
"""

import json
import subprocess
import sys

import pytest

from processes import REPO, subprocess_env
from sweeps import SMALL, png_axes


def deephyper_sweep(workdir):
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.sweep', *SMALL, f'--workdir={workdir}',
                           '--method=deephyper', '--max_trials=3', '--seed=1', '--devices=4', '--warmup=2',
                           '--steps=2', '--space=tensor=1,2', '--space=micro_batch=1,2', '--space=zero1=false,true'],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_deephyper_search_runs_real_trials_and_resumes(tmp_path):
    import deephyper.hpo  # noqa: F401 pylint: disable=unused-import  (installed by .ci/run: '.[dev,tune]')

    proc = deephyper_sweep(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    records = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
    # Three distinct trials ran; a repeated proposal is answered from the results file, without a run.
    assert 'of 3 trials' in proc.stdout and proc.stdout.count(' started on 4 devices') == 3 == len(records)
    assert len({json.dumps(r['point'], sort_keys=True) for r in records}) == 3
    for r in records:
        assert r['status'] == 'ok' and r['tokens_per_s'] > 0 and r['devices'] == 4, r
        assert set(r['point']) == {'tensor', 'micro_batch', 'zero1'} and r['zero1'] == r['point']['zero1']
    report = (tmp_path / 'report.md').read_text()
    assert all(f'| {r["trial_id"]} |' in report for r in records)
    assert all(ax['x'] and ax['y'] for ax in png_axes(tmp_path / 'plots' / 'tokens_per_s_vs_tensor.png'))

    again = deephyper_sweep(tmp_path)
    assert again.returncode == 0 and 'started' not in again.stdout, again.stdout + again.stderr[-2000:]
    assert len((tmp_path / 'results.jsonl').read_text().splitlines()) == len(records)
