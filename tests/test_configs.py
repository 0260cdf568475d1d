"""Every config file loads as `--config=configs/<file>.py[:arg]` would, validates, and shape-checks.

Each config is loaded with ml_collections' own loader (`config_flags._LoadConfigModule`, what
`--config=` uses), validated for its own device count, and its parameters and whole train state
are built with `jax.eval_shape` (no arrays, so the 1T model is as cheap as the tiny one). The
parameter counts of the paper's models are checked against FRONTIER.md and, exactly, against
the closed form of a tied-embedding GPT-2/Megatron model:

  12 l h^2 + 13 l h + (V + s) h + 2 h

(per layer: QKV 3h^2 + 3h, attention out h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h; then token
and position embeddings and the final LayerNorm), V the padded vocabulary.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from ml_collections.config_flags import config_flags

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.training import optimizer as optimizer_lib
from jaxfrontier.model import params as params_lib

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')
# ml_collections loads config files with importlib's deprecated load_module.
pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')

HELPERS = {'paper.py'}  # shared settings imported by configs, not configs themselves
FROM_A_DIRECTORY = {'hf.py', 'sft.py', 'dpo.py'}  # models from a Hugging Face directory: tests/checkpoint/test_hf_llama.py, tests/post_training

# (file, arg) for every config: each gpt.py size, the paper's models, the default.
CONFIGS = [('tiny.py', None)] + [('gpt.py', f'size={s}') for s in ('125m', '350m', '1.3b', '6.7b')] + [
    ('22b.py', None), ('175b.py', None), ('1t.py', None)]

# llama.py's sizes: Meta's published shapes (their parameter counts: tests/model/test_llama.py).
LLAMA_CONFIGS = [('llama.py', f'size={s}') for s in ('tiny', '1b', '3b', '8b', '70b', '405b')]

# configs/moe.py's sizes: published MoE shapes (their parameter counts: tests/plan/test_planner_moe.py).
MOE_CONFIGS = [('moe.py', f'size={s}') for s in ('tiny', 'mixtral_8x7b', 'qwen3_30b_a3b', 'qwen3_235b_a22b', 'moe_1t')]

# FRONTIER.md's parameter counts of the paper's models.
PAPER_PARAMS = {'22b.py': 22.1e9, '175b.py': 174.6e9, '1t.py': 1.008e12}


def _load_module(name):
    """ml_collections' loader for `--config=` files (a private name; there is no public one)."""
    load = config_flags._LoadConfigModule  # pylint: disable=protected-access
    return load(f'test_{name[:-3]}_config', os.path.join(CONFIG_DIR, name))


def load_config(name, arg=None):
    """Loads configs/<name> exactly as `--config=configs/<name>[:arg]` does."""
    module = _load_module(name)
    return module.get_config(arg) if arg is not None else module.get_config()


def closed_form_params(c):
    m = c.model
    l, h, s, v = m.num_layers, m.d_model, m.seq_len, config_lib.padded_vocab(c)
    assert m.tied_embeddings and m.mlp_ratio == 4, 'the closed form is for a tied GPT with a 4h MLP'
    return 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h


def test_every_config_file_is_covered():
    files = {f for f in os.listdir(CONFIG_DIR) if f.endswith('.py')}
    assert files - HELPERS - FROM_A_DIRECTORY == {name for name, _ in CONFIGS + LLAMA_CONFIGS + MOE_CONFIGS}
    for helper in HELPERS:  # a helper must not pretend to be a config
        assert not hasattr(_load_module(helper), 'get_config')


@pytest.mark.parametrize('name,arg', MOE_CONFIGS, ids=[f'{n}:{a}' for n, a in MOE_CONFIGS])
def test_moe_config_validates(name, arg):
    c = load_config(name, arg)
    config_lib.validate(c, config_lib.num_devices(c))
    assert config_lib.model_shape(c).moe is not None


