"""The fast tier's peer copy: each process's shards moved to another process over the job's interconnect.

Node-local disks (Frontier's NVMe) are not reachable from other nodes, so a copy of a process's
shards on another node must travel as device data, through the same links the training step
uses: one jitted `ppermute` over a 1-D mesh `ring` of every device of the job, ordered by
process then device id, so that process p holds rows p*L .. p*L+L-1 (L local devices each).

For each leaf of the state, local device j's block (its shard, the same shape on every device:
the trainer's shardings divide evenly) becomes block `p*L + j` of a global array
[N * s0, s1, ...] (scalars: [N]) built with `jax.make_array_from_single_device_arrays`, without
copying the shard. `shift(blocks, k * L)` moves every block k processes ahead, so local device j
of process p + k receives what local device j of process p held. The fast tier sends with
`+offset` after a save and brings a lost process's shards back with `-offset` on restore.

`peer_offset`: the peer is the process `processes per node` ahead (modulo the count), so it sits
on another node when Slurm places consecutive tasks on one node (its block distribution, the
default); processes per node are counted from the hosts' names (one small all-gather). When
every process is on one host (one node, or the tests), the next process is the peer: the copy
then survives the loss of one process's directory, not of the machine.
"""

from __future__ import annotations

import functools
import hashlib
import socket
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = 'ring'


def device_order() -> list[Any]:
    """Every device of the job, process by process (then by id): process p holds rows p*L .. p*L+L-1."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def local_order() -> list[Any]:
    """This process's devices in the ring's order: local device position j is row p*L + j."""
    return [d for d in device_order() if d.process_index == jax.process_index()]


def host_ids() -> np.ndarray:
    """A 31-bit hash of each process's host name, indexed by process (one all-gather; int32: JAX's default)."""
    mine = np.array([int.from_bytes(hashlib.sha256(socket.gethostname().encode()).digest()[:4], 'little') >> 1],
                    np.int32)
    if jax.process_count() == 1:
        return mine
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)


def peer_offset(hosts: np.ndarray | None = None) -> int:
    """How many processes ahead a process's peer copy is held (0: a single process, no peer).

    Args:
      hosts: a host id per process (default: all-gathered host-name hashes).
    """
    count = jax.process_count()
    if count == 1:
        return 0
    hosts = host_ids() if hosts is None else hosts
    per_node = int(np.sum(hosts == hosts[0]))
    return per_node % count or 1


def offset_warning(hosts: np.ndarray, offset: int) -> str | None:
    """A line when the peer of some process runs on its own host (one lost node would lose both copies)."""
    count = len(hosts)
    if count == 1 or len(set(hosts.tolist())) == 1:
        return None
    same = [p for p in range(count) if hosts[p] == hosts[(p + offset) % count]]
    if not same:
        return None
    return (f'fast tier: the peer copies of processes {same[:8]} are held on their own node (processes are not '
            'placed node by node in order), so a lost node loses those steps; the persistent tier still holds')


@functools.cache
def _shift_fn(devices: tuple[Any, ...], shift: int, ndims: tuple[int, ...]):
    """The jitted ppermute moving every block `shift` rows ahead on the ring (cached per tree of ranks)."""
    mesh = Mesh(np.array(devices), (AXIS,))
    n = len(devices)
    perm = [(d, (d + shift) % n) for d in range(n)]

    def move(blocks):
        return [jax.lax.ppermute(b, AXIS, perm) for b in blocks]

    specs = [P(AXIS) for _ in ndims]
    return jax.jit(jax.shard_map(move, mesh=mesh, in_specs=(specs,), out_specs=specs, check_vma=False))


def shift(blocks: list[list[jax.Array]], rows: int) -> list[list[jax.Array]]:
    """Moves each leaf's per-device blocks `rows` devices ahead on the ring.

    Args:
      blocks: per leaf, this process's blocks in `local_order()`: block j on local device j, one shape per
        leaf on every device of the job.
      rows: how far (a multiple of the local device count moves whole processes); negative: back.

    Returns:
      Per leaf, the blocks this process's devices received, in `local_order()` (device arrays: the
      transfer is dispatched, not waited for); a scalar leaf's blocks come back as shape [1].
    """
    if not blocks:
        return []
    devices = tuple(device_order())
    n = len(devices)
    mesh = Mesh(np.array(devices), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    arrays = []
    for leaf in blocks:
        # Scalars (the step count): one row of [N] each, through the host; a device reshape of one device's
        # array would run under the training loop's mesh, which spans every device.
        flat = [jax.device_put(np.asarray(b).reshape(1), b.device) if b.ndim == 0 else b for b in leaf]
        shape = (n * flat[0].shape[0], *flat[0].shape[1:])
        arrays.append(jax.make_array_from_single_device_arrays(shape, sharding, flat))
    fn = _shift_fn(devices, rows % n, tuple(a.ndim for a in arrays))
    with jax.set_mesh(mesh):  # inside the training loop's mesh: this program runs on the ring
        moved = fn(arrays)
    local = local_order()
    out = []
    for array in moved:
        by_device = {s.device: s.data for s in array.addressable_shards}
        out.append([by_device[d] for d in local])
    return out
