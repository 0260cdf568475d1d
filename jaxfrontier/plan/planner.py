"""Plan a layout before queueing: parameters, memory, FLOPs, communication and step time.

`plan(config, hardware)` answers, for the config's model and parallel layout on a hardware
description (`hardware.py`), without devices and without allocating the model:

  * parameters, exactly (`estimate.param_specs` mirrors `model/`; a test holds it to eval_shape);
  * memory per device: parameters, gradients, optimizer state, activations (the residuals JAX
    saves under the remat policy, read from JAX itself by `activations.py`, times the
    micro-batches the pipeline schedule keeps in flight), temporaries; fit and headroom;
  * FLOPs per step: model FLOPs, hardware FLOPs with recomputation, and Megatron's formula;
  * communication per step and mesh axis, and the link level each crosses;
  * the pipeline bubble, step time, tokens/s and MFU from a roofline-plus-communication model.

The model, its calibration against XLA's compiled memory analysis and its overlap
assumptions are written down in docs/planner.md. `estimate.py` holds the parameter,
memory, FLOP and compute-time formulas, `comm.py` the communication, this module the
layout, the step-time model, the plan and its printout.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.plan import comm as plan_comm
from jaxfrontier.plan import estimate
from jaxfrontier.plan import moe as plan_moe

RESERVED_FRACTION = estimate.RESERVED_FRACTION
GIB = hw_lib.GIB


@dataclasses.dataclass(frozen=True)
class StepTime:
    """The time model's answer for one optimizer step (see docs/planner.md)."""

    compute_s: float  # forward + backward (+ recompute) of all micro-batches, no waiting
    exposed_comm_s: float  # communication not hidden behind compute
    bubble_s: float  # pipeline fill and drain
    update_s: float  # optimizer update and gradient accumulation (memory bound)
    step_s: float
    bubble_fraction: float
    tokens_per_s: float
    mfu: float  # model FLOPs / (step time x devices x peak)
    model_tflops_per_device: float
    megatron_tflops_per_device: float  # the paper's counter (f = 4 with recomputation)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything `--mode=plan` reports for one config, layout and hardware."""

    name: str
    layout: layout_lib.Layout
    hardware: hw_lib.Hardware
    shape: config_lib.ModelShape
    num_params: int
    memory: estimate.Memory
    flops: estimate.Flops
    transfers: tuple[plan_comm.Transfer, ...]
    time: StepTime
    notes: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_bytes * (1.0 - RESERVED_FRACTION)

    @property
    def fits(self) -> bool:
        return self.memory.total_bytes <= self.usable_bytes

    @property
    def headroom_bytes(self) -> float:
        return self.usable_bytes - self.memory.total_bytes