@pytest.mark.parametrize('name,arg', CONFIGS, ids=[f'{n}:{a}' if a else n for n, a in CONFIGS])
def test_config_validates_and_shapes(name, arg):
    c = load_config(name, arg)
    config_lib.validate(c, config_lib.num_devices(c))

    shape = config_lib.model_shape(c)
    model_def = params_lib.ModelDef.create(shape)
    params = model_def.abstract_params()
    leaves = jax.tree.leaves(params)
    assert all(x.dtype == jnp.float32 for x in leaves), 'parameters are fp32 whatever the compute dtype'
    n_params = sum(int(np.prod(x.shape, dtype=np.int64)) for x in leaves)
    assert n_params == closed_form_params(c)

    # Shapes that pin the layout: stacked layers, Megatron split axes, padded vocabulary.
    blocks = params['blocks']
    l, h, k = c.model.num_layers, c.model.num_heads, c.model.d_model // c.model.num_heads
    assert blocks['attn']['w_qkv'].shape == (l, c.model.d_model, 3, h, k)
    assert blocks['mlp']['w_in'].shape == (l, c.model.d_model, c.model.mlp_ratio * c.model.d_model)
    assert params['wte'].shape == (config_lib.padded_vocab(c), c.model.d_model)
    assert config_lib.padded_vocab(c) % (c.model.vocab_multiple * c.mesh.tensor) == 0
    assert config_lib.padded_vocab(c) >= c.model.vocab_size

    # The whole train state, abstractly: step, params and the optimizer state.
    tx, _ = optimizer_lib.make_optimizer(c)
    state = jax.eval_shape(lambda p: {'step': jnp.zeros((), jnp.int32), 'params': p, 'opt_state': tx.init(p)},
                           params)
    opt_leaves = jax.tree.leaves(state['opt_state'])
    n_opt = sum(int(np.prod(x.shape, dtype=np.int64)) for x in opt_leaves if x.ndim > 0)
    assert n_opt == 2 * n_params, 'Adam keeps two fp32 moments per parameter'
    assert all(x.dtype == jnp.float32 for x in opt_leaves if x.ndim > 0)
    assert jax.tree.structure(state['params']) == jax.tree.structure(params)


# Hugging Face config.json of each: (layers, hidden, heads, kv heads, intermediate, tied, rope factor).
LLAMA_PUBLISHED = {'1b': (16, 2048, 32, 8, 8192, True, 32.0), '3b': (28, 3072, 24, 8, 8192, True, 32.0),
                   '8b': (32, 4096, 32, 8, 14336, False, 8.0), '70b': (80, 8192, 64, 8, 28672, False, 8.0),
                   '405b': (126, 16384, 128, 8, 53248, False, 8.0)}


@pytest.mark.parametrize('name,arg', LLAMA_CONFIGS, ids=[f'{n}:{a}' for n, a in LLAMA_CONFIGS])
def test_llama_config_validates_and_shapes(name, arg):
    c = load_config(name, arg)
    config_lib.validate(c, config_lib.num_devices(c))
    shape = config_lib.model_shape(c)
    assert shape.family == 'llama'
    model_def = params_lib.ModelDef.create(shape)
    params = model_def.abstract_params()
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    from jaxfrontier import families  # pylint: disable=g-import-not-at-top
    assert params_lib.count_params(params) == sum(p.size for p in families.get('llama').param_specs(shape))
    m, size = c.model, arg.removeprefix('size=')
    k = m.d_model // m.num_heads
    assert params['blocks']['attn']['w_kv'].shape == (m.num_layers, m.d_model, 2, shape.kv_heads, k)
    assert ('head' in params) == (not m.tied_embeddings)
    if size in LLAMA_PUBLISHED:
        assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, shape.mlp_dim, m.tied_embeddings,
                m.rope_factor) == LLAMA_PUBLISHED[size]
        assert (m.vocab_size, m.rope_theta, m.rope_scaling, m.rope_original_max_len, m.norm_eps) == (
            128256, 500000.0, 'llama3', 8192, 1e-5)
    tx, _ = optimizer_lib.make_optimizer(c)
    state = jax.eval_shape(lambda p: {'params': p, 'opt_state': tx.init(p)}, params)
    assert sum(int(np.prod(x.shape, dtype=np.int64)) for x in jax.tree.leaves(state['opt_state']) if x.ndim > 0) == (
        2 * params_lib.count_params(params))


@pytest.mark.parametrize('field,value', [('num_kv_heads', 2), ('qkv_bias', True), ('rope_scaling', 'llama3'),
                                         ('rope_theta', 500000.0), ('norm_eps', 1e-6), ('ffn_dim_multiplier', 1.3)])
def test_llama_fields_on_a_gpt_config_are_refused(field, value):
    c = config_lib.base_config()
    c.model[field] = value
    with pytest.raises(ConfigError, match=rf"model.{field} = .*only the llama family uses it.*model.family='llama'"):
        config_lib.validate(c)


def test_gpt_may_name_its_kv_heads_as_its_heads():
    c = config_lib.base_config()
    c.model.num_kv_heads = c.model.num_heads
    config_lib.validate(c)


