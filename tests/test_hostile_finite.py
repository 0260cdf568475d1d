"""Parameters that enter from a file are checked for NaN / Inf, naming the tensor (issue 28, failure 4).

`--mode=sample` from all-NaN parameters printed tokens [0, 0, 0] and exited 0; training from
them blamed the learning rate. Every entry (init_params_from for training, sample, eval, the
Hugging Face import) goes through `checkpoint.init_from.load_params`, which now refuses them.
"""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.checkpoint import finite
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.params import init_params
from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.training import state as ts
import processes

TINY = (*processes.TINY, '--config.model.num_heads=2')


def tiny_config():
    c = config_lib.base_config()
    c.model.update(num_layers=1, d_model=32, num_heads=2, seq_len=32, vocab_size=256, vocab_multiple=128,
                   dtype='float32', remat='none', attention='reference')
    c.mesh.update(data=2, fsdp=2, tensor=2)
    return c


def write_params(path, c, poison=None):
    """Our safetensors name map of fresh parameters; `poison(name, array)` may spoil some."""
    params = init_params(config_lib.model_shape(c), jax.random.key(0))
    names = {name: np.asarray(a, np.float32) for name, a in readers.flatten_names(params).items()}
    if poison:
        names = {name: poison(name, a) for name, a in names.items()}
    save_file(names, str(path))
    return path


def test_counts_name_the_tensor():
    params = {'a': np.ones(3, np.float32), 'b': {'c': np.array([1.0, np.nan, np.inf], np.float32)},
              'i': np.arange(3)}
    assert finite.nonfinite_counts(params) == {'b/c': (2, 3)}
    with pytest.raises(errors.NonFiniteParamsError, match=r"src: parameter 'b/c' has 2 of 3 values NaN or Inf"):
        finite.check(params, 'src')
    assert finite.check({'a': np.ones(2)}, 'src')['a'].shape == (2,)


@pytest.mark.parametrize('bad', ['wpe', 'blocks/mlp/w_in'])
def test_init_params_from_a_file_with_one_nonfinite_tensor_is_refused(tmp_path, bad):
    c = tiny_config()
    path = write_params(tmp_path / 'p.safetensors', c,
                        lambda name, a: np.where(np.arange(a.size).reshape(a.shape) == 1, np.nan, a) if name == bad
                        else a)
    layout = ts.make_placement(c, mesh_lib.mesh_from_config(c))
    with pytest.raises(errors.NonFiniteParamsError, match=f"parameter '{bad}' has 1 of"):
        init_from.load_params(str(path), c, target_lib.abstract_target(layout.abstract_state['params'], layout.param_shardings))


def test_finite_file_still_loads(tmp_path):
    c = tiny_config()
    path = write_params(tmp_path / 'p.safetensors', c)
    layout = ts.make_placement(c, mesh_lib.mesh_from_config(c))
    params = init_from.load_params(str(path), c, target_lib.abstract_target(layout.abstract_state['params'], layout.param_shardings))
    assert not finite.nonfinite_counts(params)


def run(tmp_path, *args):
    return processes.run_main(*TINY, f'--workdir={tmp_path / "run"}', *args, tiny=False, timeout=300)


@pytest.mark.parametrize('mode', ['sample', 'eval', pytest.param('train', marks=pytest.mark.slow)])  # train: a run first
def test_cli_refuses_nan_parameters_with_one_line(tmp_path, mode):
    """Was: sample exit 0 with tokens [0, 0, 0]; train: a NaN loss blaming the learning rate."""
    path = write_params(tmp_path / 'nan.safetensors', tiny_config(), lambda name, a: np.full_like(a, np.nan))
    more = {'sample': ['--prompt=hello', '--max_new_tokens=3', '--temperature=0'], 'eval': [],
            'train': ['--config.train.steps=1']}[mode]
    proc = run(tmp_path, f'--mode={mode}', f'--config.checkpoint.init_params_from={path}', *more)
    line = processes.error_line(proc)
    assert 'NaN or Inf' in line and str(path) in line, proc.stderr[-3000:]
    assert "parameter '" in line
    if mode == 'train':
        assert not os.path.exists(tmp_path / 'run' / 'checkpoints') or not os.listdir(tmp_path / 'run' / 'checkpoints')
