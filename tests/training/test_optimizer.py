"""Optimizers and learning-rate schedules (training/optimizer.py): values, placement, planner bytes, layouts.

Schedules are checked at chosen steps against their formulas, written out here again; the
optimizer state's shardings against optax's own `tree_map_params` where it applies (AdamW, Lion)
and against the factored shapes where it does not (Adafactor); the planner's optimizer bytes
against the bytes the placed state holds; Lion and Adafactor on a parallel layout against one
device (tests/layout_check.py: Lion on data 2 x fsdp 2 x tensor 2 with ZeRO-1 is fast; Adafactor on
d2f2t2 and fsdp 8, and Lion with padded ZeRO-1 moments, are slow).
"""

import math
import pathlib

import jax
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.plan import planner
from jaxfrontier.plan import shrink as shrink_lib
from jaxfrontier.run.observe import memory_check
from jaxfrontier.training import optimizer as optimizer_lib
from jaxfrontier.training import state as ts
from layout_check import check_against_reference, make_config, run_layout
from layout_once import run_layout_once

LR, MIN_LR, WARMUP, STEPS = 3e-3, 3e-4, 10, 100
CHOSEN_STEPS = (0, 4, 10, 11, 32, 55, 79, 80, 81, 90, 99, 100, 130)


def _warm(t):
    return LR * t / WARMUP


def cosine(t):
    if t < WARMUP:
        return _warm(t)
    s = min(t, STEPS) - WARMUP
    return MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi * s / (STEPS - WARMUP))) / 2


def linear(t):
    return _warm(t) if t < WARMUP else LR + (MIN_LR - LR) * (min(t, STEPS) - WARMUP) / (STEPS - WARMUP)


def constant(t):
    return _warm(t) if t < WARMUP else LR


def wsd(t, fraction=0.2):
    decay = round(fraction * STEPS)  # 20 steps: stable from 10 to 80, then 1 - sqrt down to min_lr at 100
    if t < WARMUP:
        return _warm(t)
    if t < STEPS - decay:
        return LR
    return MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(min((t - (STEPS - decay)) / decay, 1.0)))


def inverse_sqrt(t):
    return _warm(t) if t < WARMUP else max(MIN_LR, LR * math.sqrt(WARMUP / t))


FORMULAS = {'cosine': cosine, 'linear': linear, 'constant': constant, 'wsd': wsd, 'inverse_sqrt': inverse_sqrt}


def schedule_config(schedule, **optim):
    c = config_lib.base_config()
    c.train.steps = STEPS
    c.optim.update(schedule=schedule, lr=LR, min_lr=MIN_LR, warmup_steps=WARMUP, **optim)
    config_lib.validate(c)
    return c


@pytest.mark.parametrize('schedule', FORMULAS)
def test_schedule_follows_its_formula(schedule):
    assert set(FORMULAS) == set(config_lib.LR_SCHEDULES)
    f = optimizer_lib.learning_rate_schedule(schedule_config(schedule))
    for t in CHOSEN_STEPS:
        assert float(f(t)) == pytest.approx(FORMULAS[schedule](t), rel=1e-6, abs=1e-12), (schedule, t)


def test_schedule_landmarks():
    """A few values worked out by hand: the formulas above are the documented ones."""
    def at(name, t):
        return float(optimizer_lib.learning_rate_schedule(schedule_config(name))(t))
    assert at('cosine', 55) == pytest.approx((LR + MIN_LR) / 2, rel=1e-6)  # half-way through the decay
    assert at('linear', 55) == pytest.approx((LR + MIN_LR) / 2, rel=1e-6)
    assert at('wsd', 79) == pytest.approx(LR, rel=1e-6)  # still stable
    assert at('wsd', 90) == pytest.approx(MIN_LR + (LR - MIN_LR) * (1 - 0.5**0.5), rel=1e-6)  # half the cooldown
    assert at('inverse_sqrt', 40) == pytest.approx(LR / 2, rel=1e-6)  # sqrt(10 / 40)
    assert at('inverse_sqrt', 4000) == pytest.approx(MIN_LR, rel=1e-6)  # lr sqrt(10 / 4000) = 1.5e-4 < min_lr


