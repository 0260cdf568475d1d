"""Calibrating the planner's time model (jaxfrontier/plan/calibrate.py, jaxfrontier/calibrate.py).

  * the fit recovers known parameters from synthetic step times generated with them;
  * identifiability: a parameter without effect, or collinear with a kept one, stays at its prior;
  * a fresh fit of the checked-in CPU sweep (benchmarks/results/calibrate_cpu_sweep.jsonl,
    measured on this project's machine, `python benchmarks/calibrate.py`) beats the uncalibrated
    model held out (the issue's 15 % / 0.8 bar is not met on this noisy machine: see the test);
  * every bad input is one line `error: ...`, exit 2;
  * descriptions round-trip through JSON and `--mode=plan --hardware=path.json` says which it used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.plan import calibrate as fit_lib
from jaxfrontier.plan import measured
from jaxfrontier.plan import planner
import processes

from processes import REPO, subprocess_env

RESULTS = os.path.join(REPO, 'benchmarks', 'results')
CPU_SWEEP = os.path.join(RESULTS, 'calibrate_cpu_sweep.jsonl')
CPU_PRIOR = os.path.join(RESULTS, 'calibrate_cpu_prior.json')
PAPER = os.path.join(RESULTS, 'frontier_paper.jsonl')

def _shape() -> config_lib.ModelShape:
    c = config_lib.base_config()
    c.model.update(num_layers=4, d_model=256, num_heads=4, seq_len=256, vocab_size=512, dtype='bfloat16',
                   attention='xla')
    return config_lib.model_shape(c)


def _synthetic(truth: hw_lib.Hardware, prior: hw_lib.Hardware) -> list[measured.Measurement]:
    """Measurements of varied layouts whose step times are exactly `truth`'s predictions."""
    shape, out = _shape(), []
    layouts = [layout_lib.Layout(tensor=t, data=8 // (t * p), pipeline=p, micro_batch=mb, accum_steps=a, remat=r)
               for t, p in ((1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (1, 2))
               for mb, a, r in ((1, 4, 'full'), (4, 2, 'none'), (1, 8, 'none'))]
    for i, lay in enumerate(layouts):
        work = planner.layout_work(dataclasses.replace(shape, remat=lay.remat), lay, prior)
        out.append(measured.Measurement(f't{i}', 'synthetic', 'synthetic', work, 1.0, 'synthetic'))
    steps = fit_lib.predict(out, truth)
    return [dataclasses.replace(m, measured_s=float(s)) for m, s in zip(out, steps)]


TRUE = {'matmul_efficiency': 0.41, 'stash_passes': 6.0, 'link_bytes_per_s.node': 21e9, 'step_overhead_s': 0.003}


def test_fit_recovers_known_parameters():
    prior = hw_lib.get('mi250x')
    ms = _synthetic(fit_lib.with_values(prior, TRUE), prior)
    result = fit_lib.fit(ms, prior, list(TRUE), prior_weight=0.0)  # least squares alone: exact
    for name, value in TRUE.items():
        assert result.fitted[name]['value'] == pytest.approx(value, rel=1e-3), name
    result = fit_lib.fit(ms, prior, list(TRUE))  # the default weak pull to the prior: close
    for name, value in TRUE.items():
        assert result.fitted[name]['value'] == pytest.approx(value, rel=0.03), name
    assert fit_lib.get_value(result.hardware, 'link_bytes_per_s.package') == prior.link_bytes_per_s['package']


def test_calibrate_selects_and_holds_out_on_synthetic_measurements():
    prior = hw_lib.get('mi250x')
    ms = _synthetic(fit_lib.with_values(prior, TRUE), prior)
    hw, report = fit_lib.calibrate(ms, prior)
    assert report['uncalibrated_median_abs_rel_error'] > 0.2  # the prior is far off
    assert report['holdout_median_abs_rel_error'] < 0.01  # the truth is inside the model: found again
    assert report['spearman_holdout'] > 0.99
    assert set(TRUE) <= set(report['fitted'])
    assert hw.calibration['trials'] == len(ms) and hw.name == 'mi250x-calibrated'
    assert len(report['per_trial']) == len(ms)
    assert set(report['fitted']).isdisjoint(report['at_prior'])


def test_identifiability_leaves_out_zero_and_collinear_columns():
    params = [fit_lib.Param(n, 'log') for n in ('a', 'b', 'c', 'd')]
    rng = np.random.default_rng(0)
    a, d = rng.normal(size=8), rng.normal(size=8)
    jac = np.stack([a, np.zeros(8), 2.0 * a + 1e-4 * d, d], axis=1)
    kept, left = fit_lib.identifiable(jac, params, limit=4)
    assert kept == [0, 3]
    assert left['b'].startswith('no effect') and left['c'].startswith('collinear')
    kept, left = fit_lib.identifiable(jac, params, limit=1)
    assert kept == [0] and left['d'].startswith('too few')


def test_fresh_fit_of_the_checked_in_cpu_sweep():
    """The CPU sweep measured on this project's machine, refitted from scratch (deterministic).

    The issue asks for <= 15 % held-out error and a rank correlation >= 0.8. The error holds:
    9.7 % leave-one-out on the quiet-machine sweep of benchmarks/calibrate.py (34 %
    uncalibrated; 13.3 % before the model charged stashed residuals, `stash_passes`). On this
    CPU remat=full measures faster than remat=none in 8 (and in a second pass 9) of 12 pairs:
    keeping every residual for the backward costs more than recomputing them, which the fit
    finds as several extra passes over memory per stashed byte. The rank correlation is 0.46
    (0.10 before), short of 0.8; two passes of the same sweep rank alike at 0.83 (docs/planner.md).
    """
    prior = hw_lib.load(CPU_PRIOR)
    ms = measured.load([CPU_SWEEP], prior)
    assert len({(m.work.layout.tensor, m.work.layout.pipeline, m.work.layout.micro_batch, m.work.layout.remat)
                for m in ms}) == len(ms) == 24
    _, report = fit_lib.calibrate(ms, prior)
    assert report['holdout_median_abs_rel_error'] <= 0.12, report['holdout_median_abs_rel_error']
    assert report['holdout_median_abs_rel_error'] < report['uncalibrated_median_abs_rel_error']
    assert report['fit_median_abs_rel_error'] <= report['holdout_median_abs_rel_error']
    assert report['fitted']['stash_passes']['value'] > 1.0, report['fitted']
    stash_off = fit_lib.fit(ms, prior, [n for n in report['fitted'] if n != 'stash_passes'])
    assert stash_off.cost > 1.2 * fit_lib.fit(ms, prior, list(report["fitted"])).cost  # measured: 1.52x


def test_paper_points_calibrate_mi250x():
    prior = hw_lib.get('mi250x')
    ms = measured.load([PAPER], prior, across_models=True)
    assert [m.name for m in ms] == ['paper-22b', 'paper-175b', 'paper-1t']
    # 22B: 73.5 hardware TFLOP/s per GCD on 32 GCDs.
    assert ms[0].work.flops.megatron_hw / (32 * ms[0].measured_s) / 1e12 == pytest.approx(73.5)
    with pytest.raises(errors.UserError, match='models mixed'):
        measured.load([PAPER], prior)


def test_hardware_json_round_trip(tmp_path):
    hw = dataclasses.replace(hw_lib.get('h100'), overlap=0.5, calibration={'trials': 3})
    path = str(tmp_path / 'hw.json')
    hw_lib.save(hw, path)
    assert hw_lib.get(path) == hw
    (tmp_path / 'partial.json').write_text(json.dumps({'base': 'mi250x', 'matmul_efficiency': 0.5}))
    assert hw_lib.get(str(tmp_path / 'partial.json')) == dataclasses.replace(hw_lib.get('mi250x'),
                                                                            matmul_efficiency=0.5)


@pytest.mark.parametrize('content, match', [
    ('[1, 2]', 'not a hardware description'),
    ('{"base": "mi250x", "speed": 3}', 'unknown field'),
    ('{"base": "mi250x", "link_bytes_per_s": {"node": 1}}', 'each level'),
    ('{"base": "nope"}', 'unknown hardware'),
    ('not json', 'not JSON'),
])
def test_bad_hardware_files(tmp_path, content, match):
    path = tmp_path / 'hw.json'
    path.write_text(content)
    with pytest.raises(errors.UserError, match=match):
        hw_lib.get(str(path))
    with pytest.raises(errors.UserError, match='No such file'):
        hw_lib.get(str(tmp_path / 'missing.json'))
    with pytest.raises(errors.UserError, match='unknown hardware'):
        hw_lib.get('tpu9')


def _sweep_records(n: int = 4) -> list[dict]:
    with open(CPU_SWEEP, encoding='utf-8') as f:
        return [json.loads(line) for line in f][:n]


def _write(path, records) -> str:
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))
    return str(path)


