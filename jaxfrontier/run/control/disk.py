"""A full disk (or quota) while a run writes: one line naming the path, the free space and the fix.

Orbax's asynchronous save reports ENOSPC from a background thread, re-raised (sometimes only
as text) at the next save or wait; building the built-in corpus raises a plain OSError. Both
are found by `errors.disk_full` and end the run with `error: no space left ...` (exit 2) instead
of tracebacks (Orbax's own logged tracebacks of it are dropped: checkpoint/manager.py); nothing
committed before is touched (Orbax writes a step into a temporary directory and renames it when
done).
"""

from __future__ import annotations

import os
import shutil

from jaxfrontier.errors import DiskFullError, UserError


def _size(n: int) -> str:
    return f'{n / 2**30:.2f} GiB' if n >= 2**30 else f'{n / 2**20:.1f} MiB'


def disk_full_error(e: OSError, workdir: str) -> UserError:
    """One line: the path that could not be written, the free space there, the fix."""
    path = e.filename or workdir
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        usage = shutil.disk_usage(probe or '.')
        free = f'{_size(usage.free)} free of {_size(usage.total)}'
    except OSError:
        free = 'free space unknown'
    return DiskFullError(
        f'no space left on the device holding {path} ({free}; {e.strerror or e}). Checkpoints committed '
        f'before are intact. Fix: free space there (older runs, {os.path.join(workdir, "checkpoints")} steps '
        'you do not need) or use a --workdir on a file system with room, then rerun the same command to '
        'resume; checkpoint.keep bounds how many checkpoints stay')
