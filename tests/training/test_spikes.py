"""Loss spikes (training/spikes.py): the update of a spike is skipped on the device; persistent spikes
roll back to the checkpoint before them and skip their data, recorded so that reruns read the same.

Spikes are injected through the test's environment, never the clock: `inject` replaces the training
batches of chosen data steps with bytes 200..255 (the built-in corpus, Python source, has almost none,
so the model trained on it finds them improbable: its gradient norm jumps about 3x).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.data import loader as data_lib
from jaxfrontier.data import sources
from jaxfrontier.run import loop
from jaxfrontier.training import spikes
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib

from checkpoint_common import assert_trees_equal, read_numpy

SPIKE_BATCHES = (15, 16, 17)  # data steps of the persistent spike (three in a row: one roll-back)


def small(steps=30, data=4, tensor=2, **train):
    """A one-layer GPT on the built-in corpus; spikes judged after 8 steps, 3 in 5 steps roll back."""
    c = config_lib.base_config()
    c.model.update(num_layers=1, d_model=64, num_heads=2, seq_len=64, vocab_size=256, vocab_multiple=128,
                   dtype='float32', remat='none')
    c.mesh.update(data=data, fsdp=1, tensor=tensor, cpu_devices=8)
    spike = dict(spike_skip=True, spike_warmup=8, spike_ema=0.9, spike_window=5, spike_rollback_after=3)
    c.train.update(steps=steps, global_batch=8, micro_batch=8 // data, log_every=1, eval_every=0, eval_batches=1,
                   progress=False, **{**spike, **train})
    c.optim.update(lr=3e-3, warmup_steps=5, decay_steps=30)  # the schedule does not depend on train.steps
    c.checkpoint.update(every_steps=5, keep=10)
    return c


def corrupt(rows):
    return np.random.default_rng(int(rows.sum())).integers(200, 256, size=rows.shape).astype(np.int32)


@pytest.fixture
def inject(monkeypatch):
    """`inject(bad=(data steps,), shift_from=None)`: training batches of `bad` corrupted; with
    `shift_from` = k, train step s >= k reads data step s + 1 (a run without batch k)."""
    read_rows = sources.TokenSource.read_rows

    def set_up(bad=(), shift_from=None):
        def patched(self, step, rows, global_batch):
            if self.split_id != sources.TRAIN:
                return read_rows(self, step, rows, global_batch)
            if shift_from is not None and step >= shift_from:
                step += 1
            out = read_rows(self, step, rows, global_batch)
            return corrupt(out) if step in bad else out
        monkeypatch.setattr(sources.TokenSource, 'read_rows', patched)

    return set_up


def rows(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


# --------------------------------------------------------------------------- the estimate and the decision


def test_the_estimate_is_the_running_mean_then_an_ema_and_spikes_do_not_move_it():
    c = small(spike_ema=0.75, spike_warmup=3, spike_sigmas=4.0, spike_min_rise=0.0)
    judge = jax.jit(lambda s, loss, grad: spikes.judge(c, s, loss, grad))
    losses_in = [4.0, 3.0, 3.5, 3.2, 9.0, 3.1, float('nan')]
    grads_in = [1.0, 1.2, 0.9, 1.1, 1.0, 5.0, 1.0]
    s, decisions, seen = spikes.init_state(), [], []
    for loss, grad in zip(losses_in, grads_in):
        skip, s, metrics = judge(s, jnp.float32(loss), jnp.float32(grad))
        decisions.append(bool(skip))
        if not skip:
            seen.append((loss, grad))
    # 9.0 (loss), 5.0 (grad norm) and NaN are spikes; the others are learnt.
    assert decisions == [False, False, False, False, True, True, True]
    assert int(s['count']) == 4 and int(s['skipped_steps']) == 3
    # First 1 / (1 - 0.75) = 4 steps: weights 1, 1/2, 1/3, 1/4 -> the plain mean and population variance.
    learnt = np.array(seen, np.float64)
    np.testing.assert_allclose(float(s['loss_mean']), learnt[:, 0].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(s['loss_var']), learnt[:, 0].var(), rtol=1e-5)
    np.testing.assert_allclose(float(s['grad_mean']), learnt[:, 1].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(s['grad_var']), learnt[:, 1].var(), rtol=1e-5)
    assert float(metrics['spike/loss_limit']) == pytest.approx(learnt[:, 0].mean() + 4 * learnt[:, 0].std(), 1e-5)


def test_before_warmup_only_non_finite_steps_are_skipped_and_overflow_is_the_loss_scalers():
    c = small(spike_warmup=5)
    judge = jax.jit(lambda s, loss, grad, overflow: spikes.judge(c, s, loss, grad, overflow))
    s = spikes.init_state()
    skip, s, _ = judge(s, jnp.float32(3.0), jnp.float32(1.0), jnp.bool_(False))
    skip_high, _, _ = judge(s, jnp.float32(300.0), jnp.float32(100.0), jnp.bool_(False))  # not armed yet
    skip_inf, _, _ = judge(s, jnp.float32(3.0), jnp.float32(jnp.inf), jnp.bool_(True))  # float16 overflow
    skip_nan, _, _ = judge(s, jnp.float32(jnp.nan), jnp.float32(1.0), jnp.bool_(False))
    assert [bool(x) for x in (skip, skip_high, skip_inf, skip_nan)] == [False, False, False, True]


def test_skips_map_train_steps_to_data_steps_and_survive_without_their_file(tmp_path):
    record = spikes.SkipRecord(str(tmp_path))
    assert [record.data_step(s) for s in (0, 14, 15)] == [0, 14, 15]
    record.add(spikes.Skip(15, 15, 18, (16, 17, 18)))
    record.add(spikes.Skip(15, 18, 21, (16, 17, 18)))  # a second roll-back to the same checkpoint
    record.add(spikes.Skip(30, 36, 40, (33, 34, 35)))
    assert [record.data_step(s) for s in (14, 15, 16, 29, 30)] == [14, 21, 22, 35, 40]
    again = spikes.SkipRecord(str(tmp_path))
    assert again.skips == record.skips
    saved = record.as_json()
    os.remove(tmp_path / spikes.RECORD_FILE)
    assert spikes.SkipRecord(str(tmp_path), saved).skips == record.skips  # from a checkpoint's data.skips
    (tmp_path / spikes.RECORD_FILE).write_text('{"skips": [{"at_step": 3}]}')
    with pytest.raises(errors.CheckpointError, match='spikes.json is damaged'):
        spikes.SkipRecord(str(tmp_path))
    os.remove(tmp_path / spikes.RECORD_FILE)
    for damaged in (7, {'at_step': 1}, [{'at_step': 1, 'data_from': 5, 'data_to': 2, 'spike_steps': []}]):
        with pytest.raises(errors.CheckpointError, match='checkpoint metadata data.skips'):
            spikes.SkipRecord(str(tmp_path), spikes.skips_in_meta({'data': {'skips': damaged}}))
    assert spikes.skips_in_meta({'data': 'x'}) is None and spikes.skips_in_meta({}) is None


def test_no_save_while_a_spike_is_open_and_the_one_due_is_made_when_it_closes(tmp_path):
    """The guard as the loop drives it: step s - 1 reported, then the save after step s decided."""
    guard = spikes.SpikeGuard(small().train, str(tmp_path))  # a window of 5 steps, 3 skipped ones roll back
    skipped = {15, 27}
    saves = []
    for step in range(30):
        if step:
            guard.observe(step - 1, step - 1 in skipped)
        save, forced = guard.save_decision(step, (step + 1) % 5 == 0, lambda: step in skipped)  # noqa: B023
        if save:
            saves.append((step + 1, forced))
        assert not guard.rollback_due()
    assert saves == [(5, False), (10, False), (15, False), (21, True), (25, False)]
    assert guard.is_open(29) and not guard.is_open(32)  # a run ending at 30 saves no final checkpoint


@pytest.mark.parametrize('field, value, message', [
    ('spike_ema', 1.0, 'train.spike_ema = 1.0: must be a decay in'),
    ('spike_window', 2, 'train.spike_window = 2: must be an integer >= train.spike_rollback_after'),
    ('spike_sigmas', -1.0, 'train.spike_sigmas = -1.0: must be a number >= 0'),
])
def test_spike_settings_are_validated(field, value, message):
    c = small()
    c.train[field] = value
    with pytest.raises(errors.ConfigError, match=message):
        config_lib.validate(c, 8)


def test_a_roll_back_needs_checkpoints():
    c = small()
    c.checkpoint.enabled = False
    with pytest.raises(errors.ConfigError, match='spike_rollback_after=0'):
        config_lib.validate(c, 8)
    c.train.spike_rollback_after = 0
    config_lib.validate(c, 8)


# --------------------------------------------------------------------------- one device and eight agree


def _decisions(c, batches, devices):
    """(skip flags, losses, the estimate after the last step, params unchanged by each skipped step?)."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), devices)
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
    flags, loss_values, kept = [], [], []
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        for batch in batches:
            before = jax.tree.map(jnp.copy, state['params'])  # on the device: the step donates the state
            state, metrics = step(state, jax.device_put(batch, sharding))
            flags.append(int(metrics['spike/skipped']))
            loss_values.append(float(metrics['train/loss']))
            if flags[-1]:
                same = jax.tree.map(lambda a, b: jnp.array_equal(a, b), before, state['params'])
                kept.append(all(bool(x) for x in jax.tree.leaves(same)))
    return flags, loss_values, jax.device_get(state['spike']), kept


