"""Exports never replace a run's files, and leave no temporaries behind (issue 28: failure 2, weak cases;
issue 48: failures 1 and 4).

- `--mode=export --export_format=hf --export_path=<the training workdir>` exited 0 and replaced the
  run's config.json with the Hugging Face one (the next resume wrote it back over the export).
- an --export_path that is an existing file gave a FileExistsError traceback.
- SIGKILL during an export left `*.tmp<pid>` files that no later export removed.
- `--export_path=<the run's base>` (hf or peft) exited 0 and replaced the pretrained model.safetensors and
  config.json; an export into `<workdir>/checkpoints/<step>` was deleted by the next run's rotation.

The refusals run on a fake workdir (JSON only, no training): each export checks its target before it reads
the checkpoint (export_target.py), so they take milliseconds.
"""

import errno
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxfrontier import files
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import run_files
from jaxfrontier.errors import DiskFullError, UserError
from jaxfrontier.checkpoint.interop import export_target
from jaxfrontier.checkpoint.interop import hf
from jaxfrontier.checkpoint.interop import peft
from jaxfrontier.checkpoint.interop import safetensors as export
from jaxfrontier.data import token_files
import processes


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp('hostile_export') / 'run'
    proc = main('--config.train.steps=2', f'--workdir={workdir}')
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def main(*args):
    return processes.run_main(*args, timeout=300)


def dead_pid():
    proc = subprocess.Popen([sys.executable, '-c', 'pass'])
    proc.wait()
    return proc.pid


@pytest.mark.slow  # needs run_dir: a training run through the CLI
def test_cli_hf_export_into_the_training_workdir_is_refused(run_dir):
    before = (run_dir / 'config.json').read_bytes()
    line = processes.error_line(main('--mode=export', '--export_format=hf', f'--workdir={run_dir}', f'--export_path={run_dir}'))
    assert 'is a training workdir' in line and 'config.json' in line and 'Fix:' in line
    assert (run_dir / 'config.json').read_bytes() == before
    assert not (run_dir / 'model.safetensors').exists()


@pytest.mark.slow  # needs run_dir: a training run through the CLI
def test_hf_export_onto_an_existing_file_is_one_line(run_dir, tmp_path):
    target = tmp_path / 'taken'
    target.write_text('mine')
    with pytest.raises(UserError, match='is an existing file'):
        hf.export_hf(str(run_dir), str(target))
    assert target.read_text() == 'mine'


@pytest.mark.slow  # needs run_dir: a training run through the CLI
def test_training_into_a_hugging_face_export_is_refused(run_dir, tmp_path):
    out = tmp_path / 'hf'
    hf.export_hf(str(run_dir), str(out))
    before = (out / 'config.json').read_bytes()
    line = processes.error_line(main('--config.train.steps=1', f'--workdir={out}'))
    assert 'Hugging Face model directory' in line and 'init_params_from' in line
    assert (out / 'config.json').read_bytes() == before


@pytest.mark.slow  # needs run_dir
@pytest.mark.parametrize('kind', ['safetensors', 'hf'])
def test_stale_temporaries_of_a_killed_export_are_removed(run_dir, tmp_path, kind):
    """safetensors: `<file>.tmp<pid>` beside the file; hf: the staging directory `<dir>.export-tmp<pid>` beside the
    directory (issue 48), and a file temporary an older export left inside it."""
    out = tmp_path / ('params.safetensors' if kind == 'safetensors' else 'hf')
    final = out if kind == 'safetensors' else out / 'model.safetensors'
    final.parent.mkdir(parents=True, exist_ok=True)
    beside = f'{final}.tmp' if kind == 'safetensors' else f'{out}{export_target.STAGING}'
    stale, alive = f'{beside}{dead_pid()}', f'{beside}{os.getpid()}x'
    for path in (stale, alive):
        open(path, 'wb').close() if kind == 'safetensors' else os.makedirs(path)
    if kind == 'hf':
        inside = f'{final}.tmp{dead_pid()}'  # what an export killed before staging existed left in the directory
        open(inside, 'wb').close()
        (pathlib.Path(stale) / 'model.safetensors').write_bytes(b'half')
        hf.export_hf(str(run_dir), str(out))
        assert not os.path.exists(inside)
    else:
        export.export_params(str(run_dir), str(out))
    assert final.exists() and not os.path.exists(stale)
    assert os.path.exists(alive)  # not a temporary of ours: left alone


