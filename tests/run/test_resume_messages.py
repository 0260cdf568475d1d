"""What a resumed or interrupted run tells the user (issue 12, item 13), through `python -m jaxfrontier.main`.

A commit is logged (step, GiB, seconds); rows of steps run again after a resume are marked
`"replayed": true` in metrics.jsonl; `train.steps` at or below the restored step says that
nothing ran; the first Ctrl-C stops like SIGTERM with a committed checkpoint, a second stops
at once.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import processes

ARGS = (*processes.TINY, '--config.data.kind=synthetic', '--config.checkpoint.keep=5')


def command(workdir, *args):
    return [sys.executable, '-m', 'jaxfrontier.main', *ARGS, f'--workdir={workdir}', *args]


def run(workdir, *args):
    proc = processes.run_main(*ARGS, f'--workdir={workdir}', *args, tiny=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow  # three short runs
def test_commit_lines_replayed_rows_and_nothing_ran(tmp_path):
    workdir = tmp_path / 'wd'
    first = run(workdir, '--config.train.steps=3', '--config.checkpoint.every_steps=2')
    for step in (2, 3):
        assert f'checkpoint: step {step} committed, ' in first.stderr, first.stderr[-4000:]
    assert ' GiB, ' in first.stderr and 's after its save started' in first.stderr
    assert [r['step'] for r in processes.read_metrics(workdir)] == [1, 2, 3]
    assert not any('replayed' in r for r in processes.read_metrics(workdir))

    shutil.rmtree(workdir / 'checkpoints' / '3')  # as if killed after logging step 3, before its save
    run(workdir, '--config.train.steps=4', '--config.checkpoint.every_steps=2')
    rows = [(r['step'], r.get('replayed', False)) for r in processes.read_metrics(workdir)]
    assert rows == [(1, False), (2, False), (3, False), (3, True), (4, False)], rows

    again = run(workdir, '--config.train.steps=2')
    assert 'nothing ran: the checkpoint restored is at step 4 and train.steps = 2' in again.stdout, again.stdout
    assert 'raise --config.train.steps above 4' in again.stdout


def start(workdir):
    proc = subprocess.Popen(command(workdir, '--config.train.steps=100000', '--config.checkpoint.every_steps=0'),
                            cwd=processes.REPO, env=processes.subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 400  # a timeout, not a measurement
    while len(processes.read_metrics(workdir)) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    return proc


@pytest.mark.slow  # one run
def test_first_sigint_commits_and_exits(tmp_path):
    proc = start(tmp_path / 'once')
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    assert 'KeyboardInterrupt' not in err and 'press Ctrl-C again to stop at once' in err, err[-4000:]
    assert 'preempted by SIGINT after step' in out and 'checkpoint committed to' in out, out
    assert os.listdir(tmp_path / 'once' / 'checkpoints'), 'no checkpoint committed'


SECOND_SIGINT = """
import os, signal, sys, time, types
from jaxfrontier.run.control import interrupt
watcher = types.SimpleNamespace(received=None)
with interrupt.first_interrupt_stops(watcher):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the handler runs in the main thread, between bytecodes
    print('first:', watcher.received, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
    print('still running after the second SIGINT', flush=True)
"""


def test_second_sigint_stops_at_once():
    """The handler itself (a real run ends too fast after the first SIGINT to aim a second at it)."""
    proc = subprocess.run([sys.executable, '-c', SECOND_SIGINT], cwd=processes.REPO,
                          env=processes.subprocess_env(), capture_output=True, text=True, timeout=25)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == 'first: SIGINT\n', proc.stdout
    assert 'press Ctrl-C again' in proc.stderr and 'KeyboardInterrupt' not in proc.stderr, proc.stderr
