"""Train state, optimizer and their placement on the mesh.

The train state is a plain pytree, `{'step', 'params', 'opt_state'}`, with `params` a nested
dict of fp32 arrays (the model's `nnx.State` as a pure dict) — easy to checkpoint, export and
reshard. It is built abstractly with `jax.eval_shape`, its shardings come from the logical
axis names of the parameters, and one jitted init materialises it already sharded.

Placement:
  FSDP (ZeRO-3)  the rules shard every weight's `embed` dimension over `fsdp`; gradients and
                 optimizer state follow the parameters.
  ZeRO-1         `config.sharding.zero1`: optimizer moments are additionally sharded over the
                 data-parallel axes; parameters keep their own (e.g. replicated) layout. The
                 gradients are constrained to the moments' layout before the update, so the
                 data-parallel reduction becomes a reduce-scatter and the update an all-gather.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.gpt import GPT

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The model's structure without values: binds a params dict back into a GPT module."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State

    @classmethod
    def create(cls, shape: config_lib.ModelShape) -> 'ModelDef':
        graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(shape, rngs=nnx.Rngs(0))))
        return cls(graphdef, state)

    def bind(self, params: Params) -> GPT:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def logical_specs(self) -> Params:
        return nnx.to_pure_dict(nnx.get_partition_spec(self.abstract_state))

    def abstract_params(self) -> Params:
        return nnx.to_pure_dict(self.abstract_state)


def init_params(shape: config_lib.ModelShape, key: jax.Array) -> Params:
    return nnx.to_pure_dict(nnx.state(GPT(shape, rngs=nnx.Rngs(params=key))))


def learning_rate_schedule(c: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warm-up from 0 to optim.lr, then cosine decay to optim.min_lr."""
    o = c.optim
    decay_steps = o.decay_steps or c.train.steps
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(decay_steps, o.warmup_steps + 1), end_value=o.min_lr)


def _decay_mask(params: Params) -> Params:
    """Weight decay on weight matrices and embeddings (names 'w*' / 'head'); not on biases/norms."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(path[-1].key).startswith(('w', 'head')), params)


def make_optimizer(c: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then AdamW with the warm-up + cosine schedule."""
    o = c.optim
    schedule = learning_rate_schedule(c)
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask),
    )
    return tx, schedule


def zero1_layout(spec: P, shape: tuple[int, ...], mesh: Mesh,
                 dp_axes: tuple[str, ...]) -> tuple[P, tuple[int, ...]]:
    """ZeRO-1: the spec (and shape) of a parameter's optimizer state, sharded over the data axes.

    Adds the data-parallel axes the parameter's spec does not use yet to its first dimension
    they divide. Where none does (the paper's 1T layout: data 6 and no weight dimension
    divisible by 6), the optimizer state is padded with zeros along the dimension that needs
    the least padding, as Megatron's distributed optimizer pads its flat buffer: JAX shards
    only evenly. Returns (spec, padded shape); the shape is `shape` when no padding is needed.
    """
    used = mesh_lib.spec_axes(spec)
    extra = tuple(a for a in dp_axes if a not in used and mesh.shape[a] > 1)
    if not extra:
        return spec, tuple(shape)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    extra_size = 1
    for a in extra:
        extra_size *= mesh.shape[a]
    options = []  # (cost, dimension)
    for i, entry in enumerate(entries):
        current_size = math.prod(mesh.shape[a] for a in mesh_lib.entry_axes(entry))
        multiple = current_size * extra_size
        if shape[i] % multiple == 0:
            options = [(0.0, i)]  # the first divisible dimension: no padding
            break
        # Padding relative to the dimension; padding a dimension that is already sharded moves
        # data between its shards (the padded shards straddle the old boundaries): 5 % penalty.
        options.append((-shape[i] % multiple / shape[i] + (0.05 if current_size > 1 else 0.0), i))
    _, i = min(options)
    pad = -shape[i] % math.prod(mesh.shape[a] for a in (*mesh_lib.entry_axes(entries[i]), *extra))
    current = mesh_lib.entry_axes(entries[i])
    entries[i] = current + extra if len(current + extra) > 1 else (current + extra)[0]
    padded = tuple(n + pad if d == i else n for d, n in enumerate(shape))
    return P(*entries), padded


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, dp_axes: tuple[str, ...]) -> P:
    """The optimizer-state spec of `zero1_layout` (over the padded shape where it pads)."""
    return zero1_layout(spec, shape, mesh, dp_axes)[0]


def _pad_to(x: jax.Array, shape: tuple[int, ...], sharding) -> jax.Array:
    if x.shape == shape:
        return x
    x = jnp.pad(x, [(0, t - n) for n, t in zip(x.shape, shape)])
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def padded_optimizer(tx: optax.GradientTransformation, padded_shapes: Params,
                     padded_shardings: Params | None) -> optax.GradientTransformation:
    """`tx` over zero-padded copies of parameters and gradients; updates cut back to size.

    Padding stays exactly zero in the Adam moments (zero gradients, zero parameters) and adds
    nothing to the global gradient norm, so the update equals the unpadded one.
    """
    def pad(tree):
        shardings = padded_shardings if padded_shardings is not None else jax.tree.map(lambda _: None, tree)
        return jax.tree.map(lambda x, s, sh: _pad_to(x, tuple(s), sh), tree, padded_shapes, shardings,
                            is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, int) for n in x))

    def init(params):
        return tx.init(pad(params))

    def update(grads, state, params=None):
        updates, state = tx.update(pad(grads), state, None if params is None else pad(params))
        return jax.tree.map(lambda u, g: u[tuple(slice(0, n) for n in g.shape)], updates, grads), state

    return optax.GradientTransformation(init, update)


