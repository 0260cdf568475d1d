"""launch/slurm.sbatch on a real Slurm: a 2-task job joins one 8-device mesh and trains like one process.

The fixture starts munged, slurmctld and slurmd (Debian's packages; .ci/run installs them) on
loopback with the configuration in tests/slurm/, for one node with 4 CPUs and 2 fake GPUs, and
stops them by PID afterwards. The test `sbatch`es launch/slurm.sbatch exactly as a user would,
with CPU settings (JAX_PLATFORMS=cpu; configs/tiny.py's 8 simulated devices are the job's total,
4 per task), waits for it, and checks from the job's output that both tasks joined one 8-device
mesh through Slurm's environment, that process 0 alone wrote the metrics, whose losses equal
the single-process 8-device run's to fp32 rounding (rtol 2e-6), and that both wrote their
checkpoint shards. A second job records how Slurm's GPU binding sets the visible devices and
checks the GPU each task then selects. A third, with a stand-in for the trainer, checks the
time-limit path: USR1 to the batch shell reaches both tasks and the job requeues itself; and
that launch/slurm.sbatch's binding gives each task one GPU of its own. A fourth kills one task's
process mid-run, then stops one (SIGSTOP: a hang) in the restarted step: the job restarts inside
its allocation twice (launch/restarts.sh), process 0's watchdog writes its stacks for the hang,
and the run ends with the uninterrupted run's losses.
"""

import glob
import json
import os
import signal
import subprocess
import time

import pytest

from processes import REPO, TINY, read_metrics, single_process_losses
from slurm_cluster import job_env, sbatch

LOSS_RTOL = 2e-6


@pytest.mark.slow
def test_slurm_job_joins_one_mesh_and_trains_like_one_process(slurm, tmp_path):
    workdir, output = str(tmp_path / 'workdir'), str(tmp_path / 'job.out')
    status, text = sbatch(job_env(slurm, WORKDIR=workdir), '--nodes=1', '--ntasks-per-node=2', '--gpus-per-node=2',
                          '--time=15', f'--output={output}', 'launch/slurm.sbatch', 'configs/tiny.py', *TINY[1:],
                          '--config.sharding.zero1=True', '--config.train.steps=3')
    job_output = open(output).read() if os.path.exists(output) else ''
    assert status == 0, (text, job_output[-5000:])

    for process in (0, 1):
        assert f'process {process}/2 on ' in job_output, job_output[-5000:]
    assert job_output.count('4 local device(s)') == 2 and job_output.count('of 8 global') == 2
    assert job_output.count('(slurm); local device ids all') == 2  # Slurm mode; CPU: no GPU selection
    assert "over 8 cpu devices (2 process(es))" in job_output

    rows = read_metrics(workdir)
    assert [row['step'] for row in rows] == [1, 2, 3]  # written once: by process 0 only
    reference = single_process_losses('--config.sharding.zero1=True')
    for row in rows:
        assert row['train/loss'] == pytest.approx(reference[row['step']], rel=LOSS_RTOL), row
    done = json.loads(job_output.split('done: ', 1)[1].splitlines()[0])  # the log keeps 6 significant digits
    assert done['step'] == 3 and done['train/loss'] == pytest.approx(reference[3], abs=6e-5)
    state = os.path.join(workdir, 'checkpoints', '3', 'state')
    assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(state))


# Prints, per task, what distributed.py selects from the environment Slurm gave it (no JAX).
_SELECTION = ('import json, os; from jaxfrontier import distributed as d; '
              'print("SELECTION", json.dumps([int(os.environ["SLURM_LOCALID"]), '
              'os.environ.get("CUDA_VISIBLE_DEVICES"), d.slurm_local_device_ids(os.environ, 1)]))')


@pytest.mark.slow
def test_slurm_gpu_binding_gives_each_task_its_gpu(slurm, tmp_path):
    output = str(tmp_path / 'job.out')
    script = (f"srun --gpu-bind=map_gpu:0,1 python -c '{_SELECTION}'\n"
              f"srun python -c '{_SELECTION}'\n")
    status, text = sbatch(job_env(slurm), '--nodes=1', '--ntasks-per-node=2', '--gpus-per-node=2', '--time=5',
                          f'--output={output}', f'--wrap={script}', timeout_s=120)
    lines = [json.loads(line.split(None, 1)[1]) for line in open(output) if line.startswith('SELECTION')]
    assert status == 0 and len(lines) == 4, (text, open(output).read())
    # Bound (map_gpu): each task sees only its own GPU and uses all it sees.
    # Unbound: both see both GPUs and task i takes GPU i.
    assert sorted(map(tuple, lines)) == [(0, '0', None), (0, '0,1', [0]), (1, '0,1', [1]), (1, '1', None)]


# Stands in for `python` in the job: waits for USR1 like the trainer's preemption handler, exits 0.
_TRAINER_STUB = '''#!/bin/bash
trap 'echo "task $SLURM_PROCID got USR1" >> "$STUB_LOG"; exit 0' USR1
echo "task $SLURM_PROCID gpus ${CUDA_VISIBLE_DEVICES:-none} cpus $(nproc)" >> "$STUB_LOG"
echo "task $SLURM_PROCID restart ${SLURM_RESTART_COUNT:-0}: python $*" >> "$STUB_LOG"
for _ in $(seq 1200); do sleep 0.1; done
exit 9
'''


