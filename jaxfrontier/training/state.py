"""Train state and its placement on the mesh (the optimizer itself: training/optimizer.py).

The train state is a plain pytree, `{'step', 'params', 'opt_state'}` (plus `'loss_scale'` for
float16, training/loss_scale.py, and `'spike'` with train.spike_skip, training/spikes.py), with `params` a nested
dict of fp32 arrays (the model's `nnx.State` as a pure dict) — easy to checkpoint, export and
reshard. It is built abstractly with `jax.eval_shape`, its shardings come from the logical
axis names of the parameters, and one jitted init materialises it already sharded.

Placement:
  FSDP (ZeRO-3)  the rules shard every weight's `embed` dimension over `fsdp`; gradients and
                 optimizer state follow the parameters (Adafactor's factors keep the specs of
                 the dimensions they keep: optimizer.state_shardings).
  ZeRO-1         `config.sharding.zero1`: optimizer moments are additionally sharded over the
                 data-parallel axes; parameters keep their own (e.g. replicated) layout. The
                 gradients are constrained to the moments' layout before the update, so the
                 data-parallel reduction becomes a reduce-scatter and the update an all-gather.

LoRA (`lora.rank` > 0; families/lora.py, model/lora.py): `params` holds the adapters alone, what the
step differentiates and the optimizer updates (its state exists for them only), and the frozen base
weights travel beside them as `state['frozen']` (checkpoint/format.py `FROZEN`): an input of the step
that it binds with the adapters and returns unchanged (donated and aliased: no copy), never
differentiated, so no gradient buffer exists for it. Checkpoints leave it out; it is read from
`checkpoint.init_params_from` at every start (checkpoint/restore.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import pipeline
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.checkpoint.format import FROZEN, persistent
from jaxfrontier.training import loss_scale
from jaxfrontier.training import spikes
from jaxfrontier.training import optimizer as optimizer_lib
from jaxfrontier.model.lora import join, split
from jaxfrontier.model.params import ModelDef, Params, init_params, split_virtual


def _pad_to(x: jax.Array, shape: tuple[int, ...], sharding) -> jax.Array:
    if x.shape == shape:
        return x
    x = jnp.pad(x, [(0, t - n) for n, t in zip(x.shape, shape)])
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def padded_optimizer(tx: optax.GradientTransformation, padded_shapes: Params,
                     padded_shardings: Params | None) -> optax.GradientTransformation:
    """`tx` over zero-padded copies of parameters and gradients; updates cut back to size.

    Padding stays exactly zero in the Adam and Lion moments (zero gradients, zero parameters; Lion's
    sign(0) = 0) and adds nothing to the global gradient norm, so the update equals the unpadded
    one. Not so Adafactor's (its means and RMS count the zeros): config.validate refuses it with ZeRO-1.
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


@dataclasses.dataclass(frozen=True)
class StatePlacement:
    """Everything needed to build, place and update the train state on one mesh."""

    layout: layout_lib.Layout  # the parallel layout, made once from the config (layout.py)
    shape: config_lib.ModelShape
    model_def: ModelDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    mesh: Mesh
    rules: mesh_lib.Rules
    param_shardings: Params  # of what is trained: every parameter, or LoRA's adapters
    update_shardings: Params  # where gradients meet the optimizer state (ZeRO-1: sharded)
    state_shardings: dict[str, Any]
    abstract_state: dict[str, Any]

    @property
    def lora(self) -> bool:
        """Whether the state trains LoRA adapters over a frozen base (`state['frozen']`)."""
        return FROZEN in self.state_shardings

    @property
    def model_shardings(self) -> Params:
        """The shardings of the model's whole params dict (the base joined with the adapters under LoRA)."""
        return join(self.state_shardings[FROZEN], self.param_shardings) if self.lora else self.param_shardings

    @functools.cached_property
    def pipeline_schedule(self) -> Any:
        """`pipeline.build_schedule`'s table for this layout, built once (None without a pipeline).

        Built on first use: a placement made only to save or read a state (inference, tests) needs
        no schedule, and its micro-batch count need not suit one.
        """
        return pipeline.build_schedule(self.layout) if self.layout.pipeline > 1 else None


