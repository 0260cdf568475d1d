"""The fast checkpoint tier in one process on 8 simulated devices (jaxfrontier/checkpoint/fast/tiers.py).

A sharded state of distinct leaf shapes (fsdp- and tensor-split, replicated, a bfloat16 leaf, a
scalar step) is saved and restored bit for bit onto its shardings; a flipped byte is caught by
its checksum and that step skipped for the one before; fast_keep prunes; a non-finite step is
never written; a state saved on another mesh is not read. No training step is compiled: the
two-process test with a peer's copy and a killed process is tests/test_fast_tier_processes.py.
"""

import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint.fast import files as fast_files
from jaxfrontier.checkpoint.fast import peer
from jaxfrontier.checkpoint.fast import tiers
from jaxfrontier.errors import ConfigError

MESH = {'data': 2, 'fsdp': 2, 'tensor': 2}
# name: (shape, dtype, spec): distinct sizes so a swapped axis or shard fails.
LEAVES = {'w_split': ((6, 10), jnp.float32, P('fsdp', 'tensor')), 'w_data': ((4, 3, 5), jnp.float32, P(('data', 'fsdp'))),
          'w_rep': ((7,), jnp.float32, P()), 'w_bf16': ((2, 12), jnp.bfloat16, P('data', 'tensor'))}


def config(fast_dir, **more):
    c = config_lib.base_config()
    c.checkpoint.update(fast_dir=str(fast_dir), fast_every_steps=1, **more)
    return c


@pytest.fixture(scope='module')
def mesh():
    return mesh_lib.make_mesh(MESH)


def make_state(mesh, step, seed=0):
    rng = np.random.default_rng(seed + 1000 * step)
    state = {'step': jax.device_put(jnp.int32(step), NamedSharding(mesh, P())), 'params': {}}
    for name, (shape, dtype, spec) in LEAVES.items():
        value = jnp.asarray(rng.standard_normal(shape), dtype)
        state['params'][name] = jax.device_put(value, NamedSharding(mesh, spec))
    return state


def target_of(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def assert_same(restored, state):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(state)):
        assert a.sharding == b.sharding, path
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), path


def healthy(loss=1.0):
    return {'train/loss': jnp.float32(loss), 'train/grad_norm': jnp.float32(1.0), 'train/param_norm': jnp.float32(2.0)}


def test_round_trip_keeps_the_newest_and_skips_a_corrupt_step(tmp_path, mesh, caplog):
    caplog.set_level(logging.INFO)
    fast = tiers.FastTier(config(tmp_path, fast_keep=2).checkpoint, mesh)
    states = {s: make_state(mesh, s) for s in (1, 2, 3)}
    for s, state in states.items():
        assert fast.save(s, state, healthy())
    fast.wait()
    root = fast_files.process_root(str(tmp_path), 0)
    assert fast_files.steps(root) == [2, 3]  # fast_keep: step 1 deleted
    # The replicated leaf is written once, the fsdp x tensor split leaf as 4 distinct shards of 8 devices.
    manifest = fast_files.read_manifest(fast_files.part_dir(root, 3, 'own'))
    shards = {leaf['name']: leaf['shards'] for leaf in manifest['leaves']}
    assert len(shards['params/w_rep']) == 1 and len(shards['params/w_rep'][0]['positions']) == 8
    assert len(shards['params/w_split']) == 4

    restored, origin = fast.restore(target_of(states[3]), persistent_step=2)
    assert origin.startswith('restored step 3 from the fast tier')
    assert_same(restored, states[3])
    assert fast.restore(target_of(states[3]), persistent_step=3) is None  # not newer than the persistent tier

    # One flipped byte in step 3: its checksum fails, step 2 is restored instead, and the line names step 3.
    victim = os.path.join(fast_files.part_dir(root, 3, 'own'), shards['params/w_split'][2]['file'])
    data = bytearray(open(victim, 'rb').read())
    data[5] ^= 0x40
    open(victim, 'wb').write(bytes(data))
    restored, origin = fast.restore(target_of(states[3]), persistent_step=None)
    assert origin.startswith('restored step 2 ')
    assert_same(restored, states[2])
    assert any('step 3 skipped' in r.getMessage() and 'checksum mismatch' in r.getMessage() for r in caplog.records)
    fast.close()