def step_time(shape: config_lib.ModelShape, layout: layout_lib.Layout, hw: hw_lib.Hardware, flops: estimate.Flops,
              transfers: tuple[plan_comm.Transfer, ...], memory: estimate.Memory, per_mb: float) -> StepTime:
    """Roofline compute + exposed communication + pipeline bubble + update (docs/planner.md).

    Without a pipeline the micro-batches run back to back, each followed by the gradient
    accumulation. With one, a stage is busy for V M chunk units of (compute + exposed
    communication) / V and idle for P - 1 of them (the bubble, of which `hw.bubble_scale` is
    idle time); the sends between stages are exposed, and the lockstep executor pays one
    gradient accumulation per tick (staggered 1F1B: one per micro-batch). `hw.step_overhead_s`
    is added once per step; `per_mb` is one micro-batch's compute (`estimate.compute_s`).
    """
    m, p = layout.accum_steps, layout.pipeline
    # The pipeline's sends (ring attention's permutes over `context` run inside each micro-batch).
    sends = [t.kind == 'collective-permute' and 'pipeline' in t.axes for t in transfers]
    permute_s = sum(t.exposed_s for t, send in zip(transfers, sends) if send)
    exposed_mb = sum(t.exposed_s for t, send in zip(transfers, sends) if t.per_micro_batch and not send) / m
    exposed_step = sum(t.exposed_s for t in transfers if not t.per_micro_batch)
    accumulate_s = estimate.accumulate_s(memory, layout, hw)
    stage_mb_s = per_mb + exposed_mb
    if p == 1:
        bubble_s, bubble_fraction, overhead_s = 0.0, 0.0, m * accumulate_s
    else:
        v = layout.virtual_stages if layout.schedule == 'interleaved' else 1
        slots = estimate.pipeline_slots(layout.schedule, p, m, v)
        bubble_s, bubble_fraction = (p - 1) / v * stage_mb_s * hw.bubble_scale, slots.bubble
        # The lockstep executor adds a unit's gradients (or zeros) every tick; staggered 1F1B's
        # backward branches add into the sum themselves, M times per step.
        accumulations = m if estimate.staggered(layout) else slots.ticks
        overhead_s = accumulations * accumulate_s + permute_s
    update_s = estimate.update_s(memory, hw) + hw.step_overhead_s
    step_s = m * stage_mb_s + bubble_s + overhead_s + exposed_step + update_s
    devices_s = step_s * layout.num_devices
    peak = hw.compute_flops(shape.dtype, layout.num_devices)
    return StepTime(
        compute_s=m * per_mb, exposed_comm_s=m * exposed_mb + exposed_step + permute_s, bubble_s=bubble_s,
        update_s=update_s + overhead_s - permute_s, step_s=step_s, bubble_fraction=bubble_fraction,
        tokens_per_s=layout.global_batch * shape.seq_len / step_s, mfu=flops.model / (devices_s * peak),
        model_tflops_per_device=flops.model / devices_s / 1e12,
        megatron_tflops_per_device=flops.megatron_hw / devices_s / 1e12)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one step of a layout does, independent of the time model's parameters (`timing`)."""

    shape: config_lib.ModelShape
    layout: layout_lib.Layout
    num_params: int
    memory: estimate.Memory
    flops: estimate.Flops
    compute: estimate.ComputeWork
    traffic: tuple[plan_comm.Traffic, ...]


def layout_work(shape: config_lib.ModelShape, layout: layout_lib.Layout, hw: hw_lib.Hardware, *,
                rules: Any = config_lib.DEFAULT_RULES) -> Work:
    """Parameters, memory, FLOPs, compute work and traffic of `shape` with `layout` (hw: topology only)."""
    rules = config_lib.resolve_rules(rules, shape, layout.mesh_shape)  # kv heads split or replicated
    virtual = layout.virtual
    specs = estimate.param_specs(shape, virtual)
    attention = estimate.attention_for(shape, hw)
    memory = estimate.memory(shape, layout, rules, specs, attention=attention)
    flops = estimate.flops(shape, layout, attention)
    return Work(shape, layout, estimate.count_params(specs), memory, flops,
                estimate.compute_work(shape, layout, hw, flops), plan_comm.traffic(shape, layout, rules, specs, hw))


def timing(work: Work, hw: hw_lib.Hardware) -> tuple[tuple[plan_comm.Transfer, ...], StepTime]:
    """The transfers' times and the step time of `work` on `hw` (arithmetic only: what calibration refits)."""
    per_mb = estimate.compute_s(work.compute, hw)
    transfers = plan_comm.timed(work.traffic, work.layout, hw, per_mb, work.shape.num_layers)
    return transfers, step_time(work.shape, work.layout, hw, work.flops, transfers, work.memory, per_mb)


def plan_layout(shape: config_lib.ModelShape, layout: layout_lib.Layout, hw: hw_lib.Hardware, *,
                rules: Any = config_lib.DEFAULT_RULES, name: str = '', notes: tuple[str, ...] = ()) -> Plan:
    """The plan of `shape` with `layout` on `hw` (pure arithmetic after the first call per policy)."""
    work = layout_work(shape, layout, hw, rules=rules)
    transfers, time = timing(work, hw)
    return Plan(name, layout, hw, shape, work.num_params, work.memory, work.flops, transfers, time, notes)