def make_placement(c: ml_collections.ConfigDict, mesh: Mesh, layout: layout_lib.Layout | None = None) -> StatePlacement:
    """Builds the abstract train state and its shardings for `mesh` (no arrays allocated).

    `layout`: the run's parallel layout (`Layout.from_config(c)` when not given).
    """
    layout = layout or layout_lib.Layout.from_config(c)
    params = target_lib.param_placement(c, mesh)
    shape, model_def, rules, abstract_params, param_shardings = (
        params.shape, params.model_def, params.rules, params.abstract_params, params.param_shardings)
    frozen = None
    if shape.lora is not None:  # the optimizer sees the adapters alone; the base rides along frozen
        (abstract_params, frozen_abstract), (param_shardings, frozen_shardings) = (
            split(abstract_params), split(param_shardings))
        frozen = (frozen_abstract, frozen_shardings)
    tx, lr_schedule = optimizer_lib.make_optimizer(c)
    tx = optimizer_lib.outside_gradient(tx, abstract_params)
    if c.sharding.zero1:
        dp_axes = mesh_lib.data_parallel_axes(rules)
        zero1 = jax.tree.map(lambda s, a: layout_lib.zero1_layout(s.spec, a.shape, mesh, dp_axes), param_shardings,
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
    opt_shardings = optimizer_lib.state_shardings(abstract_opt, opt_params, opt_param_shardings, mesh,
                                                  c.optim.factor_min_dim)
    if opt_params is not abstract_params and jax.tree.leaves(opt_params) != jax.tree.leaves(abstract_params):
        tx = padded_optimizer(tx, padded_shapes, opt_param_shardings)
    abstract_state = {'step': jax.ShapeDtypeStruct((), jnp.int32), 'params': abstract_params, 'opt_state': abstract_opt}
    state_shardings = {'step': replicated, 'params': param_shardings, 'opt_state': opt_shardings}
    if loss_scale.enabled(c):  # float16: the dynamic loss scale travels with the state (and checkpoints)
        abstract_state['loss_scale'] = loss_scale.abstract_state()
        state_shardings['loss_scale'] = jax.tree.map(lambda _: replicated, abstract_state['loss_scale'])
    if spikes.enabled(c):  # the running loss / grad-norm estimate travels with the state (and checkpoints)
        abstract_state['spike'] = spikes.abstract_state()
        state_shardings['spike'] = jax.tree.map(lambda _: replicated, abstract_state['spike'])
    if frozen is not None:
        abstract_state[FROZEN], state_shardings[FROZEN] = frozen
    return StatePlacement(layout, shape, model_def, tx, lr_schedule, mesh, rules, param_shardings, update_shardings,
                          state_shardings, abstract_state)


def init_train_state(c: ml_collections.ConfigDict, layout: StatePlacement, frozen: bool = True) -> dict[str, Any]:
    """Materialises the train state directly in its shardings with one jitted init.

    Under LoRA the adapters start as PEFT's do (b = 0: the model is its base); `frozen`: with a randomly
    initialised base too (tests, benchmarks), else without it (a run reads its base, checkpoint/restore.py).
    """
    with_base = layout.lora and frozen
    shardings = layout.state_shardings if with_base or not layout.lora else persistent(layout.state_shardings)

    def init(key):
        params = split_virtual(init_params(layout.shape, key), layout.layout.virtual)
        base = None
        if layout.lora:
            params, base = split(params)
        state = {'step': jnp.zeros((), jnp.int32), 'params': params, 'opt_state': layout.tx.init(params)}
        if with_base:
            state[FROZEN] = base
        if loss_scale.enabled(c):
            state['loss_scale'] = loss_scale.init_state(c)
        if spikes.enabled(c):
            state['spike'] = spikes.init_state()
        return state

    with jax.set_mesh(layout.mesh):
        return jax.jit(init, out_shardings=shardings)(jax.random.key(c.seed))


def model_params(state: dict[str, Any]) -> Params:
    """The model's whole params dict of a train state: its params, joined with the frozen base under LoRA."""
    return join(state[FROZEN], state['params']) if FROZEN in state else state['params']
