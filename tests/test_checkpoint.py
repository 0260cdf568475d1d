"""Checkpoints: exact continuation, crash and preemption safety, any-mesh restore, export, bad input.

The model is tiny (2 layers, d_model 32, synthetic data) and the learning-rate schedule is
fixed (optim.decay_steps), so runs of different lengths compute the same steps. "Bit for bit"
means np.array_equal on fp32 arrays; losses on a different layout agree to fp32 rounding
(rtol 2e-6, as in tests/test_parallel.py).

The subprocess tests (SIGKILL, SIGTERM in one and in two processes, --mode=export) and the
training continued on other meshes are marked slow; subprocesses share a JAX compilation
cache so each process after the first skips compiling.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxfrontier.training import checkpoint as ckpt_lib
from jaxfrontier import config as config_lib
from jaxfrontier.data import dataset as data_lib
from jaxfrontier.training import export
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import loop as train
from jaxfrontier.training import state as ts

# A failed Orbax read (the corruption tests) leaves TensorStore callbacks aimed at the asyncio
# loop it has closed; Python reports them as unraisable at some later test. Nothing leaks.
pytestmark = pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_RTOL = 2e-6
MODEL = dict(num_layers=2, d_model=32, num_heads=4, seq_len=16, vocab_size=256, vocab_multiple=32,
             dtype='float32', remat='none', attention='xla')

# The same config as a file, for subprocesses: `--config=<file>` plus --config.* overrides.
CONFIG_FILE = f'''
from jaxfrontier import config as config_lib


def get_config(arg=None):
    c = config_lib.base_config()
    c.model.update(**{MODEL!r})
    c.mesh.update(data=2, fsdp=2, tensor=2, cpu_devices=8)
    c.train.update(steps=6, global_batch=8, micro_batch=2, log_every=1, eval_every=0, eval_batches=1,
                   progress=False)
    c.optim.update(warmup_steps=2, decay_steps=6)
    c.data.kind = 'synthetic'
    c.checkpoint.update(every_steps=1, keep=3)
    return c
'''


def make_config(data=2, fsdp=2, tensor=2, pipeline=1, virtual=1, steps=6, every=1, keep=10, **model):
    c = config_lib.base_config()
    c.model.update(**{**MODEL, **model})
    c.mesh.update(pipeline=pipeline, data=data, fsdp=fsdp, tensor=tensor)
    accum = pipeline if pipeline > 1 else 1  # pipelines need micro-batches
    c.train.update(steps=steps, global_batch=8, micro_batch=8 // (data * fsdp * accum), accum_steps=accum,
                   log_every=1, eval_every=0, eval_batches=1, progress=False)
    if virtual > 1:
        c.pipeline.update(schedule='interleaved', virtual_stages=virtual)
    c.optim.update(warmup_steps=2, decay_steps=6)
    c.data.kind = 'synthetic'
    c.checkpoint.update(every_steps=every, keep=keep)
    return c


def layout_for(c):
    n = config_lib.num_devices(c)
    return ts.make_layout(c, mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:n]))


def random_state(layout, seed=0):
    """A train state of random values in the layout's shardings, without compiling anything."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a, sharding: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), sharding),
                        layout.abstract_state, layout.state_shardings)


def save_state(c, workdir, state, step=0):
    checkpointer = ckpt_lib.Checkpointer(c, workdir)
    checkpointer.save(step, state, force=True)
    checkpointer.close()


def losses(workdir):
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
        return {r['step']: r['train/loss'] for r in map(json.loads, f)}


def read_numpy(step_dir, part=None):
    """A saved train state (or one part of it) as numpy, flattened to {name: array}."""
    tree = export.saved_tree(step_dir)
    with ocp.PyTreeCheckpointer() as checkpointer:
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                            is_leaf=lambda x: hasattr(x, 'shape'))
        state = checkpointer.restore(os.path.join(step_dir, 'state'),
                                     args=ocp.args.PyTreeRestore(restore_args=args))
    return export.flatten_names(state if part is None else state[part])


def flat_numpy(tree):
    return {k: np.asarray(v) for k, v in export.flatten_names(tree).items()}


def assert_trees_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def no_init():
    raise AssertionError('must not start from scratch')


# --------------------------------------------------------------------------- runs shared by tests