def test_markers():
    assert not run_files.is_training_workdir('/nonexistent/dir')
    assert not run_files.is_hf_export('/nonexistent/dir')


# --------------------------------------------------------------------------- issue 48: where an export may write

EXPORTS = {  # format -> export(source, out, **kw), as main calls them
    'hf': lambda source, out, **kw: hf.export_hf(source, out, **kw),
    'peft': lambda source, out, **kw: peft.export_peft(source, out, **kw),
    'safetensors': lambda source, out, **kw: export.export_params(source, out, **{k: v for k, v in kw.items()
                                                                                  if k != 'force'}),
}


@pytest.fixture
def fake(tmp_path):
    """A workdir as a LoRA run on a Hugging Face base leaves it, in JSON only (no arrays: nothing is read)."""
    base = tmp_path / 'base'
    base.mkdir()
    (base / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
    (base / 'model.safetensors').write_bytes(b'pretrained')
    workdir = tmp_path / 'run'
    step = workdir / 'checkpoints' / '2'
    (step / 'state').mkdir(parents=True)
    (step / 'meta').mkdir()
    config = {'model': {}, 'train': {}, 'checkpoint': {'init_params_from': str(base), 'fast_dir': ''},
              'data': {'kind': 'tokens', 'path': str(tmp_path / 'data' / 'corpus'), 'cache_dir': 'auto'}}
    (workdir / 'config.json').write_text(json.dumps(config))
    (step / 'meta' / 'metadata').write_text(json.dumps({'step': 2, 'config': config,
                                                        'lora_base': {'path': str(base), 'fingerprint': 'x'}}))
    (tmp_path / 'data').mkdir()
    for suffix in ('.bin', '.json'):
        (tmp_path / 'data' / f'corpus{suffix}').write_bytes(b'tokens')
    return {'tmp': tmp_path, 'base': base, 'workdir': workdir, 'step': step}


def snapshot(path: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob('*')) if p.is_file()}


def refused(fmt, source, out, match, **kw) -> str:
    """The one-line UserError (exit 2) the export `fmt` raises for `out`, before anything is written."""
    with pytest.raises(UserError, match=match) as e:
        EXPORTS[fmt](str(source), str(out), **kw)
    line = str(e.value)
    assert '\n' not in line and 'Fix:' in line and e.value.exit_code == 2, line
    return line


def test_cli_export_into_the_base_is_refused_before_jax(fake):
    """The command's own --config.checkpoint.init_params_from counts too; exit 2 with no JAX work."""
    other = fake['tmp'] / 'other_base'
    other.mkdir()
    (other / 'model.safetensors').write_bytes(b'mine')
    proc = main('--mode=export', '--export_format=hf', f'--workdir={fake["workdir"]}', f'--export_path={other}',
                f'--config.checkpoint.init_params_from={other}')
    line = processes.error_line(proc)
    assert 'is the base model this run started from' in line and f'--export_path={fake["workdir"]}/hf' in line
    assert snapshot(other) == {'model.safetensors': b'mine'}


