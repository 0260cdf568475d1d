"""Packed documents in the train and eval steps: the loss is the mean over the counted predictions
of the global batch in every layout (accumulation, data parallel, fsdp x tensor, the pipeline's
executors), equal to one device; the config and data refuse what cannot be packed in one line; a
real `python -m jaxfrontier.main` run trains on a prepared corpus with packing on.

The batches give rows very different numbers of end-of-text tokens, so micro-batches and data
replicas count different numbers of predictions: a mean of per-micro-batch means is measurably
wrong (checked), the pooled mean is what every layout must give.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.data import loader as data_lib
from jaxfrontier.data import token_files
from jaxfrontier.errors import ConfigError
from jaxfrontier.inference import evaluate as evaluate_lib
from jaxfrontier.model import packing
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model import params as params_lib
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import LLAMA, LOSS_RTOL, SEQ, assert_trees_close, make_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOT = 5
GLOBAL_BATCH = 8


def packed_config(attention='reference', **layout):
    c = make_config(global_batch=GLOBAL_BATCH, attention=attention, **layout)
    c.data.update(kind='tokens', path='unused.bin', pack_documents=True, eot_id=EOT)
    return c


def packed_batch(seed=0):
    """[8, SEQ + 1] tokens; row r holds about 2r end-of-text tokens (row 0 none, row 7 fourteen)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(EOT + 1, 250, (GLOBAL_BATCH, SEQ + 1)).astype(np.int32)
    for r in range(GLOBAL_BATCH):
        rows[r, rng.choice(SEQ, size=2 * r, replace=False)] = EOT
    return rows


def loss_grads_eval(c):
    """(loss, grads in model order, eval loss) of `packed_batch` under config `c`."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    batch = jax.device_put(packed_batch(), NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, grads = jax.jit(step_lib.make_loss_and_grads(c, layout))(state['params'], batch, 0)
        eval_loss = jax.jit(step_lib.make_eval_step(c, layout))(state['params'], batch)
        loss, grads, eval_loss = jax.device_get((loss, grads, eval_loss))
    return float(loss), params_lib.merge_virtual(grads), float(eval_loss)


LAYOUTS = {
    'accum2': dict(accum=2),
    'data2_accum2': dict(data=2, accum=2),  # reduced once over data: a pmean of replicas' means
    'fsdp2_tensor2': dict(fsdp=2, tensor=2),
    'fsdp2_tensor2_blockwise': dict(fsdp=2, tensor=2, attention='blockwise', attention_block_q=8,
                                    attention_block_kv=8),  # whole block pairs across documents skipped
    # context parallelism: documents found on the window, then permuted with the tokens (model/context.py)
    'context2_tensor2_blockwise': dict(context=2, tensor=2, attention='blockwise', attention_block_q=8,
                                       attention_block_kv=8),
    'pipeline2_1f1b': dict(pipeline=2, accum=2),  # staggered executor
    'pipeline2_gpipe_data2': dict(pipeline=2, data=2, accum=2, schedule='gpipe'),  # lockstep, data-local
}


@pytest.fixture(scope='module')
def reference():
    return {family: loss_grads_eval(packed_config(**model)) for family, model in (('gpt', {}), ('llama', LLAMA))}


@pytest.fixture(scope='module')
def blockwise_reference():
    return loss_grads_eval(packed_config(**{**LAYOUTS['fsdp2_tensor2_blockwise'], 'fsdp': 1, 'tensor': 1}))  # = context2's


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(LAYOUTS))
def test_layout_equals_one_device_with_packing(request, reference, name):
    family, model = ('llama', LLAMA) if 'pipeline' in name else ('gpt', {})
    loss, grads, eval_loss = loss_grads_eval(packed_config(**LAYOUTS[name], **model))
    blockwise = 'blockwise' in name  # against one device with the same kernel
    ref_loss, ref_grads, ref_eval = request.getfixturevalue('blockwise_reference') if blockwise else reference[family]
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose(eval_loss, ref_eval, rtol=LOSS_RTOL)
    np.testing.assert_allclose(eval_loss, ref_loss, rtol=LOSS_RTOL)  # no dropout: evaluation is the train loss
    assert_trees_close(grads, ref_grads, 'grad')


@pytest.mark.slow
def test_accumulated_loss_is_the_pooled_mean_not_a_mean_of_means():
    """Two accumulation steps (rows 0-3 count 84 predictions, rows 4-7 count 52): the step's loss is
    the mean over all counted predictions, from per-row losses computed apart; the mean of the two
    micro-batches' own means differs (init_std 0.5: token losses far from uniform)."""
    c = packed_config(accum=2, init_std=0.5)
    loss = loss_grads_eval(c)[0]
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    params = ts.init_train_state(c, layout)['params']
    pk, batch = packing.from_config(c), packed_batch()
    row_loss = jax.jit(lambda p, row: TokenOrder(SEQ, packing=pk).loss(layout.model_def.bind(p), row))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        sums = np.array([float(row_loss(params, row[None])) * SEQ for row in batch])  # each row's counted sum
    counts = np.sum(batch[:, :-1] != EOT, axis=1).astype(np.float64)
    np.testing.assert_allclose(loss, sums.sum() / counts.sum(), rtol=1e-5)
    micro_means = [sums[:4].sum() / counts[:4].sum(), sums[4:].sum() / counts[4:].sum()]
    assert abs(np.mean(micro_means) - loss) > 100 * LOSS_RTOL * loss


