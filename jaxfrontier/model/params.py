"""The model's parameters as a plain pytree: bind them to the NNX model, build them, reshape them.

`params` is a nested dict of fp32 arrays (the model's `nnx.State` as a pure dict): easy to
checkpoint, export and reshard. `ModelDef` binds such a dict back into the configured family's
module (`module_of`: the class its declaration names, families/) inside traced code;
`split_virtual` / `merge_virtual` reshape the stacked blocks for interleaved pipelines.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.model.layers import moe

Params = dict[str, Any]
# Parameters no optimizer updates (no gradient, no moments, no decay: training/optimizer.py `outside_gradient`):
# the model moves them after each step by its own rule (`Decoder.update_outside_gradient`): the MoE router's
# balancing bias (model/layers/moe.py).
OUTSIDE_GRADIENT = (moe.BIAS,)


@functools.cache
def _resolve(module: str) -> type:
    package, _, name = module.partition(':')
    return getattr(importlib.import_module(package), name)


def module_of(family: str) -> type:
    """The NNX model class of `family`: its declaration's 'package.module:Class', imported here on the JAX
    side (the declarations import no JAX), so a family's module may live anywhere, a test's too."""
    return _resolve(families.get(family).module)


@dataclasses.dataclass(frozen=True)
class ModelDef:
    """The model's structure without values: binds a params dict back into the family's module."""

    graphdef: nnx.GraphDef
    abstract_state: nnx.State

    @classmethod
    def create(cls, shape: config_lib.ModelShape) -> 'ModelDef':
        module = module_of(shape.family)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: module(shape, rngs=nnx.Rngs(0))))
        return cls(graphdef, state)

    def bind(self, params: Params) -> nnx.Module:
        state = jax.tree.map(lambda x: x, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def logical_specs(self) -> Params:
        return nnx.to_pure_dict(nnx.get_partition_spec(self.abstract_state))

    def abstract_params(self) -> Params:
        return nnx.to_pure_dict(self.abstract_state)

    @property
    def groups(self) -> tuple[str, ...]:
        """The model's layer groups in model order (model/decoder.py; one group: `('blocks',)`)."""
        return nnx.merge(self.graphdef, self.abstract_state).GROUPS

    def group_sizes(self) -> dict[str, int]:
        """Layers of each group, in model order."""
        return nnx.merge(self.graphdef, self.abstract_state).group_sizes()

    def update_outside_gradient(self, params: Params, aux: dict) -> Params:
        """The model's own update of its `OUTSIDE_GRADIENT` parameters after a step (train step)."""
        return nnx.merge(self.graphdef, self.abstract_state).update_outside_gradient(params, aux)


def init_params(shape: config_lib.ModelShape, key: jax.Array) -> Params:
    """The family's freshly initialised parameters for `shape` (a params dict)."""
    module = module_of(shape.family)
    return nnx.to_pure_dict(nnx.state(module(shape, rngs=nnx.Rngs(params=key))))


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
    if min(a.ndim for a in jax.tree.leaves(blocks)) == 2:  # the norms' scales are [L, d]: not split
        return params
    return {**params, 'blocks': jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), blocks)}


def split_virtual_specs(specs: Params, virtual: int) -> Params:
    if virtual == 1:
        return specs
    blocks = jax.tree.map(lambda s: P('virtual', *s), specs['blocks'], is_leaf=lambda x: isinstance(x, P))
    return {**specs, 'blocks': blocks}


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