@pytest.fixture(scope='module', autouse=True)
def compile_cache(tmp_path_factory):
    """A persistent compilation cache for this module only: runs of one config compile once.

    Loading an executable from the cache gives the same binary, so bit-for-bit comparisons
    between runs are unaffected. Switched off again for the other test modules.
    """
    from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top  (test-only)

    saved = jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update('jax_compilation_cache_dir', str(tmp_path_factory.mktemp('jax_cache')))
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    compilation_cache.reset_cache()
    yield
    jax.config.update('jax_compilation_cache_dir', saved[0])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', saved[1])
    compilation_cache.reset_cache()


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """6 steps straight (a checkpoint every step) vs 3 steps, stop, resume, 3 more."""
    root = tmp_path_factory.mktemp('runs')
    straight, resumed = str(root / 'straight'), str(root / 'resumed')
    train.train_and_evaluate(make_config(steps=6), straight)
    first = train.train_and_evaluate(make_config(steps=3, every=0), resumed)
    second = train.train_and_evaluate(make_config(steps=6, every=0), resumed)
    return dict(straight=straight, resumed=resumed, first=first, second=second)


def test_exact_continuation(runs):
    straight, resumed = losses(runs['straight']), losses(runs['resumed'])
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert [straight[s] for s in range(1, 7)] == [resumed[s] for s in range(1, 7)]  # bit for bit
    assert ckpt_lib.Checkpointer(make_config(), runs['resumed']).latest_step() == 6
    assert_trees_equal(read_numpy(f'{runs["straight"]}/checkpoints/6'), read_numpy(f'{runs["resumed"]}/checkpoints/6'))
    # Step 3 of the straight run was saved asynchronously while step 4 took the donated
    # state: it must hold exactly what the run that stopped at step 3 saved.
    assert_trees_equal(read_numpy(f'{runs["straight"]}/checkpoints/3'), read_numpy(f'{runs["resumed"]}/checkpoints/3'))
    meta = ckpt_lib.Checkpointer(make_config(), runs['straight']).read_meta(3)
    assert meta['step'] == 3 and meta['data']['next_step'] == 3 and meta['config']['model']['d_model'] == 32


def test_keep_last_k_and_every_nth(tmp_path):
    c = make_config(steps=7)
    c.checkpoint.update(every_steps=1, keep=2, keep_period=3, async_save=False)
    state = random_state(layout_for(c))
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
    for step in range(1, 8):
        assert checkpointer.save(step, state)
    assert not checkpointer.save(7, state, force=True)  # already saved
    checkpointer.close()
    assert ckpt_lib.Checkpointer(c, str(tmp_path))._mngr.all_steps() == [3, 6, 7]


# --------------------------------------------------------------------------- any mesh


TARGETS = {
    'fsdp8': dict(data=1, fsdp=8, tensor=1),
    'tensor4': dict(data=1, fsdp=1, tensor=4),
    'one_device': dict(data=1, fsdp=1, tensor=1),
    'pipeline2_fsdp2_tensor2': dict(pipeline=2, data=1, fsdp=2, tensor=2),
}


def restore_on(runs, name):
    c = make_config(**TARGETS[name])
    layout = layout_for(c)
    state = ckpt_lib.Checkpointer(c, runs['straight']).restore(layout, step=3)
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state, layout.state_shardings))
    assert_trees_equal(flat_numpy(state), read_numpy(f'{runs["straight"]}/checkpoints/3'))
    return c, layout, state


@pytest.mark.parametrize('name', TARGETS)
def test_restore_onto_other_mesh(runs, name):
    """Saved on data 2 x fsdp 2 x tensor 2; restored with the target's shardings, bit-identical."""
    restore_on(runs, name)


@pytest.mark.slow
@pytest.mark.parametrize('name', TARGETS)
def test_training_continues_on_other_mesh(runs, name):
    """After the restore, step 4 has the loss it had on the original layout, to fp32 rounding."""
    c, layout, state = restore_on(runs, name)
    train_step, _, batch_sharding = train.compile_steps(c, layout)
    source, _ = data_lib.make_datasets(c, '')
    batch = data_lib.make_global_batch(source, 3, batch_sharding, c.train.global_batch)
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        _, metrics = train_step(state, batch)
    np.testing.assert_allclose(float(metrics['train/loss']), losses(runs['straight'])[4], rtol=LOSS_RTOL)


@pytest.fixture(scope='module')
def vocab300(tmp_path_factory):
    """A checkpoint (step 0) of a model whose vocabulary 300 is padded to 320 on tensor 2."""
    workdir = str(tmp_path_factory.mktemp('vocab300'))
    c = make_config(data=1, fsdp=1, tensor=2, vocab_size=300)
    assert config_lib.padded_vocab(c) == 320
    save_state(c, workdir, random_state(layout_for(c)))
    return workdir, c