def test_a_non_finite_state_is_never_written(tmp_path, mesh):
    fast = tiers.FastTier(config(tmp_path).checkpoint, mesh)
    assert not fast.save(4, make_state(mesh, 4), healthy(loss=math.nan))
    fast.close()
    assert fast_files.steps(fast_files.process_root(str(tmp_path), 0)) == []


def test_another_mesh_is_not_read_and_discard_after(tmp_path, mesh, caplog):
    caplog.set_level(logging.INFO)
    fast = tiers.FastTier(config(tmp_path).checkpoint, mesh)
    fast.save(5, make_state(mesh, 5))
    fast.wait()
    other = mesh_lib.make_mesh({'data': 4, 'tensor': 2})
    again = tiers.FastTier(config(tmp_path).checkpoint, other)
    state = {'step': jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(other, P())),
             'params': {name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(other, P()))
                        for name, (shape, dtype, _) in LEAVES.items()}}
    assert again.restore(state, persistent_step=None) is None
    assert any('saved on another mesh' in r.getMessage() for r in caplog.records)
    fast.discard_after(4)
    assert fast_files.steps(fast_files.process_root(str(tmp_path), 0)) == []
    fast.close()
    again.close()


def test_peer_shift_moves_each_block_whole_devices_ahead():
    """The exchange's ppermute in one process: block d arrives on device d + 2 of the ring."""
    devices = peer.local_order()
    blocks = [[jax.device_put(jnp.full((3, 2), float(d), jnp.float32), dev) for d, dev in enumerate(devices)],
              [jax.device_put(jnp.int32(10 * d), dev) for d, dev in enumerate(devices)]]
    moved = peer.shift(blocks, 2)
    for d, (a, b) in enumerate(zip(*moved)):
        assert a.device == devices[d] and b.device == devices[d]
        assert np.array_equal(np.asarray(a), np.full((3, 2), float((d - 2) % 8)))
        assert b.shape == (1,) and int(b[0]) == 10 * ((d - 2) % 8)
    assert peer.peer_offset(np.array([7, 7, 9, 9])) == 0  # one process here: no peer


@pytest.mark.parametrize('override, field', [
    (dict(fast_every_steps=0), 'checkpoint.fast_every_steps'), (dict(fast_keep=0), 'checkpoint.fast_keep'),
    (dict(fast_keep=33), 'checkpoint.fast_keep'), (dict(enabled=False), 'checkpoint.fast_dir')])
def test_config_errors_are_one_line(tmp_path, override, field):
    c = config(tmp_path)
    c.checkpoint.update(**override)
    with pytest.raises(ConfigError, match=field) as e:
        config_lib.validate(c)
    assert '\n' not in str(e.value)


def test_fast_dir_expands_this_process_s_variables(tmp_path):
    c = config('$JF_NODE_LOCAL/fast')
    assert config_lib.resolve_fast_dir(c, {'JF_NODE_LOCAL': str(tmp_path)}) == str(tmp_path / 'fast')
    c.checkpoint.fast_dir = '${JF_NODE_LOCAL}'
    assert config_lib.resolve_fast_dir(c, {'JF_NODE_LOCAL': '/mnt/bb/u'}) == '/mnt/bb/u'
    with pytest.raises(ConfigError, match='JF_NODE_LOCAL') as e:
        config_lib.resolve_fast_dir(c, {})
    assert '\n' not in str(e.value)
    c.checkpoint.fast_dir = ''
    assert config_lib.resolve_fast_dir(c, {}) == ''


def test_one_lost_node_is_covered_by_its_peer_two_adjacent_are_not():
    """4 nodes x 2 processes (peer offset 2): the step lists after losing nodes, as restore sees them."""
    everything = [{5, 6} for _ in range(8)]
    lose = lambda nodes: [set() if p // 2 in nodes else {5, 6} for p in range(8)]  # noqa: E731
    assert tiers.candidates(everything, everything, 2, persistent_step=4) == [(6, []), (5, [])]
    assert tiers.candidates(lose({1}), lose({1}), 2, persistent_step=None) == [(6, []), (5, [])]  # from node 2
    assert tiers.candidates(lose({1, 2}), lose({1, 2}), 2, persistent_step=None) == [(6, [2, 3]), (5, [2, 3])]
    assert tiers.candidates(lose({1, 3}), lose({1, 3}), 2, persistent_step=None) == [(6, []), (5, [])]
    assert tiers.candidates(everything, everything, 2, persistent_step=6) == []
