"""Throughput sweeps (jaxfrontier.sweep): the search space, trial records, launchers, reports, the CLI.

The end-to-end test runs a real grid sweep of 4 points over tensor x micro-batch on 8 simulated
CPU devices: one point has no valid layout (recorded `invalid` without a process), one trial is
made to crash (its interpreter is a wrapper that kills itself with SIGSEGV, as a crashing XLA
would), two train for real (each a process and a compile: the test's cost). Then the report,
CSV and PNGs are read back, and a rerun must not repeat a finished trial. Each invalid reason
(no whole accumulation, a pipeline without 2 micro-batches, a mesh that does not divide the
devices) is held without a process by test_point_config_derives_data_and_accumulation.
"""

import csv
import json
import os
import sys
import time

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError, SpaceError, UserError
from jaxfrontier.sweep import space as sweep_space
from jaxfrontier.sweep import trials as sweep_trials
from processes import subprocess_env
from slurm_cluster import job_env, sbatch
from sweeps import SMALL, png_axes, sweep

def tiny_base():
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=32, num_heads=4, seq_len=32)
    c.mesh.update(fsdp=2, cpu_devices=8)
    c.train.update(global_batch=16, micro_batch=4)
    return c


# --------------------------------------------------------------------------- the search space


def test_space_parses_typed_values_from_flags_and_json():
    space = sweep_space.parse_space(['tensor=1,2', 'remat=full,none', 'zero1=true,false'],
                                    json.dumps({'micro_batch': [1, 2], 'model.d_model': [64]}))
    assert dict(space) == {'micro_batch': (1, 2), 'model.d_model': (64,), 'tensor': (1, 2),
                           'remat': ('full', 'none'), 'zero1': (True, False)}
    assert sweep_space.size(space) == 16 and len(sweep_space.grid(space)) == 16
    assert sweep_space.grid(space)[:2] == [
        {'micro_batch': 1, 'model.d_model': 64, 'tensor': 1, 'remat': 'full', 'zero1': True},
        {'micro_batch': 1, 'model.d_model': 64, 'tensor': 1, 'remat': 'full', 'zero1': False}]
    shuffled = sweep_space.random_order(space, seed=3)
    assert shuffled != sweep_space.grid(space)
    assert sorted(map(str, shuffled)) == sorted(map(str, sweep_space.grid(space)))
    assert shuffled == sweep_space.random_order(space, seed=3)


def test_context_and_sequence_parallelism_are_swept_and_recorded():
    space = sweep_space.parse_space(['context=1,2', 'sequence_parallel=true,false'], '')
    base = tiny_base()
    base.mesh.update(data=2, fsdp=2, tensor=2)
    base.train.global_batch = 32
    layouts = [sweep_space.layout_of(sweep_space.point_config(base, p, 8, set(dict(space)))[0])
               for p in sweep_space.grid(space)]
    assert [(l['context'], l['data'], l['sequence_parallel']) for l in layouts] == [
        (1, 2, True), (1, 2, False), (2, 1, True), (2, 1, False)]  # data takes what context leaves
    with pytest.raises(UserError, match="unknown sequence-parallelism setting.*'auto', 'true', 'false'"):
        sweep_space.parse_space(['sequence_parallel=yes'], '')


@pytest.mark.parametrize('items, json_text, message', [
    ([], '', 'the search space is empty'),
    (['tensr=1,2'], '', 'tensr=...: unknown parameter'),
    (['tensor='], '', 'has no values'),
    (['tensor=1,x'], '', 'is not a int'),
    (['tensor=0'], '', 'must be a positive integer'),
    (['remat=fast'], '', "use values from ['none', 'full'"),
    (['tensor=1,1'], '', 'lists a value twice'),
    (['tensor=1,2'], '{"tensor": [4]}', 'is given twice'),
    (['accum_steps=1,2', 'global_batch=16'], '', 'contradicts global_batch'),
    (['size=125m', 'model.d_model=64'], '', 'contradicts size'),
    ([], '[1, 2]', 'must be a JSON object'),
])
def test_bad_spaces_fail_with_the_parameter_and_a_fix(items, json_text, message):
    with pytest.raises(UserError, match='Fix|JSON object') as e:
        sweep_space.parse_space(items, json_text)
    assert message in str(e.value)


