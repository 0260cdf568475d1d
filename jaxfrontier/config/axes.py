"""The mesh axes in one table: each axis's name, role and what code that handles every axis needs to know.

Rows are in mesh order, outermost to innermost. Devices are laid out row-major over them (mesh.make_mesh),
so the last axis gets the nearest devices (on Frontier a tensor group of 2 is the two GCDs of one MI250X,
of 8 one node), the context ring the next nearest (its key/value passes go between neighbours every
attention block, docs/long_context.md) and the first the farthest (pipeline stages across nodes); the
planner reads the link level a collective crosses from this order (hardware.axis_level).

Derived from the table: `MESH_AXES` and the mesh (mesh.py), the `mesh` section of `base_config` and its
checks, `data_parallel_size`, `Layout`'s sizes (layout.py), the sweep's axis knobs and its derived `data`
(sweep/space.py), the saved checkpoint meta's mesh checks (checkpoint/saved_meta.py), the planner's
candidate meshes and measured layouts (plan/search.py, plan/measured.py), what the verify shrink keeps
(plan/shrink.py), what decoding folds (inference/load.py). Code that uses an axis's meaning (the FSDP
gather, ring attention over `context`, the pipeline executors, Megatron's split over `tensor`) names it.
Adding an axis (the MoE issue's `expert`) is a row here plus the code that uses it.

No JAX, and nothing of ours: `main` reads the config before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

# What an axis splits: code that handles every axis asks an axis's role, not its name.
ROLES = {
    'pipeline': 'the stacked layers, into stages that pass activations on',
    'batch': 'the batch rows: each replica trains on its own rows (the data-parallel size is their product)',
    'sequence': "each sequence's tokens",
    'model': "the weights' matmul dimensions (Megatron's column and row split)",
}


@dataclasses.dataclass(frozen=True)
class Axis:
    """One mesh axis: its config field is `mesh.<name>`, an integer >= 1, by default 1."""

    name: str
    role: str  # a key of ROLES
    help: str  # what its size means, in a few words (the sweep's knob)
    # ZeRO-3: every weight's model dimension is stored split over it and gathered for use (fsdp), so
    # d_model must divide by it, and it is not a replica (`replica`).
    shards_params: bool = False
    # Added after checkpoints and plans were first written (context): a saved config may lack it (that run
    # had size 1), and a layout record or command line leaves it out at 1, so older ones read the same.
    # (A sweep trial's arguments name every axis at any size, so a new row gives new trials new ids.)
    optional: bool = False
    # Expert parallelism: devices along it hold different experts of each mixture-of-experts layer (the
    # weights' `experts` dimension is split over it) and send each other the tokens routed to them inside
    # those layers; every other layer sees it as one more split of the batch rows. Not a replica.
    holds_experts: bool = False
    # Left out of the mesh where its size is 1 (and so out of every sharding and program), so the programs
    # of models that do not use it are those from before the row existed (benchmarks/program_digests.py).
    dropped_at_1: bool = False

    @property
    def field(self) -> str:
        return f'mesh.{self.name}'

    @property
    def replica(self) -> bool:
        """Whether devices along it hold the same parameters and differ only in their batch rows (data).

        The one replica axis takes the devices the others leave (the sweep, a scaling study and the
        planner's search size the other axes), the verify shrink may shrink it (its reduction is the
        same collective at any size above 1), and decoding folds the pipeline and sequence axes into it.
        """
        return self.role == 'batch' and not self.shards_params and not self.holds_experts


AXES = (
    Axis('pipeline', 'pipeline', 'pipeline stages'),
    Axis('data', 'batch', 'data-parallel replicas; takes the devices the other axes leave'),
    Axis('fsdp', 'batch', 'FSDP (ZeRO-3) size; data takes the remaining devices', shards_params=True),
    # Inside the mixture-of-experts layers each token goes to the device holding its expert and comes back
    # (all-gather + reduce-scatter over this axis, model/layers/moe_parallel.py) every layer, forward and
    # backward: traffic that data's and fsdp's once-per-step (or per micro-batch) gradient reductions do not
    # have, so nearer devices than theirs; the context ring's per-attention-block passes and tensor's
    # per-matmul all-reduces are nearer still.
    Axis('expert', 'batch', 'expert-parallel size (each device holds model.moe_experts / expert experts)',
         optional=True, holds_experts=True, dropped_at_1=True),
    # Activations per device / context; attention passes key/value blocks around a ring over it.
    Axis('context', 'sequence', 'context-parallel size (the sequence split over devices)', optional=True),
    Axis('tensor', 'model', 'tensor-parallel size'),
)


def check_table(table: tuple[Axis, ...]) -> None:
    """The table's own rules: distinct names, known roles, exactly one replica axis.

    Raises:
      ValueError: a rule is broken (a row added wrongly; raised at import).
    """
    names = [a.name for a in table]
    if len(set(names)) != len(names):
        raise ValueError(f'mesh axes named twice: {names}')
    unknown = [a.name for a in table if a.role not in ROLES]
    if unknown:
        raise ValueError(f'mesh axes {unknown} have a role outside {tuple(ROLES)}')
    replicas = [a.name for a in table if a.replica]
    if len(replicas) != 1:
        raise ValueError(f'exactly one mesh axis is the replica axis (batch role, no parameters), not {replicas}')


check_table(AXES)
MESH_AXES = tuple(a.name for a in AXES)


def in_mesh(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh's axes for `sizes` (axis -> size; absent axes are 1), in mesh order: every row's but those
    `dropped_at_1` where their size is 1."""
    return tuple(a.name for a in AXES if not a.dropped_at_1 or sizes.get(a.name, 1) > 1)


def get(name: str) -> Axis:
    """The row of axis `name` (KeyError when there is none)."""
    for a in AXES:
        if a.name == name:
            return a
    raise KeyError(name)


def of_role(role: str) -> tuple[Axis, ...]:
    """The axes of `role`, in mesh order."""
    return tuple(a for a in AXES if a.role == role)


def replica() -> Axis:
    """The replica axis (`Axis.replica`): data."""
    return next(a for a in AXES if a.replica)


def product(sizes: Mapping[str, int], axes: tuple[Axis, ...] | None = None) -> int:
    """Devices of `axes` (default: all) in mesh `sizes` (axis -> size, e.g. config.mesh; absent axes are 1)."""
    return math.prod(sizes.get(a.name, 1) for a in (AXES if axes is None else axes))


def data_parallel(sizes: Mapping[str, int]) -> int:
    """Data-parallel replicas of mesh `sizes` (axis -> size; absent axes are 1): the batch axes' product."""
    return product(sizes, of_role('batch'))


def others() -> tuple[Axis, ...]:
    """Every axis but the replica one: what a sweep point, a scaling study or the verify shrink keeps."""
    return tuple(a for a in AXES if not a.replica)