def test_restore_with_other_vocab_padding(vocab300):
    """tensor 2 -> 4 changes the padded vocabulary 320 -> 384: padding rows are zero-filled."""
    workdir, _ = vocab300
    saved = read_numpy(f'{workdir}/checkpoints/0')
    c = make_config(data=1, fsdp=1, tensor=4, vocab_size=300)
    state = flat_numpy(ckpt_lib.Checkpointer(c, workdir).restore(layout_for(c)))
    for name, value in state.items():
        if name.endswith('wte'):
            assert value.shape == (384, 32)
            np.testing.assert_array_equal(value[:320], saved[name])
            assert not value[320:].any()
        else:
            np.testing.assert_array_equal(value, saved[name])


@pytest.mark.slow
def test_padded_zero1_state_restores_and_continues(tmp_path):
    """ZeRO-1 over data 8 with d_model 36 pads the Adam moments of weights that have no dimension
    divisible by 8 (w_qkv [2, 36, 3, 4, 9], the norms [2, 36]).

    Trained 3 steps on data 8, restored on one device (no padding): the moments are the saved
    ones without their (zero) padding, and the next step has the loss the padded run had.
    """
    def config(data, steps):
        c = make_config(data=data, fsdp=1, tensor=1, steps=steps, d_model=36)
        c.sharding.zero1 = True
        return c

    workdir = str(tmp_path / 'run')
    padded = config(8, steps=4)
    mu = layout_for(padded).abstract_state['opt_state'][1][0].mu
    assert mu['blocks']['attn']['w_qkv'].shape != (2, 36, 3, 4, 9)
    train.train_and_evaluate(padded, workdir)
    saved = read_numpy(f'{workdir}/checkpoints/3', 'opt_state')

    single = config(1, steps=4)
    layout = layout_for(single)
    state = ckpt_lib.Checkpointer(single, workdir).restore(layout, step=3)
    restored = flat_numpy(state['opt_state'])
    padded_names = [n for n in saved if saved[n].shape != restored[n].shape]
    assert padded_names
    for name, value in restored.items():
        cut = saved[name][tuple(slice(0, n) for n in value.shape)]
        np.testing.assert_array_equal(value, cut, err_msg=name)
        assert np.count_nonzero(saved[name]) == np.count_nonzero(cut), name  # the padding was zero

    train_step, _, batch_sharding = train.compile_steps(single, layout)
    source, _ = data_lib.make_datasets(single, '')
    batch = data_lib.make_global_batch(source, 3, batch_sharding, single.train.global_batch)
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        _, metrics = train_step(state, batch)
    np.testing.assert_allclose(float(metrics['train/loss']), losses(workdir)[4], rtol=LOSS_RTOL)


def in_model_order(flat):
    """Block arrays of an interleaved layout, [V, L / V, ...], back in their saved [L, ...] form."""
    return {k: v.reshape(-1, *v.shape[2:]) if 'blocks/' in k and v.ndim > 2 and v.shape[0] == 2 and v.shape[1] == 2
            else v for k, v in flat.items()}


def test_interleaved_pipeline_layer_split(tmp_path):
    """Blocks are [L, ...] in plain layouts and [V, L / V, ...] in interleaved pipelines; either
    restores onto the other, bit-identical in model order, and exports as [L, ...]."""
    plain = make_config(num_layers=4)
    interleaved = make_config(num_layers=4, pipeline=2, virtual=2, data=1)
    plain_state = flat_numpy(random_state(layout_for(plain), seed=1))
    save_state(plain, str(tmp_path / 'plain'), random_state(layout_for(plain), seed=1))
    layout = layout_for(interleaved)
    restored = ckpt_lib.Checkpointer(interleaved, str(tmp_path / 'plain')).restore(layout)
    assert restored['params']['blocks']['mlp']['w_in'].shape == (2, 2, 32, 128)
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, restored, layout.state_shardings))
    assert_trees_equal(in_model_order(flat_numpy(restored)), plain_state)

    save_state(interleaved, str(tmp_path / 'interleaved'), restored)
    for target in (plain, make_config(num_layers=4, pipeline=2, data=1)):  # [V, L/V] -> [L] on 8 and on 2 stages
        back = ckpt_lib.Checkpointer(target, str(tmp_path / 'interleaved')).restore(layout_for(target))
        assert_trees_equal(flat_numpy(back), plain_state)

    out = str(tmp_path / 'params.safetensors')
    shapes = export.export_params(str(tmp_path / 'interleaved'), out)
    assert shapes['blocks/mlp/w_in'] == (4, 32, 128)
    interleaved.checkpoint.init_params_from = out
    params = export.load_params(out, interleaved, layout)
    assert_trees_equal(in_model_order(flat_numpy({'params': params})),
                       {k: v for k, v in plain_state.items() if k.startswith('params/')})


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize('field,value', [('d_model', 64), ('num_layers', 4), ('vocab_size', 256)])
def test_model_mismatch_names_field(vocab300, field, value):
    workdir, _ = vocab300
    c = make_config(data=1, fsdp=1, tensor=2, **{'vocab_size': 300, field: value})
    with pytest.raises(config_lib.ConfigError, match=f'model.{field}'):
        ckpt_lib.Checkpointer(c, workdir).restore_or_init(layout_for(c), no_init)