def test_fixed_overrides_must_not_contradict_the_space():
    space = sweep_space.parse_space(['tensor=1,2'])
    with pytest.raises(SpaceError, match='tensor=.*is swept, but --config.mesh.tensor also fixes it'):
        sweep_space.check_fixed(space, ['mesh.tensor'])
    with pytest.raises(SpaceError, match='mesh.data is derived'):
        sweep_space.check_fixed(space, ['mesh.data'])
    sweep_space.check_fixed(space, ['train.global_batch', 'model.remat'])  # fixed, not swept: fine


def test_point_config_derives_data_and_accumulation():
    base = tiny_base()
    c, sets = sweep_space.point_config(base, {'tensor': 2, 'pipeline': 2, 'micro_batch': 1}, 8,
                                       ['tensor', 'pipeline', 'micro_batch'])
    assert (c.mesh.data, c.mesh.fsdp, c.train.accum_steps, c.train.global_batch) == (1, 2, 8, 16)
    assert sets['mesh.data'] == 1 and sets['train.accum_steps'] == 8 and sets['mesh.tensor'] == 2
    # accum_steps swept: the global batch follows the data-parallel size
    c, _ = sweep_space.point_config(base, {'accum_steps': 3, 'micro_batch': 2}, 8, ['accum_steps', 'micro_batch'])
    assert (c.mesh.data, c.train.global_batch) == (4, 2 * 3 * 8)
    c, _ = sweep_space.point_config(base, {'size': '125m', 'tensor': 4}, 8, ['size', 'tensor'])
    assert (c.model.num_layers, c.model.d_model, c.model.num_heads, sweep_space.describe_model(c)) == (12, 768, 12,
                                                                                                       '125m')
    with pytest.raises(ConfigError, match='do not divide the 8 devices'):
        sweep_space.point_config(base, {'tensor': 3}, 8, ['tensor'])
    with pytest.raises(ConfigError, match='no whole number of accumulation steps'):
        sweep_space.point_config(base, {'micro_batch': 3}, 8, ['micro_batch'])
    with pytest.raises(ConfigError, match='needs at least 2 micro-batches'):  # config.validate
        sweep_space.point_config(base, {'pipeline': 2, 'micro_batch': 4}, 8, ['pipeline', 'micro_batch'])


# --------------------------------------------------------------------------- records


def _trial(tid='abc'):
    return sweep_trials.Trial(tid, {'tensor': 2}, 8, ('--config.mesh.tensor=2',), {'model': 'L2 d32', 'tensor': 2})


def test_results_store_appends_reloads_and_resumes(tmp_path):
    path = str(tmp_path / 'results.jsonl')
    store = sweep_trials.ResultStore(path)
    store.append(sweep_trials.base_record(_trial('a'), 'ok', tokens_per_s=10.0))
    store.append(sweep_trials.base_record(_trial('b'), 'crashed', error='boom'))
    with open(path, 'a') as f:
        f.write('{"trial_id": "c", "stat')  # a line cut by a killed sweep: that trial reruns
    again = sweep_trials.ResultStore(path)
    assert set(again.records) == {'a', 'b'}
    assert again.finished('a')['tokens_per_s'] == 10.0 and again.finished('b')['status'] == 'crashed'
    assert again.finished('b', retry_failed=True) is None and again.finished('a', retry_failed=True) is not None
    assert sweep_trials.trial_id('c.py', ['--x=1', '--y=2'], 8, (3, 5)) == sweep_trials.trial_id(
        'c.py', ['--y=2', '--x=1'], 8, (3, 5)) != sweep_trials.trial_id('c.py', ['--x=1', '--y=2'], 8, (3, 6))


def test_study_records_decisions_once_and_keeps_measurements(tmp_path):
    from jaxfrontier.sweep import launch as sweep_launch
    from jaxfrontier.sweep import run as sweep_run
    study = sweep_run.Study(workdir=str(tmp_path), config_spec='configs/tiny.py', base=tiny_base(), user_args=(),
                            warmup=1, steps=1, launcher=sweep_launch.LocalLauncher([sys.executable]), trial_env={})
    invalid = study.prepare({'tensor': 3}, 8, ['tensor'])
    trial = study.prepare({'tensor': 2}, 8, ['tensor'])
    assert invalid['status'] == 'invalid' and isinstance(trial, sweep_trials.Trial)
    assert '--config.train.steps=4' in trial.args and '--config.mesh.cpu_devices=8' in trial.args
    assert study.run([invalid]) == study.run([invalid]) == [invalid]
    assert len((tmp_path / 'results.jsonl').read_text().splitlines()) == 1  # decided twice, recorded once
    measured = sweep_trials.base_record(trial, 'ok', tokens_per_s=5.0)
    study.store.append(measured)
    skipped = sweep_trials.base_record(trial, 'skipped_plan', error='predicted not to fit')
    assert study.run([skipped]) == [measured]  # a measurement beats a prediction
    study.store.append(skipped)  # an earlier sweep skipped it: a --noplan_filter sweep must run it
    assert study.finished(trial) is None


