"""A family is one unit: a third one, declared and registered in a test only (tests/model/rms_gpt_family.py:
GPT with RMSNorm), is configured, checked, planned and trained like GPT and Llama without any file of
jaxfrontier/ naming it.

Its parameter table (the planner's) against `jax.eval_shape` of its module; its field refused on
another family and checked on its own; the planner's memory and FLOPs (its traced proxy); and 3
training steps on two layouts (data 2 x tensor 2, fsdp 2 x tensor 2) against one device with
tests/layout_check.py's tolerances.
"""

import pathlib

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import params as params_lib
from jaxfrontier.plan import estimate
from jaxfrontier.plan import planner
from jaxfrontier.plan import shrink as shrink_lib
from layout_check import check_against_reference, make_config, run_layout
from model import rms_gpt_family

NAME = rms_gpt_family.NAME
# Distinct sizes so a swapped axis fails: 3 layers, 40 wide, 5 heads, 24 positions, 97 tokens.
SHAPE = dict(num_layers=3, d_model=40, num_heads=5, seq_len=24, vocab_size=97)


@pytest.fixture(scope='module', autouse=True)
def registered():
    families.register(rms_gpt_family.FAMILY)
    yield
    families.unregister(NAME)


def config(**model):
    c = config_lib.base_config()
    c.model.update(family=NAME, **SHAPE)
    c.model.update(**model)
    return c


def test_jaxfrontier_names_it_nowhere():
    root = pathlib.Path(__file__).resolve().parents[2] / 'jaxfrontier'
    assert not [p for p in root.rglob('*.py') if NAME in p.read_text() or 'RmsGPT' in p.read_text()]
    assert NAME in families.names() and 'rms_eps' in config_lib.base_config().model


def test_its_field_is_checked_and_refused_elsewhere():
    c = config(rms_eps=1e-5)
    config_lib.validate(c)
    assert config_lib.model_shape(c).rms_eps == 1e-5 and config_lib.model_shape(c).family == NAME
    with pytest.raises(ConfigError, match=r'model.rms_eps = -1.0: must be a finite number > 0'):
        config_lib.validate(config(rms_eps=-1.0))
    c.model.family = 'gpt'
    with pytest.raises(ConfigError, match=rf"model.rms_eps = 1e-05: only the {NAME} family uses it.*"
                                          rf"model.family='{NAME}'"):
        config_lib.validate(c)


@pytest.mark.parametrize('tied', [True, False])
def test_planner_param_table_matches_eval_shape(tied):
    """Names, shapes and logical axes of the planner's table (the declaration's) are those of the module."""
    shape = config_lib.model_shape(config(tied_embeddings=tied))
    model_def = params_lib.ModelDef.create(shape)
    flat = lambda tree, **kw: {'/'.join(k.key for k in path): leaf for path, leaf in  # noqa: E731
                               jax.tree_util.tree_flatten_with_path(tree, **kw)[0]}
    abstract = flat(model_def.abstract_params())
    logical = flat(model_def.logical_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    specs = estimate.param_specs(shape)
    assert sorted(p.path for p in specs) == sorted(abstract) and len(specs) == len(abstract)
    for p in specs:
        assert p.shape == abstract[p.path].shape and p.names == tuple(logical[p.path]), p.path
    assert 'blocks/ln1/scale' in abstract and 'blocks/ln1/bias' not in abstract


def test_planner_and_verify_shrink_take_it():
    c = make_config(data=2, tensor=2, family=NAME, rms_eps=1e-5)
    p = planner.plan(c)  # traces the family's proxy for its activations
    assert p.num_params == estimate.count_params(estimate.param_specs(config_lib.model_shape(c)))
    assert p.memory.total_bytes > 0 and p.flops.megatron_model == config_lib.flops_per_step(c)[0]
    s = shrink_lib.shrink(c, max_devices=8)
    assert s.config.model.family == NAME and s.config.model.num_heads == 4


@pytest.fixture(scope='module')
def reference():
    return run_layout(make_config(family=NAME, rms_eps=1e-5))


@pytest.mark.parametrize('layout', [dict(data=2, tensor=2), dict(fsdp=2, tensor=2)], ids=['d2t2', 'f2t2'])
def test_layouts_match_one_device(reference, layout):
    check_against_reference(run_layout(make_config(**layout, family=NAME, rms_eps=1e-5)), reference)
