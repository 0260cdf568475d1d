"""Two processes on localhost train like one, checkpoint for one, and never hang on a dead peer.

Each test runs real `python -m jaxfrontier.main` processes (launch/local.sh for the pair):

* Two processes x 4 simulated CPU devices train configs/tiny.py (one small layer) for 3 steps
  with data 2 x fsdp 2 x tensor 2 spanning both processes, with ZeRO-1 so that the optimizer
  state is split across the processes too. Every step's loss equals the single-process
  8-device run's to fp32 rounding (rtol 2e-6, as tests/layout_check.py: the two runs differ
  only in the order of the cross-process reductions). Only process 0 writes metrics; each
  process writes its own checkpoint shards. One process on 8 devices then restores that
  checkpoint and its step 4 equals the uninterrupted single-process run's step 4.
* Killing either process of a training pair ends the other with a non-zero status and JAX's
  message naming the dead task. The bound: the coordinator's death is seen at once (its socket
  closes); another process's death after config.distributed.heartbeat_timeout_s (10 s here,
  60 s by default) plus a few seconds. The test allows 60 s; the default stays under 2 minutes.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from processes import REPO, TINY, free_port, read_metrics, single_process_losses, subprocess_env

LOSS_RTOL = 2e-6
HEARTBEAT_S = 10
PEER_DEATH_BOUND_S = 60


@pytest.fixture(scope='module')
def env():
    return subprocess_env()


def run(cmd, env, timeout_s=600):
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoint_for_one(tmp_path, env):
    main = [sys.executable, '-m', 'jaxfrontier.main', *TINY, '--config.sharding.zero1=True']
    pair_dir = str(tmp_path / 'two_processes')
    reference = single_process_losses('--config.sharding.zero1=True')  # steps 1..4

    pair = ['bash', 'launch/local.sh', '2', *main[3:], '--config.train.steps=3', f'--workdir={pair_dir}']
    output = run(pair, dict(env, JF_PORT=str(free_port())))
    for process in (0, 1):
        assert f'process {process}/2 on ' in output and '4 local device(s)' in output
    assert output.count('of 8 global') == 2, output[-4000:]
    assert "mesh: {'pipeline': 1, 'data': 2, 'fsdp': 2, 'context': 1, 'tensor': 2} over 8 cpu devices (2 process(es))" in output

    rows = read_metrics(pair_dir)
    assert [row['step'] for row in rows] == [1, 2, 3]  # written once: by process 0 only
    for row in rows:
        assert row['train/loss'] == pytest.approx(reference[row['step']], rel=LOSS_RTOL), row
    state_dir = os.path.join(pair_dir, 'checkpoints', '3', 'state')
    assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(state_dir))  # each wrote its shards

    output = run([*main, '--config.train.steps=4', f'--workdir={pair_dir}'], env)
    assert 'process 0/1 on ' in output and '8 local device(s) [0,1,2,3,4,5,6,7] of 8 global' in output
    assert 'restored step 3' in output
    rows = read_metrics(pair_dir)
    assert [row['step'] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]['train/loss'] == pytest.approx(reference[4], rel=LOSS_RTOL)


def start_pair(workdir, env, log_dir):
    """The pair of the test above (its compiled steps are cached), training for a long time."""
    port = free_port()
    procs = []
    for process in (0, 1):
        cmd = [sys.executable, '-m', 'jaxfrontier.main', *TINY, '--config.sharding.zero1=True', f'--workdir={workdir}',
               '--config.train.steps=100000', '--config.checkpoint.enabled=False',
               f'--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}', '--config.distributed.mode=explicit',
               f'--config.distributed.coordinator_address=127.0.0.1:{port}',
               '--config.distributed.num_processes=2', f'--config.distributed.process_id={process}']
        log = open(os.path.join(log_dir, f'process_{process}.log'), 'w')  # pylint: disable=consider-using-with
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    return procs


@pytest.mark.slow
@pytest.mark.parametrize('victim', [1, 0], ids=['worker_dies', 'coordinator_dies'])
def test_killed_process_ends_its_peer_within_bound(tmp_path, env, victim):
    workdir = str(tmp_path / 'run')
    procs = start_pair(workdir, env, str(tmp_path))
    survivor = procs[1 - victim]
    try:
        deadline = time.monotonic() + 400
        while len(read_metrics(workdir)) < 2:  # both processes are inside the training loop
            assert all(p.poll() is None for p in procs), open(tmp_path / 'process_0.log').read()[-4000:]
            assert time.monotonic() < deadline, 'training did not start'
            time.sleep(0.2)
        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            status = survivor.wait(timeout=PEER_DEATH_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f'process {1 - victim} still running {PEER_DEATH_BOUND_S} s after its peer died: a hang')
        elapsed_s = time.monotonic() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    log = open(tmp_path / f'process_{1 - victim}.log').read()
    assert status != 0, log[-3000:]
    assert 'This most likely indicates that another task died' in log, log[-3000:]
    if victim == 1:
        assert 'stopped sending heartbeats' in log, log[-3000:]
    print(f'process {1 - victim} exited with status {status} {elapsed_s:.1f} s after process {victim} was killed')


@pytest.mark.slow
def test_local_sh_jobs_side_by_side_and_sigterm(tmp_path, env):
    """Two launch/local.sh jobs at once (default ports) both train; SIGTERM to each: checkpoint, exit 0.

    launch/local.sh picks a free coordinator port unless JF_PORT is set (a fixed default made the
    second job's coordinator collide with the first's), passes SIGTERM to its processes as the
    trainer's preemption signal, waits for them and returns their status.
    """
    job_env = {k: v for k, v in env.items() if k != 'JF_PORT'}
    job_env['PATH'] = f'{os.path.dirname(sys.executable)}:{env["PATH"]}'
    jobs = []
    for name in ('a', 'b'):
        workdir = str(tmp_path / name)
        cmd = ['bash', 'launch/local.sh', '2', *TINY, '--config.sharding.zero1=True', '--config.train.steps=100000',
               f'--workdir={workdir}', '--config.checkpoint.every_steps=100000']
        log = open(tmp_path / f'{name}.log', 'w')  # pylint: disable=consider-using-with
        jobs.append((workdir, subprocess.Popen(cmd, cwd=REPO, env=job_env, stdout=log, stderr=subprocess.STDOUT)))
        log.close()
    try:
        deadline = time.monotonic() + 500
        while not all(read_metrics(workdir) for workdir, _ in jobs):  # both jobs are training
            for name, (_, proc) in zip('ab', jobs):
                assert proc.poll() is None, open(tmp_path / f'{name}.log').read()[-4000:]
            assert time.monotonic() < deadline, 'training did not start'
            time.sleep(0.2)
        for _, proc in jobs:
            proc.send_signal(signal.SIGTERM)
        statuses = [proc.wait(timeout=300) for _, proc in jobs]
    finally:
        for _, proc in jobs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = [open(tmp_path / f'{name}.log').read() for name in 'ab']
    assert statuses == [0, 0], [log[-3000:] for log in logs]
    for workdir, _ in jobs:  # when local.sh returned, both processes had written their shards
        steps = os.listdir(os.path.join(workdir, 'checkpoints'))
        state = os.path.join(workdir, 'checkpoints', max(steps, key=int), 'state')
        assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(state)), steps
