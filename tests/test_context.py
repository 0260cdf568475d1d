"""Context parallelism (mesh.context): the sequence split over devices computes what one device does.

Fast: the config rules (seq_len divisible by 2 x context when balanced, by context otherwise),
the balanced order, the flat token order's conversions, the rules' `tokens`, the layout and an
old checkpoint's meta without `context`. Slow (each compiles multi-device steps): loss and
gradients (and, for some, the parameters after 3 steps) of context 2 and 4, alone and with
tensor 2, fsdp 2 and pipeline 2, balanced and not, GPT and Llama, remat none / full /
save_dots, against one device (layout_check.py's tolerances); evaluation; compiled temporary
memory per device at a long sequence (context 4 <= 0.35 x context 1), the collectives the
split leaves, and a run at context 4 of a sequence over a budget that context 1 exceeds.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import saved_meta
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.model import context as context_lib
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.model.sequence import balanced_order
from jaxfrontier.plan import shrink as shrink_lib
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import LLAMA, batches, check_against_reference, make_config, run_layout, assert_trees_close
from layout_once import run_layout_once
from layout_check import LOSS_RTOL


# --------------------------------------------------------------------------- fast: rules and orders


@pytest.mark.parametrize('context,balance,seq,divisor', [(3, True, 24, 6), (4, True, 20, 8), (3, False, 20, 3)])
def test_seq_len_must_split_into_equal_chunks(context, balance, seq, divisor):
    c = config_lib.base_config()
    c.model.seq_len, c.mesh.context, c.model.context_balance = seq, context, balance
    if seq % divisor == 0:
        config_lib.validate(c)
        return
    with pytest.raises(ConfigError) as info:
        config_lib.validate(c)
    message = str(info.value)
    assert 'model.seq_len' in message and f'divisible by {"2 x " if balance else ""}mesh.context = {divisor}' in message
    assert 'Fix:' in message and '\n' not in message


@pytest.mark.parametrize('seq,context', [(16, 2), (24, 4), (12, 3)])
def test_balanced_order_gives_device_r_chunks_r_and_its_mirror(seq, context):
    order = balanced_order(seq, context)
    assert sorted(order.tolist()) == list(range(seq))
    chunk = seq // (2 * context)
    for r, part in enumerate(np.split(order, context)):
        want = list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * context - 1 - r) * chunk,
                                                                    (2 * context - r) * chunk))
        assert part.tolist() == want
        # causal work (keys each query sees) is the same on every device
        assert part.sum() == order[:seq // context].sum()


def test_token_order_permutes_only_when_balanced_over_several_devices():
    tokens = jnp.arange(2 * 9).reshape(2, 9)
    assert context_lib.TokenOrder(8, 1).order is None and context_lib.TokenOrder(8, 4, balance=False).order is None
    order = context_lib.TokenOrder(8, 2)
    np.testing.assert_array_equal(order.inputs(tokens), tokens[:, :-1][:, [0, 1, 6, 7, 2, 3, 4, 5]])
    np.testing.assert_array_equal(order.targets(tokens), tokens[:, 1:][:, [0, 1, 6, 7, 2, 3, 4, 5]])
    np.testing.assert_array_equal(order.positions(tokens), np.tile([0, 1, 6, 7, 2, 3, 4, 5], (2, 1)))
    assert context_lib.TokenOrder(8, 1).seq(tokens) == 8 and context_lib.TokenOrder(8, 1).positions(tokens) is None


def test_packed_documents_are_found_before_the_tokens_are_permuted():
    """Documents, their positions and the loss weights come from the window in its natural order,
    then move with their tokens: a token keeps its document and its position in it."""
    eot = 99
    window = jnp.asarray([[5, 6, eot, 7, 8, 9, eot, 4, 3]], jnp.int32)  # inputs: docs [0..2], [3..6], [7]
    order = context_lib.TokenOrder(8, 2, packing=packing_lib.Packing(eot))
    perm = [0, 1, 6, 7, 2, 3, 4, 5]
    seq = order.seq(window)
    np.testing.assert_array_equal(seq.segments_bt, np.asarray([[0, 0, 0, 1, 1, 1, 1, 2]])[:, perm])
    np.testing.assert_array_equal(seq.positions_bt, np.asarray([[0, 1, 2, 0, 1, 2, 3, 0]])[:, perm])
    np.testing.assert_array_equal(order.weights(window), np.asarray([[1, 1, 0, 1, 1, 1, 0, 1]])[:, perm])
    np.testing.assert_array_equal(order.inputs(window), window[:, :-1][:, perm])


def test_flat_token_order_is_part_major_and_splits_locally():
    """[B, T] with B over data and T over context flattens to [N] split over (context, data) with
    no communication, and back."""
    mesh = mesh_lib.make_mesh({'data': 2, 'context': 4}, jax.devices())
    rules = config_lib.resolve_rules(config_lib.DEFAULT_RULES, config_lib.model_shape(config_lib.base_config()),
                                     dict(mesh.shape))
    b, t = 6, 16
    x_bt = np.arange(b * t * 3, dtype=np.float32).reshape(b, t, 3)
    with jax.set_mesh(mesh), mesh_lib.use_rules(rules):
        x = jax.device_put(x_bt, NamedSharding(mesh, P('data', 'context')))
        flat = jax.jit(context_lib.flatten_tokens)(x)
        back = jax.jit(lambda n: context_lib.unflatten_tokens(n, b, t))(flat)
        text = jax.jit(context_lib.flatten_tokens, out_shardings=NamedSharding(mesh, P(('context', 'data')))
                       ).lower(x).compile().as_text()
    want = x_bt.reshape(b, 4, t // 4, 3).transpose(1, 0, 2, 3).reshape(b * t, 3)  # [C, B, T/C] order
    np.testing.assert_array_equal(flat, want)
    np.testing.assert_array_equal(back, x_bt)
    assert not re.search(r'all-gather|all-to-all|collective-permute|all-reduce', text)


def test_rules_without_tokens_get_length_then_batch():
    rules = tuple(r for r in config_lib.DEFAULT_RULES if r[0] != 'tokens')
    shape = config_lib.model_shape(config_lib.base_config())
    assert dict(config_lib.resolve_rules(rules, shape, {}))['tokens'] == ('context', 'data', 'fsdp')
    # the table names expert too; a mesh leaves it out at size 1, and so do the resolved rules
    assert dict(config_lib.DEFAULT_RULES)['tokens'] == ('context', 'data', 'fsdp', 'expert')
    assert dict(config_lib.resolve_rules(config_lib.DEFAULT_RULES, shape, {}))['tokens'] == ('context', 'data', 'fsdp')


def test_layout_and_shrink_keep_context():
    c = make_config(context=4, tensor=2)
    lay = layout_lib.Layout.from_config(c)
    assert lay.num_devices == 8 and lay.mesh_shape['context'] == 4 and 'CP 4' in lay.describe()
    assert lay.apply(config_lib.base_config()).mesh.context == 4
    assert 'context' not in layout_lib.Layout.from_config(make_config()).as_dict()  # old records read the same
    shrunk = shrink_lib.shrink(c)
    assert shrunk.config.mesh.context == 4 and shrunk.config.model.seq_len % 8 == 0
    assert shrunk.kept['mesh.context'] == 4 and shrink_lib.reference_config(shrunk.config).mesh.context == 1


def test_checkpoint_meta_without_context_is_accepted():
    meta = {'step': 3, 'config': config_lib.base_config().to_dict()}
    del meta['config']['mesh']['context']  # written before the context axis existed
    saved_meta.check(meta, 'old')
    meta['config']['mesh']['context'] = 0
    with pytest.raises(CheckpointError, match='config.mesh.context'):
        saved_meta.check(meta, 'bad')


# --------------------------------------------------------------------------- slow: one device's numbers


@pytest.fixture(scope='module')
def references():
    """One device's (loss, grads, params after 3 steps) per family, computed once (Llama's without the
    steps: only a GPT case compares parameters, which the families update alike)."""
    return {'gpt': run_layout(make_config()), 'llama': run_layout(make_config(**LLAMA), steps=False)}


# (family, layout, whether to compare the parameters after 3 steps too). Every case mixes several
# features so that few compiles cover context 2 and 4, balanced and natural order, tensor, fsdp,
# data, accumulation, the three remat policies and both pipeline executors.
CASES = {
    'gpt_c2': ('gpt', dict(context=2), True),
    'gpt_c4_natural_t2_dots_no_batch': ('gpt', dict(context=4, context_balance=False, tensor=2,
                                                    remat='save_dots_no_batch'), False),
    'gpt_c2_f2_t2_dots_accum': ('gpt', dict(context=2, fsdp=2, tensor=2, remat='save_dots', accum=2), False),
    'llama_c4_full': ('llama', dict(context=4, remat='full'), False),
    'gpt_p2_c2_t2_1f1b': ('gpt', dict(pipeline=2, context=2, tensor=2, accum=2, remat='full'), False),
    'llama_p2_c4_gpipe': ('llama', dict(pipeline=2, context=4, accum=2, schedule='gpipe'), False),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', CASES)
def test_context_layout_matches_single_device(name, references):
    family, kw, steps = CASES[name]
    c = make_config(**kw, **(LLAMA if family == 'llama' else {}))
    loss, grads, params = run_layout_once(c) if steps else run_layout(c, steps=False)
    ref_loss, ref_grads, _ = references[family]
    if steps:
        check_against_reference((loss, grads, params), references[family])
    else:
        np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
        assert_trees_close(grads, ref_grads, 'grad')


def eval_loss(c) -> float:
    """The eval step's loss on layout_check's first batch at the initial parameters."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    batch = jax.device_put(batches(c.train.global_batch)[0], NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return float(jax.jit(step_lib.make_eval_step(c, layout))(state['params'], batch))


