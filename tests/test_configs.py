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
from jaxfrontier.training import state as ts
from jaxfrontier.model import params as params_lib

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')
# ml_collections loads config files with importlib's deprecated load_module.
pytestmark = pytest.mark.filterwarnings('ignore:the load_module:DeprecationWarning')

HELPERS = {'paper.py'}  # shared settings imported by configs, not configs themselves
FROM_A_DIRECTORY = {'hf.py'}  # builds its model from a Hugging Face directory: tests/checkpoint/test_hf_llama.py

# (file, arg) for every config: each gpt.py size, the paper's models, the default.
CONFIGS = [('tiny.py', None)] + [('gpt.py', f'size={s}') for s in ('125m', '350m', '1.3b', '6.7b')] + [
    ('22b.py', None), ('175b.py', None), ('1t.py', None)]

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
    assert files - HELPERS - FROM_A_DIRECTORY == {name for name, _ in CONFIGS}
    for helper in HELPERS:  # a helper must not pretend to be a config
        assert not hasattr(_load_module(helper), 'get_config')


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
    tx, _ = ts.make_optimizer(c)
    state = jax.eval_shape(lambda p: {'step': jnp.zeros((), jnp.int32), 'params': p, 'opt_state': tx.init(p)},
                           params)
    opt_leaves = jax.tree.leaves(state['opt_state'])
    n_opt = sum(int(np.prod(x.shape, dtype=np.int64)) for x in opt_leaves if x.ndim > 0)
    assert n_opt == 2 * n_params, 'Adam keeps two fp32 moments per parameter'
    assert all(x.dtype == jnp.float32 for x in opt_leaves if x.ndim > 0)
    assert jax.tree.structure(state['params']) == jax.tree.structure(params)


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
