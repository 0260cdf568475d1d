"""The issue's run (issue 35): lr 1e4 with one warm-up step and a checkpoint every step. Step 2's loss
is normal (computed before its update) but its update multiplies the parameter norm by about 1e5;
everything stays finite. That state must not be committed; roll-back (spike handling on) or the stop
(off) names step 1, and the same workdir resumed with lr 1e-3 (no restore_step) trains on from step 1.

In process on the 8 simulated devices (data 2 x fsdp 2 x tensor 2, configs/tiny.py's layout) with a
one-layer model; the verdict's rules are tests/checkpoint/test_checkpoint_health.py's.
"""

import json
import math
import os

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.run import loop


def config(lr, spike_skip, steps):
    c = config_lib.base_config()
    c.model.update(num_layers=1, d_model=32, num_heads=4, seq_len=32, vocab_size=256, vocab_multiple=128,
                   dtype='float32', remat='none')
    c.mesh.update(data=2, fsdp=2, tensor=2, cpu_devices=8)
    c.train.update(steps=steps, global_batch=16, micro_batch=4, log_every=1, eval_every=0, eval_batches=1,
                   progress=False, spike_skip=spike_skip, spike_warmup=2)
    c.optim.update(lr=lr, warmup_steps=1, decay_steps=100)
    c.checkpoint.update(every_steps=1)
    return c


def rows(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # four runs: 26 s at load 0.5 on 2 cores (48 s at load 9)
@pytest.mark.parametrize('spike_skip', [True, False])
def test_a_ruined_state_is_not_committed_and_a_saner_rerun_resumes_before_it(tmp_path, spike_skip):
    workdir = str(tmp_path)
    stopped = errors.LossSpikeError if spike_skip else errors.NonFiniteLossError
    with pytest.raises(stopped) as error:
        loop.train_and_evaluate(config(1e4, spike_skip, 8), workdir)
    ruined = [r for r in rows(workdir) if r['step'] == 2 and 'train/param_norm' in r][0]
    assert math.isfinite(ruined['train/loss']) and ruined['train/param_norm'] > 1e3, ruined  # finite, ruined
    assert format_lib.committed_steps(os.path.join(workdir, 'checkpoints')) == [1]
    message = str(error.value)
    if spike_skip:  # rolled back to step 1 once; the ruin recurred after it: nothing older to walk back to
        assert [r['spike/rollback_to'] for r in rows(workdir) if 'spike/rollback' in r] == [1.0]
        assert 'step 2 left an unhealthy state (the parameter norm grew' in message, message
        assert 'not rolled back to already (steps 1)' in message, message
    else:
        assert message.startswith('training diverged at step 2: its state is unhealthy (the parameter norm grew')
        assert 'The newest healthy checkpoint is step 1 ' in message, message
    loop.train_and_evaluate(config(1e-3, spike_skip, 6), workdir)
    after = rows(workdir)[-5:]
    assert [r['step'] for r in after] == [2, 3, 4, 5, 6]
    assert all(math.isfinite(r['train/loss']) and r['train/param_norm'] < 1e3 for r in after), after
    assert format_lib.committed_steps(os.path.join(workdir, 'checkpoints'))[-1] == 6