@pytest.mark.parametrize('fmt', ['hf', 'peft', 'safetensors'])
@pytest.mark.parametrize('recorded', ['config', 'meta', 'lora_base', 'command'])
def test_export_into_the_base_is_refused(fake, fmt, recorded):
    """Failure 1: the base is named by the saved config.json, the checkpoint's meta, the LoRA base record, or the
    command's config; a safetensors export names the base's file."""
    source, config = fake['workdir'], json.loads((fake['workdir'] / 'config.json').read_text())
    meta_path = fake['step'] / 'meta' / 'metadata'
    meta, bases = json.loads(meta_path.read_text()), ()
    config['checkpoint']['init_params_from'] = ''
    meta['config']['checkpoint']['init_params_from'] = str(fake['base']) if recorded == 'meta' else ''
    if recorded != 'lora_base':
        del meta['lora_base']
    if recorded == 'config':
        config['checkpoint']['init_params_from'] = str(fake['base'])
    (fake['workdir'] / 'config.json').write_text(json.dumps(config))
    meta_path.write_text(json.dumps(meta))
    if recorded == 'command':
        bases = (str(fake['base']),)
    before = snapshot(fake['base'])
    out = fake['base'] / 'model.safetensors' if fmt == 'safetensors' else fake['base']
    line = refused(fmt, source, out, 'the base model this run started from', bases=bases, force=True)
    assert 'checkpoint.init_params_from' in line and 'could no longer resume' in line
    assert snapshot(fake['base']) == before


@pytest.mark.parametrize('fmt', ['hf', 'peft', 'safetensors'])
def test_export_inside_the_base_is_refused(fake, fmt):
    link = fake['tmp'] / 'link'
    link.symlink_to(fake['base'])  # the same base under another name
    out = link / ('sub.safetensors' if fmt == 'safetensors' else 'sub')
    line = refused(fmt, fake['workdir'], out, 'lies inside .*which is the base model')
    assert str(fake['base']) in line and not (fake['base'] / 'sub').exists()


@pytest.mark.parametrize('fmt', ['hf', 'peft', 'safetensors'])
def test_export_into_a_checkpoint_step_is_refused(fake, fmt):
    """Failure 4: the next run's rotation would delete it. Also from another run's source."""
    step = fake['step']
    out = step / 'params.safetensors' if fmt == 'safetensors' else step
    line = refused(fmt, fake['workdir'], out, 'which a training run writes and rotates')
    assert f'{fake["workdir"]}/checkpoints' in line and 'rotation would delete' in line
    other = fake['tmp'] / 'other_source'
    other.mkdir()
    refused(fmt, other, out, 'which a training run writes and rotates')  # found by walking up from the target
    assert sorted(os.listdir(step)) == ['meta', 'state']


@pytest.mark.parametrize('fmt', ['hf', 'peft'])
def test_export_into_a_workdir_is_refused(fake, fmt):
    line = refused(fmt, fake['workdir'], fake['workdir'], 'is a training workdir')
    assert 'config.json' in line
    refused('safetensors', fake['workdir'], fake['workdir'] / 'config.json', 'one of the files of the training')


def test_export_into_the_data_directory_is_refused(fake):
    refused('hf', fake['workdir'], fake['tmp'] / 'data', r"is the directory of .*corpus\.(bin|json).*\(data\.path\)")


@pytest.mark.parametrize('name', ['model-00001-of-00002.safetensors', 'model.safetensors.index.json',
                                  'adapter_config.json', 'pytorch_model.bin', 'model.safetensors'])
def test_hf_export_into_another_models_directory_is_refused(fake, name):
    other = fake['tmp'] / 'theirs'
    other.mkdir()
    (other / name).write_text('{}')
    line = refused('hf', fake['workdir'], other, "holds another model's files")
    assert name in line and f'--export_path={other}-hf' in line
    assert snapshot(other) == {name: b'{}'}


@pytest.mark.parametrize('name', ['model.safetensors', 'model-00001-of-00002.safetensors', 'pytorch_model.bin'])
def test_peft_export_into_model_weights_is_refused(fake, name):
    """After a PEFT export into a model's directory, transformers loads that model with the adapter applied."""
    other = fake['tmp'] / 'theirs'
    other.mkdir()
    (other / name).write_bytes(b'weights')
    assert name in refused('peft', fake['workdir'], other, "holds another model's files")
    assert snapshot(other) == {name: b'weights'}