@pytest.mark.parametrize('fields,match', [
    (dict(num_kv_heads=3), r'model.num_kv_heads = 3: must divide model.num_heads = 4'),
    (dict(num_kv_heads=8), r'model.num_kv_heads = 8: must divide model.num_heads = 4'),
    (dict(d_model=12, num_heads=4), r'model.d_model = 12: the head dimension .* = 3 must be even'),
    (dict(rope_scaling='yarn'), r"model.rope_scaling = 'yarn': unknown RoPE scaling"),
    (dict(rope_scaling='llama3', rope_low_freq_factor=4.0), r'rope_high_freq_factor = 4.0: must be finite and above'),
    (dict(rope_scaling='llama3', rope_factor=0.5), r'model.rope_factor = 0.5: must be'),
    (dict(norm_eps=0.0), r'model.norm_eps = 0.0: must be a finite number > 0'),
    (dict(multiple_of=0), r'model.multiple_of = 0: must be a positive integer'),
    (dict(mlp_dim=-1), r'model.mlp_dim = -1: must be an integer >= 0'),
])
def test_impossible_llama_configs_are_one_line_errors(fields, match):
    c = config_lib.base_config()
    c.model.update(family='llama', **fields)
    with pytest.raises(ConfigError, match=match):
        config_lib.validate(c)


def test_kv_heads_not_dividing_tensor_are_replicated_not_refused():
    """Megatron's GQA: 2 kv heads on tensor 4 are kept whole on every tensor rank (resolve_rules)."""
    c = config_lib.base_config()
    c.model.update(family='llama', num_heads=8, num_kv_heads=2, d_model=128)
    c.mesh.tensor, c.train.global_batch = 4, 8
    config_lib.validate(c)
    assert dict(config_lib.sharding_rules(c))['kv_heads'] is None
    c.mesh.tensor = 2
    assert dict(config_lib.sharding_rules(c))['kv_heads'] == 'tensor'


@pytest.mark.parametrize('name', sorted(PAPER_PARAMS))
def test_paper_model_sizes_match_frontier_md(name):
    c = load_config(name)
    n_params = params_lib.count_params(params_lib.ModelDef.create(config_lib.model_shape(c)).abstract_params())
    assert n_params == closed_form_params(c)
    assert abs(n_params / PAPER_PARAMS[name] - 1) < 0.01, (name, n_params)


def test_paper_layouts_match_frontier_md():
    """The authors' layouts (FRONTIER.md): TP x PP x DP, micro-batch, devices."""
    expected = {'22b.py': (4, 8, 1, 2, 32), '175b.py': (4, 16, 2, 1, 128), '1t.py': (8, 64, 6, 1, 3072)}
    for name, (tp, pp, dp, mb, devices) in expected.items():
        c = load_config(name)
        got = (c.mesh.tensor, c.mesh.pipeline, config_lib.data_parallel_size(c), c.train.micro_batch,
               config_lib.num_devices(c))
        assert got == (tp, pp, dp, mb, devices), name
        assert c.model.vocab_size == 50257 and c.model.seq_len == 2048
        assert c.sharding.zero1 and c.model.remat == 'full'
    assert load_config('175b.py').train.global_batch == 1280


def test_parse_arg_types_and_values():
    a = config_lib.parse_arg('size=1.3b,tensor=2', size='125m', tensor=1, zero1=False)
    assert (a.size, a.tensor, a.zero1) == ('1.3b', 2, False)
    assert isinstance(a.tensor, int)
    assert config_lib.parse_arg('zero1=true', zero1=False).zero1 is True
    assert config_lib.parse_arg(None, steps=3).steps == 3
    assert config_lib.parse_arg('7', steps=3).steps == 7  # a single default takes a bare value


def test_parse_arg_unknown_key_raises_config_error():
    with pytest.raises(ConfigError, match=r'sise.*unknown config argument.*size'):
        config_lib.parse_arg('sise=1.3b', size='125m', tensor=1)
    with pytest.raises(ConfigError, match='unknown config argument'):
        load_config('gpt.py', 'size=1.3b,tensr=2')


def test_gpt_config_arg_through_config_flags():
    """`--config=configs/gpt.py:size=1.3b,tensor=2` with overrides, parsed by config_flags itself."""
    fv = flags.FlagValues()
    path = os.path.join(CONFIG_DIR, 'gpt.py')
    argv = ['prog', f'--config={path}:size=1.3b,tensor=2', '--config.train.steps=7']
    holder = config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True,
                                             sys_argv=argv)
    fv(argv)
    c = holder.value
    assert (c.model.num_layers, c.model.d_model, c.model.num_heads) == config_lib.MODEL_SIZES['1.3b']
    assert c.mesh.tensor == 2 and c.train.steps == 7
    assert config_lib.padded_vocab(c) == 50432  # 50,257 up to a multiple of 128 x 2
    config_lib.validate(c, config_lib.num_devices(c))
    with pytest.raises(AttributeError, match='stepz'):  # locked: a misspelt key cannot be added
        c.train.stepz = 3
