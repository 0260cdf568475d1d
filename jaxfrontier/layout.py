"""Decisions the trainer and the planner both need, made once (no arrays, no tracing).

- `Layout`: how a model is spread over devices and time (mesh sizes, micro-batching, remat,
  schedule, ZeRO-1), built once per run from the config (`Layout.from_config`) and handed to
  the trainer, the pipeline and the planner, whose search turns its knobs. Its mesh sizes are
  a field per row of the axes' table (config/axes.py, `MeshSizes`).
- `reduce_once`: gradients cross the `data` axis once per step (training/reduction.py has the
  mechanism and the why).
- `token_split_axes`: the tensor axes the pipeline's stash and sends are split over
  (pipeline/chunk.py's `TokenSplit`).
- `zero1_layout` / `zero1_spec`: where ZeRO-1 puts a parameter's optimizer state.
- `factored_dims` / `drop_axis`: which dimensions Adafactor's factored moments keep, and their
  specs (training/optimizer.py places them, plan/estimate.py counts their bytes).
- The staggered executor's residual policy per `model.remat` is `config.STAGGERED_RESIDUALS`.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections
import numpy as np

from jax.sharding import Mesh, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.families import moe as moe_family

DATA = 'data'


def reduce_once(*, data: int, dropout: bool, accum_steps: int, pipeline: int, data_is_batch_axis: bool = True,
                params_over_data: bool = False) -> bool:
    """True when gradients are summed locally over micro-batches and reduced over `data` once.

    Args:
      data: size of the `data` mesh axis.
      dropout: whether dropout is on (masks are drawn per whole micro-batch, so each replica
        cannot draw its own rows' masks alone).
      accum_steps: micro-batches per step.
      pipeline: pipeline stages.
      data_is_batch_axis: whether the rules put the batch on `data` (the default rules do).
      params_over_data: whether any parameter is sharded over `data` (then the sum cannot be
        local); ZeRO-1 only shards the optimizer state.
    """
    if data == 1 or dropout or not data_is_batch_axis or params_over_data:
        return False
    return accum_steps > 1 or pipeline > 1  # one micro-batch: one reduction either way


def token_split_axes(enabled: bool, batch_axes: tuple[str, ...], tensor_axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes a pipeline's stash and sends are split over along the tokens (() = not split).

    Only the tensor axes that do not split the batch already, and only where no automatic axis
    splits the tokens (fsdp, or data while dropout keeps it automatic): there, slicing the
    tokens again would split rows the propagation already split.
    """
    tensor = tuple(a for a in tensor_axes if a not in batch_axes)
    return tensor if enabled and not batch_axes and tensor else ()


def zero1_layout(spec: P, shape: tuple[int, ...], mesh: Mesh, dp_axes: tuple[str, ...]) -> tuple[P, tuple[int, ...]]:
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
    extra_size = math.prod(mesh.shape[a] for a in extra)
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


def factored_dims(shape: tuple[int, ...], min_dim: int) -> tuple[int, int] | None:
    """(second largest, largest) dimension of a weight whose moment Adafactor factors, else None.

    optax's own rule (`optax._src.factorized._factored_dims`, with the same `np.argsort`, so ties
    resolve alike): the two largest dimensions, when the smaller of them is >= `min_dim`. Its
    `v_row` drops the largest dimension, `v_col` the second largest.
    """
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def drop_axis(spec: P, axis: int, ndim: int) -> P:
    """`spec` of an array of `ndim` dimensions without dimension `axis` (a reduced moment's spec)."""
    entries = list(spec) + [None] * (ndim - len(spec))
    del entries[axis]
    return P(*entries)


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, dp_axes: tuple[str, ...]) -> P:
    """The optimizer-state spec of `zero1_layout` (over the padded shape where it pads)."""
    return zero1_layout(spec, shape, mesh, dp_axes)[0]


# Logical names of activations, not parameters: every other name in the rules is a parameter
# dimension (embed, mlp, heads, vocab, layers, ...).
ACTIVATION_NAMES = ('batch', 'length', 'tokens', 'stream', 'act_embed')


def data_placement(rules) -> tuple[bool, bool]:
    """(the batch is split over `data`, some parameter dimension is) under logical `rules`."""
    in_batch = DATA in mesh_lib.data_parallel_axes(rules)
    over_data = any(DATA in mesh_lib.entry_axes(target) for name, target in rules if name not in ACTIVATION_NAMES)
    return in_batch, over_data


# Layout's mesh sizes: an int field per axis of the table, default 1, in mesh order. So every axis is a
# keyword of `Layout(...)` and `dataclasses.replace`, and an attribute (`layout.fsdp`), without a list here.
MeshSizes = dataclasses.make_dataclass(
    'MeshSizes', [(a.name, int, dataclasses.field(default=1)) for a in axes_lib.AXES], frozen=True,
    namespace={'__doc__': 'The size of each mesh axis (config/axes.py), 1 by default.', '__module__': __name__})


