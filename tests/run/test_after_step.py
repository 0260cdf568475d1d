"""The loop's decisions after a step (run/after_step.py), on stand-ins for the services: no compile."""

import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier.run import after_step
from jaxfrontier.run.observe import goodput
from jaxfrontier.training import spikes


class Recorder:
    """A stand-in service: every call is recorded as (name, args); `answers` gives a method's return value."""

    def __init__(self, **answers):
        self.calls, self.answers = [], answers

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args))
            answer = self.answers.get(name)
            return answer(*args) if callable(answer) else answer
        return call

    def named(self, name):
        return [args for n, args in self.calls if n == name]


def after(tmp_path, steps=10, eval_every=4, save_every=5, stop_at=None):
    t = config_lib.base_config().train  # spike_skip off: the guard passes every save through
    evaluator = Recorder(evaluate=lambda params: {'eval/loss': np.float32(2.0)})
    return after_step.AfterStep(
        steps, eval_every,
        checkpointer=Recorder(due=lambda step: step % save_every == 0, save=True),
        fast=Recorder(due=False), guard=spikes.SpikeGuard(t, str(tmp_path)), target=None, commits=Recorder(),
        preemption=Recorder(should_stop=lambda step: step == stop_at), watchdog=Recorder(),
        ledger=goodput.Ledger(str(tmp_path), None, write=False), writer=Recorder(), reporter=Recorder(),
        evaluate=evaluator.evaluate)


def test_evaluation_every_eval_every_steps_and_after_the_last(tmp_path):
    a = after(tmp_path)
    due = [done for done in range(1, 11) if a.evaluate_if_due(done, 'params', {'train/loss': np.float32(1.0)})]
    assert due == [4, 8, 10]
    assert len(a.watchdog.named('relax')) == 3  # the interval holding an evaluation is not judged as a step


def test_save_when_either_tier_is_due_and_its_commit_is_logged(tmp_path):
    a = after(tmp_path)
    for step in range(10):
        assert a.save_or_roll_back(step, {'step': step + 1}, {'train/loss': np.float32(1.0)}) is None
    saved = [args[0] for args in a.checkpointer.named('save')]
    assert saved == [5, 10]  # every 5 steps, and the last one
    assert [args[0] for args in a.fast.named('save')] == [5, 10]  # the fast tier saves with it (a no-op when off)
    assert [args[0] for args in a.commits.named('started')] == [5, 10]
    assert len(a.commits.named('poll')) == 10  # asked after every step


def test_a_preemption_stops_before_the_last_step_only(tmp_path):
    assert after(tmp_path, stop_at=3).should_stop(3)
    assert not after(tmp_path, stop_at=10).should_stop(10)  # the run ends there anyway


def test_the_previous_step_is_reported_and_beats_the_watchdog_but_the_last_relaxes_it(tmp_path):
    a = after(tmp_path)
    a.reporter.answers['report'] = lambda *args: {'train/loss': 1.0}
    a.report(None)
    a.report((3, {'train/loss': np.float32(1.0)}, None))
    a.report((4, {'train/loss': np.float32(1.0)}, None), last=True)
    assert a.reporter.named('report') == [(3, {'train/loss': np.float32(1.0)}, None),
                                          (4, {'train/loss': np.float32(1.0)}, None)]
    assert a.watchdog.named('beat') == [(3,)] and len(a.watchdog.named('relax')) == 1
    assert a.final_save(10, {'step': 10}, None)  # no spike open: saved, and waited for until committed
    assert a.checkpointer.named('save') == [(10, {'step': 10})] and a.checkpointer.named('wait') == [()]
    assert a.commits.named('started') == [(10, {'step': 10})]
