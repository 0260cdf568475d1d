"""Pipeline schedules: exact against one device, bounded memory, no FLOPs in bubbles.

Equivalence uses the single-device checks of layout_check.py (same tolerances, stated
there). Global batch 24 so that M can be P or a non-multiple of P: M in {2, 3} for P = 2 and
{4, 6} for P = 4 (interleaved needs M to be a multiple of P).
"""

import time

import jax
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import flop_count
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import pipeline
from jaxfrontier import schedules
from jaxfrontier import train
from jaxfrontier import train_state as ts
from layout_check import LOSS_RTOL, assert_trees_close, check_against_reference, make_config, run_layout

LAYERS, BATCH = 8, 24


@pytest.fixture(scope='module')
def reference():
    return run_layout(make_config(layers=LAYERS, global_batch=BATCH))


def pipeline_config(schedule, p, m, other, virtual=1, **kw):
    return make_config(layers=LAYERS, global_batch=BATCH, pipeline=p, schedule=schedule, virtual=virtual,
                       accum=m, **{other: 2}, **kw)


# (schedule, P, M, V, other axis). The fast subset runs 1F1B with M not a multiple of P.
FAST = [('1f1b', 2, 3, 1, 'tensor')]
SLOW = [(s, p, m, v, o)
        for s, v in (('gpipe', 1), ('1f1b', 1), ('interleaved', 2))
        for p, ms in ((2, (2, 3)), (4, (4, 6)))
        for m in ms if not (s == 'interleaved' and m % p)
        for o in ('tensor', 'fsdp')]
SLOW = [case for case in SLOW if case not in FAST]


@pytest.mark.parametrize('schedule,p,m,virtual,other', FAST)
def test_pipeline_matches_single_device(schedule, p, m, virtual, other, reference):
    check_against_reference(run_layout(pipeline_config(schedule, p, m, other, virtual)), reference)


@pytest.mark.slow
@pytest.mark.parametrize('schedule,p,m,virtual,other', SLOW)
def test_pipeline_matches_single_device_slow(schedule, p, m, virtual, other, reference):
    check_against_reference(run_layout(pipeline_config(schedule, p, m, other, virtual)), reference)


@pytest.mark.slow
def test_pipeline_composes_with_zero1_and_data(reference):
    c = make_config(layers=LAYERS, global_batch=BATCH, pipeline=2, data=2, tensor=2, accum=3, zero1=True)
    check_against_reference(run_layout(c), reference)


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize('name,v', [('gpipe', 1), ('1f1b', 1), ('interleaved', 2), ('interleaved', 3)])
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


def test_1f1b_stash_is_bounded_and_gpipe_grows():
    p = 4
    one_f = [schedules.build('1f1b', p, m).act_slots for m in (2 * p, 8 * p, 64 * p)]
    gpipe = [schedules.build('gpipe', p, m).act_slots for m in (2 * p, 8 * p)]
    assert one_f[0] == one_f[1] == one_f[2] <= 2 * p - 1
    assert gpipe == [2 * p, 8 * p]


def test_bubble_formula():
    assert schedules.build('1f1b', 4, 12).bubble == pytest.approx(3 / 15)
    assert schedules.build('interleaved', 4, 12, 2).bubble == pytest.approx(3 / 27)


def test_bad_pipeline_configs_fail_before_compiling():
    c = make_config(layers=LAYERS, global_batch=BATCH, accum=2)
    c.mesh.update(pipeline=4, data=1)
    with pytest.raises(config_lib.ConfigError, match='train.accum_steps = 2'):
        config_lib.validate(c, 4)
    c = make_config(layers=LAYERS, global_batch=BATCH, accum=6)
    c.mesh.pipeline, c.pipeline.schedule, c.pipeline.virtual_stages = 4, 'interleaved', 2
    with pytest.raises(config_lib.ConfigError, match='multiple of 4'):
        config_lib.validate(c, 4)
    c.pipeline.virtual_stages = 3  # 8 layers over 4 x 3 chunks
    c.train.accum_steps, c.train.micro_batch = 4, 6
    with pytest.raises(config_lib.ConfigError, match='model.num_layers = 8'):
        config_lib.validate(c, 4)
    c.pipeline.schedule, c.pipeline.virtual_stages = 'zigzag', 1
    with pytest.raises(config_lib.ConfigError, match="pipeline.schedule = 'zigzag'"):
        config_lib.validate(c, 4)
    c.pipeline.schedule, c.pipeline.virtual_stages = '1f1b', 2
    with pytest.raises(config_lib.ConfigError, match='pipeline.virtual_stages = 2'):
        config_lib.validate(c, 4)


# ----------------------------------------------------------------------------- compiled properties


def compiled_step(c):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_layout(c, mesh)
    t0 = time.perf_counter()
    compiled, _, _ = train.compile_steps(c, layout)
    return compiled, time.perf_counter() - t0


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


@pytest.mark.slow
def test_compile_time_does_not_grow_with_m():
    _, t8 = compiled_step(big_batch_config('1f1b', 8))
    _, t64 = compiled_step(big_batch_config('1f1b', 64))
    assert t64 <= 1.5 * t8, (t8, t64)


def traced_step_flops(c):
    """Executed matmul FLOPs of one train step of `c`, summed over all devices."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_layout(c, mesh)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout.abstract_state)
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jax.numpy.int32)
    weights = pipeline.schedule_branch_weights(pipeline.build_schedule(c)) if c.mesh.pipeline > 1 else None
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return flop_count.executed_dot_flops(train.make_train_step(c, layout), state, batch, branch_weights=weights)


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
def test_pipeline_dropout_matches_non_pipelined():
    """Dropout masks depend on (seed, step, micro-batch, layer), not on the layout.

    Loss and gradients of step 0 are compared at the usual tolerances: a different mask
    would change them by O(1). Parameters after 3 steps are not: dropout zeroes some
    gradient entries' main terms, leaving near-zero gradients whose rounding noise Adam
    amplifies (see layout_check.py).
    """
    flat = make_config(layers=LAYERS, global_batch=BATCH, accum=2)
    piped = pipeline_config('1f1b', 2, 2, 'tensor')
    for c in (flat, piped):
        c.model.dropout_rate = 0.1
    (loss, grads, _), (ref_loss, ref_grads, _) = run_layout(piped), run_layout(flat)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'grad')
    no_dropout = make_config(layers=LAYERS, global_batch=BATCH, accum=2)
    assert abs(run_layout(no_dropout)[0] - ref_loss) > 50 * LOSS_RTOL * ref_loss  # dropout was on
