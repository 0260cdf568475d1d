"""Device mesh, logical-axis rules and sharding helpers.

The mesh has the axes of config/axes.py's table (pipeline, data, fsdp, context, tensor), outermost
to innermost. Devices are ordered by (process, local id) and laid out row-major, so the innermost
axis (tensor) lands on neighbouring devices: on Frontier, a tensor group of 2 is the two GCDs of one MI250X and
a group of 8 is one node; the context ring comes next (its key/value passes go between close
devices); pipeline stages go across nodes.

Parameters and activations carry logical axis names; `config.sharding.rules` maps each name
to mesh axes. The model calls `constrain(x, names)`, which is a no-op outside `use_rules`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar('rules', default=None)


def device_order(devices: Sequence[jax.Device]) -> list[jax.Device]:
    """Devices sorted so that neighbours in the list are neighbours in the machine.

    JAX numbers GPUs within a process by their local id, and `--gpu-bind=closest` gives
    process i of a node the GCD(s) closest to it, so (process_index, id) puts GCDs of one
    MI250X, then of one node, next to each other.
    """
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh with axes `config_lib.MESH_AXES` (those `shape` leaves out have size 1; an axis `dropped_at_1`
    of size 1 is left out: config/axes.py), all of type Auto, innermost axis on neighbours."""
    devices = device_order(jax.devices() if devices is None else devices)
    names = config_lib.axes.in_mesh(shape)  # an axis dropped at size 1 (expert) only where it is larger
    sizes = tuple(int(shape.get(a, 1)) for a in names)
    n = int(np.prod(sizes))
    if n != len(devices):
        raise ValueError(f'mesh {dict(shape)} needs {n} devices, got {len(devices)}')
    grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(sizes))


def mesh_from_config(c) -> Mesh:
    return make_mesh(config_lib.mesh_shape(c))


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec) -> set[str]:
    """Every mesh axis a PartitionSpec uses."""
    return {a for entry in spec for a in entry_axes(entry)}


def logical_to_spec(names: Sequence[str | None] | None, rules: Rules) -> P:
    """PartitionSpec for a tensor whose dimensions have these logical names.

    A mesh axis is used at most once per tensor: a later dimension whose rule names an axis
    already taken stays unsharded on that axis.
    """
    if names is None:
        return P()
    table = dict(rules)
    used: set[str] = set()
    out = []
    for name in names:
        target = table.get(name) if name is not None else None
        axes = tuple(a for a in entry_axes(target) if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def tree_shardings(logical_specs, mesh: Mesh, rules: Rules):
    """Maps a pytree of logical PartitionSpecs (from nnx.get_partition_spec) to NamedShardings."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec), rules)), logical_specs,
                        is_leaf=lambda x: isinstance(x, P))


def batch_spec(rules: Rules, ndim: int = 2) -> P:
    """Spec of a batch whose leading dimension holds sequences."""
    return logical_to_spec(('batch',) + (None,) * (ndim - 1), rules)


def data_parallel_axes(rules: Rules) -> tuple[str, ...]:
    return entry_axes(logical_to_spec(('batch',), rules)[0])


def without_axis(rules: Rules, axis: str) -> Rules:
    """The rules with mesh `axis` removed everywhere: for code inside a shard_map manual over it."""
    out = []
    for name, target in rules:
        axes = tuple(a for a in entry_axes(target) if a != axis)
        out.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)


@contextlib.contextmanager
def use_rules(rules: Rules) -> Iterator[None]:
    """Activates logical rules for `constrain` while tracing (with a mesh set by jax.set_mesh)."""
    token = _ACTIVE_RULES.set(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def active_rules() -> Rules | None:
    """The rules `use_rules` activated (None outside it)."""
    return _ACTIVE_RULES.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op without active rules and mesh."""
    rules = _ACTIVE_RULES.get()
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def active_axes(name: str) -> tuple[str, ...] | None:
    """Mesh axes (of size > 1) that logical `name` maps to under the active rules and mesh.

    None when no rules or mesh are active (e.g. a model applied outside the trainer).
    """
    rules = _ACTIVE_RULES.get()
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return None
    entry = logical_to_spec((name,), rules)[0]
    return tuple(a for a in entry_axes(entry) if mesh.shape.get(a, 1) > 1)
