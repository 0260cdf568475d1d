"""The built-in corpus: the running interpreter's own standard-library source, as a byte-level token file."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pathlib
import platform
import sys
import sysconfig
from typing import Iterator

import numpy as np

from jaxfrontier.data.token_files import open_token_file, write_token_file
from jaxfrontier.errors import ConfigError

BYTE_VOCAB = 256  # the built-in corpus is byte-level
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.ENOSPC, errno.EDQUOT)


def _stdlib_source_files(stdlib: str) -> list[pathlib.Path]:
    """All `*.py` under the stdlib, site-packages excluded, sorted by relative path."""
    root = pathlib.Path(stdlib)
    rel_paths = [p.relative_to(root) for p in root.rglob('*.py') if p.is_file()]
    rel_paths = [r for r in rel_paths if not {'site-packages', 'dist-packages'} & set(r.parts)]
    return [root / r for r in sorted(rel_paths, key=lambda r: r.as_posix())]


def builtin_corpus(cache_dir: str | os.PathLike) -> str:
    """Returns the .bin path of the built-in corpus, building and caching it on first use.

    The corpus is the running interpreter's own standard-library source (`*.py`, sorted by
    relative path, site-packages excluded) concatenated as bytes: vocabulary 256, nothing to
    download. A valid cached file is reused; a new one is written atomically, so concurrent
    builders or a crash never leave a partial file that looks complete.

    Args:
      cache_dir: directory for the cached token file; created if needed.
    """
    stdlib = sysconfig.get_paths()['stdlib']
    bin_path = ensure_cache_dir(cache_dir)
    # Processes of one job (and runs of one user) share the directory: one builds while the others wait, then reuse it
    # (write_token_file removes the header while it writes, which a reader must not see).
    with _exclusive(bin_path + '.lock'):
        with contextlib.suppress(ConfigError):
            if open_token_file(bin_path, BYTE_VOCAB).header.get('source') == stdlib:
                return bin_path
        files = _stdlib_source_files(stdlib)
        if not files:
            raise ConfigError('data.kind', 'builtin', f'no Python source found in the stdlib at {stdlib}',
                              "use data.kind='tokens' with a token file, or data.kind='synthetic'")
        corpus_bytes = b''.join(f.read_bytes() for f in files)
        try:
            return write_token_file(bin_path, np.frombuffer(corpus_bytes, np.uint8), BYTE_VOCAB,
                                    metadata={'source': stdlib, 'num_files': len(files)})
        except OSError as e:  # a full disk: name the file (the loop turns it into one line, run/control/disk.py)
            if e.filename is None and e.errno is not None:
                raise OSError(e.errno, f'{e.strerror} (writing the built-in corpus, '
                              f'{len(corpus_bytes) / 2**20:.0f} MiB)', bin_path) from e
            raise


def ensure_cache_dir(cache_dir: str | os.PathLike) -> str:
    """Creates the corpus cache directory (and its lock file); main calls it before the run writes anything.

    Returns:
      The corpus's .bin path in it (its lock file is that path + '.lock').

    Raises:
      ConfigError: the directory cannot be created or written (a read-only home, a file in the path, a
        disk with no room for an empty file). A disk that fills while the corpus is written is left to
        the loop, which names it in one line (run/control/disk.py).
    """
    bin_path = os.path.join(os.fspath(cache_dir),
                            f'stdlib-{sys.implementation.name}-{platform.python_version()}.bin')
    try:
        os.makedirs(os.fspath(cache_dir), exist_ok=True)
        open(bin_path + '.lock', 'a').close()
    except OSError as e:
        if e.errno not in _NOT_WRITABLE:
            raise
        raise ConfigError('data.cache_dir', os.fspath(cache_dir), f'cannot write the built-in corpus there: '
                          f'{e.strerror} ({e.filename})', "name a writable directory, or 'workdir'") from None
    return bin_path


@contextlib.contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    """An advisory file lock (flock); a file system without locks runs unlocked."""
    with open(lock_path, 'a') as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