@pytest.mark.slow
def test_eight_devices_skip_the_same_steps_as_one(tmp_path):
    """data 4 x tensor 2 and one device: the same skip decisions (taken from globally reduced values)."""
    c8, c1 = small(data=4, tensor=2), small(data=1, tensor=1)
    train, _ = data_lib.make_datasets(c8.data, str(tmp_path), data_lib.BatchSpec.of(c8))
    batches = [train.read_rows(s, np.arange(8), 8) for s in range(18)]
    batches[15] = corrupt(batches[15])
    one = _decisions(c1, batches, jax.devices()[:1])
    eight = _decisions(c8, batches, jax.devices())
    assert one[0] == eight[0] == [0] * 15 + [1] + [0] * 2, (one[0], eight[0])
    assert one[3] == eight[3] == [True]  # the skipped step left the parameters as they were
    np.testing.assert_allclose(eight[1], one[1], rtol=2e-5)
    for key in one[2]:
        np.testing.assert_allclose(eight[2][key], one[2][key], rtol=2e-5, err_msg=key)


# --------------------------------------------------------------------------- the training loop


@pytest.mark.slow  # two runs of 24 steps: 17 s (the compile cache shared with the module)
def test_a_skipped_step_trains_like_a_run_without_its_batch(tmp_path, inject):
    """One bad batch (data step 15): its update is skipped, and the run ends with the parameters,
    optimizer state and losses of a run that never read it; the save due at step 20 (inside the spike
    window) is made when the spike closes, at 21."""
    inject(bad=(15,))
    loop.train_and_evaluate(small(24), str(tmp_path / 'a'))
    inject(shift_from=15)
    loop.train_and_evaluate(small(23), str(tmp_path / 'b'))
    a, b = rows(tmp_path / 'a'), rows(tmp_path / 'b')
    assert [r['step'] for r in a if r.get('spike/skipped')] == [16]
    assert not any(r.get('spike/skipped') for r in b)
    assert [r['data/step'] for r in a if r['step'] == 16] == [15]
    assert [r['train/loss'] for r in a[16:]] == [r['train/loss'] for r in b[15:]]
    assert sorted(int(d) for d in os.listdir(tmp_path / 'a' / 'checkpoints')) == [5, 10, 15, 21, 24]
    state_a = read_numpy(str(tmp_path / 'a' / 'checkpoints' / '24'))
    state_b = read_numpy(str(tmp_path / 'b' / 'checkpoints' / '23'))
    assert (int(state_a.pop('spike/skipped_steps')), int(state_b.pop('spike/skipped_steps'))) == (1, 0)
    del state_a['step'], state_b['step']
    assert_trees_equal(state_a, state_b)  # parameters, Adam's moments and count, the running estimate


