"""Pipeline schedules: exact against one device, bounded memory, no FLOPs in bubbles.

Equivalence uses the single-device checks of layout_check.py (same tolerances, stated
there); each pipelined layout compiles only its train step (layout_once.py reads step 0's loss
and gradients back from it), the one-device reference both programs. Global batch 24 so that M can be P or a non-multiple of P: M in {2, 3} for P = 2 and
{4, 6} for P = 4 (interleaved needs M to be a multiple of P).
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier.errors import ConfigError
from jaxfrontier.plan import compile_check
from jaxfrontier import config as config_lib
from jaxfrontier.plan import flop_count
from jaxfrontier.plan import hlo_collectives
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import pipeline
from jaxfrontier.pipeline import schedules
from jaxfrontier.model import params as params_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts
from layout_check import LOSS_RTOL, assert_trees_close, check_against_reference, make_config, run_layout
from layout_once import run_layout_once

LAYERS, BATCH = 8, 24


@pytest.fixture(scope='module')
def reference():
    return run_layout(make_config(layers=LAYERS, global_batch=BATCH))


def pipeline_config(schedule, p, m, other, virtual=1, **kw):
    return make_config(layers=LAYERS, global_batch=BATCH, pipeline=p, schedule=schedule, virtual=virtual,
                       accum=m, **{other: 2}, **kw)


# (schedule, P, M, V, other axis): every schedule with P = 2 and 4, once with tensor 2 and once
# with fsdp 2, once with M = P and once with an M that is not a multiple of P (where the
# schedule allows it; interleaved needs M % P == 0). All slow: the fast tier's staggered-1F1B
# equivalence case is the context x fsdp one below (P 2, M 2), and 1F1B with tensor is held in the
# fast tier by its compiled collectives (test_stash_and_sends_are_split_over_tensor).
SLOW = [case for s, v in (('gpipe', 1), ('1f1b', 1), ('interleaved', 2)) for p in (2, 4)
        for case in ((s, p, p + (p // 2 if s != 'interleaved' else 0), v, 'tensor'), (s, p, p, v, 'fsdp'))]
SLOW = [case for case in SLOW if case[:2] != ('1f1b', 2)] + [
    ('1f1b', 2, 3, 1, 'tensor'), ('1f1b', 2, 2, 1, 'fsdp'), ('1f1b_lockstep', 2, 3, 1, 'fsdp'),
    ('1f1b_lockstep', 4, 4, 1, 'tensor')]


@pytest.mark.slow
@pytest.mark.parametrize('schedule,p,m,virtual,other', SLOW)
def test_pipeline_matches_single_device(schedule, p, m, virtual, other, reference):
    check_against_reference(run_layout_once(pipeline_config(schedule, p, m, other, virtual)), reference)


@pytest.mark.slow
def test_staggered_1f1b_with_save_dots_attention_matches_single_device(reference):
    """The staggered executor's backward half-slot from the policy's residuals (config.STAGGERED_RESIDUALS:
    the weight matmuls' and attention's outputs), with tensor 2 splitting them."""
    c = pipeline_config('1f1b', 2, 3, 'tensor', remat='save_dots_attention')
    check_against_reference(run_layout_once(c), reference)


def test_pipeline_over_context_and_fsdp_matches_single_device(reference):
    """Issue 35's layout, context 2 x pipeline 2 x fsdp 2, through the loop's compiled step: no
    collective-permute in a stage's branch (XLA:CPU's waits for every device: it deadlocked), and
    one device's numbers (tests/pipeline/test_pipeline_layouts.py has the other schedules)."""
    def no_permute_in_branches(compiled):  # checked before the step runs: it would deadlock
        found = hlo_collectives.in_branches(compiled.as_text())
        assert not found, found[:2]

    check_against_reference(run_layout_once(pipeline_config('1f1b', 2, 2, 'fsdp', context=2),
                                            inspect=no_permute_in_branches), reference)