def test_export_into_a_non_empty_directory_is_refused_even_with_force(fake):
    other = fake['tmp'] / 'notes'
    other.mkdir()
    (other / 'todo.txt').write_text('mine')
    line = refused('hf', fake['workdir'], other, 'is not empty', force=True)
    assert 'todo.txt' in line and export_target.MARKER in line
    assert snapshot(other) == {'todo.txt': b'mine'}
    file = fake['tmp'] / 'a_file'
    file.write_text('mine')
    refused('peft', fake['workdir'], file, 'is an existing file')


def write_export(out, kind, names, step=1):
    """An export of ours of `kind` holding `names` (each file's text its name), through staged."""
    with export_target.staged(str(out), kind, step=step) as stage:
        for name in names:
            pathlib.Path(stage, name).write_text(name)


@pytest.mark.parametrize('exchange', [True, False])  # renameat2's RENAME_EXCHANGE, or two renames (NFS)
def test_a_previous_export_is_replaced_only_with_force_and_whole(fake, monkeypatch, exchange):
    out = fake['tmp'] / 'hf'
    write_export(out, 'hf', ['config.json', 'model.safetensors', 'tokenizer.json'])
    assert export_target.previous_export(str(out))['files'] == ['config.json', 'model.safetensors', 'tokenizer.json']
    line = refused('hf', fake['workdir'], out, 'holds a previous Hugging Face export of ours')
    assert '--force' in line
    refused('peft', fake['workdir'], out, 'holds a Hugging Face export of ours, not a PEFT adapter one', force=True)
    export_target.check_dir(str(out), 'hf', source=str(fake['workdir']), force=True)
    if not exchange:
        monkeypatch.setattr(export_target, '_exchange', lambda a, b: False)
    inode = out.stat().st_ino
    write_export(out, 'hf', ['config.json', 'model.safetensors'], step=2)
    assert snapshot(out).keys() == {'config.json', 'model.safetensors', export_target.MARKER}  # tokenizer.json: gone
    assert export_target.previous_export(str(out))['step'] == 2 and out.stat().st_ino != inode  # a new directory
    assert sorted(os.listdir(fake['tmp'])) == ['base', 'data', 'hf', 'run']  # no staging or old directory left
    (out / 'README.md').write_text('my model card')  # not the export's: --force no longer replaces it
    assert 'README.md' in refused('hf', fake['workdir'], out, 'files its export did not write', force=True)


KILLED = """
import os, sys, pathlib
from jaxfrontier.checkpoint.interop import export_target
out, when = sys.argv[1], sys.argv[2]
if when == 'between_renames':
    export_target._exchange = lambda a, b: False
    rename = os.rename
    def rename_then_die(a, b):
        rename(a, b)
        os._exit(9)  # SIGKILL-like: no cleanup runs
    os.rename = rename_then_die
with export_target.staged(out, 'hf', step=3) as stage:
    pathlib.Path(stage, 'model.safetensors').write_text('new, half written')
    if when == 'before_swap':
        os._exit(9)
"""


@pytest.mark.parametrize('when', ['before_swap', 'between_renames'])
def test_a_killed_export_leaves_the_old_one_and_the_next_cleans_up(fake, when):
    out = fake['tmp'] / 'hf'
    write_export(out, 'hf', ['config.json', 'model.safetensors'])
    before = snapshot(out)
    proc = subprocess.Popen([sys.executable, '-c', KILLED, str(out), when], env=processes.subprocess_env(),
                            stderr=subprocess.PIPE, text=True)
    assert proc.wait(timeout=60) == 9, proc.stderr.read()
    left = sorted(n for n in os.listdir(fake['tmp']) if n.startswith('hf.'))
    expected = [f'hf{export_target.OLD}{proc.pid}'] if when == 'between_renames' else []
    assert left == expected + [f'hf{export_target.STAGING}{proc.pid}']  # the new export, staged
    if when == 'before_swap':
        assert snapshot(out) == before  # the old export, whole
    else:
        assert not out.exists()  # killed between `out -> old` and `staging -> out`
    export_target.check_dir(str(out), 'hf', source=str(fake['workdir']), force=True)  # puts the old one back
    assert snapshot(out) == before
    write_export(out, 'hf', ['model.safetensors'], step=4)
    assert sorted(os.listdir(fake['tmp'])) == ['base', 'data', 'hf', 'run']
    assert snapshot(out).keys() == {'model.safetensors', export_target.MARKER}


