"""Bad input fails before compilation, with one message naming the field, its value and the fix.

Each mistake a user can make in a config, its data or its workdir is fed to
`loop.train_and_evaluate` (or `config.validate`, or the command line) and must raise a
`UserError` (shown by main without a traceback) whose message names the field, the value and
a fix, before the mesh, the state or any compiled step is built, and leave nothing in the
workdir. The command-line tests run `python -m jaxfrontier.main` and check the exit code and
that no traceback is printed.
"""

import os

import jax
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, token_files
from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.run import loop
import processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def good_config():
    """A valid config for the 8 test devices: data 2 x fsdp 2 x tensor 2, tiny model."""
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=32, num_heads=4, seq_len=16, vocab_size=256, vocab_multiple=128,
                   dtype='float32', remat='none', attention='xla')
    c.mesh.update(data=2, fsdp=2, tensor=2)
    c.train.update(steps=2, global_batch=8, micro_batch=2, accum_steps=1, progress=False)
    c.data.kind = 'synthetic'
    return c


@pytest.fixture
def no_compile(monkeypatch):
    """Makes reaching the mesh, the state or compilation a test failure."""

    def reached(*args, **kwargs):
        raise AssertionError('train_and_evaluate went past validation with a bad input')

    monkeypatch.setattr(loop.mesh_lib, 'mesh_from_config', reached)
    monkeypatch.setattr(loop.ts, 'make_placement', reached)
    monkeypatch.setattr(loop.step_lib, 'compile_steps', reached)
    monkeypatch.setattr(loop.data_lib, 'make_datasets', reached)


def assert_fails_cleanly(c, workdir, field, value, *more, error=ConfigError):
    """train_and_evaluate(c) raises `error` naming field, value and a fix; workdir untouched."""
    with pytest.raises(error) as info:
        loop.train_and_evaluate(c, str(workdir))
    message = str(info.value)
    assert field in message and str(value) in message, message
    assert 'Fix:' in message, message
    for text in more:
        assert text in message, (text, message)
    if isinstance(info.value, ConfigError):
        assert info.value.field == field
    assert not os.path.exists(workdir) or not os.listdir(workdir), os.listdir(workdir)
    return message


def test_good_config_is_valid():
    c = good_config()
    config_lib.validate(c, jax.device_count())
    loader.check_data(c)


def test_good_config_passes_every_check(tmp_path, no_compile):
    """Control: the good config gets past validation, so each bad one fails for its own reason."""
    with pytest.raises(AssertionError, match='went past validation'):
        loop.train_and_evaluate(good_config(), str(tmp_path / 'wd'))


# --------------------------------------------------------------------------- mesh and divisibility


def test_mesh_product_differs_from_device_count(tmp_path, no_compile):
    c = good_config()
    c.mesh.data = 4  # 4 x 2 x 2 = 16 devices, 8 present
    assert_fails_cleanly(c, tmp_path / 'wd', 'mesh', 'pipeline 1 x data 4 x fsdp 2 x context 1 x tensor 2',
                         'needs 16 devices but 8 are present', '--mode=plan',
                         '--config.mesh.cpu_devices=16')  # the CPU's fix first: simulated devices


@pytest.mark.parametrize('change,field,value,divisor', [
    # heads over the tensor axis (d_model 48 is divisible by 3 heads and by fsdp 2)
    (dict(num_heads=3, d_model=48), 'model.num_heads', 3, 'mesh.tensor = 2'),
    # hidden size over the heads
    (dict(d_model=30), 'model.d_model', 30, 'model.num_heads = 4'),
], ids=['heads_by_tensor', 'hidden_by_heads'])
def test_model_not_divisible(tmp_path, no_compile, change, field, value, divisor):
    c = good_config()
    c.model.update(**change)
    assert_fails_cleanly(c, tmp_path / 'wd', field, value, divisor)


def test_hidden_size_not_divisible_by_fsdp(tmp_path, no_compile):
    c = good_config()
    c.mesh.update(data=1, fsdp=8, tensor=1)
    c.train.update(global_batch=8, micro_batch=1)
    c.model.update(d_model=36, num_heads=4)  # 36 % 4 == 0, 36 % 8 != 0
    assert_fails_cleanly(c, tmp_path / 'wd', 'model.d_model', 36, 'mesh.fsdp = 8')


def test_layers_not_divisible_by_pipeline(tmp_path, no_compile):
    c = good_config()
    c.mesh.update(pipeline=2, data=2, fsdp=2, tensor=1)
    c.model.num_layers = 3
    assert_fails_cleanly(c, tmp_path / 'wd', 'model.num_layers', 3, 'mesh.pipeline')


@pytest.mark.parametrize('global_batch,micro_batch,accum', [(10, 2, 1), (8, 1, 3), (6, 2, 1)],
                         ids=['not_product', 'with_accum', 'not_divisible_by_dp'])