@pytest.mark.slow
def test_pipeline_composes_with_zero1_and_data(reference):
    c = make_config(layers=LAYERS, global_batch=BATCH, pipeline=2, data=2, tensor=2, accum=3, zero1=True)
    check_against_reference(run_layout_once(c), reference)


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize('name,v', [('gpipe', 1), ('1f1b_lockstep', 1), ('interleaved', 2), ('interleaved', 3)])
@pytest.mark.parametrize('p', [2, 4])
def test_schedule_tables_are_complete(name, v, p):
    m = 3 * p
    s = schedules.build(name, p, m, v)
    c = p * v
    # every unit appears exactly once: M*(C-1) forwards (last chunk fused) and M*C backwards
    assert np.sum(s.f_table[..., 0] != schedules.F_NONE) == m * (c - 1)
    assert np.sum(s.b_table[..., 0] != schedules.B_NONE) == m * c
    assert np.sum(s.b_table[..., 0] == schedules.B_LAST) == m
    assert np.sum(s.recv_f[..., 0]) == m * (c - 1) and np.sum(s.recv_b[..., 0]) == m * (c - 1)


@pytest.mark.parametrize('p,m', [(2, 2), (2, 5), (3, 3), (4, 4), (4, 7), (8, 64)])
def test_staggered_1f1b_tables(p, m):
    """Every (micro-batch, stage) has one forward (last stage: fused into its recomputation),
    one recomputation and one backward, in dependency order, each stage busy with one phase
    per half-slot; stage p never holds more than P - p chunk inputs."""
    s = schedules.build('1f1b', p, m)
    a, b = s.a_table, s.b_table
    f_kinds = (schedules.A_F_FIRST, schedules.A_F_MID, schedules.A_F_FIRST_R, schedules.A_F_MID_R)
    r_kinds = (schedules.A_R, schedules.A_R_LAST, schedules.A_F_FIRST_R, schedules.A_F_MID_R)
    slots = [(t, q) for t in range(s.num_half_slots) for q in range(p)]
    forwards = {(int(a[t, q, 1]), q): t for t, q in slots if a[t, q, 0] in f_kinds}
    recomputes = {(int(a[t, q, 2]), q): t for t, q in slots if a[t, q, 0] in r_kinds}
    backwards = {(int(b[t, q, 1]), q): t for t, q in slots if b[t, q, 0] != schedules.BS_NONE}
    assert len(forwards) == m * (p - 1) and len(recomputes) == len(backwards) == m * p
    for mb in range(m):
        for q in range(p):
            if 0 < q < p - 1:
                assert forwards[mb, q] == forwards[mb, q - 1] + 1  # one half-slot per hop
            if q == p - 1:
                assert recomputes[mb, q] == forwards[mb, q - 1] + 1
            assert backwards[mb, q] == recomputes[mb, q] + 1
            if q < p - 1:
                assert backwards[mb, q] == backwards[mb, q + 1] + 1
    for t, q in slots:  # A work only in A half-slots, B work only in B half-slots
        assert a[t, q, 0] == schedules.A_NONE or (t - q) % 2 == 0
        assert b[t, q, 0] == schedules.BS_NONE or (t - q) % 2 == 1
    assert s.max_stashed_inputs() <= p - 1 < s.act_slots == p
    assert s.num_half_slots == 2 * m + 2 * p - 2


def test_1f1b_stash_is_bounded_and_gpipe_grows():
    p = 4
    one_f = [schedules.build('1f1b', p, m).max_stashed_inputs() for m in (2 * p, 8 * p, 64 * p)]
    lockstep = [schedules.build('1f1b_lockstep', p, m).act_slots for m in (2 * p, 8 * p, 64 * p)]
    gpipe = [schedules.build('gpipe', p, m).act_slots for m in (2 * p, 8 * p)]
    assert one_f[0] == one_f[1] == one_f[2] <= p  # the bound: at most P per stage
    assert lockstep[0] == lockstep[1] == lockstep[2] <= 2 * p - 1
    assert gpipe == [2 * p, 8 * p]