def failing_open(code):
    """files.write_atomic's `open`, whose writes fail with OSError(code) after the first chunk."""
    def fake_open(path, *args, **kwargs):
        f = open(path, *args, **kwargs)  # noqa: SIM115
        class Failing:
            def __enter__(self):
                return self
            def __exit__(self, *exc):
                f.close()
            def write(self, chunk):
                if f.tell():
                    raise OSError(code, os.strerror(code), path)
                return f.write(chunk)
        return Failing()
    return fake_open


def write_tensors(path):
    shapes = {f't{i}': ((64,), np.dtype('float32')) for i in range(3)}
    export.write_safetensors(path, shapes, {'format': 'pt'}, (np.zeros(64, np.float32) for _ in range(3)))


@pytest.mark.parametrize('replacing', [False, True])
def test_disk_full_during_an_export_is_one_line_and_leaves_nothing(fake, monkeypatch, replacing):
    out = fake['tmp'] / 'new' / 'hf'
    if replacing:
        write_export(out, 'hf', ['model.safetensors'])
    before = snapshot(fake['tmp'])
    monkeypatch.setattr(files, 'open', failing_open(errno.ENOSPC), raising=False)
    with pytest.raises(DiskFullError) as e:
        with export_target.staged(str(out), 'hf', step=2) as stage:
            write_tensors(os.path.join(stage, 'model.safetensors'))
    line = str(e.value)
    assert '\n' not in line and 'no space left for the export' in line and 'free of' in line and 'Fix:' in line
    assert snapshot(fake['tmp']) == before  # the old export as it was, or nothing at all (not even new/)
    assert not (fake['tmp'] / 'new').exists() or replacing


def test_disk_full_during_a_safetensors_export_is_one_line(fake, monkeypatch):
    monkeypatch.setattr(export, '_export', lambda *a: write_tensors(a[1]))
    monkeypatch.setattr(files, 'open', failing_open(errno.ENOSPC), raising=False)
    out = fake['tmp'] / 'params.safetensors'
    with pytest.raises(DiskFullError, match='no space left for the export') as e:
        export.export_params(str(fake['workdir']), str(out))
    assert '\n' not in str(e.value) and not [n for n in os.listdir(fake['tmp']) if n.startswith('params')]