def plan(c: ml_collections.ConfigDict, hardware: str | hw_lib.Hardware = 'mi250x', name: str = '', *,
         validated: bool = False) -> Plan:
    """The plan of config `c` on a hardware description (a name from `hardware.NAMES`).

    `validated`: `config.validate` already ran on `c` (a training run's preflight: main validates once,
    before JAX starts); otherwise it runs here.
    """
    if not validated:
        config_lib.validate(c)
    hw = hardware if isinstance(hardware, hw_lib.Hardware) else hw_lib.get(hardware)
    layout = layout_lib.Layout.from_config(c)
    p = plan_layout(config_lib.model_shape(c), layout, hw, rules=c.sharding.rules, name=name)
    return dataclasses.replace(p, notes=notes(p, c.sharding.rules))


def notes(p: Plan, rules: Any) -> tuple[str, ...]:
    """What the user should know about this layout beyond the numbers."""
    lay, out = p.layout, []
    if lay.zero1 and lay.dp > 1:
        pls = estimate.planned_params(estimate.param_specs(p.shape, lay.virtual),
                                       lay, config_lib.resolve_rules(rules, p.shape, lay.mesh_shape))
        unsharded = sum(x.local for x in pls if x.update_local == x.local) / sum(x.local for x in pls)
        if unsharded > 0.01:
            out.append(f'ZeRO-1 leaves {unsharded:.0%} of the optimizer state unsharded: no dimension of those '
                       f'weights is divisible by the data-parallel size {lay.dp} (layout_lib.zero1_spec)')
    reductions = [t for t in p.transfers if t.per_micro_batch and 'data' in t.axes
                  and t.what.startswith(('gradients', 'embedding grad'))]
    if lay.accum_steps > 1 and reductions:
        why = 'dropout is on' if lay.dropout else 'the sharding rules put parameters on `data`'
        exposed = sum(t.exposed_s for t in reductions)
        out.append(f'gradients are reduced over `data` once per micro-batch because {why} (jaxfrontier/training/reduction.py): '
                   f'{exposed:.2f} s exposed per step; once per step would cut the bytes {lay.accum_steps}-fold')
    if lay.pipeline > 1 and lay.remat != 'full' and not estimate.staggered(lay):
        out.append(f'inside a pipeline every remat policy acts as per-layer full recomputation (model.remat='
                   f'{lay.remat} is ignored)')
    return tuple(out)


# --------------------------------------------------------------------------- output