def test_global_batch_not_micro_x_accum_x_dp(tmp_path, no_compile, global_batch, micro_batch, accum):
    c = good_config()
    c.train.update(global_batch=global_batch, micro_batch=micro_batch, accum_steps=accum)
    assert_fails_cleanly(c, tmp_path / 'wd', 'train.global_batch', global_batch,
                         f'train.micro_batch ({micro_batch})', f'train.accum_steps ({accum})',
                         'mesh.data x mesh.fsdp = 4', f'= {micro_batch * accum * 4}')


# --------------------------------------------------------------------------- vocabulary


@pytest.mark.parametrize('vocab_size', [1, 3, 255, 257, 50257, 65537])
@pytest.mark.parametrize('tensor', [1, 2, 4, 8])
@pytest.mark.parametrize('multiple', [1, 3, 128])
def test_padded_vocab_divisible_by_tensor(vocab_size, tensor, multiple):
    c = good_config()
    c.model.update(vocab_size=vocab_size, vocab_multiple=multiple)
    c.mesh.tensor = tensor
    v = config_lib.padded_vocab(c)
    assert v % tensor == 0 and v % (multiple * tensor) == 0
    assert vocab_size <= v < vocab_size + multiple * tensor  # the smallest such padding


@pytest.mark.parametrize('vocab_size,words', [(0, 'no token file'), (-5, 'positive integer')])
def test_vocab_size_must_be_positive(tmp_path, no_compile, vocab_size, words):
    c = good_config()  # synthetic data: 0 (the token file's vocabulary) has no file to read
    c.model.vocab_size = vocab_size
    assert_fails_cleanly(c, tmp_path / 'wd', 'model.vocab_size', vocab_size, words)


def test_builtin_corpus_needs_byte_vocabulary(tmp_path, no_compile):
    c = good_config()
    c.data.kind, c.model.vocab_size = 'builtin', 100
    assert_fails_cleanly(c, tmp_path / 'wd', 'model.vocab_size', 100, 'byte-level')


# --------------------------------------------------------------------------- token files


def token_config(path):
    c = good_config()
    c.data.update(kind='tokens', path=str(path), val_fraction=0.1)
    return c


def test_token_file_missing(tmp_path, no_compile):
    path = tmp_path / 'data' / 'missing.bin'
    assert_fails_cleanly(token_config(path), tmp_path / 'wd', 'data.path', path, 'does not exist')


def test_token_path_empty(tmp_path, no_compile):
    assert_fails_cleanly(token_config(''), tmp_path / 'wd', 'data.path', "''", 'needs a token file')


def test_token_file_truncated(tmp_path, no_compile):
    path = token_files.write_token_file(tmp_path / 'data' / 'toks.bin', np.arange(1000) % 256, 256)
    with open(path, 'r+b') as f:
        f.truncate(1500)  # uint16: the header promises 2,000 bytes
    assert_fails_cleanly(token_config(path), tmp_path / 'wd', 'data.path', path, 'truncated', '2,000 bytes')


def test_token_header_missing(tmp_path, no_compile):
    path = token_files.write_token_file(tmp_path / 'data' / 'toks.bin', np.arange(1000) % 256, 256)
    os.remove(token_files.token_paths(path)[1])
    assert_fails_cleanly(token_config(path), tmp_path / 'wd', 'data.path', path, 'header', 'missing')


def test_tokens_not_below_vocabulary(tmp_path, no_compile):
    tokens = np.arange(1000) % 256
    tokens[617] = 999
    path = token_files.write_token_file(tmp_path / 'data' / 'toks.bin', tokens, 1000)
    assert_fails_cleanly(token_config(path), tmp_path / 'wd', 'data.path', path, 'token 999',
                         'position 617', 'model.vocab_size = 256')


# --------------------------------------------------------------------------- names and workdir


@pytest.mark.parametrize('field,value', [('attention', 'flash'), ('remat', 'bogus'), ('dtype', 'float8')])
def test_unknown_choice(tmp_path, no_compile, field, value):
    c = good_config()
    c.model[field] = value
    choices = {'attention': config_lib.ATTENTION_IMPLS, 'remat': config_lib.REMAT_POLICIES,
               'dtype': config_lib.DTYPES}[field]
    assert_fails_cleanly(c, tmp_path / 'wd', f'model.{field}', repr(value), str(choices))


def test_workdir_below_a_file(tmp_path, no_compile):
    blocker = tmp_path / 'a_file'
    blocker.write_text('not a directory')
    workdir = blocker / 'wd'
    assert_fails_cleanly(good_config(), workdir, '--workdir', workdir, error=UserError)
    assert blocker.read_text() == 'not a directory' and sorted(os.listdir(tmp_path)) == ['a_file']


