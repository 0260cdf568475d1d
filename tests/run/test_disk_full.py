"""A full disk is one line naming the path, the free space and the fix; exit 2 (run/control/disk.py).

Black-box on a small tmpfs (needs root to mount; skipped elsewhere): the built-in corpus that
does not fit, and a checkpoint save that does not fit after a committed one, which stays, with
nothing else on stderr (Orbax's logged tracebacks and TensorStore's late callbacks are dropped by
checkpoint/manager.py, whose two filters are also tested here without a disk).
"""

import asyncio
import errno
import gc
import logging
import os
import subprocess
import sys
import types

import pytest
import tensorstore as ts

from jaxfrontier import errors
from jaxfrontier.checkpoint import manager
import processes


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
    return processes.run_main(f'--workdir={workdir}', *args)


def one_error_line(proc) -> str:
    """The one `error:` line (processes.error_line), last on stderr, and no traceback of any thread before it."""
    line = processes.error_line(proc)
    assert 'Event loop is closed' not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1] == line, proc.stderr[-4000:]
    full = [line for line in proc.stderr.splitlines() if any(t.lower() in line.lower() for t in errors.DISK_FULL_TEXTS)]
    assert full == [line], proc.stderr[-4000:]  # no log record of Orbax's names the full disk besides it
    return line


def test_enospc_is_found_behind_wrappers():
    inner = OSError(errno.ENOSPC, 'No space left on device', '/x/y')
    try:
        try:
            raise inner
        except OSError as e:
            raise RuntimeError('async save failed') from e
    except RuntimeError as outer:
        assert errors.disk_full(outer) is inner
    assert errors.disk_full(ValueError('INTERNAL: ... No space left on device [tensorstore]')).errno == errno.ENOSPC
    assert errors.disk_full(OSError(errno.EACCES, 'Permission denied')) is None


def test_builtin_corpus_on_a_full_disk(small_fs):
    line = one_error_line(run(small_fs / 'wd', '--config.train.steps=1', '--config.data.cache_dir=workdir'))
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
    line = one_error_line(run(workdir, *args, '--config.train.steps=3'))
    assert f'no space left on the device holding {workdir}' in line, line
    assert 'KiB' in line or 'MiB free' in line, line
    assert '1' in os.listdir(workdir / 'checkpoints'), os.listdir(workdir / 'checkpoints')
    os.remove(small_fs / 'filler')  # room again: the same command resumes from the committed step
    again = run(workdir, *args, '--config.train.steps=3')
    assert again.returncode == 0, again.stderr[-4000:]
    assert 'restored step 1 from' in again.stderr, again.stderr[-4000:]


def orbax_record(exception: BaseException | None, message: str = 'save failed', level=logging.ERROR):
    """A log record as Orbax's future.py writes it from a failed writer thread (logging.exception)."""
    path = os.path.join(os.sep, 'venv', 'orbax', 'checkpoint', '_src', 'futures', 'future.py')
    exc_info = (type(exception), exception, None) if exception is not None else None
    return logging.LogRecord('absl', level, path, 387, message, (), exc_info)


def test_orbax_error_records_of_a_full_disk_are_dropped_and_others_kept():
    quiet = manager._QuietOrbax()
    tensorstore_enospc = ValueError('RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/2/x": '
                                    "Failed to write 190430 bytes to file 12: No space left on device "
                                    "[os_error_code='28']")
    wrapped = RuntimeError('Failed to run 3 Handler Commit operations')
    wrapped.__cause__ = OSError(errno.EDQUOT, 'Disk quota exceeded', '/w/checkpoints/2/y')
    assert not quiet.filter(orbax_record(tensorstore_enospc))
    assert not quiet.filter(orbax_record(wrapped))
    assert not quiet.filter(orbax_record(None, 'raised an exception: ... Disk quota exceeded', logging.WARNING))
    assert not quiet.filter(orbax_record(None, 'Finished saving checkpoint', logging.INFO))  # chatter
    assert quiet.filter(orbax_record(PermissionError(errno.EACCES, 'Permission denied', '/w')))
    assert quiet.filter(orbax_record(ValueError('DATA_LOSS: checksum mismatch')))
    ours = orbax_record(tensorstore_enospc)
    ours.pathname = os.path.join(os.sep, 'jaxfrontier', 'training', 'loop.py')
    assert quiet.filter(ours)


def test_a_tensorstore_callback_on_a_closed_event_loop_is_dropped_and_other_unraisables_kept(monkeypatch):
    shown = []
    monkeypatch.setattr(sys, 'unraisablehook', manager._unraisable_hook(shown.append))
    # What Orbax's run_sync does when one write of a save fails: the gather raises, the loop closes,
    # and a TensorStore write still in flight completes afterwards (here: its promise is set).
    promise, future = ts.Promise.new()

    async def save():
        async def failed_write():
            raise OSError(errno.ENOSPC, 'No space left on device')
        await asyncio.gather(failed_write(), future)

    loop = asyncio.new_event_loop()
    with pytest.raises(OSError):
        loop.run_until_complete(save())
    loop.close()
    promise.set_result(None)  # TensorStore's callback calls loop.call_soon_threadsafe: RuntimeError
    assert shown == []

    # The same RuntimeError from a Python caller is a bug of ours to see; so is any other unraisable.
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        from_python = types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, exc_traceback=e.__traceback__,
                                            err_msg=None, object=None)
    sys.unraisablehook(from_python)
    other = types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError('x'), exc_traceback=None,
                                  err_msg=None, object=None)
    sys.unraisablehook(other)
    assert shown == [from_python, other]


