"""The loss mask (data.loss_mask; data/loss_mask.py) in the train and eval steps: the loss is the
mean cross-entropy over the predictions the mask counts, equal to a NumPy computation on a tiny
model, and every layout (data, fsdp, tensor, d2 x f2 x t2, ZeRO-1, the staggered 1F1B and GPipe
pipelines, context) gives one device's loss, gradients and eval loss; with packed documents too;
--mode=eval scores the file's mask like training.

The batches flag different shares of each row (row 0 counts nothing, the last row almost all),
so micro-batches and replicas count different numbers of predictions: only the pooled mean over
the global batch's counted predictions is the same in every layout.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.data import loss_mask
from jaxfrontier.inference import evaluate as evaluate_lib
from jaxfrontier.model import packing
from jaxfrontier.model import params as params_lib
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import LLAMA, LOSS_RTOL, SEQ, assert_trees_close, make_config

EOT = 5
GLOBAL_BATCH = 8


def masked_config(attention='xla', pack=False, **layout):
    c = make_config(global_batch=GLOBAL_BATCH, attention=attention, **layout)
    c.data.update(kind='tokens', path='unused.bin', loss_mask='on')  # as resolved from a file with a mask
    if pack:
        c.data.update(pack_documents=True, eot_id=EOT)
    return c


def masked_batch(seed=0):
    """(flagged tokens [8, SEQ + 1], ids, file mask): row r's predictions count with probability r / 7, in
    runs like a conversation's turns (row 0 counts nothing); a few end-of-text tokens for packing."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(EOT + 1, 250, (GLOBAL_BATCH, SEQ + 1)).astype(np.int32)
    mask = np.zeros_like(ids, np.uint8)
    for r in range(GLOBAL_BATCH):
        ids[r, rng.choice(SEQ, size=r % 3, replace=False)] = EOT
        turns = np.repeat(rng.random(SEQ // 4 + 1) < r / 7, 4)[:SEQ + 1]
        mask[r] = turns
    return loss_mask.mark(ids, mask), ids, mask


def loss_grads_eval(c, batch=None):
    """(loss, grads in model order, eval loss) of `batch` (masked_batch's flagged tokens) under config `c`."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    batch = jax.device_put(masked_batch()[0] if batch is None else batch,
                           NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, grads = jax.jit(step_lib.make_loss_and_grads(c, layout))(state['params'], batch, 0)
        eval_loss = jax.jit(step_lib.make_eval_step(c, layout))(state['params'], batch)
        loss, grads, eval_loss = jax.device_get((loss, grads, eval_loss))
    return float(loss), params_lib.merge_virtual(grads), float(eval_loss)


def _numpy_loss(c, ids, mask):
    """The mean cross-entropy over the counted predictions, from the model's logits, in float64."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    params = ts.init_train_state(c, layout)['params']
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        logits = np.asarray(jax.jit(lambda p, x: layout.model_def.bind(p)(x))(params, jnp.asarray(ids[:, :-1])),
                            np.float64)[..., :c.model.vocab_size]  # the padded vocabulary is not predicted
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    token_loss = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    counted = mask[:, 1:] == 1
    return token_loss[counted].mean(), token_loss.mean()


def test_masked_loss_is_the_numpy_mean_over_counted_predictions():
    c = masked_config(init_std=0.5)  # token losses far from uniform: a wrong set of counted predictions shows
    flagged, ids, mask = masked_batch()
    loss, _, eval_loss = loss_grads_eval(c, flagged)
    expected, every = _numpy_loss(c, ids, mask)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(eval_loss, expected, rtol=1e-5)
    assert abs(every - expected) > 1e-2  # not vacuous: counting every prediction is another loss
    assert 0 < mask[:, 1:].sum() < mask[:, 1:].size


def test_a_batch_that_counts_nothing_scores_zero_not_nan():
    c = masked_config()
    flagged = masked_batch()[0] | loss_mask.NOT_COUNTED
    loss, grads, eval_loss = loss_grads_eval(c, flagged)
    assert loss == 0.0 and eval_loss == 0.0
    assert all(np.all(g == 0) for g in jax.tree.leaves(grads))


def test_without_a_mask_the_bit_is_not_read():
    """data.loss_mask off: the packing object is None (no program change) and unflagged ids train as before."""
    c = make_config(global_batch=GLOBAL_BATCH)
    assert packing.from_config(c) is None  # 'auto' unresolved counts as off: the loader sets no flag either
    c.data.loss_mask = 'off'
    assert packing.from_config(c) is None
    assert packing.from_config(masked_config()) == packing.Packing(None, loss_mask=True)
    assert packing.from_config(masked_config(pack=True)) == packing.Packing(EOT, False, True)


LAYOUTS = {
    'data4': dict(data=4),
    'fsdp4': dict(fsdp=4),
    'tensor4': dict(tensor=4),
    'd2f2t2_accum2': dict(data=2, fsdp=2, tensor=2, accum=2),
    'zero1_data4_tensor2': dict(data=4, tensor=2, zero1=True),
    'pipeline2_1f1b': dict(pipeline=2, accum=2),  # staggered executor
    'pipeline2_gpipe_data2': dict(pipeline=2, data=2, accum=2, schedule='gpipe'),  # lockstep, data-local
    'context2_tensor2': dict(context=2, tensor=2),
    'packed_data2_accum2': dict(data=2, accum=2, pack=True),  # the mask times packing's boundary weights
}
FAST = ('d2f2t2_accum2', 'pipeline2_1f1b')


@pytest.fixture(scope='module')
def reference():
    return {(family, pack): loss_grads_eval(masked_config(pack=pack, **model))
            for family, model, pack in (('gpt', {}, False), ('llama', LLAMA, False), ('gpt', {}, True))}


@pytest.mark.parametrize('name', [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_layout_equals_one_device_with_a_loss_mask(request, name):
    layout = dict(LAYOUTS[name])
    pack = layout.pop('pack', False)
    family, model = ('llama', LLAMA) if 'pipeline' in name else ('gpt', {})
    loss, grads, eval_loss = loss_grads_eval(masked_config(pack=pack, **layout, **model))
    ref_loss, ref_grads, ref_eval = request.getfixturevalue('reference')[family, pack]
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    np.testing.assert_allclose(eval_loss, ref_eval, rtol=LOSS_RTOL)
    np.testing.assert_allclose(eval_loss, ref_loss, rtol=LOSS_RTOL)  # no dropout: evaluation is the train loss
    assert_trees_close(grads, ref_grads, 'grad')


def test_mode_eval_scores_the_files_mask_like_training():
    """--mode=eval's step (inference/evaluate.py) with the run's mask and the file's: the training eval loss."""
    c = masked_config()
    flagged, ids, mask = masked_batch()
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    params = ts.init_train_state(c, layout)['params']
    pk = evaluate_lib.run_packing({'data': c.data.to_dict()})
    assert pk == packing.Packing(None, loss_mask=True)
    assert evaluate_lib.run_packing({'data': {**c.data.to_dict(), 'loss_mask': 'off'}}) is None
    weights = np.stack([evaluate_lib.counted(row, SEQ, pk, m) for row, m in zip(ids, mask)]).astype(np.float32)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        total, count = evaluate_lib.make_nll_step(layout, pk)(params, ids, weights)
        eval_loss = jax.jit(step_lib.make_eval_step(c, layout))(params, flagged)
    assert count == mask[:, 1:].sum()
    np.testing.assert_allclose(float(total) / float(count), float(eval_loss), rtol=LOSS_RTOL)


@pytest.mark.slow
def test_main_trains_and_evaluates_on_prepared_conversations(tmp_path):
    """prepare --sft (held-out conversations), then `python -m jaxfrontier.main` on them: the mask is
    found ('auto' -> 'on' in the workdir's config.json), training and the held-out eval run, and
    --mode=eval scores the held-out file's mask."""
    from data.test_prepare_sft import WORDS, make_tokenizer  # pylint: disable=import-outside-toplevel  (transformers)

    rng = np.random.default_rng(0)
    with open(tmp_path / 'chats.jsonl', 'w') as f:
        for _ in range(300):
            turns = [{'role': role, 'content': ' '.join(rng.choice(WORDS[4:], size=rng.integers(1, 8)))}
                     for role in ('user', 'assistant') * int(rng.integers(1, 3))]
            f.write(json.dumps({'messages': turns}) + '\n')
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, 'PYTHONPATH': repo}
    run = lambda *args: subprocess.run([sys.executable, '-m', *args], cwd=repo, env=env, capture_output=True,  # noqa
                                       text=True, timeout=600)
    done = run('jaxfrontier.prepare', '--sft', f'--input={tmp_path}/chats.jsonl', f'--output={tmp_path}/c',
               f'--tokenizer={make_tokenizer(tmp_path / "tok")}', '--val_fraction=0.2', '--max_tokens=33')
    assert done.returncode == 0, done.stderr[-2000:]
    common = ['--config=configs/tiny.py', f'--workdir={tmp_path}/w', '--config.data.kind=tokens',
              f'--config.data.path={tmp_path}/c_train.bin', f'--config.data.val_path={tmp_path}/c_val.bin',
              '--config.model.vocab_size=0', '--config.model.seq_len=32', '--config.data.pack_documents=true']
    done = run('jaxfrontier.main', *common, '--config.train.steps=2', '--config.train.eval_every=2',
               '--config.train.eval_batches=1')
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'eval: step 2' in done.stderr + done.stdout and 'with its loss mask' in done.stderr + done.stdout
    assert json.load(open(tmp_path / 'w' / 'config.json'))['data']['loss_mask'] == 'on'
    done = run('jaxfrontier.main', *common, '--mode=eval')
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result['loss_mask'] is True and result['tokens'] < json.load(open(tmp_path / 'c_val.json'))['num_tokens']