def test_default_schedule_is_the_cosine_it_was():
    """The default config's schedule is optax's warm-up cosine, as before optim.schedule existed."""
    c = schedule_config('cosine')
    ref = optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, STEPS, MIN_LR)
    f = optimizer_lib.learning_rate_schedule(c)
    assert [float(f(t)) for t in CHOSEN_STEPS] == [float(ref(t)) for t in CHOSEN_STEPS]
    assert config_lib.base_config().optim.name == 'adamw' and config_lib.base_config().optim.schedule == 'cosine'


def test_every_optim_field_is_in_the_docs_table():
    """docs/training.md's table has a row for every optim.* field of the base config."""
    text = (pathlib.Path(__file__).resolve().parents[2] / 'docs' / 'training.md').read_text()
    rows = {line.split('|')[1].strip().strip('`') for line in text.splitlines() if line.startswith('| `')}
    assert set(config_lib.base_config().optim) <= rows, set(config_lib.base_config().optim) - rows


@pytest.mark.parametrize('field,value,needle', [
    ('name', 'sgd', 'optim.name'), ('schedule', 'step', 'optim.schedule'),
    ('decay_fraction', 0.95, 'optim.decay_fraction'), ('factor_min_dim', 0, 'optim.factor_min_dim')])
def test_bad_optimizer_settings_name_the_field(field, value, needle):
    c = config_lib.base_config()
    c.optim.update(**{'schedule': 'wsd', field: value})
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert needle in str(e.value) and '\n' not in str(e.value)


def test_inverse_sqrt_needs_warmup_and_adafactor_refuses_zero1():
    c = config_lib.base_config()
    c.optim.update(schedule='inverse_sqrt', warmup_steps=0)
    with pytest.raises(ConfigError, match='optim.warmup_steps'):
        config_lib.validate(c)
    c = config_lib.base_config()
    c.optim.name = 'adafactor'
    c.sharding.zero1 = True
    with pytest.raises(ConfigError, match='sharding.zero1.*adafactor'):
        config_lib.validate(c)


def test_verify_checks_the_layout_with_adamw():
    """--mode=verify's shrunk run uses AdamW whatever optim.name (plan/shrink.py says why: Lion's sign
    turns the key bias's rounding noise into O(lr) updates, a false FAIL; measured 0.69 against tol 1e-3)."""
    c = make_config(optimizer='lion', data=2, fsdp=2, tensor=2, zero1=True)
    shrunk = shrink_lib.shrink(c, max_devices=8)
    assert shrunk.config.optim.name == 'adamw' and shrunk.config.sharding.zero1


@pytest.mark.parametrize('shape', [(6, 10), (2, 64, 48), (2, 48, 64), (2, 64, 64), (64, 3, 8, 8), (7,), (300, 5)])
def test_factored_dims_agree_with_optax(shape):
    """layout.factored_dims picks the dimensions optax's Adafactor reduces (the state's shapes tell)."""
    state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=6).init, jax.ShapeDtypeStruct(shape, 'float32'))
    dims = layout_lib.factored_dims(shape, 6)
    if dims is None:
        assert state[0].v_row.shape == (1,) and state[0].v.shape == shape
    else:
        assert state[0].v_row.shape == tuple(n for i, n in enumerate(shape) if i != dims[1])
        assert state[0].v_col.shape == tuple(n for i, n in enumerate(shape) if i != dims[0])


def _placement(optimizer, zero1, **mesh_sizes):
    c = make_config(optimizer=optimizer, zero1=zero1, **mesh_sizes)
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    return c, ts.make_placement(c, mesh)


@pytest.mark.parametrize('optimizer', ['adamw', 'lion'])
def test_moments_placed_like_optax_places_them(optimizer):
    """Where optax.tree_map_params applies (moments shaped like the parameters), the path-based
    placement gives the same shardings, ZeRO-1's included."""
    _, layout = _placement(optimizer, True, data=2, fsdp=2, tensor=2)
    tx, _ = optimizer_lib.make_optimizer(make_config(optimizer=optimizer, zero1=True, data=2, fsdp=2, tensor=2))
    replicated = NamedSharding(layout.mesh, P())
    opt = layout.abstract_state['opt_state']
    zero1 = jax.tree.map(lambda s, a: NamedSharding(layout.mesh, layout_lib.zero1_spec(
        s.spec, a.shape, layout.mesh, mesh_lib.data_parallel_axes(layout.rules))), layout.param_shardings,
        layout.abstract_state['params'])
    expected = optax.tree_map_params(tx, lambda _, s: s, opt, zero1, transform_non_params=lambda _: replicated,
                                     is_leaf=lambda x: isinstance(x, NamedSharding))
    assert jax.tree.leaves(expected) == jax.tree.leaves(layout.state_shardings['opt_state'])
    assert any('data' in str(s.spec) for s in jax.tree.leaves(expected))  # ZeRO-1 did shard over data