@pytest.mark.slow  # four runs: 19 s
def test_a_persistent_spike_rolls_back_skips_its_data_and_reruns_reproduce_it(tmp_path, inject):
    inject(bad=SPIKE_BATCHES)
    loop.train_and_evaluate(small(30), str(tmp_path / 'a'))
    a = rows(tmp_path / 'a')
    assert [r['step'] for r in a if r.get('spike/skipped')] == [16, 17, 18]
    rollback, = [r for r in a if 'spike/rollback' in r]
    assert rollback == {'step': 18, 'spike/rollback': 1.0, 'spike/rollback_to': 15.0, 'data/skip_from': 15.0,
                        'data/skip_to': 18.0}
    recorded = json.loads((tmp_path / 'a' / spikes.RECORD_FILE).read_text())
    assert recorded == {'skips': [{'at_step': 15, 'data_from': 15, 'data_to': 18, 'spike_steps': [16, 17, 18]}]}
    after = a[a.index(rollback) + 1:]
    assert [r['step'] for r in after] == list(range(16, 31)) and all(r.get('replayed') for r in after[:3])
    assert [r['data/step'] for r in after] == list(range(18, 33))
    # The same command again, in a new workdir: the same losses, row for row.
    loop.train_and_evaluate(small(30), str(tmp_path / 'rerun'))
    assert [r.get('train/loss') for r in rows(tmp_path / 'rerun')] == [r.get('train/loss') for r in a]
    # Stopped after the roll-back at step 22, resumed without spikes.json (the checkpoint's data.skips
    # carries it): the same losses and the same final state, running estimate included.
    loop.train_and_evaluate(small(22), str(tmp_path / 'resumed'))
    os.remove(tmp_path / 'resumed' / spikes.RECORD_FILE)
    loop.train_and_evaluate(small(30), str(tmp_path / 'resumed'))
    assert {r['step']: r['train/loss'] for r in rows(tmp_path / 'resumed') if r['step'] > 22} == {
        r['step']: r['train/loss'] for r in after if r['step'] > 22}
    final = read_numpy(str(tmp_path / 'resumed' / 'checkpoints' / '30'))
    assert_trees_equal(final, read_numpy(str(tmp_path / 'a' / 'checkpoints' / '30')))
    assert int(final['spike/count']) == 30 and int(final['spike/skipped_steps']) == 0