def _largest_file(directory):
    files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


CORRUPTIONS = {
    'truncated_data': lambda step: os.truncate(_largest_file(f'{step}/state'), 100),
    'missing_data': lambda step: os.remove(_largest_file(f'{step}/state')),
    'missing_state_metadata': lambda step: os.remove(f'{step}/state/_METADATA'),
    'missing_manifest': lambda step: os.remove(f'{step}/state/manifest.ocdbt'),
    'missing_meta': lambda step: os.remove(f'{step}/meta/metadata'),
    'garbage_meta': lambda step: open(f'{step}/meta/metadata', 'w').write('{"format": 1'),
    'unlisted_step_dir': lambda step: shutil.rmtree(f'{step}/state') or os.remove(f'{step}/_CHECKPOINT_METADATA'),
}


@pytest.mark.parametrize('kind', CORRUPTIONS)
def test_corrupted_checkpoint_fails_clearly(vocab300, tmp_path, kind):
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    CORRUPTIONS[kind](str(tmp_path / 'checkpoints' / '0'))
    with pytest.raises(config_lib.UserError, match=r'checkpoints/0.*Fix:'):
        checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
        checkpointer.restore_or_init(layout_for(c), no_init)


def test_incomplete_checkpoint_is_never_restored(vocab300, tmp_path):
    """A step left in Orbax's temporary directory by a crash is ignored and removed."""
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    partial = tmp_path / 'checkpoints' / '5.orbax-checkpoint-tmp-1700000000000000'
    shutil.copytree(f'{workdir}/checkpoints/0', partial)
    os.remove(_largest_file(partial / 'state'))
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
    state, origin = checkpointer.restore_or_init(layout_for(c), no_init)
    assert int(state['step']) == 0 and 'restored step 0' in origin
    assert not partial.exists()


def test_unwritable_workdir_fails_before_training(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('x')
    with pytest.raises(config_lib.UserError, match='cannot be written'):
        train.train_and_evaluate(make_config(), str(blocker / 'run'))
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'checkpoints').write_text('not a directory')
    with pytest.raises(config_lib.UserError, match='checkpoint directory .* cannot be written'):
        train.train_and_evaluate(make_config(), str(tmp_path / 'run'))
    assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def test_config_validation():
    c = make_config()
    config_lib.validate(c, 8)
    for field, value in [('every_steps', -1), ('keep', 0), ('keep_period', -2), ('preemption_sync_every', 0),
                         ('preemption_signals', ('SIGTERM', 'SIGNOPE')), ('preemption_signals', ('SIGKILL',))]:
        bad = make_config()
        bad.checkpoint[field] = value
        with pytest.raises(config_lib.ConfigError, match=f'checkpoint.{field}'):
            config_lib.validate(bad, 8)


# --------------------------------------------------------------------------- preemption


def test_signal_stops_after_step_with_committed_checkpoint(tmp_path):
    """SIGUSR1 (an early warning) mid-run: the loop stops, saves, waits, returns normally."""
    workdir = str(tmp_path)
    c = make_config(steps=100_000, every=0)
    metrics = os.path.join(workdir, 'metrics.jsonl')

    def send_when_running():
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.getsignal(signal.SIGUSR1)
    threading.Thread(target=send_when_running, daemon=True).start()
    record = train.train_and_evaluate(c, workdir)
    step = record['preempted_at_step']
    assert 1 <= step < 100_000
    assert ckpt_lib.Checkpointer(c, workdir).latest_step() == step
    assert max(losses(workdir)) == step
    assert signal.getsignal(signal.SIGUSR1) is before