def test_adafactor_factors_keep_their_dimensions_sharding():
    """A [d, f] weight sharded (fsdp, tensor) keeps v_row [d] over fsdp and v_col [f] over tensor."""
    _, layout = _placement('adafactor', False, data=2, fsdp=2, tensor=2)
    state = layout.abstract_state['opt_state'][1][0]
    shardings = layout.state_shardings['opt_state'][1][0]
    assert layout.param_shardings['blocks']['mlp']['w_in'].spec == P('pipeline', 'fsdp', 'tensor')  # [L, d, f]
    assert state.v_row['blocks']['mlp']['w_in'].shape == (2, 64)  # f = 256 reduced
    assert shardings.v_row['blocks']['mlp']['w_in'].spec == P('pipeline', 'fsdp')
    assert state.v_col['blocks']['mlp']['w_in'].shape == (2, 256)  # d = 64 reduced
    assert shardings.v_col['blocks']['mlp']['w_in'].spec == P('pipeline', 'tensor')
    assert state.v['blocks']['mlp']['w_in'].shape == (1,) and shardings.v['blocks']['mlp']['w_in'].spec == P()
    assert shardings.v['blocks']['ln1']['scale'] == layout.param_shardings['blocks']['ln1']['scale']  # unfactored


def test_planner_optimizer_bytes_follow_the_optimizer():
    """The planner's optimizer state per device equals what the placed state holds, per optimizer:
    AdamW two moments, Lion one (both with ZeRO-1), Adafactor factors and the small vectors' moments."""
    held = {}
    for optimizer, zero1 in (('adamw', True), ('lion', True), ('adafactor', False)):
        c, layout = _placement(optimizer, zero1, data=2, fsdp=2, tensor=2)
        held[optimizer] = memory_check.state_parts(layout.abstract_state, layout.state_shardings)['optimizer state']
        assert planner.plan(c, 'mi250x').memory.optimizer_bytes == held[optimizer], optimizer
    assert held['lion'] - 8 == (held['adamw'] - 8) / 2  # 4 B against 8 B per parameter, two step counters each
    # A full moment would be the parameters' bytes (same layout, no ZeRO-1): the MLP, embedding and head
    # weights keep only their factors (the attention weights' [d, 3, heads, head_dim] are not factored:
    # their second largest dimension, 8, is below factor_min_dim 32).
    params = memory_check.state_parts(layout.abstract_state, layout.state_shardings)['parameters']
    assert held['adafactor'] < params / 3


# --------------------------------------------------------------------------- one device vs a layout


@pytest.fixture(scope='module')
def references():
    cache = {}

    def get(optimizer):
        if optimizer not in cache:
            cache[optimizer] = run_layout(make_config(optimizer=optimizer))
        return cache[optimizer]
    return get


@pytest.mark.slow
def test_lion_zero1_matches_single_device(references):
    check_against_reference(run_layout_once(make_config(optimizer='lion', data=2, fsdp=2, tensor=2, zero1=True)),
                            references('lion'))


@pytest.mark.slow
@pytest.mark.parametrize('optimizer,layout', [
    ('adafactor', dict(data=2, fsdp=2, tensor=2)), ('adafactor', dict(fsdp=8, accum=2))])
def test_optimizer_layout_matches_single_device(optimizer, layout, references):
    check_against_reference(run_layout(make_config(optimizer=optimizer, **layout)), references(optimizer))


@pytest.mark.slow
def test_lion_padded_zero1_matches_single_device():
    """ZeRO-1 over data 3 pads Lion's moment (no dimension divides by 3, test_parallel's padded case):
    the padding stays zero (sign(0) = 0) and the run is still exact."""
    reference = run_layout(make_config(optimizer='lion', global_batch=24))
    check_against_reference(run_layout_once(make_config(optimizer='lion', data=3, tensor=2, zero1=True, accum=2,
                                                   global_batch=24)), reference)
