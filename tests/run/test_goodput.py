"""Goodput's ledger, the straggler rule, the W&B settings and the writer's sinks, without a training run.

The ledger runs on a fake clock, so every second is placed by the test; the runs through the
CLI (a restart, W&B offline) are tests/run/test_observe.py, the two-process straggler
tests/run/test_stragglers.py.
"""

import importlib.util
import json
import logging
import subprocess
import sys

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.run.observe import goodput
from jaxfrontier.run.observe import metrics
from jaxfrontier.run.observe import stragglers
from jaxfrontier.run.observe import wandb_log
import processes


class Clock:
    def __init__(self, now=100.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


def run_attempt(workdir, clock, first, last, started, reached_by_kill=None):
    """An attempt: 2 s of start-up phases timed before the ledger, 3 s to the first step, then per
    step 1 s (0.25 s of it waiting), a 0.5 s save at even steps, a 2 s evaluation at step 4."""
    ledger = goodput.Ledger(str(workdir), started, write=True, clock=clock)
    ledger.phases({'flags_and_imports': 1.0, 'compile': 7.0, 'restore': 0.5, 'data': 1.0})
    clock.advance(3.0)  # memory check, writers: start-up until the first step
    with ledger.span('step'):
        for number in range(first, last + 1):
            ledger.step(number)
            clock.advance(0.75)
            with ledger.span('wait'):
                clock.advance(0.25)
            if number % 2 == 0:
                with ledger.span('checkpoint'):
                    clock.advance(0.5)
            if number == 4:
                with ledger.span('eval'):
                    clock.advance(2.0)
            if number == reached_by_kill:
                ledger.metrics()  # the row written before the kill: the file holds this much
                return ledger
    clock.advance(0.125)  # outside every span: other
    return ledger


def test_ledger_places_every_second_and_counts_replayed_steps_over_restarts(tmp_path):
    clock = Clock()
    started = clock() - 9.5  # main's start: the phases above took 9.5 s
    first = run_attempt(tmp_path, clock, 1, 6, started, reached_by_kill=6)  # killed after step 6's row
    a = first.attempt()
    assert (a['startup_s'], a['compile_s'], a['checkpoint_s'], a['eval_s']) == (5.0, 7.0, 2.0, 2.0)
    assert (a['productive_s'], a['replayed_s'], a['replayed_steps']) == (6.0, 0.0, 0)
    assert a['wall_s'] == 9.5 + 3.0 + 6 * 1.0 + 3 * 0.5 + 2.0 and a['other_s'] == 0.0
    assert first.waited_s == 6 * 0.25

    clock.advance(50.0)  # the queue between attempts is no attempt's
    second = run_attempt(tmp_path, clock, 3, 8, clock() - 9.5)  # restored step 2: steps 3..6 run again
    b = second.attempt(finished=True)
    assert (b['start_step'], b['end_step'], b['replayed_steps']) == (2, 8, 4)
    assert (b['replayed_s'], b['productive_s']) == (4.0, 2.0)
    assert b['other_s'] == pytest.approx(0.125)
    assert b['goodput'] == pytest.approx(2.0 / b['wall_s'])

    row = second.metrics(finished=True)
    kept = json.loads((tmp_path / goodput.FILE).read_text())
    assert [x['finished'] for x in kept['attempts']] == [False, True]
    assert kept['total']['wall_s'] == pytest.approx(a['wall_s'] + b['wall_s'])
    assert row['goodput/total/replayed_steps'] == 4 and row['goodput/replayed_steps'] == 4
    assert row['goodput/total/productive_s'] == 8.0
    line = second.summary()
    assert 'over 2 attempts' in line and '4 replayed steps 4.0 s' in line, line


def test_steps_run_again_after_a_roll_back_in_the_same_attempt_are_replayed(tmp_path):
    clock = Clock()
    ledger = goodput.Ledger(str(tmp_path), clock(), write=True, clock=clock)
    with ledger.span('step'):
        for number in (1, 2, 3, 4, 2, 3, 4, 5):  # a loss-spike roll-back after step 4 to step 1's checkpoint
            ledger.step(number)
            clock.advance(1.0)
    record = ledger.attempt()
    assert (record['replayed_steps'], record['replayed_s'], record['productive_s']) == (3, 3.0, 5.0)


def test_a_process_other_than_0_neither_reads_nor_writes_the_file(tmp_path):
    (tmp_path / goodput.FILE).write_text(json.dumps({'attempts': [], 'total': {}}))
    ledger = goodput.Ledger(str(tmp_path), None, write=False, clock=Clock())
    ledger.metrics()
    assert json.loads((tmp_path / goodput.FILE).read_text()) == {'attempts': [], 'total': {}}


@pytest.mark.parametrize('text', ['{', '[]', '{"attempts": [{"wall_s": 1}]}', '{"attempts": 3}'])
def test_an_unreadable_goodput_file_is_warned_about_and_counting_restarts(tmp_path, caplog, text):
    (tmp_path / goodput.FILE).write_text(text)
    with caplog.at_level(logging.WARNING):
        assert goodput.read(str(tmp_path)) == {}
    assert 'goodput counts from this attempt on' in caplog.text


def test_the_straggler_is_the_process_with_the_most_host_work():
    # Process 2 reads its data slowly: it waits least, the others wait for it.
    host, wait = [0.01, 0.012, 0.5, 0.011], [0.49, 0.488, 0.0, 0.489]
    own = stragglers.own_step_times(host, wait)
    assert own == pytest.approx([0.01, 0.012, 0.5, 0.011])
    assert stragglers.stragglers(own, 1.5) == [2]
    line = stragglers.warning_line(40, own, [2], 1.5)
    assert line.startswith('straggler: steps up to 40: process 2 0.500 s (') and 'of 4 processes' in line, line


def test_of_two_processes_the_slower_is_judged_against_the_other():
    # 3 x the other: the median of both (their mean) would need more than 3 x at a factor of 1.5.
    assert stragglers.stragglers([0.25, 0.74], 1.5) == [1]
    assert stragglers.stragglers([0.25, 0.37], 1.5) == []


def test_device_bound_processes_are_no_stragglers():
    # Everyone waits for the devices; host work differs by milliseconds, the own step times do not.
    host, wait = [0.003, 0.009, 0.004], [0.297, 0.291, 0.296]
    assert stragglers.stragglers(stragglers.own_step_times(host, wait), 1.5) == []


@pytest.mark.parametrize('field, value, match', [
    ('wandb_mode', 'on', 'unknown W&B mode'), ('wandb_project', 'a/b', 'W&B project names'),
    ('wandb_tags', 'x' * 65, 'at most 64 characters'), ('straggler_factor', 1.0, 'a factor above 1'),
    ('straggler_factor', float('nan'), 'finite number')])
def test_observer_settings_are_validated(field, value, match):
    c = config_lib.base_config()
    c.train[field] = value
    with pytest.raises(errors.ConfigError, match=match):
        config_lib.validate(c)


def test_wandb_asked_for_but_missing_is_one_line_before_jax(tmp_path):
    """`wandb` made unimportable in the process; main stops at validation with the extra's name."""
    code = "import sys; sys.modules['wandb'] = None; from jaxfrontier import main; main.run()"
    proc = subprocess.run([sys.executable, '-c', code, '--config.train.wandb_mode=offline', f'--workdir={tmp_path}'],
                          cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: config.train.wandb_mode = 'offline': needs the wandb package, which is not installed. "
        "Fix: pip install 'jaxfrontier[wandb]', or set --config.train.wandb_mode=disabled"], proc.stderr
    assert not list(tmp_path.iterdir())


def test_wandb_run_id_is_kept_in_the_workdir(tmp_path):
    first = wandb_log.run_id(str(tmp_path))
    assert first.isalnum() and len(first) == 8
    assert wandb_log.run_id(str(tmp_path)) == first


class Sink:
    def __init__(self):
        self.rows, self.summaries = [], []

    def write(self, step, values, replayed):
        self.rows.append((step, values, replayed))

    def summary(self, values):
        self.summaries.append(values)


def test_the_writer_hands_every_row_and_its_replayed_mark_to_its_sinks(tmp_path):
    (tmp_path / 'metrics.jsonl').write_text('{"step": 2, "train/loss": 3.0}\n')  # an earlier attempt reached 2
    sink = Sink()
    writer = metrics.MetricsWriter(str(tmp_path), total_steps=4, enabled=True, progress=False, sinks=(sink,))
    writer.write(2, {'train/loss': 2.5})
    writer.write(3, {'train/loss': 2.25, 'eval/loss': 2.75})
    writer.close()
    writer.summary({'goodput/goodput': 0.5})
    assert sink.rows == [(2, {'train/loss': 2.5}, True), (3, {'train/loss': 2.25, 'eval/loss': 2.75}, False)]
    assert sink.summaries == [{'goodput/goodput': 0.5}]


@pytest.mark.slow  # W&B's service starts (a few seconds); nothing compiles
@pytest.mark.skipif(importlib.util.find_spec('wandb') is None, reason="wandb is not installed (the test extra has it)")
def test_wandb_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv('HOME', str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv('WANDB_API_KEY', raising=False)
    monkeypatch.setenv('WANDB_SILENT', 'true')
    c = config_lib.base_config()
    c.train.wandb_mode = 'online'
    with pytest.raises(errors.ConfigError, match='W&B could not start the run: .*Fix: log in'):
        wandb_log.WandbSink(c.train, str(tmp_path), {})
