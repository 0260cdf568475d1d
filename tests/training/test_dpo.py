"""The DPO objective (training/dpo.py): equal to the formula computed in NumPy (float64) from the
model's logits on a tiny model, with its rewards, margin and accuracy; every layout without a
pipeline (data, fsdp, tensor, d2 x f2 x t2 with accumulation, ZeRO-1 with accumulation) gives one
device's loss, metrics and gradients; layouts that would split a pair or run a pipeline are refused.

The pairs share a prompt of varying length and have responses of different lengths, right-padded:
only the response tokens' predictions count, so a wrong mask, a pair split across replicas or a
row sum over the wrong tokens changes the numbers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.data import dpo as dpo_data
from jaxfrontier.data import loss_mask
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import params as params_lib
from jaxfrontier.training import dpo
from jaxfrontier.training import state as ts
from layout_check import LOSS_RTOL, SEQ, assert_trees_close, make_config

ROWS = 16  # 8 pairs
BETA = 0.5


def dpo_config(**layout):
    c = make_config(global_batch=ROWS, **layout)
    c.data.update(kind='tokens', path='unused.bin', loss_mask='on')
    c.train.update(dpo_beta=BETA, objective='dpo')
    c.checkpoint.init_params_from = 'sft_run'
    return c


def pair_batch(seed=0):
    """(flagged tokens [ROWS, SEQ + 1], ids, mask): row 2i chosen, 2i + 1 rejected, one prompt per pair."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((ROWS, SEQ + 1), np.int32)
    mask = np.zeros_like(ids, np.uint8)
    for p in range(ROWS // 2):
        prompt = rng.integers(1, 250, rng.integers(2, SEQ // 2))
        for r in (2 * p, 2 * p + 1):
            response = rng.integers(1, 250, rng.integers(1, SEQ + 1 - len(prompt)))
            n = len(prompt) + len(response)
            ids[r, :n] = np.concatenate([prompt, response])
            mask[r, len(prompt):n] = 1
    return loss_mask.mark(ids, mask), ids, mask


def placement(c, devices):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:devices])
    layout = ts.make_placement(c, mesh)
    params = ts.init_train_state(c, layout)['params']
    # the reference: the parameters moved a little, so policy and reference differ (rewards not 0)
    leaves, tree = jax.tree.flatten(jax.device_get(params))
    noise = np.random.default_rng(1)
    reference = jax.tree.unflatten(tree, [x + 0.05 * noise.standard_normal(x.shape).astype(x.dtype) for x in leaves])
    reference = jax.device_put(reference, layout.param_shardings)
    return mesh, layout, params, reference


def loss_metrics_grads(c):
    mesh, layout, params, reference = placement(c, config_lib.num_devices(c))
    batch = jax.device_put(pair_batch()[0], NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, metrics, grads = jax.device_get(jax.jit(dpo.make_dpo_loss_and_grads(c, layout))(params, reference,
                                                                                                batch))
    return float(loss), {k: float(v) for k, v in metrics.items()}, params_lib.merge_virtual(grads)


def numpy_logps(layout, mesh, params, ids, mask, vocab):
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        logits = np.asarray(jax.jit(lambda p, x: layout.model_def.bind(p)(x))(params, jnp.asarray(ids[:, :-1])),
                            np.float64)[..., :vocab]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    token_logp = np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    return (token_logp * mask[:, 1:]).sum(-1)


@pytest.fixture(scope='module')
def one_device():
    return loss_metrics_grads(dpo_config())


def test_the_loss_is_the_dpo_formula_in_numpy(one_device):
    c = dpo_config()
    mesh, layout, params, reference = placement(c, 1)
    _, ids, mask = pair_batch()
    policy = numpy_logps(layout, mesh, params, ids, mask, c.model.vocab_size)
    ref = numpy_logps(layout, mesh, reference, ids, mask, c.model.vocab_size)
    chosen, rejected = BETA * (policy[0::2] - ref[0::2]), BETA * (policy[1::2] - ref[1::2])
    margin = chosen - rejected
    expected = {'dpo/loss': np.mean(np.log1p(np.exp(-margin))), 'dpo/reward_chosen': chosen.mean(),
                'dpo/reward_rejected': rejected.mean(), 'dpo/margin': margin.mean(),
                'dpo/accuracy': np.mean(margin > 0)}
    loss, metrics, _ = one_device
    assert 0 < expected['dpo/accuracy'] < 1 and np.abs(margin).min() > 1e-3  # a wrong sign or pair would show
    assert loss == metrics['dpo/loss']
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=2e-5, atol=1e-6, err_msg=key)


LAYOUTS = {
    'data4': dict(data=4),
    'fsdp4': dict(fsdp=4),
    'tensor4': dict(tensor=4),
    'd2f2t2_accum2': dict(data=2, fsdp=2, tensor=2, accum=2),
    'zero1_data4_accum2': dict(data=4, accum=2, zero1=True),
}
FAST = ()  # each layout compiles for seconds: the slow tier


@pytest.mark.parametrize('name', [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_layout_equals_one_device(one_device, name):
    loss, metrics, grads = loss_metrics_grads(dpo_config(**LAYOUTS[name]))
    ref_loss, ref_metrics, ref_grads = one_device
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    for key, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # The layout tests' comparison (layout_check.assert_trees_close: atol 2e-6, rtol 2e-5) in their loss's units.
    # Their loss weighs each prediction 1 / (ROWS * SEQ); DPO's weighs a response token beta * sigmoid(-margin) / P
    # (the derivative of the pair's loss by its log-probability sum), up to 2 * BETA * SEQ = 24 times more, and the
    # chosen and rejected rows' terms (one prompt) nearly cancel: the gradients' summands, and the fp32 rounding
    # of a different reduction order (the replicas' all-reduce), are that much larger. Measured: b_out's leaf
    # reaches 0.94 (the LM test's 0.1), an element -0.036 of it is 3.2e-6 off under data 4 (1.3e-7 in these units).
    scale = 2 * BETA * SEQ
    assert_trees_close(jax.tree.map(lambda g: g / scale, grads), jax.tree.map(lambda g: g / scale, ref_grads),
                       'grad / (2 beta SEQ)')


@pytest.mark.parametrize('layout,field', [(dict(pipeline=2, accum=2), 'mesh.pipeline'),
                                          (dict(context=2), 'mesh.context'),
                                          (dict(data=4, accum=4), 'train.micro_batch')])
def test_layouts_that_split_pairs_or_pipeline_are_refused(layout, field):
    with pytest.raises(ConfigError) as e:
        dpo_data.check_run(dpo_config(**layout))
    assert e.value.field == field and '\n' not in str(e.value)


def test_under_lora_the_reference_is_the_base_with_adapters_off():
    """DPO's reference under LoRA: the base with the adapters off, not a copy. With b = 0 (PEFT's start) the
    policy is its base, so step 0's rewards and margins are exactly 0 (loss log 2); the compiled step's arguments
    are the state and the batch alone (no reference copy of the base); after the update (b != 0) the policy
    moves from the unchanged reference and the margins are no longer 0."""
    c = dpo_config()
    c.lora.update(rank=4, alpha=8.0, targets='q,v')
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    train, _, sharding = dpo.compile_steps(c, layout, None)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    batch = jax.device_put(pair_batch()[0], sharding)
    assert train.memory_analysis().argument_size_in_bytes == per_device + batch.addressable_shards[0].data.nbytes
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        state, first = jax.device_get(train(state, batch))
        _, second = jax.device_get(train(state, batch))
    assert first['dpo/margin'] == 0 and first['dpo/reward_chosen'] == 0 and first['dpo/reward_rejected'] == 0
    assert first['dpo/loss'] == pytest.approx(np.log(2), abs=1e-6) and first['train/grad_norm'] > 0
    assert second['dpo/margin'] != 0 and second['dpo/reward_chosen'] != 0
