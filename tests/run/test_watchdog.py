"""Hang detection (run/control/watchdog.py): the limit rule, the stacks it writes, the test fault, exit 5.

The rule is driven by `StepClock` with times given as numbers, never the clock. The thread test
uses a fake exit and tiny limits and only waits for the thread to report (no timing asserted).
The slow test runs `python -m jaxfrontier.main` with a fault injected through its environment
(`JAXFRONTIER_TEST_HANG`): the process stalls where a stuck collective would leave it, after the
warm-up, and the watchdog's median rule (not the timeout) ends it with exit 5 and its stacks,
the injected stall's frame among them.
"""

import glob
import os
import shutil
import subprocess
import sys
import threading

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.run.control import watchdog

from processes import REPO, TINY, subprocess_env


def clock(factor=10.0, min_s=2.0, timeout_s=100.0):
    return watchdog.StepClock(watchdog.Limits(factor, min_s, timeout_s), now=0.0)


def warm(c, interval, start=50.0):
    """Step 1's result at `start`, then steps 2..5 every `interval` s: four intervals measured."""
    for step in range(1, 6):
        c.beat(step, start + (step - 1) * interval)
    return start + 4 * interval


def test_first_step_and_warm_up_get_the_timeout():
    c = clock()
    assert c.limit()[0] == 100.0 and c.overdue(99.0) is None  # start-up to the first result: the timeout
    reason = c.overdue(100.5)
    assert 'train.hang_timeout_s=100' in reason and 'no step result yet' in reason
    c.beat(1, 50.0)  # a slow first step is not counted in the median
    for step in range(2, 2 + watchdog.WARMUP_STEPS):
        assert c.limit()[0] == 100.0  # fewer than WARMUP_STEPS intervals measured
        c.beat(step, 50.0 + 0.3 * (step - 1))
    assert list(c.intervals) == pytest.approx([0.3] * watchdog.WARMUP_STEPS)
    assert c.limit()[0] == pytest.approx(3.0)  # 10 x the median 0.3 s


def test_median_rule_with_floor_and_cap():
    c = clock(factor=10.0, min_s=2.0, timeout_s=100.0)
    last = warm(c, 0.7)
    seconds, rule = c.limit()
    assert seconds == pytest.approx(7.0) and 'train.hang_factor=10 x the median step time 0.7 s' in rule
    assert c.overdue(last + 6.9) is None
    assert 'the last step result seen was step 5' in c.overdue(last + 7.1)
    c = clock(factor=10.0, min_s=2.0)
    warm(c, 0.05)  # 10 x 0.05 s = 0.5 s: the floor holds
    assert c.limit() == (2.0, 'train.hang_min_s=2')
    c = clock(factor=10.0, min_s=2.0, timeout_s=30.0)
    warm(c, 5.0)  # 10 x 5 s = 50 s: capped by the timeout
    assert c.limit() == (30.0, 'train.hang_timeout_s=30')
    c = clock(factor=0.0)
    warm(c, 0.05)
    assert c.limit()[0] == 100.0  # hang_factor=0: the timeout only


def test_a_relaxed_interval_gets_the_timeout_and_stays_out_of_the_median():
    c = clock()
    last = warm(c, 0.3)
    c.relax()  # e.g. an evaluation
    assert c.limit()[0] == 100.0 and c.overdue(last + 50.0) is None
    c.beat(6, last + 50.0)
    assert 50.0 not in c.intervals and c.limit()[0] == pytest.approx(3.0)


def test_config_bounds():
    c = config_lib.base_config()
    config_lib.validate(c)
    for field, value, text in (('hang_factor', -1.0, 'must be a finite number in'),
                               ('hang_min_s', float('nan'), 'must be a finite number'),
                               ('hang_min_s', 4000.0, 'exceeds train.hang_timeout_s')):
        bad = config_lib.base_config()
        bad.train[field] = value
        with pytest.raises(errors.ConfigError, match=text) as e:
            config_lib.validate(bad)
        assert e.value.field.startswith('train.hang_')
    off = config_lib.base_config()
    off.train.hang_timeout_s = 0.0  # off: no floor to compare
    config_lib.validate(off)


