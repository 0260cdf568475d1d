"""A finite but ruined state is never committed nor resumed or rolled back to (checkpoint/verdict.py, issue 35).

In process, on the Checkpointer and the spike guard without compiling a train step: the verdict's
rule, a ruinous update refused before its commit (and what is trained from it), a verdict learned one
step later kept in <workdir>/health.json and obeyed by resume and roll-back, and a roll-back target
that fails again walked back from. The issue's command line end to end is tests/run/test_ruined_state.py.
"""

import json
import os

import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier.checkpoint import verdict
from jaxfrontier.training import spikes

from checkpoint_common import make_config, layout_for, target_of, random_state, no_init  # noqa: F401

pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')


def row(loss=2.0, grad=1.0, norm=5.0):
    return {'train/loss': np.float32(loss), 'train/grad_norm': np.float32(grad), 'train/param_norm': np.float32(norm)}


def steps_of(workdir):
    return format_lib.committed_steps(os.path.join(workdir, 'checkpoints'))


def test_the_verdict_rule():
    finite = {'finite': True}
    assert verdict.judge({**finite, 'param_norm': 7.5}, 5.0)['healthy']  # 1.5x: the limit itself
    grown = verdict.judge({**finite, 'param_norm': 7.6}, 5.0)
    assert not grown['healthy'] and 'grew 1.52x in one step (5 -> 7.6; at most 1.5x)' in grown['reason']
    assert verdict.judge({**finite, 'param_norm': 1e6}, None)['healthy']  # no reference: a run's first step
    assert verdict.judge({'finite': False, 'param_norm': 5.0}, 5.0)['reason'] == 'not finite'
    tainted = verdict.judge({**finite, 'param_norm': 5.0}, 5.0, (2, 'why'))
    assert not tainted['healthy'] and tainted['reason'] == 'trained from the unhealthy state of step 2: why'


def test_the_watch_finds_jumps_and_next_losses_and_taints_what_follows():
    watch = verdict.Watch()
    assert watch.seen(1, 5.0, 10.0) is None and watch.seen(2, 5.0, 12.0) is None
    step, why, jumped = watch.seen(3, 5.0, 1e5)
    assert (step, jumped) == (3, True) and 'grew' in why
    assert watch.seen(4, 5.0, 1e5) is None and watch.tainted[0] == 3  # stable, but trained from step 3
    watch.forget()
    assert watch.tainted is None
    assert watch.seen(5, float('nan'), 10.0)[:3:2] == (4, False) and watch.tainted[0] == 4


def test_a_ruinous_update_is_not_committed_nor_what_is_trained_from_it(tmp_path):
    c = make_config()
    c.checkpoint.async_save = False
    state = random_state(layout_for(c))
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
    assert checkpointer.save(1, state, metrics=row(norm=5.0))
    assert not checkpointer.save(2, state, metrics=row(norm=5000.0))  # the loss looks normal: computed before
    checkpointer.observe(2, row(norm=5000.0))
    assert not checkpointer.save(3, state, metrics=row(norm=5000.0))  # no jump, but trained from step 2
    assert 'newest healthy checkpoint is step 1 ' in checkpointer.unhealthy_message(2, 'why')
    checkpointer.close()
    assert steps_of(str(tmp_path)) == [1]
    meta = ckpt_lib.Checkpointer(c, str(tmp_path)).read_meta(1)
    assert meta['health'] == {'loss': 2.0, 'grad_norm': 1.0, 'param_norm': 5.0, 'finite': True, 'healthy': True,
                              'reason': ''}


def test_a_verdict_learned_after_the_commit_is_kept_and_obeyed(tmp_path):
    """Step 2 looked healthy when saved; step 3's loss, computed on it, is NaN: the ledger marks it,
    the resume hint, roll-back and a resume skip it, and the resume forgets the superseded verdict."""
    c = make_config()
    c.checkpoint.async_save = False
    layout = layout_for(c)
    state = random_state(layout)
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
    for step in (1, 2):
        assert checkpointer.save(step, state, metrics=row())
        checkpointer.observe(step, row())
    assert checkpointer.observe(3, row(loss=np.nan)) == (2, "the next step's loss, computed on it, was nan", False)
    ledger = json.loads((tmp_path / verdict.LEDGER_FILE).read_text())
    assert ledger == {'unhealthy': {'2': "the next step's loss, computed on it, was nan"}}
    assert checkpointer.newest_step_at_most(2) == 1
    assert 'newest healthy checkpoint is step 1 ' in checkpointer.resume_hint()
    checkpointer.close()
    resumed = ckpt_lib.Checkpointer(c, str(tmp_path))
    _, origin = resumed.restore_or_init(target_of(layout), no_init)
    assert 'restored step 1' in origin and steps_of(str(tmp_path)) == [1]
    assert resumed.health_ledger.unhealthy == {}  # step 2 was superseded: the number may be saved again
    resumed.close()


class _Checkpoints:
    """The checkpointer's roll-back surface: committed steps, those known unhealthy, the restores."""

    def __init__(self, steps, unhealthy=()):
        self.steps, self.unhealthy, self.rewound = steps, set(unhealthy), []

    def wait(self):
        pass

    def newest_step_at_most(self, step):
        ok = [s for s in self.steps if s <= step and s not in self.unhealthy]
        return max(ok) if ok else None

    def rewind(self, target, step):
        self.rewound.append(step)
        return 'state'


def test_a_roll_back_skips_unhealthy_steps_and_walks_back_when_spikes_recur(tmp_path):
    t = config_lib.base_config().train
    t.update(spike_skip=True, spike_window=5, spike_rollback_after=3, spike_max_rollbacks=5)
    guard = spikes.SpikeGuard(t, str(tmp_path))
    checkpoints = _Checkpoints([1, 2, 3, 4], unhealthy={4})

    def spikes_at(first):
        for step in range(first, first + 3):
            guard.observe(step, True)
        assert guard.rollback_due()
        return guard.roll_back(checkpoints, None)[1]

    assert spikes_at(4) == 3  # step 4 is unhealthy
    assert spikes_at(3) == 2  # the spikes recurred after step 3: further back
    guard.ruined(2, 'the parameter norm grew')  # one unhealthy state rolls back at once
    assert guard.rollback_due() and guard.roll_back(checkpoints, None)[1] == 1
    with pytest.raises(errors.LossSpikeError, match=r'no healthy committed checkpoint at or before step 1 that was '
                                                    r'not rolled back to already \(steps 1, 2, 3\)'):
        spikes_at(1)
    assert checkpoints.rewound == [3, 2, 1]