def split_virtual(params: Params, virtual: int) -> Params:
    """Interleaved pipelines: block leaves [L, ...] -> [V, L / V, ...] (a reshape, same order).

    Layer l = (v P + p) Lc + j lands at [v, p Lc + j], so sharding the second axis over
    `pipeline` gives stage p exactly its chunks p, P + p, ... (round-robin) in model order.
    """
    if virtual == 1:
        return params

    def split(a):
        shape = (virtual, a.shape[0] // virtual, *a.shape[1:])
        return jax.ShapeDtypeStruct(shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a.reshape(shape)

    return {**params, 'blocks': jax.tree.map(split, params['blocks'])}


def merge_virtual(params: Params) -> Params:
    """Inverse of split_virtual: block leaves back to [L, ...] (model order)."""
    blocks = params['blocks']
    ln = blocks['ln1']['scale']
    if ln.ndim == 2:  # [L, d]: not split
        return params
    return {**params, 'blocks': jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), blocks)}


def split_virtual_specs(specs: Params, virtual: int) -> Params:
    if virtual == 1:
        return specs
    blocks = jax.tree.map(lambda s: P('virtual', *s), specs['blocks'], is_leaf=lambda x: isinstance(x, P))
    return {**specs, 'blocks': blocks}


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Everything needed to build, place and update the train state on one mesh."""

    model_def: ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: Mesh
    rules: mesh_lib.Rules
    param_shardings: Params
    update_shardings: Params  # where gradients meet the optimizer state (ZeRO-1: sharded)
    state_shardings: dict[str, Any]
    abstract_state: dict[str, Any]


def make_layout(c: ml_collections.ConfigDict, mesh: Mesh) -> StateLayout:
    """Builds the abstract train state and its shardings for `mesh` (no arrays allocated)."""
    rules = tuple(tuple(r) for r in c.sharding.rules)
    model_def = ModelDef.create(config_lib.model_shape(c))
    tx, schedule = make_optimizer(c)
    virtual = c.pipeline.virtual_stages if c.mesh.pipeline > 1 else 1
    abstract_params = split_virtual(model_def.abstract_params(), virtual)
    param_shardings = mesh_lib.tree_shardings(split_virtual_specs(model_def.logical_specs(), virtual), mesh, rules)
    if c.sharding.zero1:
        dp_axes = mesh_lib.data_parallel_axes(rules)
        zero1 = jax.tree.map(lambda s, a: zero1_layout(s.spec, a.shape, mesh, dp_axes), param_shardings,
                             abstract_params)
        is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], P)  # noqa: E731
        padded_shapes = jax.tree.map(lambda z: z[1], zero1, is_leaf=is_pair)
        opt_param_shardings = jax.tree.map(lambda z: NamedSharding(mesh, z[0]), zero1, is_leaf=is_pair)
        # Gradients of padded parameters meet the optimizer in their own layout (padded inside tx).
        update_shardings = jax.tree.map(
            lambda z, s, a: NamedSharding(mesh, z[0]) if z[1] == tuple(a.shape) else s,
            zero1, param_shardings, abstract_params, is_leaf=is_pair)
        opt_params = jax.tree.map(lambda a, shape: jax.ShapeDtypeStruct(shape, a.dtype), abstract_params,
                                  padded_shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    else:
        update_shardings = opt_param_shardings = param_shardings
        opt_params = abstract_params
    abstract_opt = jax.eval_shape(tx.init, opt_params)
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, opt_param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding))
    if opt_params is not abstract_params and jax.tree.leaves(opt_params) != jax.tree.leaves(abstract_params):
        tx = padded_optimizer(tx, padded_shapes, opt_param_shardings)
    abstract_state = {
        'step': jax.ShapeDtypeStruct((), jnp.int32),
        'params': abstract_params,
        'opt_state': abstract_opt,
    }
    state_shardings = {'step': replicated, 'params': param_shardings, 'opt_state': opt_shardings}
    return StateLayout(model_def, tx, schedule, mesh, rules, param_shardings, update_shardings,
                       state_shardings, abstract_state)


def init_train_state(c: ml_collections.ConfigDict, layout: StateLayout) -> dict[str, Any]:
    """Materialises the train state directly in its shardings with one jitted init."""
    shape = config_lib.model_shape(c)
    virtual = c.pipeline.virtual_stages if c.mesh.pipeline > 1 else 1

    def init(key):
        params = split_virtual(init_params(shape, key), virtual)
        return {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': layout.tx.init(params)}

    with jax.set_mesh(layout.mesh):
        return jax.jit(init, out_shardings=layout.state_shardings)(jax.random.key(c.seed))


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
