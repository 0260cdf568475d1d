"""Layout search: every layout of a model on a device count, the ones that fit, best first.

`search(config, hardware, num_devices)` enumerates tensor (with and without sequence
parallelism) x context x pipeline x data-parallel (data or fsdp, with or without ZeRO-1)
meshes (over every axis of config/axes.py: one the search has no sizes for stays 1), micro-batch
sizes, remat policies and pipeline schedules at the config's global batch, plans each
(`planner.plan_layout`, arithmetic only), drops those that do not fit the device memory and ranks the rest by predicted tokens/s.
What the authors searched with DeepHyper on the machine, this does on a laptop in seconds;
the top layouts are then worth a compile check (`compile_check`) and a short real run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.plan import moe as plan_moe
from jaxfrontier.plan import planner

MICRO_BATCHES = (1, 2, 4, 8)
DISPATCHES = ('gather', 'all_to_all', 'ragged')  # families/moe.DISPATCHES less auto
VIRTUAL_STAGES = (2, 4)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shape_for(c: ml_collections.ConfigDict, tensor: int) -> config_lib.ModelShape:
    m = c.model
    multiple = m.vocab_multiple * tensor
    return dataclasses.replace(config_lib.model_shape(c), vocab_size=-(-m.vocab_size // multiple) * multiple)


def candidate_layouts(c: ml_collections.ConfigDict, num_devices: int, hw: hw_lib.Hardware) -> list[layout_lib.Layout]:
    """Layouts of `num_devices` that satisfy every divisibility rule at the config's global batch.

    Meshes come from `_meshes` (each axis's sizes: `_axis_sizes`); ZeRO-1 is tried where the
    replica axis (data) has more than one device (not with Adafactor, which config.validate refuses),
    sequence parallelism where tensor does.
    """
    out = []
    for mesh in _meshes(tuple(_axis_sizes(c, hw).items()), num_devices, {}):
        replicas = mesh[axes_lib.replica().name]
        for zero1 in ((False, True) if replicas > 1 and c.optim.name != 'adafactor' else (False,)):
            for sp in ((False, True) if mesh['tensor'] > 1 else (False,)):
                out += _time_layouts(c, c.train.global_batch, mesh, zero1, sp)
    return out


def _axis_sizes(c: ml_collections.ConfigDict, hw: hw_lib.Hardware) -> dict[str, Callable[[int], list[int]]]:
    """Axis -> the sizes to try for it given the devices still free, in the order the search turns them.

    Tensor parallelism stays inside a node (the paper's finding; across nodes it only loses); context
    sizes split the sequence into equal chunks (two per device when balanced, config's
    `_validate_context`); pipeline sizes divide the layers; fsdp is 1, all, or a power of two up to 128
    (`_fsdp_sizes`); expert-parallel sizes divide model.moe_experts (the config's rule; 1 for a dense model).
    The replica axis (data) takes the devices left; an axis without sizes here stays 1.
    """
    m = c.model
    chunks_per_device = 2 if m.context_balance else 1
    experts = m.get('moe_experts', 0)
    return {
        'tensor': lambda free: [t for t in _divisors(free) if t <= hw.devices_per_node and m.num_heads % t == 0
                                and config_lib.mlp_dim(c) % t == 0 and m.get('moe_mlp_dim', 0) % t == 0],
        'context': lambda free: [x for x in _divisors(free) if x == 1 or m.seq_len % (chunks_per_device * x) == 0],
        'pipeline': lambda free: [p for p in _divisors(free) if m.num_layers % p == 0],
        'fsdp': lambda free: _fsdp_sizes(free, m.d_model),
        # MoE: expert-parallel sizes divide the experts (each device holds E / EP of them); dense: 1.
        'expert': lambda free: [e for e in _divisors(free) if e == 1 or (experts and experts % e == 0)],
    }


def _meshes(sizes: tuple[tuple[str, Callable[[int], list[int]]], ...], free: int, chosen: dict[str, int]
            ) -> Iterator[dict[str, int]]:
    """Every mesh of `free` more devices: each axis of `sizes` in turn at each of its sizes, then the replica
    axis takes the devices left and every other axis is 1 (axis -> size, in mesh order)."""
    if not sizes:
        yield {a.name: chosen.get(a.name, free if a.replica else 1) for a in axes_lib.AXES}
        return
    (name, options), rest = sizes[0], sizes[1:]
    for size in options(free):
        yield from _meshes(rest, free // size, {**chosen, name: size})


def _fsdp_sizes(dp: int, d_model: int) -> list[int]:
    """fsdp sizes to try: 1, all of dp, and powers of two in between (each must divide d_model)."""
    sizes = {1, dp} | {2**i for i in range(1, 8) if dp % 2**i == 0}
    return sorted(f for f in sizes if dp % f == 0 and d_model % f == 0)


def _time_layouts(c, batch: int, mesh: dict[str, int], zero1: bool, sequence_parallel: bool
                  ) -> list[layout_lib.Layout]:
    """Micro-batch, accumulation, remat and schedule choices of one mesh (`mesh`: its axis sizes)."""
    pipeline, dp, out = mesh['pipeline'], axes_lib.data_parallel(mesh), []
    for micro in MICRO_BATCHES:
        if batch % (micro * dp):
            continue
        accum = batch // (micro * dp)
        base = layout_lib.Layout(**mesh, micro_batch=micro, accum_steps=accum, zero1=zero1,
                                 optimizer=c.optim.name, factor_min_dim=c.optim.factor_min_dim,
                                 context_balance=bool(c.model.context_balance), sequence_parallel=sequence_parallel)
        if pipeline == 1:
            out += [dataclasses.replace(base, remat=r) for r in config_lib.REMAT_POLICIES]
            continue
        if accum < pipeline:
            continue
        out += [dataclasses.replace(base, schedule=s) for s in ('gpipe', '1f1b', '1f1b_lockstep')]
        for v in VIRTUAL_STAGES:
            if accum % pipeline == 0 and c.model.num_layers % (pipeline * v) == 0:
                out.append(dataclasses.replace(base, schedule='interleaved', virtual_stages=v))
    return out


def _dispatches(shape: config_lib.ModelShape, layout: layout_lib.Layout) -> list[config_lib.ModelShape]:
    """The shape with each expert dispatch (model.moe_dispatch) where a layout sends tokens to other devices'
    experts (a MoE model at EP > 1); otherwise the shape as it is."""
    moe = getattr(shape, 'moe', None)
    if moe is None or layout.expert <= 1:
        return [shape]
    return [dataclasses.replace(shape, moe=dataclasses.replace(moe, dispatch=d)) for d in DISPATCHES]


def search(c: ml_collections.ConfigDict, hardware: str | hw_lib.Hardware = 'mi250x', num_devices: int = 0,
           top: int = 10) -> tuple[list[planner.Plan], int, int]:
    """The `top` layouts that fit, fastest first; also how many were planned and how many fit.

    Args:
      c: a config: its model, global batch and rules are kept, its layout is ignored.
      hardware: a name from `hardware.NAMES` or a `Hardware`.
      num_devices: devices to use; 0 takes the config's mesh size.
      top: how many plans to return.
    """
    hw = hardware if isinstance(hardware, hw_lib.Hardware) else hw_lib.get(hardware)
    n = num_devices or config_lib.num_devices(c)
    shapes: dict[int, config_lib.ModelShape] = {}
    plans, planned = [], 0
    for layout in candidate_layouts(c, n, hw):
        shape = shapes.setdefault(layout.tensor, _shape_for(c, layout.tensor))
        for variant in _dispatches(dataclasses.replace(shape, remat=layout.remat), layout):
            p = planner.plan_layout(variant, layout, hw, rules=c.sharding.rules, name=f'{layout.num_devices} devices')
            planned += 1
            if p.fits:
                plans.append(p)
    plans.sort(key=lambda p: -p.time.tokens_per_s)
    return plans[:top], planned, len(plans)


def format_search(plans: list[planner.Plan], planned: int, fitting: int) -> str:
    """A table of the ranked layouts."""
    lines = [f'{planned} layouts planned, {fitting} fit; the fastest {len(plans)}:',
             f'{"#":>3s} {"TP":>3s} {"SP":>3s} {"CP":>3s} {"PP":>3s} {"data":>5s} {"fsdp":>5s} {"EP":>4s} {"Z1":>3s} {"mb":>3s} '
             f'{"accum":>5s} {"dispatch":<10s} '
             f'{"remat":<18s} {"schedule":<14s} {"GiB":>6s} {"step s":>8s} {"tokens/s":>10s} {"MFU":>6s} '
             f'{"HW TF/s":>8s} {"bubble":>7s}']
    for i, p in enumerate(plans, 1):
        lay, t = p.layout, p.time
        sched = '-' if lay.pipeline == 1 else lay.schedule + (f' v{lay.virtual_stages}' if lay.schedule == 'interleaved'
                                                               else '')
        lines.append(f'{i:>3d} {lay.tensor:>3d} {"y" if lay.sequence_parallel else "-":>3s} {lay.context:>3d} '
                     f'{lay.pipeline:>3d} {lay.data:>5d} {lay.fsdp:>5d} {lay.expert:>4d} '
                     f'{"y" if lay.zero1 else "-":>3s} {lay.micro_batch:>3d} {lay.accum_steps:>5d} '
                     f'{_dispatch_of(p):<10s} '
                     f'{lay.remat if lay.pipeline == 1 else "full (pipeline)":<18s} {sched:<14s} '
                     f'{p.memory.total_bytes / hw_lib.GIB:>6.1f} {t.step_s:>8.2f} {t.tokens_per_s:>10,.0f} '
                     f'{t.mfu:>6.1%} {t.megatron_tflops_per_device:>8.1f} {t.bubble_fraction:>7.1%}')
    return '\n'.join(lines)


def _dispatch_of(p: planner.Plan) -> str:
    """The plan's expert dispatch, '-' for a dense model or EP 1."""
    return plan_moe.dispatch(p.shape, p.layout) if p.layout.expert > 1 and plan_moe.of(p.shape) else '-'


def search_to_json(plans: list[planner.Plan], planned: int, fitting: int) -> dict[str, Any]:
    return {'planned': planned, 'fit': fitting, 'plans': [planner.plan_to_json(p) for p in plans]}


def dumps(plans: list[planner.Plan], planned: int, fitting: int) -> str:
    return json.dumps(search_to_json(plans, planned, fitting), default=float)