def test_bad_results_in_process(tmp_path):
    prior = hw_lib.load(CPU_PRIOR)
    records = _sweep_records()
    with pytest.raises(errors.UserError, match='required'):
        measured.load([], prior)
    with pytest.raises(errors.UserError, match='No such file'):
        measured.load([str(tmp_path / 'none.jsonl')], prior)
    failed = [dict(r, status='crashed') for r in records]
    with pytest.raises(errors.UserError, match='no measured step times'):
        measured.load([_write(tmp_path / 'failed.jsonl', failed)], prior)
    (tmp_path / 'junk.jsonl').write_text('x\n')
    with pytest.raises(errors.UserError, match='line 1: not a JSON record'):
        measured.load([str(tmp_path / 'junk.jsonl')], prior)
    other = dict(records[0], config=dict(records[0]['config'], model=dict(records[0]['config']['model'], d_model=64)))
    with pytest.raises(errors.UserError, match='2 models mixed'):
        measured.load([_write(tmp_path / 'models.jsonl', records[1:] + [other])], prior)
    ms = measured.load([_write(tmp_path / 'two.jsonl', records[:2])], prior)
    with pytest.raises(errors.UserError, match='at least 3'):
        fit_lib.calibrate(ms, prior)
    ms = measured.load([_write(tmp_path / 'three.jsonl', records[:3])], prior)
    with pytest.raises(errors.UserError, match='3 parameters but only 3'):
        fit_lib.calibrate(ms, prior, ['matmul_efficiency', 'step_overhead_s', 'layer_overhead_s'])
    with pytest.raises(errors.UserError, match='cannot be fitted'):
        fit_lib.calibrate(ms, prior, ['link_bytes_per_s.network'])