@dataclasses.dataclass(frozen=True)
class Layout(MeshSizes):
    """How a model is spread over devices and time: the knobs the search turns (the mesh sizes: `MeshSizes`)."""

    context_balance: bool = True  # model.context_balance: the zigzag token order (model/context.py)
    micro_batch: int = 1
    accum_steps: int = 1
    remat: str = 'full'
    schedule: str = '1f1b'
    virtual_stages: int = 1
    zero1: bool = False
    optimizer: str = 'adamw'  # optim.name: the optimizer state's bytes (plan/estimate.py)
    factor_min_dim: int = 128  # optim.factor_min_dim: which weights Adafactor factors
    dropout: bool = False  # dropout (or LoRA's) > 0 keeps the per-micro-batch data-parallel reduction (reduction.py)
    shard_activations: bool = True  # pipeline.shard_activations
    # sharding.sequence_parallel resolved (config.sequence_parallel): the residual stream's
    # tokens split over `tensor` too.
    sequence_parallel: bool = False
    # From the logical-axis rules (sharding.rules): the default rules put the batch on `data`
    # and no parameter dimension on it.
    data_in_batch: bool = True
    params_over_data: bool = False
    # Micro-batch a is global rows a, a + A, ... in every layout (training/step.split_micro_batches) where
    # the model has per-micro-batch statistics that are not linear in its rows: a MoE layer's balancing
    # loss and capacity drops. Dense models keep the blocked split (their programs unchanged).
    strided_micro_batches: bool = False

    @property
    def split_tokens(self) -> int:
        """Parts the pipeline's stash and sends are split into over `tensor` (pipeline.TokenSplit)."""
        if self.pipeline == 1:
            return 1
        # The tokens' automatic axes: those splitting rows or sequences (data only unless the pipeline runs
        # data-manual).
        batch = tuple(a.name for a in axes_lib.AXES if a.role in ('batch', 'sequence') and getattr(self, a.name) > 1
                      and not (a.name == DATA and self.reduce_once))
        axes = token_split_axes(self.shard_activations, batch, ('tensor',) if self.tensor > 1 else ())
        return self.tensor if axes else 1

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> Layout:
        """The config's layout, made once per run and handed to the trainer, the pipeline and the planner."""
        data_in_batch, params_over_data = data_placement(config_lib.sharding_rules(c))
        return cls(**config_lib.mesh_shape(c), context_balance=bool(c.model.context_balance),
                   micro_batch=c.train.micro_batch, accum_steps=c.train.accum_steps, remat=c.model.remat,
                   schedule=c.pipeline.schedule, virtual_stages=c.pipeline.virtual_stages,
                   zero1=bool(c.sharding.zero1), optimizer=c.optim.name, factor_min_dim=c.optim.factor_min_dim,
                   dropout=c.model.dropout_rate > 0 or config_lib.lora_dropout(c) > 0,
                   shard_activations=bool(c.pipeline.shard_activations),
                   sequence_parallel=config_lib.sequence_parallel(c.sharding.sequence_parallel, c.mesh.tensor),
                   data_in_batch=data_in_batch, params_over_data=params_over_data,
                   strided_micro_batches=moe_family.on(c.model))

    @property
    def reduce_once(self) -> bool:
        """Training's gradients cross `data` once per step (jaxfrontier/training/reduction.py)."""
        return self.reduces_once(training=True)

    def reduces_once(self, training: bool) -> bool:
        """`reduce_once` for training or evaluation (which draws no dropout masks)."""
        return reduce_once(data=self.data, dropout=training and self.dropout, accum_steps=self.accum_steps,
                           pipeline=self.pipeline, data_is_batch_axis=self.data_in_batch,
                           params_over_data=self.params_over_data)

    def as_dict(self) -> dict:
        """The layout as JSON-ready fields; the rules' data placement, the optimizer, the optional axes
        (context), context balance and SP only where not the default (records of layouts without them read
        the same)."""
        fields = dataclasses.asdict(self)
        optional_axes = tuple(a.name for a in axes_lib.AXES if a.optional)
        for name in ('data_in_batch', 'params_over_data', 'optimizer', 'factor_min_dim', *optional_axes,
                     'context_balance', 'sequence_parallel', 'strided_micro_batches'):
            if fields[name] == Layout.__dataclass_fields__[name].default:
                del fields[name]
        return fields

    @property
    def virtual(self) -> int:
        """Chunks per pipeline stage (1 without a pipeline, whatever pipeline.virtual_stages says)."""
        return self.virtual_stages if self.pipeline > 1 else 1

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis sizes in config.MESH_AXES order (outermost first: the planner's link levels read it so)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(MeshSizes)}

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape.values())

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the product of the batch axes (data x fsdp)."""
        return axes_lib.data_parallel(self.mesh_shape)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum_steps * self.dp

    def apply(self, c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of config `c` with this layout."""
        c = ml_collections.ConfigDict(c.to_dict())
        c.mesh.update(self.mesh_shape)
        c.train.update(micro_batch=self.micro_batch, accum_steps=self.accum_steps, global_batch=self.global_batch)
        c.model.remat = self.remat
        c.model.context_balance = self.context_balance
        c.pipeline.update(schedule=self.schedule, virtual_stages=self.virtual_stages)
        c.sharding.zero1 = self.zero1
        c.optim.update(name=self.optimizer, factor_min_dim=self.factor_min_dim)
        c.pipeline.shard_activations = self.shard_activations
        c.sharding.sequence_parallel = 'true' if self.sequence_parallel else 'false'
        return c

    def describe(self) -> str:
        parts = [f'TP {self.tensor}', f'PP {self.pipeline}', f'DP {self.dp}']
        batch = axes_lib.of_role('batch')
        if any(getattr(self, a.name) > 1 for a in batch if not a.replica):  # data x fsdp, where fsdp > 1
            parts[-1] += ' (' + ' x '.join(f'{a.name} {getattr(self, a.name)}' for a in batch) + ')'
        if self.context > 1:
            parts.append(f'CP {self.context}')
        sched = ''
        if self.pipeline > 1:
            sched = f', {self.schedule}' + (f' v={self.virtual_stages}' if self.schedule == 'interleaved' else '')
        return (' x '.join(parts) + f', micro-batch {self.micro_batch} x {self.accum_steps} steps, '
                f'remat {self.remat}{sched}' + (', ZeRO-1' if self.zero1 else '')
                + (', SP' if self.sequence_parallel and self.tensor > 1 else ''))
