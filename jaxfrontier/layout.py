"""Decisions the trainer and the planner both need, made once (no arrays, no tracing).

- `reduce_once`: gradients cross the `data` axis once per step (training/reduction.py has the
  mechanism and the why).
- `token_split_axes`: the tensor axes the pipeline's stash and sends are split over
  (pipeline/chunk.py's `TokenSplit`).
- `zero1_layout` / `zero1_spec`: where ZeRO-1 puts a parameter's optimizer state.
- The staggered executor's residual policy per `model.remat` is `config.STAGGERED_RESIDUALS`.
"""

from __future__ import annotations

import math

from jax.sharding import Mesh, PartitionSpec as P

from jaxfrontier import mesh as mesh_lib

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


def zero1_spec(spec: P, shape: tuple[int, ...], mesh: Mesh, dp_axes: tuple[str, ...]) -> P:
    """The optimizer-state spec of `zero1_layout` (over the padded shape where it pads)."""
    return zero1_layout(spec, shape, mesh, dp_axes)[0]
