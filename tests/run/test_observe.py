"""A run with a restart, through `python -m jaxfrontier.main`: goodput adds up, W&B offline resumes its run.

The first attempt trains 5 steps (checkpoints at 2, 4, 5; evaluations at 2, 4, 5); the second
resumes from step 2 (`checkpoint.restore_step=2`, as after losing the newer checkpoints) and
trains to 7, so steps 3, 4, 5 run again. Both attempts log to one W&B run in offline mode when
`wandb` is installed (the `test` extra has it); the run's `.wandb` files are read back with W&B's
own reader (`wandb leet inspect --json`).
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

import processes

ARGS = (*processes.TINY, '--config.data.kind=synthetic', '--config.checkpoint.every_steps=2',
        '--config.train.eval_every=2')
WANDB = importlib.util.find_spec('wandb') is not None
PARTS = ('startup', 'compile', 'checkpoint', 'eval', 'productive', 'replayed')


def run(workdir, *args):
    offline = ('--config.train.wandb_mode=offline',) if WANDB else ()
    proc = processes.run_main(*ARGS, f'--workdir={workdir}', *args, *offline, tiny=False,
                              env=processes.subprocess_env(WANDB_SILENT='true'))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope='module')
def restarted(tmp_path_factory):
    """The workdir of the two attempts, and the second one's output."""
    workdir = tmp_path_factory.mktemp('observe')
    run(workdir, '--config.train.steps=5')
    output = run(workdir, '--config.train.steps=7', '--config.checkpoint.restore_step=2')
    return workdir, output


@pytest.mark.slow  # two short runs
def test_goodput_parts_add_up_to_the_wall_time_and_replayed_steps_are_counted(restarted):
    workdir, output = restarted
    record = json.loads((workdir / 'goodput.json').read_text())
    first, second = record['attempts']
    for attempt in (first, second):
        parts = sum(attempt[f'{k}_s'] for k in PARTS)
        assert abs(attempt['wall_s'] - parts) <= 0.05 * attempt['wall_s'], attempt
        assert attempt['other_s'] == pytest.approx(attempt['wall_s'] - parts)
        assert min(attempt[f'{k}_s'] for k in ('startup', 'compile', 'checkpoint', 'eval', 'productive')) > 0, attempt
        assert attempt['finished']
    assert (first['start_step'], first['end_step'], first['replayed_steps'], first['replayed_s']) == (0, 5, 0, 0)
    assert (second['start_step'], second['end_step'], second['replayed_steps']) == (2, 7, 3)
    assert second['replayed_s'] > 0
    total = record['total']
    for key in (*(f'{k}_s' for k in (*PARTS, 'wall')), 'replayed_steps'):
        assert total[key] == pytest.approx(first[key] + second[key]), key
    assert abs(total['other_s']) <= 0.05 * total['wall_s']

    rows = processes.read_metrics(workdir)
    assert [r['step'] for r in rows] == [1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    assert rows[-1]['goodput/replayed_steps'] == 3 and rows[-1]['goodput/total/replayed_steps'] == 3
    assert rows[4]['goodput/total/wall_s'] == rows[4]['goodput/wall_s']  # the first attempt's last row
    assert rows[-1]['goodput/total/wall_s'] > rows[-1]['goodput/wall_s']
    summary = [line for line in output.splitlines() if 'goodput: ' in line]
    assert len(summary) == 1 and 'over 2 attempts' in summary[0] and ', 3 replayed steps ' in summary[0], summary
    done = json.loads(output.split('done: ', 1)[1].splitlines()[0])
    assert done['goodput/goodput'] == pytest.approx(second['goodput'], rel=0.05)


def wandb_records(path):
    """The records of one `.wandb` transaction log, read by W&B's own reader."""
    proc = subprocess.run([sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json', path], capture_output=True,
                          text=True, timeout=120, env=processes.subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.mark.slow  # the runs above
@pytest.mark.skipif(not WANDB, reason="wandb is not installed (pip install 'jaxfrontier[wandb]' or the test extra)")
def test_wandb_offline_holds_every_row_and_the_restart_resumes_the_same_run(restarted):
    workdir, _ = restarted
    run_id = (workdir / 'wandb_run_id').read_text().strip()
    files = sorted(glob.glob(os.path.join(workdir, 'wandb', 'offline-run-*', f'run-{run_id}.wandb')))
    assert len(files) == 2, os.listdir(workdir / 'wandb')  # one per attempt, the same run id
    rows = processes.read_metrics(workdir)
    expected = [{r['step']: r for r in rows[:5]}, {r['step']: r for r in rows[5:] if not r.get('replayed')}]
    for path, want in zip(files, expected):
        records = wandb_records(path)
        run = next(r['run'] for r in records if r['type'] == 'run')
        assert run['run_id'] == run_id and run['project'] == 'jaxfrontier' and run['resume'], run
        history = {r['history']['step']['num']: r['history']['item'] for r in records if r['type'] == 'history'}
        assert sorted(history) == sorted(want)  # the replayed steps 3..5 are not sent twice
        for step, row in want.items():
            for key, value in row.items():
                if key != 'step' and value is not None:
                    assert history[step][key] == pytest.approx(value, rel=1e-6), (step, key)
        config = {}
        for r in records:
            if r['type'] == 'config':
                config.update(r['config'].get('update', {}))
        assert config['train']['steps'] == max(want), config.get('train')
        summary = {}
        for r in records:
            if r['type'] == 'summary':
                summary.update(r['summary'].get('update', {}))
        assert summary['goodput/goodput'] > 0 and 'goodput/total/wall_s' in summary