def _calibrate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.calibrate', *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)


def test_cli_bad_input_is_one_line(tmp_path):
    records = _sweep_records()
    mixed = records[:3] + [dict(records[3], machine='another machine')]
    for args, match in ((('--hardware=mi250x',), '--results is required'),
                        ((f'--results={_write(tmp_path / "m.jsonl", mixed)}', f'--hardware={CPU_PRIOR}'),
                         '2 machines mixed')):
        proc = _calibrate(*args, f'--out={tmp_path / "hw.json"}')
        assert match in processes.error_line(proc), proc.stderr[-2000:]


@pytest.mark.slow  # the fast tier: test_fresh_fit_of_the_checked_in_cpu_sweep and the CLI's one-line errors
def test_cli_calibrates_and_plan_uses_the_description(tmp_path):
    out = tmp_path / 'paper.json'
    proc = _calibrate(f'--results={PAPER}', '--hardware=mi250x', '--across_models', f'--out={out}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / 'paper.report.json').read_text())
    assert report['trials'] == 3 and 'matmul_efficiency' in report['fitted']
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/22b.py', '--mode=plan',
                           '--plan_check=none', f'--hardware={out}'], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'calibration  mi250x-calibrated: fitted to 3 measured steps' in proc.stdout
    assert 'held-out step-time error' in proc.stdout
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--mode=plan', '--hardware=tpu9'], cwd=REPO,
                          env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and 'unknown hardware' in proc.stderr, proc.stderr[-2000:]


def test_checked_in_plan_check_matches_a_fresh_plan():
    """benchmarks/results/plan_check.json holds the plans of the code it describes (no compile here)."""
    sys.path.insert(0, os.path.join(REPO, 'configs'))
    import importlib  # pylint: disable=g-import-not-at-top

    with open(os.path.join(RESULTS, 'plan_check.json'), encoding='utf-8') as f:
        checked_in = json.load(f)
    assert {c['model'] for c in checked_in['checks']} == {'175b', '1t'}
    # The time model's memory traffic reads jax's saved residuals (plan/activations.py): jax 0.11
    # keeps one MLP-sized residual fewer per layer without remat, and the 175B step time moves by
    # 0.24 %. Memory (the `full` policy's residuals) and FLOPs hold on any jax; time on the jax
    # the file was written with (CI's).
    same_jax = checked_in['jax'] == jax.__version__
    for check in checked_in['checks']:
        c = importlib.import_module(check['model']).get_config()
        fresh = json.loads(json.dumps(planner.plan_to_json(planner.plan(c, 'mi250x', name=check['model'])),
                                      default=float))
        old = check['plan']
        for key in ('memory_gib', 'flops_per_step', 'time') if same_jax else ('memory_gib', 'flops_per_step'):
            assert old[key] == pytest.approx(fresh[key], rel=1e-9), (check['model'], key)
        assert old['fits'] == fresh['fits'] and old['layout'] == fresh['layout']
        assert [t['what'] for t in old['communication']] == [t['what'] for t in fresh['communication']]
    assert checked_in['checks'][0]['plan']['memory_gib']['total'] < 57  # not the stale 57.4 GiB any more


