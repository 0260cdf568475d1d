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
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import attention
from jaxfrontier.model import params as params_lib
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
    rng = np.random.default_rng(c.seed)
    return [rng.integers(0, c.model.vocab_size, (c.train.global_batch, c.model.seq_len + 1), dtype=np.int32)
            for _ in range(n)]


def run(c: ml_collections.ConfigDict, devices) -> tuple[float, Any, Any]:
    """(first step's loss, its gradients, each parameter's change after `train.steps` steps) of `c` on `devices`.

    Gradients and updates come back in model order ([L, ...] blocks) as NumPy.
    """
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), devices)
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    initial = params_lib.merge_virtual(jax.device_get(state['params']))
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    batches = [jax.device_put(b, sharding) for b in _batches(c, c.train.steps)]
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, grads = jax.device_get(jax.jit(step_lib.make_loss_and_grads(c, layout))(state['params'], batches[0], 0))
        train_step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
        for batch in batches:
            state, _ = train_step(state, batch)
    final = params_lib.merge_virtual(jax.device_get(state['params']))
    updates = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), final, initial)
    return float(loss), params_lib.merge_virtual(grads), updates


def compare_trees(actual, expected, tolerance: float) -> Quantity:
    """The worst per-tensor relative difference of two trees (see the module docstring)."""
    pairs = [(jax.tree_util.keystr(path), np.asarray(a, np.float64), np.asarray(e, np.float64))
             for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected))]
    rms = np.sqrt(np.mean([np.sum(e ** 2) for _, _, e in pairs])) or 1.0
    worst, where = 0.0, ''
    for name, a, e in pairs:
        if a.shape != e.shape:
            return Quantity(float('inf'), f'{name}: shape {a.shape} vs {e.shape}', tolerance)
        diff = np.linalg.norm(a - e) / max(np.linalg.norm(e), FLOOR * rms)
        if not np.isfinite(diff) or diff > worst:
            worst, where = float(diff), name
            if not np.isfinite(diff):
                break
    return Quantity(worst, where.lstrip("['").replace("']['", '/').rstrip("']"), tolerance)


def certificate(name: str, shrunk: shrink_lib.Shrunk) -> dict[str, Any]:
    """Runs the shrunk config (`shrink.shrink`) and its one-device reference; returns the certificate."""
    c = shrunk.config
    devices = jax.devices()
    if len(devices) < shrunk.num_devices:
        raise ConfigError('mesh', config_lib.mesh_shape(c), f'the check needs {shrunk.num_devices} '
                                     f'devices but {len(devices)} are present',
                                     'run it through python -m jaxfrontier.main --mode=verify, which sets them')
    loss, grads, updates = run(c, devices[:shrunk.num_devices])
    ref_loss, ref_grads, ref_updates = run(shrink_lib.reference_config(c), devices[:1])
    tol = TOLERANCES[c.model.dtype]
    loss_diff = abs(loss - ref_loss) / max(abs(ref_loss), 1e-12)
    quantities = {'loss': Quantity(loss_diff if np.isfinite(loss) else float('inf'), 'step 0', tol['loss']),
                  'grads': compare_trees(grads, ref_grads, tol['grads']),
                  'updates': compare_trees(updates, ref_updates, tol['updates'])}
    return {
        'config': name,
        'passed': all(q.passed for q in quantities.values()),
        'devices': shrunk.num_devices,
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
    return (f'verify: {verdict} {cert["config"]}: {mesh} ({cert["devices"]} {cert["platform"]} devices, '
            f'{cert["kept"]["pipeline.schedule"] if cert["kept"]["mesh.pipeline"] > 1 else "no pipeline"}, '
            f'remat {cert["kept"]["model.remat"]}, {cert["attention"]} attention, {cert["kept"]["model.dtype"]}'
            f'{", ZeRO-1" if cert["kept"]["sharding.zero1"] else ""}) vs one device over {cert["steps"]} steps: '
            + '; '.join(parts) + f'. Shrunk: {shrunk or "nothing"}.')


def report(name: str, shrunk: shrink_lib.Shrunk) -> tuple[str, bool]:
    """(the certificate as JSON, then its line; passed) for `--mode=verify`."""
    cert = certificate(name, shrunk)
    return json.dumps(cert, indent=1, default=str) + '\n' + summary(cert), cert['passed']