def test_bubble_formula():
    assert schedules.build('1f1b', 4, 12).bubble == pytest.approx(3 / 15)
    assert schedules.build('interleaved', 4, 12, 2).bubble == pytest.approx(3 / 27)


def test_bad_pipeline_configs_fail_before_compiling():
    c = make_config(layers=LAYERS, global_batch=BATCH, accum=2)
    c.mesh.update(pipeline=4, data=1)
    with pytest.raises(ConfigError, match='train.accum_steps = 2'):
        config_lib.validate(c, 4)
    c = make_config(layers=LAYERS, global_batch=BATCH, accum=6)
    c.mesh.pipeline, c.pipeline.schedule, c.pipeline.virtual_stages = 4, 'interleaved', 2
    with pytest.raises(ConfigError, match='multiple of 4'):
        config_lib.validate(c, 4)
    c.pipeline.virtual_stages = 3  # 8 layers over 4 x 3 chunks
    c.train.accum_steps, c.train.micro_batch = 4, 6
    with pytest.raises(ConfigError, match='model.num_layers = 8'):
        config_lib.validate(c, 4)
    c.pipeline.schedule, c.pipeline.virtual_stages = 'zigzag', 1
    with pytest.raises(ConfigError, match="pipeline.schedule = 'zigzag'"):
        config_lib.validate(c, 4)
    c.pipeline.schedule, c.pipeline.virtual_stages = '1f1b', 2
    with pytest.raises(ConfigError, match='pipeline.virtual_stages = 2'):
        config_lib.validate(c, 4)


# ----------------------------------------------------------------------------- compiled properties


def compiled_step(c):
    """The compiled train step of `c` (the program training.step.compile_steps compiles, without its eval step)."""
    return compile_check.compile_on_cpu(c), None


