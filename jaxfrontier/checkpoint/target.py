"""What a checkpoint is read into: abstract trees that carry their shardings.

Restoring builds every array directly in its target sharding, so the reader needs only the
abstract tree (shapes, dtypes) and where each leaf goes: `abstract_target` joins the two.
`param_placement` is the parameters alone on a mesh (no optimizer): what sampling, evaluation and
`checkpoint.init_params_from` read into; the train state's layout (training/state.py) builds
on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
from jax.sharding import Mesh

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.params import ModelDef, Params, split_virtual, split_virtual_specs


def abstract_target(abstract: Any, shardings: Any) -> Any:
    """`abstract` (a tree of ShapeDtypeStructs) as ShapeDtypeStructs that carry `shardings`."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """The model's parameters on one mesh: structure, abstract values and shardings (no optimizer)."""

    shape: config_lib.ModelShape
    model_def: ModelDef
    mesh: Mesh
    rules: mesh_lib.Rules
    abstract_params: Params
    param_shardings: Params

    def target(self) -> Params:
        """The parameters as ShapeDtypeStructs with their shardings (what a reader fills)."""
        return abstract_target(self.abstract_params, self.param_shardings)


def _platform(mesh) -> str | None:
    """The mesh's device platform (None for an AbstractMesh: model.scan_unroll=0 then means rolled)."""
    devices = getattr(mesh, 'devices', None) if isinstance(mesh, Mesh) else None
    return None if devices is None else devices.flat[0].platform


def param_placement(c: ml_collections.ConfigDict, mesh: Mesh) -> ParamPlacement:
    """The parameters of `c` on `mesh` from the model definition and the sharding rules alone."""
    shape = config_lib.model_shape(c, _platform(mesh))
    rules = config_lib.resolve_rules(c.sharding.rules, shape, dict(mesh.shape),
                                     config_lib.sequence_parallel(c.sharding.sequence_parallel, c.mesh.tensor))
    model_def = ModelDef.create(shape)
    virtual = c.pipeline.virtual_stages if c.mesh.pipeline > 1 else 1
    abstract_params = split_virtual(model_def.abstract_params(), virtual)
    param_shardings = mesh_lib.tree_shardings(split_virtual_specs(model_def.logical_specs(), virtual), mesh, rules)
    return ParamPlacement(shape, model_def, mesh, rules, abstract_params, param_shardings)
