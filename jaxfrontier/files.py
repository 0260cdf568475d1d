"""Small files written whole or not at all: a run's records and a fast-tier checkpoint's manifest.

No JAX, no other jaxfrontier import: the training loop (config.json, spikes.json, goodput.json,
the W&B run id), the checkpoint fast tier (its commit marker) and the safetensors export write
through here.
"""

from __future__ import annotations

import os
from typing import Iterable


def write_atomic(path: str, data: str | bytes | Iterable[bytes], *, durable: bool = False) -> None:
    """Writes `data` to `path` so that a reader, or a kill at any moment, sees the old file or the new
    one, never a part: a temporary file of this process beside it (`<path>.tmp<pid>`), then one rename.

    data: text, bytes, or byte chunks written as they come (a file larger than the host should hold).

    durable: also survive a power loss or a lost node's page cache: the file is fsynced before the
    rename and its directory after, so a commit marker never outlives the data it names.
    """
    tmp = f'{path}.tmp{os.getpid()}'
    text = isinstance(data, str)
    chunks = [data] if text or isinstance(data, bytes) else data
    try:
        with open(tmp, 'w' if text else 'wb', encoding='utf-8' if text else None) as f:
            for chunk in chunks:
                f.write(chunk)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # a full disk or a refused rename: the old file stays, no half-written one beside it
            os.remove(tmp)
        raise
    if durable:
        fd = os.open(os.path.dirname(path) or '.', os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