@pytest.mark.parametrize('rc, timed_out, log, status, error', [
    (1, False, 'I1130 x] compile\n2024 E external/xla/...: RESOURCE_EXHAUSTED: Out of memory while trying to '
     'allocate 17.2GiB\nTraceback ...', 'oom', 'RESOURCE_EXHAUSTED: Out of memory'),
    (2, False, 'error: config.mesh = \'tensor 2\': the mesh needs 16 devices. Fix: ...', 'invalid',
     'config.mesh ='),
    (-11, False, 'I1130 x] compile: 1 s\nFatal Python error: Segmentation fault\n', 'crashed',
     'killed by SIGSEGV: Fatal Python error: Segmentation fault'),
    (1, False, 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad', 'crashed',
     'exit status 1: ValueError: bad\nTraceback (most recent call last):'),
    (137, False, '', 'crashed', 'exit status 137 (SIGKILL)'),
    (0, True, '', 'timeout', 'stopped after the trial timeout of 30 s'),
])
def test_failures_are_classified(rc, timed_out, log, status, error):
    got_status, got_error = sweep_trials.classify(rc, timed_out, log, 30)
    assert got_status == status and error in got_error, got_error
    assert 'I1130' not in got_error  # INFO lines are not the error


def test_measurement_is_the_mean_over_the_measured_steps():
    # Per-step fetch intervals jitter (a late fetch makes the next interval short); their sum does not.
    tokens = 16 * 32
    rows = [{'step': 1, 'train/loss': 5.0}]
    for step, t in ((2, 0.5), (3, 0.10), (4, 0.05), (5, 0.15), (6, 0.7)):
        rows.append({'step': step, 'train/loss': 5.0, 'perf/step_time_s': t, 'perf/tokens_per_s': tokens / t,
                     'perf/tokens_per_s_per_device': tokens / t / 8, 'perf/model_tflops_per_device': 1e-3 / t,
                     'perf/mfu': None, 'perf/megatron_hw_tflops_per_device': 2e-3 / t})
    log = 'I1 train.py] compile: 7.3 s; memory/peak_gib_per_device 0.001\nI1 train.py] done: {"step": 6, ' \
          '"memory/peak_gib_per_device": 0.0012}'
    m = sweep_trials.measure(rows, log, warmup=2, steps=3)
    assert m['step_time_s'] == pytest.approx(0.1)
    assert m['tokens_per_s'] == pytest.approx(tokens / 0.1) and m['tokens_per_s_per_device'] == pytest.approx(
        tokens / 0.8)
    assert m['tflops_per_device'] == pytest.approx(1e-2) and m['hw_tflops_per_device'] == pytest.approx(2e-2)
    assert m['mfu'] is None and m['compile_time_s'] == 7.3 and m['peak_memory_gib'] == 0.0012
    with pytest.raises(ValueError, match='2 of the 3 measured steps'):
        sweep_trials.measure(rows[:4], log, warmup=2, steps=3)  # steps 3, 4


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize('args, message', [
    ([], 'the search space is empty'),
    (['--space=tensr=1,2'], 'tensr=...: unknown parameter'),
    (['--space=tensor=1,2', '--max_trials=0'], 'a budget of no trials runs nothing'),
    (['--space=tensor=1,2', '--method=random'], 'needs a budget'),
    (['--space=tensor=1,2', '--config.mesh.tensor=2'], 'is swept, but --config.mesh.tensor also fixes it'),
    (['--space=tensor=3,5', '--noplan_filter'], 'no point of the search space has a valid layout on 8 devices'),
    (['--space=tensor=1', '--config.train.steps=9'], 'the sweep sets it for every trial'),
    (['--space=tensor=1', '--config.train.stepz=9'], 'the config has no field'),
])
def test_bad_input_is_one_line_and_runs_nothing(tmp_path, args, message):
    proc = sweep(tmp_path / 'w', *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith('error: ') and message in proc.stderr, proc.stderr
    assert 'Traceback' not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / 'w' / 'results.jsonl').exists()


