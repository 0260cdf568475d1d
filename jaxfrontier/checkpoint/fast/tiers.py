"""The fast checkpoint tier: every few steps, each process's shards to node-local disk and to a peer's.

The persistent tier (manager.py: Orbax on the shared file system, Lustre on Frontier) is saved
every `checkpoint.every_steps`; its cost grows with the job and its file system is shared by
every job on the machine, so it is saved rarely, and a failure loses the steps since. The fast
tier (`checkpoint.fast_dir`, e.g. Frontier's NVMe at `$JF_NODE_LOCAL`) is saved every
`checkpoint.fast_every_steps`: each process copies the shards its devices hold to host memory
(the only part the step waits for), sends them to its peer process on another node over the
interconnect (peer.py), and a background thread writes both its own shards and the peer's
received ones to its node's disk (fast_files.py), then deletes all but the newest
`checkpoint.fast_keep` steps. A lost node loses its disk; its shards of every kept step are on
its peer's disk. Two lost nodes that are each other's peer lose the fast tier's steps; the
persistent tier still holds.

Why not Orbax: its checkpoint manager writes one OCDBT tree on a shared file system, which a
node-local disk is not; its experimental emergency (local) checkpoint manager restores a lost
node's data from a replica slice, so it needs the state replicated across data-parallel slices,
which ZeRO-1 and FSDP (the paper's layouts) do not have. Here every process writes exactly its
addressable shards and the peer copy is explicit, whatever the sharding.

A step is committed by a process when both its parts' manifests are on disk (written last). On
restore, every process lists what it holds, all processes all-gather those lists (one small
array), and the newest step newer than the persistent tier's newest for which every process's
shards are held (its own copy, or its peer's) is read: every process verifies what it holds
(checksums), they all-gather the result, a process whose own copy is missing or corrupt gets
it back from its peer (the exchange reversed), and the arrays are assembled on the run's
shardings. A corrupt or incomplete step is skipped with a line naming it. The fast tier is read
only on the mesh, process count and device count it was saved with (else one line, and the
persistent tier restores with resharding as before). A state that is not finite is never saved.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxfrontier import logs
from jaxfrontier.errors import CheckpointError, ConfigError, UserError
from jaxfrontier.checkpoint.fast import files as fast_files
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint import integrity
from jaxfrontier.checkpoint.fast import peer

State = dict[str, Any]
_log = logs.process0(__name__).info
_KEEP_LISTED = 32  # steps per part in the all-gathered listing (far above any fast_keep in use)


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's global index as ((start, stop), ...) per dimension."""
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def _host_copy(block: jax.Array) -> np.ndarray:
    """The block's values in host memory of their own. On a GPU `np.asarray` copies; on the CPU backend it
    is a view of the device buffer, which the next step (donating the state) may overwrite."""
    host = np.asarray(block)
    return host.copy() if block.device.platform == 'cpu' else host


def _allgather(row: np.ndarray) -> np.ndarray:
    """[processes, len(row)]: every process's `row` (one collective)."""
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def candidates(owns: list[set[int]], helds: list[set[int]], offset: int,
               persistent_step: int | None) -> list[tuple[int, list[int]]]:
    """(step, the processes none of whose copies it has) of each fast step newer than `persistent_step`,
    newest first. `owns[p]`: the steps process p holds its own shards of; `helds[p]`: those it holds
    the peer copy of (the shards of process p - offset). A step with nobody lacking is complete."""
    count = len(owns)
    floor = -1 if persistent_step is None else persistent_step
    steps = sorted({s for s in set().union(*owns, *helds) if s > floor}, reverse=True)
    return [(s, [p for p in range(count) if s not in owns[p] and s not in helds[(p + offset) % count]])
            for s in steps]


