"""`--mode=verify`: prove a config's layout computes what one device computes, before a large run.

The config is shrunk (`shrink.py`: every parallel and numeric choice kept, the size made
small), run for a few steps on simulated CPU devices with its own mesh, and compared with
the same small model on one device on the same batches: the first step's loss and
gradients, and each parameter's change over the steps (the updates: comparing the
parameters themselves would hide a wrong update behind the much larger initial values).

Differences are relative, per tensor: |a - b| / |b| in the Frobenius norm, with |b| floored
at `FLOOR` times the root-mean-square tensor norm, so a tensor whose true gradient vanishes
(the key bias: softmax does not depend on it) is judged against the model's scale, not
against rounding noise. A layout is right when the worst tensor of each quantity is within
its dtype's tolerance; a wrong shard, a missing or doubled reduction or a mis-ordered
micro-batch is off by tens of percent (tests/plan/test_verify.py injects one).

Past 256 simulated devices the check runs in several processes (plan/fanout.py): each runs the
layout on the global mesh and the reference on a device of its own, compares the shards it
holds, and the squared differences are summed over the processes; no array is gathered.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import attention
from jaxfrontier.plan import shrink as shrink_lib
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib

FLOOR = 1e-2
# Worst relative difference allowed per quantity, by compute dtype. fp32 allows reduction-order
# rounding (observed ~1e-6); 16-bit compute rounds every matmul output to 8 (bf16) or 11 (fp16)
# bits, and the sums run in another order on another layout.
TOLERANCES = {
    'float32': {'loss': 1e-5, 'grads': 1e-4, 'updates': 1e-3},
    'bfloat16': {'loss': 2e-2, 'grads': 1e-1, 'updates': 1e-1},
    'float16': {'loss': 5e-3, 'grads': 3e-2, 'updates': 5e-2},
}


@dataclasses.dataclass(frozen=True)
class Quantity:
    """One compared quantity: its worst relative difference, where, and the tolerance."""

    worst: float
    where: str
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(np.isfinite(self.worst)) and self.worst <= self.tolerance


def _batches(c: ml_collections.ConfigDict, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(c.seed)  # the same in every process of a multi-process check
    return [rng.integers(0, c.model.vocab_size, (c.train.global_batch, c.model.seq_len + 1), dtype=np.int32)
            for _ in range(n)]


@dataclasses.dataclass(frozen=True)
class Local:
    """This process's part of one global array: its shape and the shards it holds that no other
    process or device also counts (replica 0), by index. In one process on one device: the whole array.
    """

    shape: tuple[int, ...]
    shards: tuple[tuple[tuple[slice, ...], np.ndarray], ...]


def _local(tree) -> Any:
    """Each leaf's `Local` part, as float64 NumPy: a layout's arrays need not be addressable here."""
    def part(a: jax.Array) -> Local:
        return Local(tuple(a.shape), tuple((s.index, np.asarray(s.data, np.float64))
                                           for s in a.addressable_shards if s.replica_id == 0))
    return jax.tree.map(part, tree)


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def run(c: ml_collections.ConfigDict, devices) -> tuple[float, Any, Any]:
    """(first step's loss, its gradients, each parameter's change after `train.steps` steps) of `c` on `devices`.

    Gradients and updates come back in the layout's order (interleaved blocks [V, L / V, ...]) as a
    tree of `Local` parts: with several processes no process can gather the arrays, and the
    comparison needs only each process's own shards (`compare_trees`).
    """
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), devices)
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    initial = jax.tree.map(lambda p: {_key(i): x for i, x in p.shards}, _local(state['params']),
                           is_leaf=lambda x: isinstance(x, Local))
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    batches = [jax.make_array_from_callback(b.shape, sharding, b.__getitem__) for b in _batches(c, c.train.steps)]
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, grads = jax.jit(step_lib.make_loss_and_grads(c, layout))(state['params'], batches[0], 0)
        loss, grads = float(loss.addressable_data(0)), _local(grads)  # the loss is replicated
        train_step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
        for batch in batches:
            state, _ = train_step(state, batch)
    updates = jax.tree.map(lambda p, start: Local(p.shape, tuple((i, x - start[_key(i)]) for i, x in p.shards)),
                           _local(state['params']), initial, is_leaf=lambda x: isinstance(x, Local))
    return loss, grads, updates


def _whole(tree) -> Any:
    """The full arrays of a one-device run's `Local` tree."""
    def whole(p: Local) -> np.ndarray:
        (index, x), = p.shards
        assert x.shape == p.shape, index  # one device holds everything
        return x
    return jax.tree.map(whole, tree, is_leaf=lambda x: isinstance(x, Local))


def _whole_part(a) -> Local:
    """A full array (a test's own, gathered to one host) as a `Local` part."""
    a = np.asarray(a, np.float64)
    return Local(a.shape, (((slice(None),) * a.ndim, a),))