def _gib(x: float) -> str:
    return f'{x / GIB:,.2f} GiB'


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e18, 'E'), (1e15, 'P'), (1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
        if abs(x) >= scale:
            return f'{x / scale:,.2f} {prefix}{unit}'
    return f'{x:,.0f} {unit}'


def calibration_line(hw: hw_lib.Hardware) -> str:
    """How far a calibrated description's step times can be trusted (its held-out error)."""
    c = hw.calibration
    return (f'{hw.name}: fitted to {c.get("trials")} measured steps on {c.get("machine")}; held-out step-time '
            f'error {c.get("holdout_median_abs_rel_error", float("nan")):.1%} median ({c.get("holdout")}), '
            f'uncalibrated {c.get("uncalibrated_median_abs_rel_error", float("nan")):.1%}')


def format_plan(p: Plan) -> str:
    """The plan as text for a terminal."""
    s, lay, mem, t, f = p.shape, p.layout, p.memory, p.time, p.flops
    lines = [
        f'plan{" " + p.name if p.name else ""}: {p.num_params:,} parameters ({p.num_params / 1e9:,.2f} B) '
        f'on {lay.num_devices:,} x {p.hardware.name}',
        f'  model     {s.family}: {s.num_layers} layers, d {s.d_model}, {s.num_heads} heads'
        f'{f" of {s.head_dim}" if s.head_dim != s.d_model // s.num_heads else ""}'
        f'{f" ({s.kv_heads} k/v)" if s.kv_heads < s.num_heads else ""}, MLP {s.mlp_dim}, seq {s.seq_len}, vocab '
        f'{s.vocab_size} (padded), {s.dtype}',
        f'  layout    {lay.describe()}; global batch {lay.global_batch}',
        f'  hardware  {p.hardware.description}',
        *([f'  calibration  {calibration_line(p.hardware)}'] if p.hardware.calibration else []),
        f'memory per device ({mem.stage}; activations: {mem.activations_detail.strip("()")}):',
    ]
    lines += [f'  {label.split(" (")[0] if label.startswith("activations") else label:<30s} {_gib(v):>13s}'
              for label, v in mem.items()]
    verdict = 'fits' if p.fits else 'DOES NOT FIT'
    lines.append(f'  {"total":<30s} {_gib(mem.total_bytes):>13s}  {verdict}: {p.hardware.memory_gib:.0f} GiB less '
                 f'{RESERVED_FRACTION:.0%} reserved leaves headroom {_gib(p.headroom_bytes)}')
    lines += plan_moe.format_lines(plan_moe.summary(s, lay, p.num_params), f.model, lay.global_batch * s.seq_len,
                                   t.compute_s)
    lines += [
        'FLOPs per step:',
        f'  model (matmuls, fwd + bwd)     {_si(f.model, "FLOP")}',
        f'  hardware (with recomputation) {_si(f.hardware, "FLOP")}',
        f'  Megatron formula f=3 / f={4 if f.megatron_hw > f.megatron_model else 3}     '
        f'{_si(f.megatron_model, "FLOP")} / {_si(f.megatron_hw, "FLOP")}',
        'communication per device per step:',
        f'  {"what":<46s} {"collective":<18s} {"axes":<11s} {"link":<8s} {"bytes":>11s} {"count":>8s} '
        f'{"wire s":>9s} {"exposed s":>9s}',
    ]
    for tr in p.transfers:
        lines.append(f'  {tr.what:<46s} {tr.kind:<18s} {"x".join(tr.axes):<11s} {tr.level:<8s} '
                     f'{_si(tr.payload_bytes, "B"):>11s} {tr.count:>8,.0f} {tr.time_s:>9.3f} {tr.exposed_s:>9.3f}')
    lines += [
        'time per step (roofline + communication model, docs/planner.md):',
        f'  compute {t.compute_s:.3f} s + exposed communication {t.exposed_comm_s:.3f} s + bubble {t.bubble_s:.3f} s'
        f' ({t.bubble_fraction:.1%}) + update/accumulation {t.update_s:.3f} s = {t.step_s:.3f} s',
        f'  {t.tokens_per_s:,.0f} tokens/s; MFU {t.mfu:.1%} ({t.model_tflops_per_device:.1f} model TFLOP/s per '
        f'device); Megatron hardware counter {t.megatron_tflops_per_device:.1f} TFLOP/s per device',
    ]
    lines += [f'note: {n}' for n in p.notes]
    return '\n'.join(lines)


def plan_to_json(p: Plan) -> dict[str, Any]:
    """The plan as plain JSON-able data."""
    return {
        'name': p.name, 'hardware': p.hardware.name, 'num_params': p.num_params,
        **({'hardware_calibration': p.hardware.calibration} if p.hardware.calibration else {}),
        'layout': p.layout.as_dict(), 'num_devices': p.layout.num_devices,
        'global_batch': p.layout.global_batch,
        'memory_gib': {k: v / GIB for k, v in p.memory.items()} | {'total': p.memory.total_bytes / GIB},
        'memory_stage': p.memory.stage, 'fits': p.fits, 'headroom_gib': p.headroom_bytes / GIB,
        'flops_per_step': dataclasses.asdict(p.flops),
        'communication': [dataclasses.asdict(t) for t in p.transfers],
        'time': dataclasses.asdict(p.time), 'notes': list(p.notes),
        **({'moe': dataclasses.asdict(x)} if (x := plan_moe.summary(p.shape, p.layout, p.num_params)) else {}),
    }


def dumps(p: Plan) -> str:
    return json.dumps(plan_to_json(p), indent=1, default=float)
