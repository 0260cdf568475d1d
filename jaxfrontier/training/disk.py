"""A full disk (or quota) while a run writes: one line naming the path, the free space and the fix.

Orbax's asynchronous save reports ENOSPC from a background thread, re-raised (sometimes only
as text) at the next save or wait; building the built-in corpus raises a plain OSError. Both
end the run with `error: no space left ...` (exit 2) instead of tracebacks; nothing committed
before is touched (Orbax writes a step into a temporary directory and renames it when done).
"""

from __future__ import annotations

import errno
import os
import re
import shutil

from jaxfrontier.errors import DiskFullError, UserError



def disk_full(e: BaseException | None) -> OSError | None:
    """The OSError(ENOSPC / EDQUOT) behind `e` (Orbax and TensorStore wrap it, or only say it), if any.

    Of several in the chain, the first that names a file.
    """
    seen, found = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            found.append(e)
        elif 'No space left on device' in str(e) or 'Disk quota exceeded' in str(e):
            named = re.search(r'local file "(/[^"]+)"|"(/[^"]+)"', str(e))  # TensorStore names the file
            path = getattr(e, 'filename', None) or (named and (named.group(1) or named.group(2)))
            found.append(OSError(errno.ENOSPC, 'No space left on device', path or None))
        e = e.__cause__ or e.__context__
    return next((f for f in found if f.filename), found[0] if found else None)


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
