"""Shared by the checkpoint tests (tests/checkpoint/test_checkpoint_*.py): a tiny model, helpers, fixtures.

The model is tiny (2 layers, d_model 32, synthetic data) and the learning-rate schedule is
fixed (optim.decay_steps), so runs of different lengths compute the same steps. "Bit for bit"
means np.array_equal on fp32 arrays; losses on a different layout agree to fp32 rounding
(rtol 2e-6, as in tests/test_parallel.py). Subprocesses share a JAX compilation cache so each
process after the first skips compiling.
"""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.run import loop
from jaxfrontier.training import state as ts
import processes

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


def make_config(data=2, fsdp=2, tensor=2, pipeline=1, virtual=1, context=1, steps=6, every=1, keep=10, **model):
    c = config_lib.base_config()
    c.model.update(**{**MODEL, **model})
    c.mesh.update(pipeline=pipeline, data=data, fsdp=fsdp, context=context, tensor=tensor)
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
    return ts.make_placement(c, mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:n]))


def target_of(layout):
    """The layout's train state as the abstract target (ShapeDtypeStructs with shardings) a restore fills."""
    return target_lib.abstract_target(layout.abstract_state, layout.state_shardings)


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
    tree = readers.saved_tree(step_dir)
    with ocp.PyTreeCheckpointer() as checkpointer:
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree,
                            is_leaf=lambda x: hasattr(x, 'shape'))
        state = checkpointer.restore(os.path.join(step_dir, 'state'),
                                     args=ocp.args.PyTreeRestore(restore_args=args))
    return readers.flatten_names(state if part is None else state[part])


def flat_numpy(tree):
    return {k: np.asarray(v) for k, v in readers.flatten_names(tree).items()}


def assert_trees_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def main(workdir, *overrides, mode='train'):
    """`python -m jaxfrontier.main` on the tiny test config, as a user runs it (output captured)."""
    return processes.run_main(f'--workdir={workdir}', f'--mode={mode}', *overrides)


def no_init():
    raise AssertionError('must not start from scratch')


def _largest_file(directory):
    files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)



# --------------------------------------------------------------------------- fixtures (import them by name)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """6 steps straight (a checkpoint every step) vs 3 steps, stop, resume, 3 more."""
    root = tmp_path_factory.mktemp('runs')
    straight, resumed = str(root / 'straight'), str(root / 'resumed')
    loop.train_and_evaluate(make_config(steps=6), straight)
    first = loop.train_and_evaluate(make_config(steps=3, every=0), resumed)
    second = loop.train_and_evaluate(make_config(steps=6, every=0), resumed)
    return dict(straight=straight, resumed=resumed, first=first, second=second)


@pytest.fixture(scope='module')
def vocab300(tmp_path_factory):
    """A checkpoint (step 0) of a model whose vocabulary 300 is padded to 320 on tensor 2."""
    workdir = str(tmp_path_factory.mktemp('vocab300'))
    c = make_config(data=1, fsdp=1, tensor=2, vocab_size=300)
    assert config_lib.padded_vocab(c) == 320
    save_state(c, workdir, random_state(layout_for(c)))
    return workdir, c


@pytest.fixture(scope='module')
def cli(tmp_path_factory):
    """Runs `python -m jaxfrontier.main --config=<tiny file> ...` (with the session's compile cache)."""
    root = tmp_path_factory.mktemp('cli')
    config_file = root / 'ckpt_config.py'
    config_file.write_text(CONFIG_FILE)
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO)

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
    return format_lib.committed_steps(os.path.join(workdir, 'checkpoints'))


def _saving(workdir):
    directory = os.path.join(workdir, 'checkpoints')
    return os.path.isdir(directory) and any('orbax-checkpoint-tmp' in n for n in os.listdir(directory))