def lowered_op_counts(c) -> collections.Counter:
    """{op name: count} of the train step's lowered StableHLO (no compile): the program's size."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    batch_sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32, sharding=batch_sharding)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         layout.abstract_state, layout.state_shardings)
    step = jax.jit(step_lib.make_train_step(c, layout), in_shardings=(layout.state_shardings, batch_sharding),
                   out_shardings=(layout.state_shardings, None), donate_argnums=0)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        text = step.lower(state, batch).as_text()
    return collections.Counter(re.findall(r'\b((?:stablehlo|sdy|mhlo|chlo|func)\.[a-z_]+)\b', text))


def big_batch_config(schedule, m):
    c = make_config(layers=4, global_batch=m, pipeline=4, schedule=schedule, accum=m)
    c.model.seq_len = 64
    return c


@pytest.mark.slow
def test_1f1b_memory_is_flat_in_m_and_gpipe_grows():
    temp = {(s, m): compiled_step(big_batch_config(s, m))[0].memory_analysis().temp_size_in_bytes
            for s in ('1f1b', 'gpipe') for m in (8, 32)}
    assert temp['1f1b', 32] <= 1.10 * temp['1f1b', 8], temp
    # GPipe stashes every micro-batch: 24 more stashes of [layers per stage, rows x seq, d] fp32.
    c = big_batch_config('gpipe', 8)
    stash_bytes = (c.model.num_layers // 4) * c.train.micro_batch * c.model.seq_len * c.model.d_model * 4
    assert temp['gpipe', 32] - temp['gpipe', 8] >= 0.9 * 24 * stash_bytes, (temp, stash_bytes)


@pytest.mark.parametrize('schedule', ['1f1b', 'gpipe'])
def test_program_does_not_grow_with_m(schedule):
    """One scan over the schedule's ticks: 64 micro-batches lower to the same ops as 8.

    The deterministic form of "compile time does not grow with M" (the timing itself is the
    compile_s column of benchmarks/pipeline.py): an unrolled loop would multiply the ops by 8.
    """
    ops8 = lowered_op_counts(big_batch_config(schedule, 8))
    ops64 = lowered_op_counts(big_batch_config(schedule, 64))
    assert sum(ops8.values()) > 100, ops8
    assert ops64 == ops8, (ops64 - ops8, ops8 - ops64)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', ['1f1b', '1f1b_lockstep'])
def test_stash_and_sends_are_split_over_tensor(schedule):
    """pipeline.shard_activations: the stash and the sends between stages hold 1/TP of the tokens.

    P 2 x TP 4, M 8, 4 layers per stage: the sends carry exactly 1/4 of the bytes and the stash
    shrinks 4-fold (staggered 1F1B: P chunk inputs and the message buffer; lockstep:
    act_slots x 4 layer inputs and the received-gradient slot, of [rows x seq, d] fp32). The
    price is one all-gather over tensor per use of a split activation: staggered, the
    forward's and the recomputation's inputs and the received gradient, 3 (P - 1) / P per
    micro-batch and device; lockstep, every stashed layer input and the received activation
    and gradient, (P - 1) / P x (layers per stage + 2).
    """
    results = {}
    for on in (False, True):
        c = make_config(layers=8, global_batch=32, pipeline=2, tensor=4, accum=8, schedule=schedule)
        c.pipeline.shard_activations = on
        compiled = compile_check.compile_on_cpu(c)
        by_kind = {}
        for x in compile_check.collectives(c, compiled):
            by_kind[x.kind, x.axes] = by_kind.get((x.kind, x.axes), 0.0) + x.total_bytes
        results[on] = compiled.memory_analysis().temp_size_in_bytes, by_kind
    act = 32 // 8 * c.model.seq_len * c.model.d_model * 4
    if schedule == '1f1b':
        stash, gathers = (2 + 1) * act, 8 * 3 * (2 - 1) / 2
    else:
        stash, gathers = (schedules.build(schedule, 2, 8).act_slots * 4 + 1) * act, 8 * (4 + 2) / 2
    (temp_off, off), (temp_on, on) = results[False], results[True]
    assert on['collective-permute', ('pipeline',)] == off['collective-permute', ('pipeline',)] / 4
    assert temp_off - temp_on >= 0.9 * stash * 3 / 4, (temp_off, temp_on, stash)
    assert ('all-gather', ('tensor',)) not in off
    assert on['all-gather', ('tensor',)] == pytest.approx(act * gathers)


def traced_step_flops(c):
    """Executed matmul FLOPs of one train step of `c`, summed over all devices."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout.abstract_state)
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jax.numpy.int32)
    weights = pipeline.build_schedule(layout_lib.Layout.from_config(c)).flop_weights if c.mesh.pipeline > 1 else None
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return flop_count.executed_dot_flops(step_lib.make_train_step(c, layout), state, batch, branch_weights=weights)


@pytest.mark.parametrize('schedule,virtual', [('1f1b', 1), ('interleaved', 2)])
def test_executed_flops_do_not_grow_with_pipeline(schedule, virtual):
    """P = 4 executes the FLOPs of P = 1 with per-layer full recomputation: no work in bubbles."""
    base = dict(layers=8, global_batch=8, accum=4)
    flat = traced_step_flops(make_config(remat='full', **base))
    piped = traced_step_flops(make_config(pipeline=4 if virtual == 1 else 2, schedule=schedule, virtual=virtual,
                                          **base))
    assert abs(piped / flat - 1) < 0.05, (piped, flat)
    no_remat = traced_step_flops(make_config(remat='none', **base))
    assert 1.2 < piped / no_remat < 4 / 3 + 1e-6  # recomputation costs one forward of the blocks


