"""JAX's persistent compilation cache is on by default (train.compile_cache), shared and switchable off."""

import json
import os

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from processes import run_main, subprocess_env


def _config(setting):
    c = config_lib.base_config()
    c.train.compile_cache = setting
    return c


def test_compile_cache_dir_follows_the_setting_and_the_environment(tmp_path):
    home = {'HOME': str(tmp_path)}
    assert config_lib.compile_cache_dir(_config('auto'), home) == str(tmp_path / '.cache' / 'jaxfrontier' / 'xla')
    assert config_lib.compile_cache_dir(_config('auto'), dict(home, XDG_CACHE_HOME='/x')) == '/x/jaxfrontier/xla'
    # The Frontier scripts export JAX_COMPILATION_CACHE_DIR (Lustre): 'auto' keeps it.
    assert config_lib.compile_cache_dir(_config('auto'), dict(home, JAX_COMPILATION_CACHE_DIR='/lustre/c')) == '/lustre/c'
    assert config_lib.compile_cache_dir(_config('off'), dict(home, JAX_COMPILATION_CACHE_DIR='/lustre/c')) is None
    assert config_lib.compile_cache_dir(_config('~/cc'), home) == os.path.expanduser('~/cc')


def test_a_bad_compile_cache_setting_is_one_line():
    c = _config('auto')
    c.train.compile_cache_min_s = -1
    with pytest.raises(ConfigError, match='train.compile_cache_min_s'):
        config_lib.validate(c)


def _train(tmp_path, *overrides, workdir='wd'):
    env = subprocess_env(HOME=str(tmp_path / 'home'))
    for name in ('JAX_COMPILATION_CACHE_DIR', 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', 'XDG_CACHE_HOME'):
        env.pop(name)
    proc = run_main('--config.train.steps=2', '--config.checkpoint.enabled=False', f'--workdir={tmp_path / workdir}',
                    *overrides, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_training_fills_the_default_caches_and_off_writes_none(tmp_path):
    """The compilation cache and the built-in corpus (data.cache_dir=auto) live in ~/.cache/jaxfrontier,
    shared by runs: a second run in a new workdir builds neither again."""
    cache, data = (tmp_path / 'home' / '.cache' / 'jaxfrontier' / name for name in ('xla', 'data'))
    _train(tmp_path, '--config.train.compile_cache=off')
    assert not cache.exists()
    corpus = [data / name for name in os.listdir(data) if name.endswith('.bin')]
    assert len(corpus) == 1 and not (tmp_path / 'wd' / 'data_cache').exists()
    assert json.loads((tmp_path / 'wd' / 'config.json').read_text())['data']['cache_dir'] == str(data)
    built = os.stat(corpus[0]).st_mtime_ns
    _train(tmp_path, '--config.train.compile_cache_min_s=0', workdir='wd2')
    assert len(os.listdir(cache)) >= 2  # the train and eval steps (and the init) at least
    assert os.stat(corpus[0]).st_mtime_ns == built and not (tmp_path / 'wd2' / 'data_cache').exists()