class FakeCoordinationClient:
    """The three calls of the JAX coordination client that agree_any uses, for N threads."""

    def __init__(self, n):
        self.store, self.barrier = {}, threading.Barrier(n)

    def key_value_set(self, key, value):
        self.store[key] = value

    def wait_at_barrier(self, name, timeout_ms):
        self.barrier.wait(timeout_ms / 1000)

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


@pytest.mark.parametrize('received', [(None, None, None), (None, 'SIGUSR1', None), ('SIGTERM', 'SIGUSR1', None)])
def test_processes_agree_on_stop(received):
    client, out = FakeCoordinationClient(len(received)), {}
    threads = [threading.Thread(target=lambda p=p: out.update({p: ckpt_lib.agree_any(client, 'k/7', received[p], p)}))
               for p in range(len(received))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out.values()) == {min((r for r in received if r), default=None)}


# --------------------------------------------------------------------------- export and fine-tuning

EXPECTED_NAMES = {
    'blocks/attn/w_qkv': (2, 32, 3, 4, 8), 'blocks/attn/b_qkv': (2, 3, 4, 8), 'blocks/attn/w_out': (2, 4, 8, 32),
    'blocks/attn/b_out': (2, 32), 'blocks/ln1/scale': (2, 32), 'blocks/ln1/bias': (2, 32),
    'blocks/ln2/scale': (2, 32), 'blocks/ln2/bias': (2, 32), 'blocks/mlp/w_in': (2, 32, 128),
    'blocks/mlp/b_in': (2, 128), 'blocks/mlp/w_out': (2, 128, 32), 'blocks/mlp/b_out': (2, 32),
    'ln_f/scale': (32,), 'ln_f/bias': (32,), 'wpe': (16, 32), 'wte': (256, 32),
}


def test_export_and_fine_tune_from_it(runs, tmp_path):
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

    out = str(tmp_path / 'params.safetensors')
    shapes = export.export_params(runs['straight'], out)
    assert shapes == EXPECTED_NAMES  # the name map of docs/checkpoints.md
    saved = read_numpy(f'{runs["straight"]}/checkpoints/6', 'params')
    assert_trees_equal(load_file(out), saved)

    c = make_config(data=1, fsdp=1, tensor=4)  # another mesh than the run that wrote it
    layout = layout_for(c)
    fresh = random_state(layout, seed=3)  # stands in for ts.init_train_state, without its compile
    for source in (out, runs['straight']):
        c.checkpoint.init_params_from = source
        checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path / 'finetune'))
        state, origin = checkpointer.restore_or_init(layout, lambda: dict(fresh), export.load_params)
        assert 'init_params_from' in origin
        assert_trees_equal(flat_numpy(state['params']), saved)
        assert_trees_equal(flat_numpy(state['opt_state']), flat_numpy(fresh['opt_state']))
        assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state, layout.state_shardings))


def test_fine_tune_source_mismatch_names_field(runs, tmp_path):
    out = str(tmp_path / 'params.safetensors')
    export.export_params(runs['straight'], out)
    for source in (out, runs['straight']):
        c = make_config(d_model=64)
        c.checkpoint.init_params_from = source
        with pytest.raises(config_lib.ConfigError, match='model.d_model'):
            ckpt_lib.Checkpointer(c, str(tmp_path / 'ft')).restore_or_init(layout_for(c), lambda: None, export.load_params)
    c = make_config()
    c.checkpoint.init_params_from = str(tmp_path / 'nothing_here')
    with pytest.raises(config_lib.ConfigError, match='checkpoint.init_params_from'):
        ckpt_lib.Checkpointer(c, str(tmp_path / 'ft')).restore_or_init(layout_for(c), lambda: None, export.load_params)


# --------------------------------------------------------------------------- subprocesses (slow)


@pytest.fixture(scope='module')
def cli(tmp_path_factory):
    """Runs `python -m jaxfrontier.main --config=<tiny file> ...`; all runs share a compile cache."""
    root = tmp_path_factory.mktemp('cli')
    config_file = root / 'ckpt_config.py'
    config_file.write_text(CONFIG_FILE)
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_COMPILATION_CACHE_DIR=str(root / 'jax_cache'),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', PYTHONPATH=REPO)

    def start(workdir, *overrides, mode='train'):
        cmd = [sys.executable, '-m', 'jaxfrontier.main', f'--config={config_file}', f'--workdir={workdir}',
               f'--mode={mode}', *overrides]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(workdir, *overrides, mode='train'):
        proc = start(workdir, *overrides, mode=mode)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        return out, err

    return start, run