# Stubs for a Slurm allocation of 2 nodes: scontrol names them; srun records its start and end in one
# log and exits 0 without training (the trials are recorded as crashed: no measured steps). A step
# ends only once two have started (or after 60 s), so the log's order of events, not a clock, says
# whether steps ran at the same time. One O_APPEND write per record keeps the lines whole and ordered.
_SCONTROL = '#!/bin/bash\n[[ "$*" == "show hostnames nid[01-02]" ]] && printf "nid01\\nnid02\\n"\n'
_SRUN = '''#!/bin/bash
python3 -c 'import json, os, sys, time
path = os.environ["STUB_LOG"]
def put(event):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (json.dumps({"event": event, "args": sys.argv[1:]}) + "\\n").encode())
    os.close(fd)
put("start")
deadline = time.monotonic() + 60
while time.monotonic() < deadline and open(path).read().count("\\"start\\"") < 2:
    time.sleep(0.05)
put("end")' "$@"
'''


def test_slurm_launcher_runs_trials_as_concurrent_srun_steps(tmp_path):
    bin_dir, log = tmp_path / 'bin', tmp_path / 'srun.jsonl'
    bin_dir.mkdir()
    for name, text in (('scontrol', _SCONTROL), ('srun', _SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = subprocess_env(PATH=f'{bin_dir}:{os.environ["PATH"]}', STUB_LOG=str(log), SLURM_JOB_ID='77',
                         SLURM_JOB_NODELIST='nid[01-02]', SLURM_NTASKS_PER_NODE='4', SLURM_CPUS_ON_NODE='32')
    # GPU trials (no simulated CPU devices) of 8 devices = 4 tasks x 2 GPUs: one node each, two at once.
    proc = sweep(tmp_path / 'w', '--space=tensor=1,2,4', '--launcher=slurm', '--devices_per_task=2',
                 '--config.mesh.cpu_devices=0', '--config.train.micro_batch=1', '--hardware=h100', '--warmup=1',
                 '--steps=1', env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    events = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [e for e in events if e['event'] == 'start']
    assert len(calls) == 3, events
    for call in calls:
        args = call['args']
        at = args.index(sys.executable)
        assert {'--nodes=1', '--ntasks=4', '--ntasks-per-node=4', '--exclusive', '--kill-on-bad-exit=1',
                '--gpus-per-task=2', '--gpu-bind=closest', '--cpus-per-task=8'} <= set(args[:at]), args  # 32 / 4
        assert args[at + 1:at + 3] == ['-m', 'jaxfrontier.main']
        assert '--config.distributed.devices_per_process=2' in args and '--config.mesh.cpu_devices=0' in args
    nodes = [next(a for a in c['args'] if a.startswith('--nodelist=')) for c in calls]
    assert sorted(nodes[:2]) == ['--nodelist=nid01', '--nodelist=nid02'], nodes  # the first two share the time
    order = [e['event'] for e in events]  # two steps at once; the third waits for a free node
    assert order[:2] == ['start', 'start'] and order.index('end') < len(order) - order[::-1].index('start') - 1, order
    records = [json.loads(line) for line in (tmp_path / 'w' / 'results.jsonl').read_text().splitlines()]
    assert [r['status'] for r in records] == ['crashed'] * 3
    assert all('0 of the 1 measured steps' in r['error'] for r in records)


def test_slurm_launcher_outside_an_allocation_says_how_to_submit(tmp_path):
    env = {k: v for k, v in subprocess_env().items() if not k.startswith('SLURM_')}
    proc = sweep(tmp_path / 'w', '--space=tensor=1,2', '--launcher=slurm', '--noplan_filter', env=env, timeout=120)
    assert proc.returncode == 2 and 'not inside a Slurm allocation' in proc.stderr and 'launch/sweep.sbatch' in \
        proc.stderr, proc.stderr


# --------------------------------------------------------------------------- end to end

# Stands in for `python` in one trial: the process dies of SIGSEGV as a crashing XLA would.
_CRASHING_PYTHON = '''#!/bin/bash
if [[ " $* " == *" --config.mesh.tensor=2 "* && " $* " == *" --config.train.micro_batch=1 "* ]]; then
  echo "Fatal Python error: Segmentation fault (made on purpose by the test)" >&2
  kill -SEGV $$
fi
exec {python} "$@"
'''


@pytest.mark.slow
def test_grid_sweep_end_to_end_records_failures_reports_and_resumes(tmp_path):
    python = tmp_path / 'python'
    python.write_text(_CRASHING_PYTHON.format(python=sys.executable))
    python.chmod(0o755)
    workdir = tmp_path / 'sweep'
    args = ('--space=tensor=1,2', '--space=micro_batch=1,4', '--warmup=2', '--steps=3', f'--python={python}')
    proc = sweep(workdir, *args)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    records = [json.loads(line) for line in (workdir / 'results.jsonl').read_text().splitlines()]
    by_point = {(r['point']['tensor'], r['point']['micro_batch']): r for r in records}
    assert len(records) == 4 == len(by_point)
    statuses = {k: r['status'] for k, r in by_point.items()}
    # tensor 1 (data 4 x fsdp 2), micro-batch 4: 16 / (4 x 8 replicas) is no whole accumulation
    assert statuses == {(1, 1): 'ok', (1, 4): 'invalid', (2, 1): 'crashed', (2, 4): 'ok'}, statuses
    crashed = by_point[2, 1]
    assert 'killed by SIGSEGV' in crashed['error'] and 'made on purpose' in crashed['error']
    assert 'no whole number of accumulation steps' in by_point[1, 4]['error']
    assert {r['pipeline'] for r in records if r['status'] == 'ok'} == {1} and by_point[2, 4]['accum_steps'] == 1
    for r in (r for r in records if r['status'] == 'ok'):
        assert r['data'] * r['fsdp'] * r['tensor'] * r['pipeline'] == 8 and r['global_batch'] == 16
        assert r['tokens_per_s'] == pytest.approx(16 * 32 / r['step_time_s'], rel=1e-6)
        assert r['tokens_per_s_per_device'] == pytest.approx(r['tokens_per_s'] / 8, rel=1e-6)
        assert r['tflops_per_device'] > 0 and 0 < r['mfu'] < 1 and r['hw_tflops_per_device'] > 0
        assert r['compile_time_s'] > 0 and r['peak_memory_gib'] > 0 and r['plan_memory_gib'] > 0
        assert r['step_time_min_s'] <= r['step_time_s'] <= r['step_time_max_s']
        rows = [json.loads(l) for l in (workdir / 'trials' / r['trial_id'] / 'metrics.jsonl').read_text().split('\n')
                if l]
        assert [row['step'] for row in rows] == list(range(1, 2 + 3 + 2 + 1))  # warm-up, measured, 2 more

    report = (workdir / 'report.md').read_text()
    assert '4 trials: 2 ok, 1 invalid, 1 crashed' in report
    assert all(f'| {r["trial_id"]} |' in report for r in records)
    with open(workdir / 'results.csv') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and rows[0]['status'] == 'ok'
    assert float(rows[0]['tokens_per_s']) == max(r['tokens_per_s'] for r in records if r['status'] == 'ok')
    plots = sorted(os.listdir(workdir / 'plots'))
    assert plots == ['best_per_model.png', 'tokens_per_s_vs_micro_batch.png', 'tokens_per_s_vs_tensor.png']
    for name in plots:
        for ax in png_axes(workdir / 'plots' / name):
            assert ax['x'] and ax['y'] and ax['title'], (name, ax)
    assert png_axes(workdir / 'plots' / 'tokens_per_s_vs_tensor.png')[0]['x'] == 'tensor'

    logs = {r['trial_id']: os.path.getmtime(workdir / 'trials' / r['trial_id'] / 'log.txt')
            for r in records if r['status'] != 'invalid'}
    time.sleep(0.05)
    again = sweep(workdir, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert '0 trials to run' in again.stdout and 'started' not in again.stdout, again.stdout
    assert len((workdir / 'results.jsonl').read_text().splitlines()) == 4
    assert logs == {tid: os.path.getmtime(workdir / 'trials' / tid / 'log.txt') for tid in logs}


# --------------------------------------------------------------------------- on a real Slurm


@pytest.mark.slow
def test_sweep_sbatch_runs_trials_as_concurrent_steps_of_one_allocation(slurm, tmp_path):  # noqa: F811
    """launch/sweep.sbatch on a real Slurm: a 2-task allocation runs two 1-task trials at the same time.

    A CPU allocation (--gpus-per-node=0): on the loopback cluster, whose two fake GPUs are both
    /dev/null, Slurm 22.05 runs GPU steps one at a time; the GPU options of a trial's srun are
    checked with a stub srun above.
    """
    workdir, output = tmp_path / 'sweep', str(tmp_path / 'job.out')
    status, text = sbatch(job_env(slurm, WORKDIR=str(workdir)), '--nodes=1', '--ntasks-per-node=2',
                          '--gpus-per-node=0', '--time=15', f'--output={output}', 'launch/sweep.sbatch',
                          'configs/tiny.py', *SMALL[1:], '--config.train.micro_batch=2', '--space=tensor=1,2',
                          '--devices_per_task=8', '--warmup=2', '--steps=2', timeout_s=600)
    job_output = open(output).read() if os.path.exists(output) else ''
    assert status == 0, (text, job_output[-5000:])
    records = [json.loads(line) for line in (workdir / 'results.jsonl').read_text().splitlines()]
    assert [r['status'] for r in records] == ['ok', 'ok'], job_output[-5000:]
    first, second = sorted(records, key=lambda r: r['start_time'])
    assert second['start_time'] < first['start_time'] + first['wall_s'], records  # they overlapped
    for r in records:
        log = (workdir / r['log']).read_text()
        assert log.startswith('$ srun --job-name=trial-') and '--ntasks=1' in log.splitlines()[0]
        assert 'of 8 global' in log and 'step creation temporarily disabled' not in log
    assert (workdir / 'report.md').exists()


def test_study_with_verify_skips_trials_of_a_failing_layout_and_checks_each_layout_once(tmp_path):
    """--verify: a layout whose check fails is recorded skipped_verify with the certificate's line."""
    from jaxfrontier.sweep import launch as sweep_launch
    from jaxfrontier.sweep import run as sweep_run
    checked = []

    def check(trial, c):
        checked.append(c.mesh.tensor)
        passed = c.mesh.tensor == 2
        return {'passed': passed, 'line': f'verify: {"PASS" if passed else "FAIL"} tensor {c.mesh.tensor}',
                'certificate': None}

    study = sweep_run.Study(workdir=str(tmp_path), config_spec='configs/tiny.py', base=tiny_base(), user_args=(),
                            warmup=1, steps=1, launcher=sweep_launch.LocalLauncher([sys.executable]), trial_env={},
                            verify=check)
    good, bad = study.prepare({'tensor': 2}, 8, ['tensor']), study.prepare({'tensor': 4}, 8, ['tensor'])
    assert isinstance(good, sweep_trials.Trial), good
    assert bad['status'] == 'skipped_verify' and bad['error'] == 'verify: FAIL tensor 4'
    assert checked == [2, 4]
    assert 'skipped_verify' in sweep_trials.STATUSES


@pytest.mark.slow
def test_verifier_runs_main_verify_once_per_shrunk_layout(tmp_path):
    """The real check (python -m jaxfrontier.main --mode=verify) of a trial; an equal shrunk config reuses it."""
    from jaxfrontier.sweep import launch as sweep_launch
    from jaxfrontier.sweep import run as sweep_run
    from jaxfrontier.sweep import verify as sweep_verify
    from jaxfrontier.plan import verify as verify_lib
    logged = []
    check = sweep_verify.verifier([sys.executable], subprocess_env(), str(tmp_path), 'configs/tiny.py', 600,
                                  logged.append)
    study = sweep_run.Study(workdir=str(tmp_path), config_spec='configs/tiny.py', base=tiny_base(), user_args=(),
                            warmup=1, steps=1, launcher=sweep_launch.LocalLauncher([sys.executable]),
                            trial_env={}, verify=check)
    # data 4 x fsdp 2 with ZeRO-1: also the check that a ZeRO-1 layout's certificate passes and says so
    # (tests/plan/test_verify.py certifies tensor and pipeline layouts in process).
    point = {'micro_batch': 1, 'zero1': True}
    first = study.prepare(point, 8, list(point))
    again = study.prepare(point, 8, list(point))  # the same layout: checked once
    assert isinstance(first, sweep_trials.Trial) and isinstance(again, sweep_trials.Trial)
    runs = [line for line in logged if 'checking' in line]
    verdicts = [line for line in logged if 'verify: PASS' in line]
    assert len(verdicts) == len(runs) >= 1, logged
    certificate = sweep_verify.certificate(check(first, sweep_run.ml_collections.ConfigDict(first.config))['certificate'])
    assert certificate['passed'] and certificate['devices'] == 8 and certificate['kept']['sharding.zero1']
    line = verify_lib.summary(certificate)
    assert line.startswith('verify: PASS ') and ': data 4 x fsdp 2 (8 cpu devices' in line, line
    assert 'ZeRO-1' in line, line
    assert len([line for line in logged if 'checking' in line]) == len(runs)  # the same layout: not checked again
