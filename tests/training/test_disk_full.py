"""A full disk is one line naming the path, the free space and the fix; exit 2 (training/disk.py).

Black-box on a small tmpfs (needs root to mount; skipped elsewhere): the built-in corpus that
does not fit, and a checkpoint save that does not fit after a committed one, which stays.
"""

import errno
import os
import subprocess
import sys

import pytest

from jaxfrontier.training import disk
from tests import processes


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs of 4 MiB at tmp_path/fs (unmounted afterwards)."""
    path = tmp_path / 'fs'
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=4M', 'tmpfs', str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip('mounting a small tmpfs needs root')
    yield path
    subprocess.run(['umount', '-l', str(path)], check=True)


def run(workdir, *args):
    cmd = [sys.executable, '-m', 'jaxfrontier.main', *processes.TINY, f'--workdir={workdir}', *args]
    return subprocess.run(cmd, cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=600)


def one_error_line(proc, background_tracebacks=False) -> str:
    """The one `error:` line, last on stderr; Orbax's writer threads may log their own tracebacks before it."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-4000:])
    assert background_tracebacks or 'Traceback' not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1].startswith('error:'), proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith('error:')]
    assert len(lines) == 1, proc.stderr[-4000:]
    return lines[0]


def test_enospc_is_found_behind_wrappers():
    inner = OSError(errno.ENOSPC, 'No space left on device', '/x/y')
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError('async save failed') from e
    except RuntimeError as outer:
        assert disk.disk_full(outer) is inner
    assert disk.disk_full(ValueError('INTERNAL: ... No space left on device [tensorstore]')).errno == errno.ENOSPC
    assert disk.disk_full(OSError(errno.EACCES, 'Permission denied')) is None


def test_builtin_corpus_on_a_full_disk(small_fs):
    line = one_error_line(run(small_fs / 'wd', '--config.train.steps=1'))
    assert 'no space left on the device holding' in line and 'data_cache/stdlib-' in line, line
    assert 'MiB free of 4.0 MiB' in line and 'Fix:' in line, line


@pytest.mark.slow  # two runs: one compile each
def test_checkpoint_save_on_a_full_disk_keeps_the_committed_one(small_fs):
    workdir = small_fs / 'wd'
    args = ('--config.data.kind=synthetic', '--config.checkpoint.every_steps=1', '--config.checkpoint.keep=5')
    first = run(workdir, *args, '--config.train.steps=1')
    assert first.returncode == 0, first.stderr[-4000:]
    committed = sorted(os.listdir(workdir / 'checkpoints'))
    assert committed == ['1'], committed
    with open(small_fs / 'filler', 'wb') as f:  # leave 64 KiB: room for the lock and logs, not a checkpoint
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        f.write(b'\0' * max(free - 64 * 1024, 0))
    line = one_error_line(run(workdir, *args, '--config.train.steps=3'), background_tracebacks=True)
    assert f'no space left on the device holding {workdir}' in line, line
    assert 'KiB' in line or 'MiB free' in line, line
    assert '1' in os.listdir(workdir / 'checkpoints'), os.listdir(workdir / 'checkpoints')
    os.remove(small_fs / 'filler')  # room again: the same command resumes from the committed step
    again = run(workdir, *args, '--config.train.steps=3')
    assert again.returncode == 0, again.stderr[-4000:]
    assert 'restored step 1 from' in again.stderr, again.stderr[-4000:]