@pytest.mark.skipif(os.geteuid() == 0, reason='root can write to a read-only directory')
def test_workdir_read_only(tmp_path, no_compile):
    parent = tmp_path / 'ro'
    parent.mkdir()
    parent.chmod(0o500)
    try:
        assert_fails_cleanly(good_config(), parent / 'wd', '--workdir', parent / 'wd', error=UserError)
    finally:
        parent.chmod(0o700)


def test_misspelt_key_in_a_locked_config():
    c = good_config()
    c.lock()
    with pytest.raises(AttributeError, match='stepz'):
        c.train.stepz = 3


# --------------------------------------------------------------------------- the command line


def run_main(tmp_path, *args):
    workdir = tmp_path / 'wd'
    proc = processes.run_main(f'--workdir={workdir}', *args, tiny=False, timeout=120,
                              env=processes.subprocess_env(XLA_FLAGS='--xla_force_host_platform_device_count=8'))
    assert 'Traceback' not in proc.stdout, proc.stdout
    line = processes.error_line(proc, code=None)  # one message
    assert not os.path.exists(workdir), os.listdir(workdir)
    return proc.returncode, line


@pytest.mark.parametrize('args,named,hint', [
    (['--config.train.stepz=3'], '--config.train.stepz', '"steps"'),  # default config: loaded in main
    (['--config=configs/tiny.py', '--config.trian.steps=3'], '--config.trian.steps', '"train"'),
    (['--config=configs/gpt.py:size=1.3b,tensr=2'], '<arg>.tensr', "'tensor'"),  # get_config's arg
], ids=['default_config', 'named_config', 'config_arg'])
def test_cli_misspelt_key(tmp_path, args, named, hint):
    code, message = run_main(tmp_path, *args)
    assert code == 2
    assert named in message and hint in message and 'Fix:' in message, message


def test_cli_1t_on_8_cpu_devices(tmp_path):
    code, message = run_main(tmp_path, '--config=configs/1t.py')
    assert code == 2
    for text in ('pipeline 64 x data 6 x fsdp 1 x context 1 x tensor 8', '3072 devices', '8 are present', '--mode=plan'):
        assert text in message, (text, message)


def test_cli_bad_value(tmp_path):
    code, message = run_main(tmp_path, '--config=configs/tiny.py', '--config.model.remat=bogus')
    assert code == 2
    assert "config.model.remat = 'bogus'" in message and 'save_dots' in message


@pytest.mark.parametrize('args,text', [
    (['--config.lora.targets=q,qkv'], "config.lora.targets = 'q,qkv': 'qkv' matches nothing in the llama family"),
    (['--config.lora.rank=129'], "config.lora.rank = 129: is larger than the 'q' matrix allows"),
], ids=['target_matches_nothing', 'rank_past_the_matrix'])
def test_cli_bad_lora(tmp_path, args, text):
    """LoRA's bad inputs from the command line (in-process: tests/model/test_lora.py; another base:
    tests/checkpoint/test_lora_checkpoints.py): one line, exit 2, no workdir."""
    code, message = run_main(tmp_path, '--config=configs/llama.py', '--config.lora.rank=8', *args)
    assert code == 2
    assert text in message and 'Fix:' in message, message


def test_pipeline_with_dropout_over_data_and_fsdp_is_refused_on_jax_0_11(monkeypatch):
    """jax 0.11.2 aborts the process compiling it (config/checks.check_compiles): one error line instead,
    the same from training's, --mode=plan's and --mode=verify's checks, before anything compiles."""
    from jaxfrontier.config import checks
    from jaxfrontier.plan import planner, shrink
    from jaxfrontier.run import validation

    def config_with(dropout_rate):
        c = good_config()
        c.mesh.update(pipeline=2, data=2, fsdp=2, tensor=1)
        c.train.update(micro_batch=1, accum_steps=2)
        c.model.dropout_rate = dropout_rate
        return c

    monkeypatch.setattr(checks, '_installed_jax', lambda: '0.11.2')
    lines = set()
    for check in (lambda c: validation.validate_run(c, 8), planner.plan, shrink.shrink):
        with pytest.raises(ConfigError, match=r'dropout_rate = 0.1: jax 0.11.2 aborts .* Fix: set model.dropout') as e:
            check(config_with(0.1))
        lines.add(str(e.value))
    assert len(lines) == 1
    config_lib.validate(config_with(0.0), 8)  # gradients reduced once: `data` is manual inside the pipeline's map
    monkeypatch.setattr(checks, '_installed_jax', lambda: '0.10.2')
    config_lib.validate(config_with(0.1), 8)
    config_lib.check_compiles(config_with(0.1), jax_version='0.10.2.dev20260101')