def test_a_read_only_target_is_one_line(fake, monkeypatch):
    """Tests run as root, which may write anywhere: the file system's EROFS is simulated, in the writer and at
    the staging directory."""
    out = fake['tmp'] / 'hf'
    monkeypatch.setattr(files, 'open', failing_open(errno.EROFS), raising=False)
    with pytest.raises(UserError, match='cannot be written .Read-only file system.; nothing was written') as e:
        with export_target.staged(str(out), 'peft', step=2) as stage:
            write_tensors(os.path.join(stage, 'adapter_model.safetensors'))
    assert '\n' not in str(e.value) and 'Fix:' in str(e.value)
    monkeypatch.undo()

    def read_only(path, *args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    monkeypatch.setattr(export_target.os, 'mkdir', read_only)
    with pytest.raises(UserError, match='cannot be written .Read-only file system.'):
        with export_target.staged(str(out), 'hf', step=2):
            pass
    assert sorted(os.listdir(fake['tmp'])) == ['base', 'data', 'run']


def test_a_refused_tokenizer_is_named_in_one_line(tmp_path):
    """The token file's header names a tokenizer token_files refuses (a link out of the .bin's directory): the
    export goes on without it, and says why and what to do."""
    secret = tmp_path / 'secret'
    secret.write_text('password')
    data = tmp_path / 'data'
    data.mkdir()
    token_files.write_token_file(str(data / 'corpus'), np.arange(64, dtype=np.uint16), vocab_size=64)
    (data / 'corpus.tokenizer.json').symlink_to(secret)
    header = json.loads((data / 'corpus.json').read_text())
    (data / 'corpus.json').write_text(json.dumps(header | {'tokenizer': 'corpus.tokenizer.json'}))
    config = {'data': {'kind': 'tokens', 'path': str(data / 'corpus'), 'blend': ''}, 'model': {'vocab_size': 64}}
    tokenizer, _, why = hf._tokenizer_of(config)  # pylint: disable=protected-access
    assert tokenizer is None and 'corpus.tokenizer.json' in why and 'links outside' in why and 'Fix:' in why
    assert '\n' not in why
    (data / 'corpus.tokenizer.json').unlink()
    (data / 'corpus.json').write_text(json.dumps(header | {'tokenizer': 'gone.json'}))
    tokenizer, _, why = hf._tokenizer_of(config)  # pylint: disable=protected-access
    assert tokenizer is None and 'gone.json' in why and 'does not exist' in why


@pytest.mark.slow  # needs run_dir
def test_hf_export_again_needs_force_and_a_full_disk_leaves_the_old(run_dir, tmp_path, monkeypatch):
    out = tmp_path / 'hf'
    assert hf.export_hf(str(run_dir), str(out))['no_tokenizer'] == ''  # builtin data: no tokenizer to name
    first = snapshot(out)
    assert set(first) == {'config.json', 'model.safetensors', export_target.MARKER}
    with pytest.raises(UserError, match='holds a previous Hugging Face export of ours .step 2.. Fix: pass --force'):
        hf.export_hf(str(run_dir), str(out))
    monkeypatch.setattr(files, 'open', failing_open(errno.ENOSPC), raising=False)
    with pytest.raises(DiskFullError, match='no space left for the export'):
        hf.export_hf(str(run_dir), str(out), force=True)
    monkeypatch.undo()
    assert snapshot(out) == first and sorted(os.listdir(tmp_path)) == ['hf']
    hf.export_hf(str(run_dir), str(out), force=True)
    assert snapshot(out)['model.safetensors'] == first['model.safetensors']


@pytest.mark.slow  # needs run_dir
def test_hf_export_with_a_refused_tokenizer_says_so_in_one_line(run_dir, tmp_path, caplog):
    """A copy of run_dir's step whose config reads a token file; its header's tokenizer links out of its directory
    (changed after training, or received so): exported without it, one warning line naming it and the fix."""
    step_dir = pathlib.Path(readers.step_dir_of(str(run_dir)))
    copy = tmp_path / 'copy' / 'checkpoints' / step_dir.name
    shutil.copytree(step_dir, copy)
    meta = json.loads((copy / 'meta' / 'metadata').read_text())
    data = tmp_path / 'data'
    data.mkdir()
    token_files.write_token_file(str(data / 'corpus'), np.arange(64, dtype=np.uint16), vocab_size=64)
    (tmp_path / 'secret').write_text('password')
    (data / 'corpus.tokenizer.json').symlink_to(tmp_path / 'secret')
    header = json.loads((data / 'corpus.json').read_text())
    (data / 'corpus.json').write_text(json.dumps(header | {'tokenizer': 'corpus.tokenizer.json'}))
    meta['config']['data'].update(kind='tokens', path=str(data / 'corpus'), blend='')
    (copy / 'meta' / 'metadata').write_text(json.dumps(meta))
    out = tmp_path / 'hf'
    with caplog.at_level(logging.WARNING):
        summary = hf.export_hf(str(copy), str(out))
    assert not summary['tokenizer'] and 'links outside' in summary['no_tokenizer']
    lines = [r.getMessage() for r in caplog.records if 'no tokenizer copied' in r.getMessage()]
    assert len(lines) == 1 and '\n' not in lines[0], lines
    assert 'corpus.tokenizer.json' in lines[0] and 'Fix:' in lines[0] and str(out) in lines[0]
    assert 'password' not in ''.join(p.read_text(errors='replace') for p in out.iterdir())
    assert {'config.json', 'model.safetensors'} <= set(os.listdir(out)) and 'tokenizer.json' not in os.listdir(out)