@pytest.mark.slow
def test_pipelined_context_eval_matches_single_device(references):
    """The forward-only pipeline wave (its own units, data-manual map) at context 2, balanced."""
    c = make_config(pipeline=2, context=2, data=2, accum=2)
    np.testing.assert_allclose(eval_loss(c), references['gpt'][0], rtol=LOSS_RTOL)


# --------------------------------------------------------------------------- slow: memory


LONG = dict(num_layers=1, d_model=32, num_heads=2, seq_len=2048, vocab_size=64, vocab_multiple=64,
            attention='blockwise', remat='full', dtype='float32', tied_embeddings=False)
BUDGET_BYTES = 4 * 2**20  # one simulated device's budget for this sequence


def long_config(context: int):
    c = config_lib.base_config()
    c.model.update(**LONG)
    c.mesh.context = context
    c.train.update(global_batch=1, micro_batch=1, accum_steps=1, steps=2)
    c.optim.update(warmup_steps=0)
    config_lib.validate(c, context)
    return c


def compiled_step(c):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    jitted, state, batch = step_lib.jit_train_step(c, layout)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        compiled = jitted.lower(state, batch).compile()
    return compiled, layout


@pytest.mark.slow
def test_context_4_splits_temporary_memory_and_trains_a_sequence_over_budget():
    """Temporary memory per device at sequence 2048: context 4 <= 0.35 x context 1; context 1 needs more
    than the budget, context 4 fits it and runs real steps; the split leaves no gather of activations:
    keys and values travel the ring (collective-permutes), only the int32 positions are gathered."""
    one, _ = compiled_step(long_config(1))
    c4 = long_config(4)
    four, layout = compiled_step(c4)
    temp1, temp4 = one.memory_analysis().temp_size_in_bytes, four.memory_analysis().temp_size_in_bytes
    assert temp4 <= 0.35 * temp1, (temp1, temp4)
    assert temp1 > BUDGET_BYTES >= temp4, (temp1, temp4, BUDGET_BYTES)

    t = LONG['seq_len']
    gathered = re.findall(r'= (\w+)\[[\d,]*\]\S* all-gather(?:-start)?\(', four.as_text())
    assert set(gathered) <= {'s32'}, gathered
    assert re.search(r'collective-permute(?:-start)?\(', four.as_text())
    assert not re.search(r'all-to-all\(', four.as_text())

    state = ts.init_train_state(c4, layout)
    tokens = np.random.default_rng(0).integers(0, LONG['vocab_size'], (1, t + 1), dtype=np.int32)
    batch = jax.device_put(tokens, NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules)))
    losses = []
    for _ in range(2):
        state, metrics = four(state, batch)
        losses.append(float(metrics['train/loss']))
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0], losses