def test_an_orbax_write_task_left_unawaited_after_a_full_disk_is_not_logged_and_others_are(caplog, monkeypatch):
    # What Orbax's async_serialize_from_host does when a full disk fails several writes: the first
    # failure is raised, the other write tasks are never awaited, and asyncio logs each one when it
    # is collected ("Task exception was never retrieved", with a traceback). CI saw one such.
    monkeypatch.setattr(logging.getLogger('asyncio'), 'filters', [])
    monkeypatch.setattr(manager.logging.get_absl_logger(), 'filters', [])
    monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)
    manager.quiet_orbax_logs()
    orbax_file = os.path.join(os.sep, 'venv', 'orbax', 'checkpoint', '_src', 'serialization', 'serialization.py')
    ours_file = os.path.join(os.sep, 'jaxfrontier', 'training', 'loop.py')
    writers = {}
    for name, file in (('orbax', orbax_file), ('ours', ours_file)):
        exec(compile('async def write_fragment(e):\n    raise e\n'
                     'async def _read_array_index_and_device_put(e):\n    raise e\n', file, 'exec'),
             writers.setdefault(name, {}))
    enospc = ('RESOURCE_EXHAUSTED: Error writing local file "/w/checkpoints/2/x": '
              "Failed to write 3827 bytes to file 17: No space left on device [os_error_code='28']")

    def orphaned(writer: str, message: str, task: str = 'write_fragment') -> list[logging.LogRecord]:
        async def save():
            write = writers[writer][task]
            first, _second = asyncio.ensure_future(write(ValueError(message))), asyncio.ensure_future(write(ValueError(message)))
            await asyncio.sleep(0)
            await first  # raises; `_second` is never awaited
        caplog.clear()
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(save())
        except ValueError:
            pass  # not kept: its traceback holds save()'s frame, which holds `second`
        loop.close()
        gc.collect()
        return [r for r in caplog.records if r.name == 'asyncio' and 'never retrieved' in r.getMessage()]

    with caplog.at_level(logging.ERROR, logger='asyncio'):
        assert orphaned('orbax', enospc) == []
        assert len(orphaned('orbax', 'DATA_LOSS: checksum mismatch')) == 1  # not a full disk
        assert len(orphaned('ours', enospc)) == 1  # not Orbax's task: a bug of ours to see
        # A restore's reads of a truncated file: the first failure is raised (one line); the rest are dropped.
        out_of_range = 'OUT_OF_RANGE: Error reading shard entry {0, 0}/{1, 1}: Requested byte range is not valid'
        assert orphaned('orbax', out_of_range, '_read_array_index_and_device_put') == []
        assert len(orphaned('ours', out_of_range, '_read_array_index_and_device_put')) == 1


def test_quiet_orbax_logs_installs_each_filter_once(monkeypatch):
    monkeypatch.setattr(sys, 'unraisablehook', sys.unraisablehook)
    manager.quiet_orbax_logs()
    hook = sys.unraisablehook
    manager.quiet_orbax_logs()
    assert sys.unraisablehook is hook and hook.drops_closed_loop_wakeups
    absl_filters = manager.logging.get_absl_logger().filters
    assert sum(isinstance(f, manager._QuietOrbax) for f in absl_filters) == 1
    asyncio_filters = logging.getLogger('asyncio').filters
    assert sum(isinstance(f, manager._QuietOrbax) for f in asyncio_filters) == 1


def test_an_orbax_read_abandoned_by_a_failed_restore_is_not_printed_and_others_are():
    """A failed restore's still-suspended Orbax reads, closed by the collector, print nothing; an Orbax
    read that failed for another reason, and a coroutine of anyone else closed the same way, still do."""
    from orbax.checkpoint._src.serialization import serialization

    async def ours():
        pass

    seen = []
    hook = manager._unraisable_hook(seen.append)
    for coroutine, cause, printed in [
            (serialization._read_array_index_and_device_put([], (), None, global_shape=(), new_shard_shape=(),
                                                            dtype=None, byte_limiter=None, strict=True, dll=None,
                                                            memory_kind=None), GeneratorExit(), False),
            (serialization._read_array_index_and_device_put([], (), None, global_shape=(), new_shard_shape=(),
                                                            dtype=None, byte_limiter=None, strict=True, dll=None,
                                                            memory_kind=None), ValueError('DATA_LOSS'), True),
            (ours(), GeneratorExit(), True)]:
        error = Exception('Encountered error while reading array index')
        error.__cause__ = cause
        seen.clear()
        hook(types.SimpleNamespace(exc_type=Exception, exc_value=error, exc_traceback=None, object=coroutine,
                                   err_msg=None))
        coroutine.close()  # never started: closing runs none of its code
        assert len(seen) == printed, (coroutine, cause)