def test_thread_writes_every_stack_and_ends_the_process(tmp_path):
    c = config_lib.base_config()
    c.train.hang_timeout_s, c.train.hang_min_s = 0.2, 0.1
    ended, messages = threading.Event(), []

    def on_hang(message):
        messages.append(message)
        ended.set()

    dog = watchdog.Watchdog(c.train, str(tmp_path), 3, on_hang=on_hang,
                            native=lambda pid, out: out.write(f'native of {pid}\n'))
    try:
        assert ended.wait(120), 'the watchdog never reported'  # a bound on the test, not a timing assertion
    finally:
        dog.stop()
    [path] = glob.glob(str(tmp_path / 'hang' / '3-*.txt'))
    text = open(path).read()
    assert text.startswith(f'hang detected in process 3 (pid {os.getpid()}): no progress for')
    assert 'Current thread' in text and 'Thread 0x' in text  # faulthandler: this thread and the others
    assert f'native of {os.getpid()}' in text
    assert messages == [f'{errors.HangError.describe(messages[0][6:].split(". Fix")[0])}; stacks of process 3 in '
                        f'{path}'] and messages[0].startswith('hang: no progress for')


def test_stacks_that_cannot_be_written_still_end_the_process(tmp_path):
    c = config_lib.base_config()
    c.train.hang_timeout_s, c.train.hang_min_s = 0.2, 0.1
    (tmp_path / 'hang').write_text('a file where the directory would go')
    ended, messages = threading.Event(), []
    dog = watchdog.Watchdog(c.train, str(tmp_path), 0, on_hang=lambda m: (messages.append(m), ended.set()))
    try:
        assert ended.wait(120), 'the watchdog never reported'
    finally:
        dog.stop()
    assert messages[0].startswith('hang: no progress for') and 'stacks of process 0 on stderr' in messages[0]


def test_hang_error_has_its_own_exit_code():
    codes = {cls.__name__: getattr(cls, 'exit_code', None) for cls in
             (errors.UserError, errors.NonFiniteLossError, errors.DistributedError, errors.HangError)}
    assert codes == {'UserError': 2, 'NonFiniteLossError': 3, 'DistributedError': 4, 'HangError': 5}


@pytest.mark.skipif(not (shutil.which('gdb') or shutil.which('py-spy')), reason='neither gdb nor py-spy installed')
def test_native_stacks_of_a_process(tmp_path):
    child = subprocess.Popen(['sleep', '600'])
    try:
        with open(tmp_path / 'stacks.txt', 'w') as out:
            watchdog.native_stacks(child.pid, out, timeout_s=120)
    finally:
        child.kill()
        child.wait()
    text = (tmp_path / 'stacks.txt').read_text()
    assert 'native stacks by' in text and 'exited with status 0' in text and 'sleep' in text, text[-2000:]


def test_injected_fault_fires_once(tmp_path):
    (tmp_path / 'hang-1-3').write_text('kill')
    code = f'from jaxfrontier.run.control import watchdog; watchdog.maybe_inject({str(tmp_path)!r}, 1, 3)'
    first = subprocess.run([sys.executable, '-c', code], cwd=REPO, env=subprocess_env(), capture_output=True)
    assert first.returncode == -9, first.stderr[-2000:]
    assert not (tmp_path / 'hang-1-3').exists() and (tmp_path / 'hung-1-3').read_text().strip().isdigit()
    watchdog.maybe_inject(str(tmp_path), 1, 3)  # consumed: returns
    watchdog.maybe_inject(None, 1, 3)


@pytest.mark.slow
def test_injected_stall_is_detected_stacks_written_exit_5(tmp_path):
    faults, workdir = tmp_path / 'faults', tmp_path / 'run'
    faults.mkdir()
    (faults / 'hang-0-6').write_text('sleep')  # after the warm-up: the median rule decides
    cmd = [sys.executable, '-m', 'jaxfrontier.main', *TINY, '--config.train.steps=50', f'--workdir={workdir}',
           '--config.checkpoint.enabled=False', '--config.train.hang_min_s=5', '--config.train.hang_factor=2',
           '--config.train.hang_timeout_s=900']
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(JAXFRONTIER_TEST_HANG=str(faults)), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == errors.HangError.exit_code, proc.stderr[-4000:]
    assert (faults / 'hung-0-6').exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('error: hang: no progress for') and 'train.hang_min_s=5' in last, proc.stderr[-3000:]
    assert 'the last step result seen was step 5' in last and 'Fix: restart from the newest checkpoint' in last
    [path] = glob.glob(str(workdir / 'hang' / '0-*.txt'))
    assert path in last
    text = open(path).read()
    assert '_injected_hang' in text and 'in beat' in text and '_train_and_evaluate' in text  # the stuck main thread
    assert 'native stacks' in text
    print(text[text.index('native stacks'):][:3000])
