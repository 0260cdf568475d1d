"""One run per workdir (run/control/workdir_lock.py, docs/checkpoints.md "The workdir lock").

A second `python -m jaxfrontier.main` on a live workdir refuses at start (exit 2) naming the
holder; a holder killed with SIGKILL, a requeued Slurm job's own lock and an expired lease are
taken over with a warning.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxfrontier.errors import UserError
from jaxfrontier.run import loop
from jaxfrontier.run.control import workdir_lock
import processes
from test_bad_input import good_config


def write_lock(workdir, **fields):
    record = {'host': 'other-node', 'pid': 4242, 'slurm_job_id': None, 'start_time': '2026-01-01T00:00:00+00:00',
              'renewed_at': time.time(), 'token': 'abc', **fields}
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, workdir_lock.LOCK_NAME), 'w') as f:
        json.dump(record, f)
    return record


def test_live_holder_refuses_and_names_it(tmp_path):
    write_lock(tmp_path, slurm_job_id='777')
    with pytest.raises(UserError) as info:
        workdir_lock.WorkdirLock(str(tmp_path), 600, env={}).acquire()
    message = str(info.value)
    for text in ('in use by another run', 'host other-node', 'pid 4242', 'Slurm job 777', 'started 2026-01-01',
                 'Fix:'):
        assert text in message, (text, message)


def test_expired_lease_is_taken_over(tmp_path):
    write_lock(tmp_path, renewed_at=time.time() - 601)
    warnings = []
    lock = workdir_lock.WorkdirLock(str(tmp_path), 600, env={}, warn=warnings.append)
    lock.acquire()
    try:
        assert lock.read()['token'] == lock.record['token']
        assert len(warnings) == 1 and 'lease was last renewed 601 s ago' in warnings[0], warnings
    finally:
        lock.release()
    assert os.listdir(tmp_path) == []


def test_requeued_slurm_job_takes_over_its_own_lock(tmp_path):
    write_lock(tmp_path, slurm_job_id='123456')  # live lease, another host: only the job id says it is ours
    warnings = []
    lock = workdir_lock.WorkdirLock(str(tmp_path), 600, env={'SLURM_JOB_ID': '123456'}, warn=warnings.append)
    lock.acquire()
    lock.release()
    assert 'this Slurm job (123456), requeued' in warnings[0], warnings
    with pytest.raises(UserError, match='Slurm job 123456'):  # a different job still refuses
        write_lock(tmp_path, slurm_job_id='123456')
        workdir_lock.WorkdirLock(str(tmp_path), 600, env={'SLURM_JOB_ID': '999'}).acquire()


def test_dead_pid_on_this_host_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, '-c', 'pass'])
    dead.wait()
    write_lock(tmp_path, host=socket.gethostname(), pid=dead.pid)
    warnings = []
    with workdir_lock.WorkdirLock(str(tmp_path), 600, env={}, warn=warnings.append):
        pass
    assert f'its process {dead.pid} on this host is gone' in warnings[0], warnings


def test_lease_is_renewed_and_a_stolen_lock_is_noticed(tmp_path):
    warnings = []
    lock = workdir_lock.WorkdirLock(str(tmp_path), 0.5, env={}, warn=warnings.append)
    lock.acquire()
    first = lock.read()['renewed_at']
    assert lock.renew() and lock.read()['renewed_at'] > first
    write_lock(tmp_path, token='someone-else')
    assert not lock.renew() and 'no longer held by this run' in warnings[-1]
    lock.release()  # leaves the other holder's lock alone
    assert workdir_lock.WorkdirLock(str(tmp_path), 600).read()['token'] == 'someone-else'


def test_train_and_evaluate_takes_over_and_releases(tmp_path, monkeypatch):
    """The loop takes the lock before writing anything and releases it even when it fails."""
    workdir = tmp_path / 'wd'
    write_lock(workdir, renewed_at=time.time() - 10_000)

    def reached(*args, **kwargs):
        assert json.load(open(workdir / workdir_lock.LOCK_NAME))['pid'] == os.getpid()
        raise RuntimeError('past the lock')

    monkeypatch.setattr(loop.mesh_lib, 'mesh_from_config', reached)
    with pytest.raises(RuntimeError, match='past the lock'):
        loop.train_and_evaluate(good_config(), str(workdir))
    assert not (workdir / workdir_lock.LOCK_NAME).exists()


@pytest.mark.slow  # three processes, one compile
def test_cli_second_run_refuses_and_sigkilled_holder_is_taken_over(tmp_path):
    """Two live runs: the second exits 2 naming the first; after SIGKILL a third run takes over."""
    workdir = str(tmp_path / 'wd')
    env = processes.subprocess_env()
    cmd = [sys.executable, '-m', 'jaxfrontier.main', *processes.TINY, '--config.checkpoint.enabled=False',
           '--config.data.kind=synthetic', f'--workdir={workdir}']
    first = subprocess.Popen([*cmd, '--config.train.steps=100000'], cwd=processes.REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock_path = os.path.join(workdir, workdir_lock.LOCK_NAME)
        deadline = time.monotonic() + 300  # a timeout, not a measurement
        while not os.path.exists(lock_path):
            assert first.poll() is None and time.monotonic() < deadline, 'the first run never took the lock'
            time.sleep(0.2)
        second = subprocess.run([*cmd, '--config.train.steps=1'], cwd=processes.REPO, env=env,
                                capture_output=True, text=True, timeout=300)
        line = processes.error_line(second)
        assert f'pid {first.pid}' in line and f'host {socket.gethostname()}' in line, line
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert os.path.exists(lock_path)  # SIGKILL leaves it behind
    third = subprocess.run([*cmd, '--config.train.steps=1'], cwd=processes.REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f'taking over {lock_path}' in third.stderr and f'its process {first.pid} on this host is gone' in \
        third.stderr, third.stderr[-3000:]
    assert not os.path.exists(lock_path)
