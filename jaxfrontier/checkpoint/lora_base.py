"""Which base model a LoRA run trains over, so that its adapters never resume on (or export with) another.

A LoRA checkpoint holds the adapters alone (training/state.py); the base comes from
`checkpoint.init_params_from` at every start. Every save records the base (`record`: its path and a
fingerprint of its files), and a restore or an export whose base's fingerprint differs is refused with
one line (`check`). The fingerprint is of the files the base's readers read (checkpoint/interop/init_from.py):
a .safetensors file; a Hugging Face directory's config.json, weight files and their index; a checkpoint's
step directory (a workdir's newest) whole. Per file its path relative to the base, its size, and its
first and last MiB: a different model (other weights of the same shapes, another step of a run) differs in
them, and a moved or copied base does not. Reading 2 MiB per file keeps it cheap for any model size.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from jaxfrontier.errors import ConfigError
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint.interop import hf_files

EDGE_BYTES = 2**20  # read from each end of every file
HF_FILES = ('config.json', '.safetensors', '.safetensors.index.json')


def _files(source: str) -> tuple[str, list[str]]:
    """(the directory the names are relative to, the files that make up base `source`)."""
    if os.path.isfile(source):
        return os.path.dirname(source), [source]
    if hf_files.looks_like_hf(source):
        names = sorted(n for n in os.listdir(source) if n == HF_FILES[0] or n.endswith(HF_FILES[1:]))
        return source, [os.path.join(source, n) for n in names]
    step_dir = readers.step_dir_of(source)
    found = [os.path.join(d, n) for d, _, names in os.walk(step_dir) for n in names]
    return step_dir, sorted(found)


def fingerprint(source: str) -> str:
    """The fingerprint of base model `source` (module docstring), a hex digest."""
    root, paths = _files(os.path.abspath(source))
    h = hashlib.sha256()
    for path in paths:
        size = os.path.getsize(path)
        h.update(f'{os.path.relpath(path, root)}\0{size}\0'.encode())
        with open(path, 'rb') as f:
            h.update(f.read(EDGE_BYTES))
            if size > 2 * EDGE_BYTES:
                f.seek(size - EDGE_BYTES)
            h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def record(source: str) -> dict[str, Any]:
    """What a LoRA checkpoint records of its base: {'path', 'fingerprint'}."""
    return {'path': os.path.abspath(source), 'fingerprint': fingerprint(source)}


def check(saved: dict[str, Any] | None, source: str, where: str, current: str | None = None) -> None:
    """Refuses, with one line, adapters saved over another base than `source` (`current`: its fingerprint,
    when already known). `saved`: the checkpoint's record (None: saved without one, nothing to compare)."""
    if not saved:
        return
    if (current or fingerprint(source)) != saved.get('fingerprint'):
        raise ConfigError('checkpoint.init_params_from', source, f'is not the base model the LoRA adapters of '
                          f'{where} were trained over ({saved.get("path")}: its files differ)',
                          f'set --config.checkpoint.init_params_from={saved.get("path")} (that base, unchanged), '
                          'or train new adapters in a new --workdir')
