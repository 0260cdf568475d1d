"""The fast tier on disk: one process's shards of one step, each with its place in the array and a checksum.

Layout, under the process's own directory `<checkpoint.fast_dir>/process_<p>/` (node-local: no
other process reads it):

  <step>/own/    this process's shards of the state at <step>
  <step>/peer/   the shards of its source process (the one `peer_offset` behind), received over the
                 interconnect (checkpoint/fast/peer.py)

Each part holds one raw file per distinct shard (`<leaf>.<shard>.bin`, C order, the array's dtype)
and `manifest.json`, written last, fsynced, then renamed into place: the part's commit marker.
A part without a manifest was cut short and is never read. The manifest names the step, the
source and holder processes, the job's process and device counts and mesh, and per leaf its
name, global shape and dtype, and per shard its global index ([start, stop) per dimension), the
local device positions holding it, its byte count and the CRC-32 of its bytes (zlib's; the same
error-detection class as the persistent tier's CRC32C, from the standard library). Reading
verifies every byte count and checksum and names the first file that fails.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from typing import Any

import numpy as np

from jaxfrontier import files as files_lib
from jaxfrontier.errors import CheckpointError

FORMAT = 'jaxfrontier-fast'
VERSION = 1
MANIFEST = 'manifest.json'
PARTS = ('own', 'peer')

# (name, global shape, dtype name, [(index, positions, host array)]) of one leaf.
Leaf = tuple[str, tuple[int, ...], str, list[tuple[tuple[tuple[int, int], ...], list[int], np.ndarray]]]


def process_root(fast_dir: str, process: int) -> str:
    return os.path.join(fast_dir, f'process_{process}')


def part_dir(root: str, step: int, part: str) -> str:
    return os.path.join(root, str(step), part)


def write_part(directory: str, head: dict[str, Any], leaves: list[Leaf]) -> int:
    """Writes one part (a directory replaced if it exists); returns the bytes written.

    Args:
      directory: `part_dir(...)`.
      head: the manifest's fields other than `leaves` (step, processes, mesh, ...).
      leaves: what to store, per leaf.
    """
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.makedirs(directory)
    entries, total = [], 0
    for i, (name, shape, dtype, shards) in enumerate(leaves):
        files = []
        for k, (index, positions, data) in enumerate(shards):
            payload = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
            file = f'{i}.{k}.bin'
            with open(os.path.join(directory, file), 'wb') as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            files.append({'file': file, 'index': [list(r) for r in index], 'positions': list(positions),
                          'bytes': int(payload.size), 'crc32': zlib.crc32(payload)})
            total += int(payload.size)
        entries.append({'name': name, 'shape': list(shape), 'dtype': dtype, 'shards': files})
    manifest = {'format': FORMAT, 'version': VERSION, **head, 'leaves': entries}
    files_lib.write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest).encode(), durable=True)
    return total


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The committed manifest of a part, or None (not committed, unreadable, or not ours)."""
    try:
        with open(os.path.join(directory, MANIFEST), 'rb') as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get('format') != FORMAT or manifest.get('version') != VERSION:
        return None
    return manifest


def load_part(directory: str, manifest: dict[str, Any], dtype_of) -> dict[str, list[tuple[Any, list[int], np.ndarray]]]:
    """{leaf name: [(index, positions, array)]} of a part, every byte count and checksum verified.

    Args:
      dtype_of: a dtype name -> numpy dtype (`jax.numpy.dtype`: bfloat16 included).

    Raises:
      CheckpointError: a file is missing, short, or fails its checksum (names it).
    """
    out = {}
    for leaf in manifest['leaves']:
        dtype = dtype_of(leaf['dtype'])
        shards = []
        for shard in leaf['shards']:
            path = os.path.join(directory, shard['file'])
            try:  # a writable buffer of its own: the restored arrays may be built on it
                with open(path, 'rb') as f:
                    payload = bytearray(f.read())
            except OSError as e:
                raise CheckpointError(f'{path}: {e.strerror or e}') from None
            if len(payload) != shard['bytes'] or zlib.crc32(payload) != shard['crc32']:
                raise CheckpointError(f'{path}: checksum mismatch ({len(payload)} of {shard["bytes"]} bytes read)')
            index = tuple(tuple(r) for r in shard['index'])
            shape = tuple(b - a for a, b in index)
            shards.append((index, shard['positions'], np.frombuffer(payload, dtype).reshape(shape)))
        out[leaf['name']] = shards
    return out


def steps(root: str) -> list[int]:
    """The step directories under a process's root, oldest first (committed or not)."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def prune(root: str, keep: int) -> list[int]:
    """Deletes the steps older than the newest `keep` whose own part is committed; returns those deleted."""
    all_steps = steps(root)
    committed = [s for s in all_steps if read_manifest(part_dir(root, s, 'own')) is not None]
    if len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    gone = [s for s in all_steps if s < oldest_kept]
    for s in gone:
        shutil.rmtree(os.path.join(root, str(s)), ignore_errors=True)
    return gone
