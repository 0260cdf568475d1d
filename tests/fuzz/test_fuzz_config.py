"""Fuzz: config overrides (`--config.section.field=value`): any value of a field's type, then validate.

An override that ml_collections accepts (the field's type) reaches `config.validate`, the one place
every rule is checked; a value it lets through must be one the rest of the start-up can use
(model shape, padded vocabulary, device count, the planner's estimate).
"""

import math

import ml_collections
from hypothesis import strategies as st

from fuzzing import fuzz, tiers, user_error_or
from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import planner


def base():
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256)
    return c


FIELDS = sorted((section, field) for section, sub in base().items() if isinstance(sub, ml_collections.ConfigDict)
                for field, value in sub.items() if not isinstance(value, ml_collections.ConfigDict))


def values_like(value):
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-3, 70), st.integers(-2**63, 2**63), st.sampled_from([0, 1, 2, 3, 4, 8, 64]))
    if isinstance(value, float):
        return st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=12), st.sampled_from(['none', 'full', 'auto', 'float16', 'bfloat16',
                                                                '1f1b', 'gpipe', 'interleaved', 'tokens']))
    return st.none()


overrides = st.lists(st.sampled_from(FIELDS).flatmap(
    lambda f: values_like(base()[f[0]][f[1]]).map(lambda v, f=f: (f, v))), min_size=1, max_size=3)


def apply(edits):
    c = base()
    for (section, field), value in edits:
        try:
            c[section][field] = value
        except TypeError:
            pass  # ml_collections refuses the type: the command line's one-line error
    config_lib.validate(c)
    for section, field in FIELDS:  # what validate lets through is a number the run can use
        value = c[section][field]
        assert not isinstance(value, float) or math.isfinite(value), (section, field, value)
    shape = config_lib.model_shape(c)
    assert config_lib.padded_vocab(c) >= c.model.vocab_size > 0 and config_lib.num_devices(c) >= 1
    p = planner.plan(c, hw_lib.get('mi250x'))
    assert math.isfinite(p.memory.total_bytes) and p.memory.total_bytes > 0 and shape.num_layers > 0
    return c


def check(edits):
    user_error_or(lambda: apply(edits))


@tiers(fast=150)
def test_config_overrides(budget):
    fuzz('config overrides (validate + plan)', overrides, check, budget, deadline_ms=5000,
         examples=[[(('model', 'init_std'), math.nan)], [(('optim', 'lr'), math.inf)],
                   [(('model', 'seq_len'), 2**62)], [(('sharding', 'rules'), None)],
                   [(('model', 'dropout_rate'), 0.5)], [(('model', 'mlp_ratio'), 1)],
                       [(('model', 'multiple_of'), 0)]])