class FastTier:
    """The fast tier of one run on this process (no-op when `checkpoint.fast_dir` is '').

    Usage, beside manager.Checkpointer (run/loop.py):

        fast = FastTier(config.checkpoint, mesh)
        restored = fast.restore(target, checkpointer.latest_step())   # None: restore as before
        ...  fast.save(step, state, metrics)  (when fast.due(step))
        fast.close()
    """

    def __init__(self, cc: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, base: str = ''):
        """`cc`: the run's `checkpoint` section (enabled, fast_dir, fast_every_steps, fast_keep, restore_step);
        `base`: LoRA's base fingerprint (lora_base.py; a step saved over another base is not restored here, so
        the persistent tier's restore refuses it with one line), '' without LoRA."""
        self.enabled = bool(cc.enabled and cc.fast_dir)
        self.every, self.keep, self.restore_step = cc.fast_every_steps, cc.fast_keep, cc.restore_step
        self.restored_meta: dict[str, Any] | None = None
        self.last_blocking_s: float | None = None  # the last save's wait: the device-to-host copy
        self._pending: concurrent.futures.Future | None = None
        if not self.enabled:
            return
        if '$' in cc.fast_dir:  # main expands it (config.resolve_fast_dir); a direct caller must too
            raise ConfigError('checkpoint.fast_dir', cc.fast_dir, 'holds an unexpanded $VARIABLE',
                              'expand it with config.resolve_fast_dir(config, os.environ) first')
        self.process, self.count = jax.process_index(), jax.process_count()
        self.root = fast_files.process_root(os.path.abspath(cc.fast_dir), self.process)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise UserError(f'checkpoint.fast_dir: {self.root} cannot be created ({e.strerror or e}). Fix: name a '
                            "node-local directory you can write (e.g. '$JF_NODE_LOCAL/fast'), or '' for no fast "
                            'tier.') from None
        hosts = peer.host_ids()
        self.offset = peer.peer_offset(hosts)
        self.local = peer.local_order()
        self.order = peer.device_order()
        self.head = {'process_count': self.count, 'device_count': len(self.order),
                     'local_device_count': len(self.local), 'mesh': {k: int(v) for k, v in mesh.shape.items()},
                     **({'lora_base': base} if base else {})}
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='fast_tier')
        warning = peer.offset_warning(hosts, self.offset)
        if warning:
            _log(warning)
        where = f'process p + {self.offset}' if self.offset else 'none (one process)'
        _log(f'fast tier: every {self.every} steps to {cc.fast_dir}/process_<p>, newest {self.keep} kept; '
             f'peer copies on {where}')

    # ------------------------------------------------------------------ save

    def due(self, step: int) -> bool:
        return bool(self.enabled and self.every and step % self.every == 0)

    def _source(self) -> int:
        """The process whose shards this process holds as the peer copy."""
        return (self.process - self.offset) % self.count

    def _positions(self, sharding, shape, process: int) -> list[tuple[tuple[int, int], ...]]:
        """The global index of each local device position of `process` (the ring's order)."""
        indices = sharding.devices_indices_map(tuple(shape))
        n = len(self.local)
        return [_index(indices[d], tuple(shape)) for d in self.order[process * n:(process + 1) * n]]

    @staticmethod
    def _grouped(positions, blocks) -> list[tuple[Any, list[int], Any]]:
        """(index, positions holding it, the first such block) per distinct index: a replica written once."""
        seen: dict[Any, tuple[Any, list[int], Any]] = {}
        for j, (index, block) in enumerate(zip(positions, blocks)):
            seen.setdefault(index, (index, [], block))[1].append(j)
        return list(seen.values())

    def save(self, step: int, state: State, metrics: dict[str, jax.Array] | None = None,
             data_skips: list[dict[str, Any]] | None = None, force: bool = False,
             health: dict[str, Any] | None = None) -> bool:
        """Starts the fast save of `state` as `step` if due (or `force`); returns whether it did.

        Returns once this process's shards are on the host and the peer exchange is dispatched, so
        `state` may be donated right after; the disk writes continue on a background thread (the
        previous save's writes are waited for first, and their error, if any, raised here). With
        `metrics`, a step whose loss, gradient or parameter norm is not finite is not saved; with
        `health` (the persistent tier's verdict, checkpoint/verdict.py), neither is an unhealthy one.
        """
        if not (self.enabled and (force or self.due(step))):
            return False
        state = format_lib.persistent(state)  # LoRA's frozen base is not saved (training/state.py)
        if health is None and metrics is not None:
            health = integrity.health(metrics)
        if health is not None and (health['finite'] is False or health.get('healthy') is False):
            _log(f'fast tier: step {step} not saved: its state is {health.get("reason") or "not finite"} ({health})')
            return False
        self.wait()
        t0 = time.perf_counter()
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        names = [format_lib.path_name(path) for path, _ in flat]
        blocks = []
        for _, x in flat:
            by_device = {s.device: s.data for s in x.addressable_shards}
            blocks.append([by_device[d] for d in self.local])
        received = peer.shift(blocks, self.offset * len(self.local)) if self.offset else []
        own = []
        for (_, x), name, leaf in zip(flat, names, blocks):
            groups = self._grouped(self._positions(x.sharding, x.shape, self.process), leaf)
            for _, _, block in groups:
                block.copy_to_host_async()
            own.append((name, tuple(x.shape), str(x.dtype), groups))
        for leaf in received:
            for block in leaf:
                block.copy_to_host_async()
        own = [(name, shape, dtype, [(i, p, _host_copy(b)) for i, p, b in groups])
               for name, shape, dtype, groups in own]
        source = self._source()
        held = [(name, tuple(x.shape), str(x.dtype), self._grouped(self._positions(x.sharding, x.shape, source), leaf))
                for (_, x), name, leaf in zip(flat, names, received)]
        self.last_blocking_s = time.perf_counter() - t0
        head = {**self.head, 'step': int(step), 'holder': self.process,
                'data': {'next_step': int(step), **({'skips': data_skips} if data_skips else {})}}
        self._pending = self._writer.submit(self._write, int(step), head, own, held)
        return True

    def _write(self, step: int, head: dict[str, Any], own, held) -> None:
        t0 = time.perf_counter()
        # The peer's shards first off the devices, replaced in the list itself (the work item holds it too),
        # so the device memory they take is free before the disk writes start.
        for k, (name, shape, dtype, groups) in enumerate(held):
            held[k] = (name, shape, dtype, [(i, p, np.asarray(b).reshape([hi - lo for lo, hi in i]))
                                            for i, p, b in groups])  # a scalar's block arrives as [1]
        written = fast_files.write_part(fast_files.part_dir(self.root, step, 'own'), {**head, 'source': self.process},
                                        own)
        if held:
            written += fast_files.write_part(fast_files.part_dir(self.root, step, 'peer'),
                                             {**head, 'source': self._source()}, held)
        fast_files.prune(self.root, self.keep)
        seconds = time.perf_counter() - t0
        gib = written / 2**30
        _log(f'fast tier: step {step} committed on process {self.process}, {gib:.3f} GiB in {seconds:.2f} s '
             f'({gib / max(seconds, 1e-9):.2f} GiB/s) after a {self.last_blocking_s:.3f} s wait')

    def wait(self) -> None:
        """Blocks until the started save is on disk; raises its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Waits for the started save and stops the writer (idempotent)."""
        if self.enabled:
            try:
                self.wait()
            finally:
                self._writer.shutdown(wait=True)

    def discard_after(self, step: int) -> None:
        """Deletes this process's fast steps newer than `step` (a run resumed or rolled back to `step`:
        they belong to a timeline that no longer continues)."""
        if not self.enabled:
            return
        self.wait()
        for s in fast_files.steps(self.root):
            if s > step:
                shutil.rmtree(os.path.join(self.root, str(s)), ignore_errors=True)

    # ------------------------------------------------------------------ restore

    def _listing(self, part: str, expected_source: int) -> tuple[dict[int, dict[str, Any]], bool]:
        """({step: manifest} of this process's committed `part`s on this job's layout, whether any other)."""
        found, other = {}, False
        for s in fast_files.steps(self.root)[::-1][:_KEEP_LISTED]:
            manifest = fast_files.read_manifest(fast_files.part_dir(self.root, s, part))
            if manifest is None:
                continue
            if any(manifest.get(k) != v for k, v in self.head.items()) or manifest.get('source') != expected_source:
                other = True
                continue
            found[s] = manifest
        return found, other

    def _check_target(self, manifest: dict[str, Any], target: State, process: int) -> None:
        """Raises CheckpointError unless the saved leaves are the target's, shard for shard."""
        flat = jax.tree_util.tree_flatten_with_path(target)[0]
        leaves = {leaf['name']: leaf for leaf in manifest['leaves']}
        if [format_lib.path_name(p) for p, _ in flat] != [leaf['name'] for leaf in manifest['leaves']]:
            raise CheckpointError('its arrays are not those of this run\'s state')
        for path, x in flat:
            leaf = leaves[format_lib.path_name(path)]
            if tuple(leaf['shape']) != tuple(x.shape) or leaf['dtype'] != str(x.dtype):
                raise CheckpointError(f'{leaf["name"]} is {leaf["dtype"]}{leaf["shape"]}, this run\'s '
                                      f'{x.dtype}{list(x.shape)}')
            saved = {j: tuple(tuple(r) for r in shard['index']) for shard in leaf['shards'] for j in shard['positions']}
            if saved != dict(enumerate(self._positions(x.sharding, x.shape, process))):
                raise CheckpointError(f'{leaf["name"]} was sharded otherwise')

    def _load(self, step: int, part: str, manifest: dict[str, Any] | None, target: State, process: int):
        """(the part's {name: {position: array}}, '') verified, or (None, why not)."""
        if manifest is None:
            return None, 'missing'
        directory = fast_files.part_dir(self.root, step, part)
        try:
            self._check_target(manifest, target, process)
            shards = fast_files.load_part(directory, manifest, jnp.dtype)
        except Exception as e:  # noqa: BLE001 -- any damage: the others must still hear this process's answer
            return None, f'{directory}: {e}'
        return {name: {j: a for _, positions, a in groups for j in positions} for name, groups in shards.items()}, ''

    def restore(self, target: State, persistent_step: int | None,
                unhealthy: dict[int, str] | None = None) -> tuple[State, str] | None:
        """The newest complete fast step newer than `persistent_step` and not in `unhealthy` (the
        ledger's steps, checkpoint/verdict.py), on `target`'s shardings, or None.

        Collective: every process calls it at the same point. Returns (state, the origin line).
        """
        if not self.enabled or self.restore_step >= 0:
            return None
        target = format_lib.persistent(target)  # LoRA: the adapters' state; the caller reads the base
        own, own_other = self._listing('own', self.process)
        held, held_other = self._listing('peer', self._source())
        row = np.full(2 * _KEEP_LISTED + 1, -1, np.int32)
        row[0] = int(own_other or held_other)
        row[1:1 + len(own)] = sorted(own, reverse=True)
        row[1 + _KEEP_LISTED:1 + _KEEP_LISTED + len(held)] = sorted(held, reverse=True)
        table = _allgather(row)
        if table[:, 0].any():
            _log(f'fast tier: steps saved on another mesh, process count or device count than this run\'s '
                 f'{self.head} are ignored (the persistent tier restores onto any mesh)')
        owns = [set(r[1:1 + _KEEP_LISTED].tolist()) - {-1} for r in table]
        helds = [set(r[1 + _KEEP_LISTED:].tolist()) - {-1} for r in table]
        holder = [(p + self.offset) % self.count for p in range(self.count)]
        for step, lacking in candidates(owns, helds, self.offset, persistent_step):
            if unhealthy and step in unhealthy:
                _log(f'fast tier: step {step} skipped: unhealthy ({unhealthy[step]})')
                continue
            if lacking:
                _log(f'fast tier: step {step} skipped: incomplete (no copy of the shards of processes {lacking[:8]})')
                continue
            state = self._restore_step(step, own.get(step), held.get(step), target, holder)
            if state is not None:
                return state
        return None

    def _restore_step(self, step: int, own_manifest, held_manifest, target: State, holder: list[int]):
        mine, why_own = self._load(step, 'own', own_manifest, target, self.process)
        kept, why_held = self._load(step, 'peer', held_manifest, target, self._source())
        ok = _allgather(np.array([mine is not None, kept is not None], np.int32))
        lost = [p for p in range(self.count) if not ok[p, 0]]
        unrecoverable = [p for p in lost if not ok[holder[p], 1]]
        if unrecoverable:
            why = why_own if self.process in unrecoverable else why_held
            _log(f'fast tier: step {step} skipped: incomplete or corrupt (processes {unrecoverable[:8]} have no '
                 f'verified copy{"; " + why if why and why != "missing" else ""})')
            return None
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        names = [format_lib.path_name(p) for p, _ in flat]
        if lost:  # every process takes part: the holders send back what they hold, the others zeros
            blocks = []
            for name, (_, x) in zip(names, flat):
                shape = x.sharding.shard_shape(x.shape)
                held = kept[name] if kept is not None else {}
                blocks.append([jax.device_put(held.get(j, np.zeros(shape, x.dtype)), d)
                               for j, d in enumerate(self.local)])
            returned = peer.shift(blocks, -self.offset * len(self.local))
        leaves = []
        for i, (name, (_, x)) in enumerate(zip(names, flat)):
            if mine is not None:
                arrays = [jax.device_put(mine[name][j], d) for j, d in enumerate(self.local)]
            elif x.ndim == 0:  # a scalar's block arrives as [1] (peer.shift)
                arrays = [jax.device_put(np.asarray(a).reshape(()), d) for a, d in zip(returned[i], self.local)]
            else:
                arrays = returned[i]
            leaves.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays))
        state = jax.tree_util.tree_unflatten(treedef, leaves)
        manifest = own_manifest or held_manifest  # the data position (and spike skips) of the step
        self.restored_meta = {'data': manifest['data']} if manifest else {}
        source = (f'own copies; processes {lost[:8]} from their peer\'s copy' if lost else 'own copies')
        return state, f'restored step {step} from the fast tier {os.path.dirname(self.root)} ({source})'