@pytest.mark.slow
def test_pipeline_dropout_matches_non_pipelined(reference):
    """Dropout masks depend on (seed, step, micro-batch, layer), not on the layout.

    Loss and gradients of step 0 are compared at the usual tolerances: a different mask
    would change them by O(1). Parameters after 3 steps are not (so no train step is
    compiled): dropout zeroes some gradient entries' main terms, leaving near-zero gradients
    whose rounding noise Adam amplifies (see layout_check.py). The control without dropout
    is the module's reference run (same model, seed and batch; its step-0 loss equals the
    accumulated one to LOSS_RTOL, as the layout tests hold).
    """
    flat = make_config(layers=LAYERS, global_batch=BATCH, accum=2)
    piped = pipeline_config('1f1b', 2, 2, 'tensor')
    for c in (flat, piped):
        c.model.dropout_rate = 0.1
    (loss, grads, _), (ref_loss, ref_grads, _) = run_layout(piped, steps=False), run_layout(flat, steps=False)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'grad')
    no_dropout_loss = reference[0]
    assert abs(no_dropout_loss - ref_loss) > 50 * LOSS_RTOL * ref_loss  # dropout was on


def _initial_params(c):
    """The model's initial parameters (what ts.init_train_state draws from c.seed), as numpy.

    Drawn once, unsharded and without the optimizer state, then placed in each layout's
    shardings: the eval test compares eval steps on identical parameters. That a pipelined
    layout's own sharded init draws these same values is checked by
    test_pipeline_matches_single_device (same schedule, P, M and tensor 2).
    """
    shape = config_lib.model_shape(c)
    return jax.device_get(jax.jit(lambda key: params_lib.init_params(shape, key))(jax.random.key(c.seed)))


def _eval(c, tokens, params):
    """(eval loss, executed matmul FLOPs of the eval step) of config `c` on `tokens` with `params`."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    virtual = c.pipeline.virtual_stages if c.mesh.pipeline > 1 else 1
    params = jax.device_put(params_lib.split_virtual(params, virtual), layout.param_shardings)
    eval_step = step_lib.make_eval_step(c, layout)
    weights = None
    if c.mesh.pipeline > 1:
        schedule = schedules.forward_only(c.mesh.pipeline, c.train.accum_steps, c.pipeline.virtual_stages)
        weights = schedule.flop_weights
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss = float(jax.jit(eval_step)(params, tokens))
        flops = flop_count.executed_dot_flops(eval_step, abstract, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype),
                                              branch_weights=weights)
    return loss, flops


@pytest.mark.parametrize('schedule,p,m,virtual', [pytest.param('1f1b', 2, 3, 1, marks=pytest.mark.slow),
                                                  pytest.param('interleaved', 2, 4, 2, marks=pytest.mark.slow)])
def test_pipeline_eval_is_forward_only(schedule, p, m, virtual):
    """Evaluation of a pipelined model runs forward units only: the loss of the unpipelined
    eval step, and exactly its matmul FLOPs (no backward, no recomputation, nothing in bubbles)."""
    tokens = np.random.default_rng(0).integers(0, 250, (BATCH, 25), dtype=np.int32)
    flat = make_config(layers=LAYERS, global_batch=BATCH, accum=m)
    params = _initial_params(flat)
    flat_loss, flat_flops = _eval(flat, tokens, params)
    loss, flops = _eval(pipeline_config(schedule, p, m, 'tensor', virtual), tokens, params)
    np.testing.assert_allclose(loss, flat_loss, rtol=LOSS_RTOL)
    assert flops == pytest.approx(flat_flops, rel=1e-9)


@pytest.mark.slow  # the fast tier checks the pipelined train step against one device
def test_pipeline_eval_with_data_and_fsdp_matches_flat():
    """Pipeline 2 x data 2 x fsdp 2: the wave runs manual over `data` too, each replica on its
    rows (jax 0.11.2 aborts compiling it with `data` and `fsdp` both automatic inside)."""
    tokens = np.random.default_rng(0).integers(0, 250, (BATCH, 25), dtype=np.int32)
    flat = make_config(layers=LAYERS, global_batch=BATCH, accum=3)
    params = _initial_params(flat)
    flat_loss, _ = _eval(flat, tokens, params)
    loss, _ = _eval(make_config(layers=LAYERS, global_batch=BATCH, pipeline=2, accum=3, data=2, fsdp=2), tokens, params)
    np.testing.assert_allclose(loss, flat_loss, rtol=LOSS_RTOL)
