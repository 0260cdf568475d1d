"""The logical sharding rules a model gets on a mesh: what every consumer of the rules uses.

`config.sharding.rules` names mesh axes per logical dimension whatever the model and mesh;
`resolve_rules` fits them to one model on one mesh (kv heads that cannot split, the flat
token dimension, Megatron's sequence parallelism). No JAX import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxfrontier.config import axes as axes_lib
from jaxfrontier.config.schema import ModelShape, mesh_shape, model_shape


SEQUENCE_PARALLEL = ('auto', 'true', 'false')  # sharding.sequence_parallel


def sequence_parallel(setting: Any, tensor: int) -> bool:
    """Whether `sharding.sequence_parallel` = `setting` splits the residual stream over `tensor`.

    'auto' is off: in the compiled programs (docs/long_context.md) XLA keeps each all-reduce and
    adds gathers (2.6x the tensor bytes on the CPU, more under fsdp or a pipeline) for 3-21 %
    less temporary memory. Until a GPU shows equal speed it is an opt-in for runs that need it.
    """
    return tensor > 1 and setting == 'true'


def resolve_rules(rules, shape: ModelShape, mesh_sizes: Mapping[str, int],
                  sequence_parallel: bool = False) -> tuple[tuple[str, Any], ...]:
    """The logical rules for this model on this mesh: what every consumer of the rules uses.

    The rules name axes per logical dimension whatever the model; a grouped-query model's g
    key/value heads can only be split over `kv_heads`' axes where g divides their size (JAX
    shards evenly). Where it does not (8 kv heads on tensor 16, 2 on tensor 4), each tensor
    rank keeps every kv head, as Megatron-LM does for GQA, and still slices its own query
    heads' share after the repeat (model/attention.py). A table without `tokens` (the flat
    [B*T] activations) gets length's axes followed by batch's (model/context.py). Lists become tuples (a resolved
    config file holds lists). An axis the mesh leaves out at size 1 (config/axes.py `dropped_at_1`: expert)
    is left out of every rule.

    `stream`, the tokens of the residual stream [B*T, d] between the blocks' matmuls
    (model/layers.ACT_ND), is derived here unless the rules name it: the axes of `tokens`,
    followed with `sequence_parallel` by the query heads' axes (Megatron's sequence parallelism
    over the tensor-parallel group; inside attention and the MLP the tokens stay on `tokens`).
    """
    out, present = [], axes_lib.in_mesh(mesh_sizes)
    for name, target in rules:
        target = tuple(target) if isinstance(target, list) else target
        if any(a not in present for a in _axes_of(target)):  # an axis the mesh leaves out at size 1 (expert)
            kept = tuple(a for a in _axes_of(target) if a in present)
            target = None if not kept else kept[0] if len(kept) == 1 else kept
        if name == 'kv_heads' and target is not None:
            axes = (target,) if isinstance(target, str) else target
            if shape.kv_heads % math.prod(int(mesh_sizes.get(a, 1)) for a in axes):
                target = None
        out.append((name, target))
    if 'tokens' not in dict(out):  # flat activations: split by part of the sequence, then by rows
        table = dict(out)
        axes = tuple(a for name in ('length', 'batch') for a in _axes_of(table.get(name)))
        out.append(('tokens', None if not axes else axes[0] if len(axes) == 1 else axes))
    table = dict(out)
    if 'stream' not in table:
        axes = _axes_of(table['tokens'])
        if sequence_parallel:
            axes += tuple(a for a in _axes_of(table.get('heads')) if a not in axes and int(mesh_sizes.get(a, 1)) > 1)
        out.append(('stream', None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(out)


def _axes_of(target) -> tuple[str, ...]:
    return () if target is None else (target,) if isinstance(target, str) else tuple(target)


def sharding_rules(c: ml_collections.ConfigDict) -> tuple[tuple[str, Any], ...]:
    """`resolve_rules` of config `c` on its own mesh."""
    return resolve_rules(c.sharding.rules, model_shape(c), mesh_shape(c),
                         sequence_parallel(c.sharding.sequence_parallel, c.mesh.tensor))
