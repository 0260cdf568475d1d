"""Each optimizer's state checkpoints: resuming mid-run continues bit for bit (tests/checkpoint_common.py).

As test_checkpoint_restore's `runs` does for AdamW: 4 steps straight against 2 steps, stop,
resume, 2 more, on data 2 x fsdp 2 x tensor 2 (Adafactor's factors are sharded there:
optim.factor_min_dim 16 factors the MLP [32, 128], embedding and head of this model). Adafactor
and Lion both slow; their sharded states restoring onto other meshes is fast (no step compiled).
Resuming with another optimizer is refused with one line.
"""

import pytest

from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.run import loop

from checkpoint_common import (
    make_config, layout_for, target_of, random_state, save_state, losses, read_numpy, flat_numpy,
    assert_trees_equal)


def config(optimizer, steps, every=1, **mesh):
    c = make_config(steps=steps, every=every, **mesh)
    c.optim.update(name=optimizer, factor_min_dim=16, decay_steps=4)
    return c


@pytest.mark.parametrize('optimizer', ['adafactor', 'lion'])
def test_state_restores_onto_another_mesh(optimizer, tmp_path):
    """A state saved on data 2 x fsdp 2 x tensor 2 (Adafactor's factors sharded there) restores onto
    one device and onto tensor 4 bit for bit, without compiling a step."""
    c = config(optimizer, 4)
    save_state(c, str(tmp_path), random_state(layout_for(c), seed=2), step=2)
    saved = read_numpy(f'{tmp_path}/checkpoints/2')
    assert any('/v_row/' in n and v.size > 1 for n, v in saved.items()) == (optimizer == 'adafactor')
    for mesh in (dict(data=1, fsdp=1, tensor=1), dict(data=1, fsdp=1, tensor=4)):
        other = config(optimizer, 4, **mesh)
        state = ckpt_lib.Checkpointer(other, str(tmp_path)).restore(target_of(layout_for(other)))
        assert_trees_equal(flat_numpy(state), saved)


@pytest.mark.slow
@pytest.mark.parametrize('optimizer', ['adafactor', 'lion'])
def test_resume_continues_bit_for_bit(optimizer, tmp_path):
    straight, resumed = str(tmp_path / 'straight'), str(tmp_path / 'resumed')
    loop.train_and_evaluate(config(optimizer, 4), straight)
    loop.train_and_evaluate(config(optimizer, 2, every=0), resumed)
    loop.train_and_evaluate(config(optimizer, 4, every=0), resumed)
    a, b = losses(straight), losses(resumed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert [a[s] for s in range(1, 5)] == [b[s] for s in range(1, 5)]  # bit for bit
    saved = read_numpy(f'{straight}/checkpoints/4')
    assert_trees_equal(saved, read_numpy(f'{resumed}/checkpoints/4'))
    factors = [n for n in saved if '/v_row/' in n and saved[n].size > 1]
    assert (len(factors) > 0) == (optimizer == 'adafactor'), factors
    # The sharded state restores onto one device, bit for bit.
    one = config(optimizer, 4, data=1, fsdp=1, tensor=1)
    state = ckpt_lib.Checkpointer(one, straight).restore(target_of(layout_for(one)), step=2)
    assert_trees_equal(flat_numpy(state), read_numpy(f'{straight}/checkpoints/2'))


@pytest.mark.parametrize('saved,resumed', [('adamw', 'lion'), ('adafactor', 'adamw')])
def test_resuming_with_another_optimizer_is_refused(saved, resumed, tmp_path):
    """The saved optimizer state does not fit another optimizer: one line naming both and the two ways on."""
    c = config(saved, 4)
    save_state(c, str(tmp_path), random_state(layout_for(c)), step=2)
    other = config(resumed, 4)
    with pytest.raises(ConfigError) as e:
        ckpt_lib.Checkpointer(other, str(tmp_path)).restore(target_of(layout_for(other)))
    message = str(e.value)
    assert 'optim.name' in message and repr(saved) in message and '\n' not in message
    assert f'--config.optim.name={saved}' in message and 'init_params_from' in message