@pytest.mark.slow
def test_mode_eval_scores_packed_documents_like_training(reference):
    """--mode=eval's step (inference/evaluate.py) with the run's packing: the training eval loss."""
    c = packed_config()
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    params = ts.init_train_state(c, layout)['params']
    pk = evaluate_lib.run_packing({'data': c.data.to_dict()})
    assert pk == packing.Packing(EOT) and evaluate_lib.run_packing({}) is None
    batch = packed_batch()
    weights = np.stack([evaluate_lib.counted(row, SEQ, pk) for row in batch]).astype(np.float32)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        total, count = evaluate_lib.make_nll_step(layout, pk)(params, batch, weights)
    assert count == np.sum(batch[:, :-1] != EOT)
    np.testing.assert_allclose(float(total) / float(count), reference['gpt'][2], rtol=LOSS_RTOL)


# --------------------------------------------------------------------------- refusals and a real run


def _token_file(tmp_path, eot_id=EOT):
    metadata = {} if eot_id is None else {'eot_id': eot_id}
    return token_files.write_token_file(tmp_path / 'd.bin', packed_batch().reshape(-1), 250, metadata=metadata)


def _config(**data):
    c = config_lib.base_config()
    c.model.update(vocab_size=250)
    c.data.update(**{'pack_documents': True, **data})
    return c


@pytest.mark.parametrize('data,field,words', [
    (dict(kind='builtin'), 'data.pack_documents', 'no documents'),
    (dict(kind='synthetic'), 'data.pack_documents', 'no documents'),
    (dict(kind='tokens', path='{tmp}/d.bin', pack_documents=False, boundary_loss=True), 'data.boundary_loss',
     'pack_documents=false'),
    (dict(kind='tokens', path='{tmp}/d.bin', eot_id=7), 'data.eot_id', 'says the end-of-text token is 5'),
    (dict(kind='tokens', path='{tmp}/d.bin', eot_id=250), 'data.eot_id', 'not a token'),
])
def test_what_cannot_be_packed_is_one_config_error(tmp_path, data, field, words):
    _token_file(tmp_path)
    c = _config(**{k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in data.items()})
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
        data_lib.resolve_eot(c)
    assert e.value.field == field and words in str(e.value) and '\n' not in str(e.value)


def test_eot_comes_from_the_header_or_the_config(tmp_path):
    path = _token_file(tmp_path)
    c = _config(kind='tokens', path=path)
    data_lib.resolve_eot(c)
    assert c.data.eot_id == EOT
    bare = _token_file(tmp_path / 'bare', eot_id=None)
    with pytest.raises(ConfigError, match='names no end-of-text token'):
        data_lib.resolve_eot(_config(kind='tokens', path=bare))
    c = _config(kind='tokens', path=bare, eot_id=EOT)  # a hand-written file: the user names it
    data_lib.resolve_eot(c)
    assert c.data.eot_id == EOT


@pytest.mark.slow
def test_main_trains_with_packed_documents(tmp_path):
    """`python -m jaxfrontier.main --config.data.pack_documents=true` on a corpus prepare wrote."""
    folder = tmp_path / 'txt'
    folder.mkdir()
    for i in range(60):
        (folder / f'doc{i:02d}.txt').write_text(f'document {i}: ' + ' '.join(['word'] * (i % 13 + 1)) + '\n')
    env = {**os.environ, 'PYTHONPATH': REPO}
    run = lambda *args: subprocess.run([sys.executable, '-m', *args], cwd=REPO, env=env, capture_output=True,  # noqa
                                       text=True, timeout=600)
    done = run('jaxfrontier.prepare', f'--input={folder}/*.txt', f'--output={tmp_path}/c', '--train_tokenizer=300')
    assert done.returncode == 0, done.stderr[-2000:]
    common = ['jaxfrontier.main', '--config=configs/tiny.py', '--config.data.kind=tokens',
              f'--config.data.path={tmp_path}/c.bin', '--config.model.vocab_size=0', '--config.model.seq_len=32',
              '--config.data.pack_documents=true',  # attention auto: blockwise on the CPU
              '--config.data.val_fraction=0.2']
    done = run(*common, f'--workdir={tmp_path}/w', '--config.train.steps=2', '--config.train.eval_every=2',
               '--config.train.eval_batches=1')
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'eval: step' in done.stderr + done.stdout
    done = run(*common, f'--workdir={tmp_path}/w2', '--config.data.boundary_loss=maybe')
    assert done.returncode == 2 and 'boundary_loss' in done.stderr and 'Traceback' not in done.stderr