def test_repeated_trials_of_a_layout_are_one_measurement(tmp_path):
    prior = hw_lib.load(CPU_PRIOR)
    records = _sweep_records(3)
    again = [dict(r, step_time_median_s=r['step_time_median_s'] * 3) for r in records]
    ms = measured.load([_write(tmp_path / 'a.jsonl', records), _write(tmp_path / 'b.jsonl', again + again)], prior)
    assert len(ms) == 3
    assert [m.measured_s for m in ms] == pytest.approx([r['step_time_median_s'] * 3 for r in records])
    assert ms[0].name.endswith('(+2 repeats)')
    # x, 3x, 3x lie 2/3, 0, 0 from their median 3x.
    assert fit_lib.repeat_spread(ms) == {'repeated_layouts': 3, 'repeat_median_abs_rel_spread': 0.0}
    assert fit_lib.repeat_spread(ms[:0] + [dataclasses.replace(ms[0], repeats=(1.0, 3.0), measured_s=2.0)]) == \
        {'repeated_layouts': 1, 'repeat_median_abs_rel_spread': 0.5}


def test_deephyper_is_seeded_with_the_plans_fastest_points():
    from jaxfrontier.sweep import deephyper as sweep_deephyper  # pylint: disable=g-import-not-at-top
    from jaxfrontier.sweep import trials as sweep_trials  # pylint: disable=g-import-not-at-top

    class Study:
        predict = staticmethod(lambda c, n: {})

        def prepare(self, point, devices, swept):
            if point['tensor'] == 4 and point['micro_batch'] == 2:  # not runnable: never a seed
                return {'trial_id': 'x', 'status': 'invalid', 'error': 'no'}
            plan = {'tokens_per_s': 10.0 * point['tensor'] + point['micro_batch']}
            return sweep_trials.Trial(f'{point}', point, devices, (), {}, plan)

    space = [('tensor', [1, 2, 4]), ('micro_batch', [1, 2])]
    assert sweep_deephyper.plan_seeds(Study(), space, 8, 2) == [{'tensor': 4, 'micro_batch': 1},
                                                               {'tensor': 2, 'micro_batch': 2}]
    Study.predict = None
    assert not sweep_deephyper.plan_seeds(Study(), space, 8, 2)


@pytest.mark.slow
def test_real_sweep_then_calibrate_then_plan_with_it(tmp_path):
    """End to end: a 4-layout sweep on 4 simulated CPU devices, calibrated, its description used."""
    from sweeps import sweep  # pylint: disable=g-import-not-at-top

    proc = sweep(tmp_path / 'sw', '--devices=4', '--config.mesh.fsdp=1', '--space=tensor=1,2',
                 '--space=micro_batch=1,2', '--warmup=2', '--steps=3')
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / 'sw' / 'results.jsonl').read_text().splitlines()]
    assert all(r['status'] == 'ok' and r['config'] and r['machine'] and r['step_time_median_s'] > 0 for r in records)
    out = tmp_path / 'hw.json'
    proc = _calibrate(f'--results={tmp_path / "sw" / "results.jsonl"}', '--hardware=local', f'--out={out}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / 'hw.report.json').read_text())
    assert report['trials'] == 4 and len(report['fitted']) <= 2
    assert hw_lib.load(str(out)).shared_host_devices > 0
    proc = sweep(tmp_path / 'sw', '--devices=4', '--config.mesh.fsdp=1', '--space=tensor=1,2',
                 '--space=micro_batch=1,2', '--warmup=2', '--steps=3', f'--hardware={out}', '--report_only')
    assert proc.returncode == 0, proc.stderr[-3000:]