@pytest.mark.slow  # 4 s
def test_spikes_that_outlast_the_roll_backs_stop_the_run_with_one_line(tmp_path, inject):
    inject(bad=range(15, 40))
    with pytest.raises(errors.LossSpikeError) as stopped:
        loop.train_and_evaluate(small(30, spike_max_rollbacks=1), str(tmp_path))
    message = str(stopped.value)
    assert stopped.value.exit_code == 3 and '\n' not in message
    assert 'after 1 roll-back(s) (train.spike_max_rollbacks = 1)' in message and '--config.optim.lr' in message
    # No checkpoint was committed inside the spikes: the newest is the one rolled back to.
    assert sorted(int(d) for d in os.listdir(tmp_path / 'checkpoints')) == [5, 10, 15]
    assert len(json.loads((tmp_path / spikes.RECORD_FILE).read_text())['skips']) == 1


@pytest.mark.slow  # two short runs: 12 s
def test_resuming_with_the_other_spike_setting_names_it(tmp_path):
    """The estimate is part of the state: a checkpoint saved without it is not "corrupted" for a run
    with train.spike_skip, but a setting to match (or a new workdir from its parameters)."""
    c = small(4)
    c.train.spike_skip = False
    loop.train_and_evaluate(c, str(tmp_path))
    with pytest.raises(errors.ConfigError, match=r'train.spike_skip = True: the checkpoint .*/4 was saved with '
                       r'train.spike_skip = False .* Fix: set --config.train.spike_skip=False'):
        loop.train_and_evaluate(small(6), str(tmp_path))