def _wait_for(predicate, proc, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, 'timed out'
        time.sleep(0.002)


def _steps(workdir):
    return ckpt_lib.committed_steps(os.path.join(workdir, 'checkpoints'))


def _saving(workdir):
    directory = os.path.join(workdir, 'checkpoints')
    return os.path.isdir(directory) and any('orbax-checkpoint-tmp' in n for n in os.listdir(directory))


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume(cli, tmp_path):
    """Killed 4 times (twice while an asynchronous save is being written), then resumed: the
    final parameters equal those of an uninterrupted run, bit for bit."""
    start, run = cli
    steps = ['--config.train.steps=30', '--config.optim.decay_steps=30']
    reference, crashed = str(tmp_path / 'reference'), str(tmp_path / 'crashed')
    run(reference, *steps)
    rng = random.Random(4)
    left_incomplete = []
    for kill in range(4):
        proc = start(crashed, *steps)
        before = max(_steps(crashed), default=0)
        _wait_for(lambda b=before: max(_steps(crashed), default=0) > b, proc)  # resumed and saving
        if kill % 2:
            _wait_for(lambda: _saving(crashed), proc)  # mid-save
        else:
            time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        left_incomplete.append(_saving(crashed))
        assert max(_steps(crashed)) < 30, 'the run finished before it was killed: make it longer'
    assert any(left_incomplete), 'no kill landed during a save'
    run(crashed, *steps)
    assert max(_steps(crashed)) == 30 and not _saving(crashed)
    assert_trees_equal(read_numpy(f'{crashed}/checkpoints/30'), read_numpy(f'{reference}/checkpoints/30'))


@pytest.mark.slow
def test_sigterm_exits_zero_with_checkpoint_then_resume(cli, tmp_path):
    start, run = cli
    workdir = str(tmp_path / 'run')
    proc = start(workdir, '--config.train.steps=100000', '--config.checkpoint.every_steps=0')
    metrics = os.path.join(workdir, 'metrics.jsonl')
    _wait_for(lambda: os.path.exists(metrics) and os.path.getsize(metrics) > 0, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith('preempted by SIGTERM')]
    assert len(lines) == 1, out
    step = max(_steps(workdir))
    assert f'after step {step}: checkpoint committed to {workdir}/checkpoints/{step};' in lines[0]
    assert max(losses(workdir)) == step

    _, err = run(workdir, f'--config.train.steps={step + 2}')
    assert f'restored step {step} from' in err
    assert max(_steps(workdir)) == step + 2
    with open(metrics) as f:
        logged = [json.loads(line)['step'] for line in f]
    assert logged[-2:] == [step + 1, step + 2]


@pytest.mark.slow
def test_export_command_line(cli, runs, tmp_path):
    _, run = cli
    out = str(tmp_path / 'exported.safetensors')
    run(runs['straight'], f'--export_path={out}', mode='export')
    from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
    assert_trees_equal(load_file(out), read_numpy(f'{runs["straight"]}/checkpoints/6', 'params'))


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_after_the_same_step(tmp_path):
    """The signal reaches only process 1; through the coordination service both stop after the
    same step, each commits its own shards of one checkpoint (fsdp 2 spans the two processes),
    and both exit 0."""
    from processes import TINY, free_port, read_metrics, subprocess_env  # pylint: disable=g-import-not-at-top

    workdir, port, procs = str(tmp_path / 'run'), free_port(), []
    for process in (0, 1):
        cmd = [sys.executable, '-m', 'jaxfrontier.main', *TINY, f'--workdir={workdir}', '--config.mesh.data=1',
               '--config.mesh.fsdp=2', '--config.mesh.tensor=1', '--config.mesh.cpu_devices=2',
               '--config.train.micro_batch=8',
               '--config.train.steps=100000', '--config.checkpoint.every_steps=0',
               '--config.distributed.mode=explicit', f'--config.distributed.coordinator_address=127.0.0.1:{port}',
               '--config.distributed.num_processes=2', f'--config.distributed.process_id={process}']
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        _wait_for(lambda: len(read_metrics(workdir)) >= 2, procs[0], timeout_s=300)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outputs]
    step = max(_steps(workdir))
    assert f'preempted by SIGTERM after step {step}: checkpoint committed' in outputs[0][0], outputs[0]
    assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(os.listdir(f'{workdir}/checkpoints/{step}/state'))
    assert max(row['step'] for row in read_metrics(workdir)) == step
