"""Exports never replace a run's files, and leave no temporaries behind (issue 28: failure 2, weak cases).

- `--mode=export --export_format=hf --export_path=<the training workdir>` exited 0 and replaced the
  run's config.json with the Hugging Face one (the next resume wrote it back over the export).
- an --export_path that is an existing file gave a FileExistsError traceback.
- SIGKILL during an export left `*.tmp<pid>` files that no later export removed.
"""

import os
import subprocess
import sys

import pytest

from jaxfrontier.checkpoint import run_files
from jaxfrontier.errors import UserError
from jaxfrontier.checkpoint.interop import hf
from jaxfrontier.checkpoint.interop import safetensors as export
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
    out = tmp_path / ('params.safetensors' if kind == 'safetensors' else 'hf')
    final = out if kind == 'safetensors' else out / 'model.safetensors'
    final.parent.mkdir(parents=True, exist_ok=True)
    stale, alive = f'{final}.tmp{dead_pid()}', f'{final}.tmp{os.getpid()}x'
    for path in (stale, alive):
        open(path, 'wb').close()
    if kind == 'safetensors':
        export.export_params(str(run_dir), str(out))
    else:
        hf.export_hf(str(run_dir), str(out))
    assert final.exists() and not os.path.exists(stale)
    assert os.path.exists(alive)  # not a temporary of ours: left alone


def test_markers():
    assert not run_files.is_training_workdir('/nonexistent/dir')
    assert not run_files.is_hf_export('/nonexistent/dir')