def _sum_over_processes(x: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return x
    return np.sum(multihost_utils.process_allgather(x), axis=0, dtype=np.float64)


def compare_trees(actual, expected, tolerance: float) -> Quantity:
    """The worst per-tensor relative difference (see the module docstring) of a layout's `Local` tree
    (or full arrays) and the one-device run's full arrays (model order: interleaved blocks are a
    reshape of them).

    Each process sums |a - e|^2 over its own shards; the sums are added over the processes, so
    every process reaches the same verdict without gathering a layout's arrays.
    """
    leaves = jax.tree_util.tree_leaves_with_path(actual, is_leaf=lambda x: isinstance(x, Local))
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    parts = [p if isinstance(p, Local) else _whole_part(p) for _, p in leaves]
    wanted = [np.asarray(e, np.float64) for e in jax.tree.leaves(expected)]
    merged = [p.shape if len(p.shape) == e.ndim else (p.shape[0] * p.shape[1], *p.shape[2:]) if p.shape else ()
              for p, e in zip(parts, wanted)]
    for name, shape, e in zip(names, merged, wanted):
        if tuple(shape) != e.shape:
            return Quantity(float('inf'), f'{_short(name)}: shape {tuple(shape)} vs {e.shape}', tolerance)
    wanted = [e.reshape(p.shape) for p, e in zip(parts, wanted)]
    squares = _sum_over_processes(np.array([sum(float(np.sum((x - e[i]) ** 2)) for i, x in p.shards)
                                            for p, e in zip(parts, wanted)], np.float64))
    norms = [float(np.linalg.norm(e)) for e in wanted]
    rms = np.sqrt(np.mean(np.square(norms))) or 1.0
    worst, where = 0.0, ''
    for name, square, norm in zip(names, squares, norms):
        diff = np.sqrt(square) / max(norm, FLOOR * rms)
        if not np.isfinite(diff) or diff > worst:
            worst, where = float(diff), name
            if not np.isfinite(diff):
                break
    return Quantity(worst, _short(where), tolerance)


def _short(name: str) -> str:
    return name.lstrip("['").replace("']['", '/').rstrip("']")


def certificate(name: str, shrunk: shrink_lib.Shrunk) -> dict[str, Any]:
    """Runs the shrunk config (`shrink.shrink`) and its one-device reference; returns the certificate."""
    c = shrunk.config
    devices = jax.devices()
    if len(devices) < shrunk.num_devices:
        raise ConfigError('mesh', config_lib.mesh_shape(c), f'the check needs {shrunk.num_devices} '
                                     f'devices but {len(devices)} are present',
                                     'run it through python -m jaxfrontier.main --mode=verify, which sets them')
    loss, grads, updates = run(c, devices[:shrunk.num_devices])
    # In every process, on a device of its own: deterministic, so each holds the same reference.
    ref_loss, ref_grads, ref_updates = run(shrink_lib.reference_config(c), jax.local_devices()[:1])
    ref_grads, ref_updates = _whole(ref_grads), _whole(ref_updates)  # one chunk per stage: model order
    tol = TOLERANCES[c.model.dtype]
    loss_diff = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    quantities = {'loss': Quantity(loss_diff if np.isfinite(loss) else float('inf'), 'step 0', tol['loss']),
                  'grads': compare_trees(grads, ref_grads, tol['grads']),
                  'updates': compare_trees(updates, ref_updates, tol['updates'])}
    return {
        'config': name,
        'passed': all(q.passed for q in quantities.values()),
        'devices': shrunk.num_devices,
        'processes': jax.process_count(),
        'platform': devices[0].platform,
        'attention': attention.resolve_impl(c.model.attention, c.model.dtype, devices[0].platform),
        'kept': shrunk.kept,
        'shrunk': {k: list(v) for k, v in shrunk.shrunk.items()},
        'steps': c.train.steps,
        'loss': {'layout': loss, 'one_device': ref_loss},
        'quantities': {k: {'worst_relative_difference': q.worst, 'where': q.where, 'tolerance': q.tolerance,
                           'passed': q.passed} for k, q in quantities.items()},
        'method': 'relative Frobenius difference per tensor, floored at 1e-2 x the rms tensor norm (plan/verify.py)',
    }


def summary(cert: dict[str, Any]) -> str:
    """The certificate's one line: verdict, layout, what shrank, the worst difference per quantity."""
    mesh = ' x '.join(f'{k} {v}' for k, v in cert['kept']['mesh'].items() if v > 1) or 'one device'
    shrunk = ', '.join(f'{k.split(".")[1]} {a} -> {b}' for k, (a, b) in cert['shrunk'].items()
                       if k.split('.')[0] in ('mesh', 'model', 'train') and k != 'mesh.cpu_devices')
    parts = [f'{k} {q["worst_relative_difference"]:.1e}{"" if q["passed"] else " FAIL"} (tol {q["tolerance"]:g}'
             + (f', {q["where"]})' if k != 'loss' else ')') for k, q in cert['quantities'].items()]
    verdict = 'PASS' if cert['passed'] else 'FAIL'
    processes = f' in {cert["processes"]} processes' if cert.get('processes', 1) > 1 else ''
    return (f'verify: {verdict} {cert["config"]}: {mesh} ({cert["devices"]} {cert["platform"]} devices{processes}, '
            f'{cert["kept"]["pipeline.schedule"] if cert["kept"]["mesh.pipeline"] > 1 else "no pipeline"}, '
            f'remat {cert["kept"]["model.remat"]}, {cert["attention"]} attention, {cert["kept"]["model.dtype"]}'
            f'{", ZeRO-1" if cert["kept"]["sharding.zero1"] else ""}) vs one device over {cert["steps"]} steps: '
            + '; '.join(parts) + f'. Shrunk: {shrunk or "nothing"}.')


def report(name: str, shrunk: shrink_lib.Shrunk) -> tuple[str, bool]:
    """(the certificate as JSON, then its line; passed) for `--mode=verify`."""
    cert = certificate(name, shrunk)
    return json.dumps(cert, indent=1, default=str) + '\n' + summary(cert), cert['passed']