def _job_state(slurm, job_id):
    text = subprocess.run(['scontrol', 'show', 'job', job_id], env=job_env(slurm), capture_output=True,
                          text=True).stdout
    return dict(item.split('=', 1) for item in text.split() if '=' in item)


@pytest.mark.slow
def test_slurm_time_limit_signal_reaches_tasks_then_job_requeues(slurm, tmp_path):
    """`scancel --batch --signal=USR1` is what `--signal=B:USR1@300` sends before the time limit."""
    bin_dir, log, output = tmp_path / 'bin', tmp_path / 'stub.log', str(tmp_path / 'job.out')
    bin_dir.mkdir()
    (bin_dir / 'python').write_text(_TRAINER_STUB)
    (bin_dir / 'python').chmod(0o755)
    env = job_env(slurm, STUB_LOG=str(log), WORKDIR=str(tmp_path / 'workdir'))
    env['PATH'] = f'{bin_dir}:{env["PATH"]}'
    submitted = subprocess.run(['sbatch', '--parsable', '--chdir', REPO, '--nodes=1', '--ntasks-per-node=2',
                                '--gpus-per-node=2', '--time=5', f'--output={output}', 'launch/slurm.sbatch',
                                'configs/tiny.py'], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    job_id = submitted.stdout.strip().split(';')[0]
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().count('restart 0:') == 2):
            assert time.monotonic() < deadline, (log.read_text() if log.exists() else '', _job_state(slurm, job_id))
            time.sleep(0.2)
        subprocess.run(['scancel', '--batch', '--signal=USR1', job_id], env=env, check=True)
        deadline = time.monotonic() + 60
        while _job_state(slurm, job_id).get('Restarts') != '1':
            assert time.monotonic() < deadline, (log.read_text(), _job_state(slurm, job_id))
            time.sleep(0.5)
    finally:
        subprocess.run(['scancel', job_id], env=env, capture_output=True)
    lines = log.read_text().splitlines()
    assert sorted(l for l in lines if 'got USR1' in l) == ['task 0 got USR1', 'task 1 got USR1']
    # launch/slurm.sbatch's binding: one GPU of its own per task (--gpus-per-task=1).
    gpus = {l.split()[1]: l.split()[3] for l in lines if ' gpus ' in l}
    assert sorted(gpus.values()) == ['0', '1'], lines
    assert 'time limit near: checkpointing, then requeueing job' in open(output).read()


@pytest.mark.slow
def test_slurm_job_restarts_inside_its_allocation_after_a_kill_and_a_hang(slurm, tmp_path):
    """Faults through the job's environment (run/control/watchdog.py, JAXFRONTIER_TEST_HANG), each fired once.

    Attempt 1: process 1 stalls when it sees step 2's result; the test kills it (SIGKILL, by the pid
    it left). Attempt 2 resumes from the newest checkpoint; process 1 stops itself (SIGSTOP) at step
    3, so process 0 waits on it until its watchdog's timeout: stacks, exit 5. Attempt 3 finishes.
    """
    workdir, output, faults = tmp_path / 'workdir', str(tmp_path / 'job.out'), tmp_path / 'faults'
    faults.mkdir()
    (faults / 'hang-1-2').write_text('sleep')
    (faults / 'hang-1-3').write_text('stop')
    env = job_env(slurm, WORKDIR=str(workdir), JAXFRONTIER_TEST_HANG=str(faults), JF_MAX_RESTARTS='3')
    job = subprocess.Popen(['sbatch', '--wait', '--chdir', REPO, '--nodes=1', '--ntasks-per-node=2',
                            '--gpus-per-node=2', '--time=15', f'--output={output}', 'launch/slurm.sbatch',
                            'configs/tiny.py', *TINY[1:], '--config.sharding.zero1=True', '--config.train.steps=4',
                            '--config.checkpoint.every_steps=1', '--config.train.hang_timeout_s=30',
                            '--config.train.hang_min_s=10', '--config.train.hang_native_stacks=False',
                            '--config.distributed.heartbeat_timeout_s=600'],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (faults / 'hung-1-2').exists() or not (faults / 'hung-1-2').read_text().strip():
            assert job.poll() is None and time.monotonic() < deadline, open(output).read()[-5000:]
            time.sleep(0.2)
        os.kill(int((faults / 'hung-1-2').read_text()), signal.SIGKILL)  # a process dies mid-run
        text, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    job_output = open(output).read()
    assert job.returncode == 0, (text, job_output[-6000:])
    records = [json.loads(line) for line in open(workdir / 'restarts.jsonl')]
    assert [(r['restart'], r['code']) for r in records] == [(1, 'signal'), (2, '5')], records
    assert 'restart 2/3 of job' in job_output and 'requeueing' not in job_output
    [stacks] = glob.glob(str(workdir / 'hang' / '0-*.txt'))  # process 0 saw the hang (process 1 was stopped)
    text = open(stacks).read()
    assert text.startswith('hang detected in process 0') and 'train.hang_timeout_s=30' in text
    assert 'Current thread' in text and '_train_and_evaluate' in text
    rows = read_metrics(str(workdir))
    reference = single_process_losses('--config.sharding.zero1=True')
    assert rows[-1]['step'] == 4
    for row in rows:  # every attempt's rows, replayed ones too, equal the uninterrupted run's
        assert row['train/loss'] == pytest.approx(reference[row['step']], rel=LOSS_RTOL), row
