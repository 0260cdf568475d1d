"""The planner's formulas: parameter table, memory, FLOPs, communication and compute time.

Everything here is arithmetic on a `ModelShape`, a `layout.Layout`, the logical-axis rules
and a `hardware.Hardware`; nothing is allocated or compiled. docs/planner.md explains each
formula and how it was checked against XLA's compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, NamedTuple

from jaxfrontier.plan import activations
from jaxfrontier.plan import moe as plan_moe
from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model.attention import blockwise
from jaxfrontier import families
from jaxfrontier.families import ParamSpec
from jaxfrontier.families import lora as lora_lib
from jaxfrontier import layout as layout_lib

# Share of device memory kept free for the runtime, the allocator's fragmentation and
# collective buffers: a layout "fits" when the estimate is within the rest.
RESERVED_FRACTION = 0.10
PARAM_BYTES = 4  # parameters, gradients and optimizer moments are fp32
# Arrays of the update layout the optimizer update reads or writes: AdamW reads gradient,
# parameter and both moments and writes three; Lion reads three, writes two; Adafactor reads
# gradient and parameter, its update twice more (block-RMS clipping, parameter scale), writes one.
UPDATE_PASSES = {'adamw': 7, 'lion': 5, 'adafactor': 5}
# Share of a layer's residual set live at once while `jax.checkpoint` recomputes it in the
# backward pass (calibrated on XLA:CPU, docs/planner.md).
RECOMPUTE_LIVE_FRACTION = 0.85


# --------------------------------------------------------------------------- parameters


def param_specs(s: config_lib.ModelShape, virtual: int = 1) -> tuple[ParamSpec, ...]:
    """Every parameter of the model: the family's table (`Family.param_specs`, tested against eval_shape), and
    LoRA's adapters (families/lora.py). With `virtual` > 1 (interleaved pipelines) block parameters are stored
    [V, L / V, ...] (`params_lib.split_virtual`).
    """
    specs = families.get(s.family).param_specs(s)
    specs += lora_lib.adapter_specs(specs, s.lora) if s.lora is not None else ()
    if virtual == 1:
        return specs
    return tuple(ParamSpec(p.path, (virtual, p.shape[0] // virtual, *p.shape[1:]), ('virtual', *p.names))
                 if p.is_block else p for p in specs)


def count_params(specs: tuple[ParamSpec, ...]) -> int:
    return sum(p.size for p in specs)


def local_size(shape: tuple[int, ...], spec: Any, mesh_shape: dict[str, int]) -> int:
    """Elements of one device's shard (XLA pads a dimension that does not divide)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    return math.prod(-(-dim // math.prod(mesh_shape[a] for a in mesh_lib.entry_axes(e))) for dim, e in zip(shape, entries))


@dataclasses.dataclass(frozen=True)
class PlannedParam:
    """Per-device elements of one parameter in its own layout and in the update layout."""

    spec: ParamSpec
    param_spec: Any  # PartitionSpec of the parameter
    update_spec: Any  # PartitionSpec of its gradient at the optimizer (ZeRO-1: also over DP)
    local: int
    update_local: int


def planned_params(specs: tuple[ParamSpec, ...], layout, rules) -> tuple[PlannedParam, ...]:
    """Shardings of every parameter under `rules` on `layout`'s mesh, as `train_state` builds them.

    Remembered by what it reads (specs, mesh sizes, ZeRO-1, rules): a layout search plans
    thousands of layouts that differ only in micro-batch, remat or schedule (the 175B search on
    1,024 devices: 26,414 plans, two calls each), and this took 40 % of its time.
    """
    return _planned_params(specs, tuple(layout.mesh_shape.items()), bool(layout.zero1), _frozen(rules))


def _frozen(value):
    """`value` with its lists as tuples (a rule table from a ConfigDict), so that it can be a cache key."""
    try:
        hash(value)
        return value
    except TypeError:
        return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


@functools.lru_cache(maxsize=4096)
def _planned_params(specs, mesh_items, zero1: bool, rules) -> tuple[PlannedParam, ...]:
    mesh_shape = dict(mesh_items)
    mesh = types.SimpleNamespace(shape=mesh_shape)
    dp_axes = mesh_lib.data_parallel_axes(rules)
    out = []
    for p in specs:
        spec = mesh_lib.logical_to_spec(p.names, rules)
        update = layout_lib.zero1_spec(spec, p.shape, mesh, dp_axes) if zero1 else spec
        out.append(PlannedParam(p, spec, update, local_size(p.shape, spec, mesh_shape),
                               local_size(p.shape, update, mesh_shape)))
    return tuple(out)


# --------------------------------------------------------------------------- memory


def optimizer_bytes(pls: tuple[PlannedParam, ...], layout) -> float:
    """Bytes per device of the optimizer state of `layout.optimizer` (training/optimizer.py).

    adamw: two fp32 moments (8 B per parameter) in the update layout, plus two step counters.
    lion: one moment (4 B), two counters. adafactor: a factored weight (`layout.factored_dims`)
    keeps a row and a column factor (its size over either factored dimension), each sharded like
    the dimensions it keeps; any other parameter a full second moment (4 B); optax keeps a
    one-element placeholder for each kind a parameter does not use, and three counters.
    """
    if layout.optimizer == 'adamw':
        return 2 * PARAM_BYTES * sum(p.update_local for p in pls) + 8
    if layout.optimizer == 'lion':
        return PARAM_BYTES * sum(p.update_local for p in pls) + 8
    total = 12.0
    for p in pls:
        shape, dims = p.spec.shape, layout_lib.factored_dims(p.spec.shape, layout.factor_min_dim)
        if dims is None:  # a full moment, and (1,) placeholders for the two factors
            total += PARAM_BYTES * (p.update_local + 2)
            continue
        total += PARAM_BYTES  # the (1,) placeholder of the full moment
        for dropped in dims:
            kept = tuple(n for i, n in enumerate(shape) if i != dropped)
            total += PARAM_BYTES * local_size(kept, layout_lib.drop_axis(p.update_spec, dropped, len(shape)),
                                              layout.mesh_shape)
    return total


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device on the device that needs the most (`stage`)."""

    params_bytes: float
    grads_bytes: float  # one micro-batch's gradients, plus the running sum with accumulation
    optimizer_bytes: float
    activations_bytes: float  # residuals kept for the backward pass (all in-flight micro-batches)
    temporaries_bytes: float  # the largest working set on top (one layer's backward, or the head's)
    inputs_bytes: float  # the token batch
    stage: str  # which device: 'every device', 'pipeline stage 0', ...
    activations_detail: str = ''
    update_traffic_bytes: float = 0.0  # memory traffic of the optimizer update (`update_s`)

    def items(self) -> list[tuple[str, float]]:
        return [('parameters (fp32)', self.params_bytes), ('gradients (fp32)', self.grads_bytes),
                ('optimizer state (fp32)', self.optimizer_bytes),
                (f'activations {self.activations_detail}'.strip(), self.activations_bytes),
                ('temporaries (working set)', self.temporaries_bytes), ('input batch', self.inputs_bytes)]

    @property
    def total_bytes(self) -> float:
        return sum(v for _, v in self.items())


@dataclasses.dataclass(frozen=True)
class PipelineSlots:
    """Buffers and ticks of `schedules.build` for a layout (closed forms, tested against it)."""

    act_slots: int  # stashed chunk inputs a stage holds at once
    grad_slots: int  # received input gradients a stage holds at once
    ticks: int  # iterations of the tick loop
    bubble: float  # (P - 1) / (V M + P - 1)


def pipeline_slots(schedule: str, p: int, m: int, v: int = 1) -> PipelineSlots:
    """Slots and ticks of the pipeline executors: GPipe stashes all M micro-batches, lockstep
    1F1B at most 2P - 1, interleaved at most V P + P - 1 chunks (each of them every layer's
    input); staggered 1F1B (pipeline/staggered.py) P chunk inputs, over 2M + 2P - 2 half-slots."""
    if schedule == '1f1b':
        return PipelineSlots(p, 1, 2 * m + 2 * p - 2, (p - 1) / (m + p - 1))
    if schedule == 'gpipe':
        slots, ticks = m, 2 * m + 2 * p - 3
    else:
        v = v if schedule == 'interleaved' else 1
        slots = min(v * m, v * p + p - 1)
        ticks = v * m + (v + 1) * p - 2
    return PipelineSlots(slots, 1, ticks, (p - 1) / (v * m + p - 1))


class _ActLayout(NamedTuple):
    """The layout fields the activation sizes read (`_act_sizes`), hashable: `layer_bytes`' cache key."""

    micro_batch: int
    tensor: int
    fsdp: int
    context: int
    sequence_parallel: bool
    data: int = 1  # with `expert`: a MoE layer's routed buffer (plan/moe.py)
    expert: int = 1

    @classmethod
    def of(cls, layout) -> '_ActLayout':
        return cls(*(getattr(layout, field) for field in cls._fields))


def _act_sizes(shape, layout, weight: bool) -> dict[str, int]:
    shape = plan_moe.act_shape(shape, layout)  # MoE: `f` arrays as wide as the routed buffer per token
    return activations.act_sizes(shape, layout.micro_batch, layout.tensor, layout.fsdp, weight, layout.context,
                                 layout.sequence_parallel)


def layer_bytes(shape, layout, remat: str, attention: str = 'xla') -> tuple[float, float]:
    """(residual bytes of one layer for one micro-batch, the same for the embedding + head).

    Remembered by what it reads (`_ActLayout`): a layout search asks it for thousands of layouts
    that share those fields (30 % of the search's time before).
    """
    return _layer_bytes(shape, remat, attention, _ActLayout.of(layout))


@functools.lru_cache(maxsize=65536)
def _layer_bytes(shape, remat: str, attention: str, layout: _ActLayout) -> tuple[float, float]:
    sig = activations.for_shape(shape, remat, attention)
    act, weight = _act_sizes(shape, layout, False), _act_sizes(shape, layout, True)
    return (activations.residual_bytes(sig.block, act, weight), activations.residual_bytes(sig.head, act, weight))


def backward_working_bytes(shape, layout, attention: str = 'xla') -> float:
    """Transient buffers of one layer's backward when its residuals are stashed (docs/planner.md).

    The gradient path in fp32: 3 attention-score-sized buffers (probabilities, their gradient,
    the scores' gradient; none with a fused kernel), 3 MLP-hidden-sized and 6 residual-stream-
    sized ones. Calibrated on XLA:CPU with GPT; a gated (SwiGLU) MLP keeps as many F-wide residuals
    as GPT's GeLU MLP (6 per layer, traced), and the same count holds it to XLA (tests/plan).
    """
    a = _act_sizes(shape, layout, False)
    scores = 3 * a['b'] * a['h'] * a['t'] * a['t_keys'] * 4  # local queries against every key
    if attention == 'cudnn':
        scores = 0
    elif attention == 'blockwise':  # one block pair's scores, probabilities and their gradient at a time
        scores = 3 * a['b'] * a['h'] * shape.attention_block_q * shape.attention_block_kv * 4
    stream = (3 * a['n'] * a['f'] + 6 * a['n'] * a['d'] // a['stream']) * 4
    return scores + stream


def gathered_layer_bytes(shape, layout, rules=config_lib.DEFAULT_RULES) -> float:
    """One layer's weights gathered over fsdp (fp32, as stored) while it runs: the family's block
    parameters, each in its own layout without the fsdp split (k/v heads whole where `rules`
    leave them unsplit)."""
    if layout.fsdp == 1:
        return 0.0
    gathered = dict(layout.mesh_shape, fsdp=1, pipeline=1)
    rules = config_lib.resolve_rules(rules, shape, layout.mesh_shape)
    block = [p for p in param_specs(shape) if p.is_block]
    return PARAM_BYTES * sum(local_size(p.shape[1:], mesh_lib.logical_to_spec(p.names[1:], rules), gathered)
                             for p in block)


def layer_working_bytes(shape, layout, attention: str = 'xla') -> float:
    """Peak extra memory of one layer's backward.

    With full recomputation the layer's residual set (the `none` policy's) is rebuilt and
    consumed while its gradients replace it. Under `jax.checkpoint` (no pipeline) XLA fuses
    part of the recomputation into its consumers, so RECOMPUTE_LIVE_FRACTION of the set is
    live at once (XLA:CPU: 0.81-0.83); the pipeline's explicit per-layer `jax.vjp` holds all of
    it. Without recomputation the residuals are already stashed and only the gradient path's
    buffers (`backward_working_bytes`) come on top. Either way the layer's weights gathered over
    fsdp are live too.
    """
    gathered = gathered_layer_bytes(shape, layout)
    if effective_remat(layout) != 'full':
        return backward_working_bytes(shape, layout, attention) + gathered
    fraction = RECOMPUTE_LIVE_FRACTION if layout.pipeline == 1 else 1.0
    return fraction * layer_bytes(shape, layout, 'none', attention)[0] + gathered


def _plain_memory(shape, layout, states: dict[str, float], attention: str) -> tuple[float, float, float, str]:
    """(gradients, activations, temporaries, detail) of `training.step.make_loss_and_grads` without a pipeline.

    Gradients: one micro-batch's (parameter layout) plus the running sum (update layout)
    when accumulating, of the trained parameters (LoRA: the adapters alone). Activations: every layer's residuals under the remat policy for one
    micro-batch. Temporaries: the largest of one layer's backward (`layer_working_bytes`),
    the head's backward (its residuals, the logits and their gradient) and Adam's update.
    """
    per_layer, head = layer_bytes(shape, layout, layout.remat, attention)
    a = _act_sizes(shape, layout, False)
    grads = states['trained'] + (states['update'] if layout.accum_steps > 1 else 0)
    acts = shape.num_layers * per_layer
    head_ws = head + 2 * a['n'] * a['v'] * 4
    temps = max(layer_working_bytes(shape, layout, attention), head_ws, states['update'])
    return grads, acts, temps, f'{layout.remat} remat, one micro-batch'


def _pipeline_memory(shape, layout, states: dict[str, float], attention: str) -> tuple[float, float, float, str]:
    """The same for the pipeline executors (every policy acts as per-layer full remat).

    Gradients: fp32 accumulators of the stage's blocks and of the shared (embedding, head)
    parameters, plus one unit's gradients of a chunk and of the shared parameters.
    Activations, lockstep executor (pipeline/lockstep.py): the stash carry (slots x chunk layers x
    [tokens, d]) and the received gradient slots. Staggered 1F1B (pipeline/staggered.py): P chunk
    inputs and the message buffer, plus one chunk's `jax.vjp` residuals (the `none` policy's
    set) carried from the recomputation to the backward, and the last stage's own output
    gradient. The stash and messages are split over tensor (`Layout.split_tokens`).
    Temporaries: a backward unit's working set (lockstep: its chunk's layer inputs plus one
    layer's recomputed residuals; staggered: the new residual set being built while the
    carried one is live, or one layer's backward buffers) or the head's backward; or Adam's update.
    """
    v = layout.virtual_stages if layout.schedule == 'interleaved' else 1
    slots = pipeline_slots(layout.schedule, layout.pipeline, layout.accum_steps, v)
    chunk_layers = shape.num_layers // (layout.pipeline * v)
    a = _act_sizes(shape, layout, False)
    act = a['n'] * a['d'] * (4 if shape.dtype == 'float32' else 2)
    split = max(layout.split_tokens, a['stream'])  # TokenSplit's stash split, or SP's stream split
    block, shared = states['block_params'], states['params'] - states['block_params']
    grads = block + block / v + 2 * shared
    _, head = layer_bytes(shape, layout, 'none', attention)
    head_ws = head + 2 * a['n'] * a['v'] * 4
    if staggered(layout):
        residuals = chunk_layers * layer_bytes(shape, layout, effective_remat(layout), attention)[0]
        acts = (slots.act_slots * act + act) / split + act + residuals
        working = max(residuals, backward_working_bytes(shape, layout, attention), head_ws) + \
            gathered_layer_bytes(shape, layout)
        detail = f'1f1b: {slots.act_slots} stashed chunk inputs + one chunk\'s residuals ({chunk_layers} layers)'
    else:
        acts = (slots.act_slots * chunk_layers * act + slots.grad_slots * act) / split
        working = chunk_layers * act + max(layer_working_bytes(shape, layout, attention), head_ws)
        detail = f'{layout.schedule}: {slots.act_slots} stashed chunk inputs of {chunk_layers} layers'
    temps = max(working, states['update'])
    return grads, acts, temps, detail


def memory(shape, layout, rules, specs, attention: str = 'xla') -> Memory:
    """Per-device memory of one training step at its peak (see `Memory` and docs/planner.md)."""
    pls = planned_params(specs, layout, rules)
    trained = tuple(p for p in pls if lora_lib.trainable(p.spec, shape))  # LoRA: the adapters; the base frozen
    states = {'params': PARAM_BYTES * sum(p.local for p in pls),
              'block_params': PARAM_BYTES * sum(p.local for p in pls if p.spec.is_block),
              'trained': PARAM_BYTES * sum(p.local for p in trained),
              'update': PARAM_BYTES * sum(p.update_local for p in trained)}
    optimizer = optimizer_bytes(trained, layout)
    inputs = 4 * layout.global_batch * (shape.seq_len + 1) / layout.dp
    if layout.pipeline == 1:
        grads, acts, temps, detail = _plain_memory(shape, layout, states, attention)
        stage = 'every device'
    else:
        grads, acts, temps, detail = _pipeline_memory(shape, layout, states, attention)
        stage = 'every pipeline stage'
    return Memory(states['params'], grads, optimizer, acts, temps, inputs, stage, f'({detail})',
                  UPDATE_PASSES[layout.optimizer] * (states['update'] + PARAM_BYTES))


# --------------------------------------------------------------------------- FLOPs


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of one optimizer step (whole model, all devices)."""

    model: float  # matmuls of forward + backward, no recomputation (basis of MFU)
    hardware: float  # plus what the remat policy recomputes
    megatron_model: float  # Megatron's formula, f = 3 (the family's megatron_flops, flops.py)
    megatron_hw: float  # Megatron's formula, f = 4 with recomputation (the paper's counter)
    layer_forward: float  # one layer's forward matmuls for one micro-batch of one replica
    head_forward: float


def forward_flops(shape) -> tuple[float, float]:
    """Forward matmul FLOPs of one layer and of the head, per sequence: the family's count
    (`Family.forward_flops`; attention counted in full)."""
    return families.get(shape.family).forward_flops(shape)


def staggered(layout) -> bool:
    """The staggered 1F1B executor (pipeline/staggered.py) runs this layout."""
    return layout.pipeline > 1 and layout.schedule == '1f1b'


def effective_remat(layout) -> str:
    """The remat policy that runs: the lockstep pipeline executor makes every policy per-layer
    `full`; staggered 1F1B recomputes every chunk but its last stage's in its forward half-slot
    and keeps `config.STAGGERED_RESIDUALS[remat]` for the backward."""
    if staggered(layout):
        return config_lib.STAGGERED_RESIDUALS[layout.remat]
    return 'full' if layout.pipeline > 1 else layout.remat


def blockwise_attention_share(shape) -> float:
    """Share of the full s x s score matrix the blockwise kernel computes (the causal blocks)."""
    pairs = blockwise.visited_block_pairs(shape.seq_len, shape.attention_block_q, shape.attention_block_kv)
    return pairs * shape.attention_block_q * shape.attention_block_kv / shape.seq_len**2


def flops(shape, layout, attention: str = 'xla') -> Flops:
    """Model, hardware and Megatron FLOPs per step; see `Flops`.

    With the blockwise kernel the attention matmuls run only on the causal blocks (share r of
    the s x s scores), and its backward recomputes the scores: forward r A, backward 2.5 r A
    (5 matmuls instead of 4), recomputation r A, where A is the full forward attention.
    """
    layer, head = forward_flops(shape)
    b, L = layout.global_batch, shape.num_layers
    model = 3 * b * (L * layer + head)
    attention_fwd = 2 * 2 * shape.seq_len * shape.seq_len * shape.num_heads * shape.head_dim  # h K: d unless apart
    share = blockwise_attention_share(shape) if attention == 'blockwise' else 1.0
    layer_run = layer - (1 - share) * attention_fwd  # one layer's forward as the kernel computes it
    # Full recomputation skips the MLP output projection: it only feeds the layer output the stash holds.
    full = layer_run - 2 * shape.seq_len * shape.d_model * shape.mlp_dim
    kept = {'blockwise': 0.0, 'cudnn': share * attention_fwd}.get(attention, attention_fwd / 2)
    recompute = {'none': 0.0, 'full': full, 'save_dots': 0.0, 'save_dots_no_batch': share * attention_fwd,
                 'save_dots_attention': kept}  # output kept: cuDNN's forward again (unnamed statistics), xla's q k^T
    hardware = model + b * L * recompute[effective_remat(layout)]
    if staggered(layout):
        # Staggered 1F1B recomputes whole chunks under one `jax.vjp` of the layer scan (the scan
        # carry computes every layer's output, the last one's too) and the last stage nothing:
        # its one forward keeps the residuals for its backward. The backward then recomputes
        # what the residual policy did not keep (save_dots_no_batch: the attention core).
        hardware = model + b * (L - L // layout.pipeline) * layer_run + b * L * recompute[effective_remat(layout)]
    if attention == 'blockwise':  # forward r A + backward 2.5 r A instead of 3 A (see above)
        hardware += b * L * (3.5 * share - 3) * attention_fwd
    megatron = families.get(shape.family).megatron_flops
    return Flops(model, hardware, megatron(b, shape, False),
                 megatron(b, shape, staggered(layout) or effective_remat(layout) != 'none'),
                 layer_run * layout.micro_batch, head * layout.micro_batch)


def attention_for(shape: config_lib.ModelShape, hw: hw_lib.Hardware) -> str:
    """The attention kernel 'auto' picks on `hw`, as `model.attention.resolve_impl` does on a
    device: cuDNN on NVIDIA with 16-bit compute, blockwise everywhere else."""
    if shape.attention != 'auto':
        return shape.attention
    nvidia = hw.name in ('a100', 'h100', 'h200') or 'NVIDIA' in hw.description
    return 'cudnn' if nvidia and shape.dtype in ('bfloat16', 'float16') else 'blockwise'


@dataclasses.dataclass(frozen=True)
class ComputeWork:
    """One micro-batch through one pipeline stage of one replica, per device, before timing."""

    matmul_flops: float  # hardware matmul FLOPs (recomputation included)
    memory_bytes: float  # element-wise traffic over HBM
    layer_flops: float  # one layer's forward matmuls per device and micro-batch: the GEMM size
    layers: float  # layers on the stage
    num_devices: int
    dtype: str
    stash_bytes: float = 0.0  # residuals the layers keep from forward to backward (the policy that runs)


def compute_work(shape, layout, hw: hw_lib.Hardware, fl: Flops) -> ComputeWork:
    """What `compute_s` times: matmul FLOPs and memory-bound bytes of one micro-batch.

    Every residual of a layer (the `none` policy's set) is written once in the forward, again
    when recomputed, read once in the backward, and its gradient written and read once (4 or
    5 passes over HBM). Embedding and head count on the average stage (1/P of them).
    """
    per_replica = fl.hardware / layout.dp / layout.accum_steps  # one micro-batch, all stages
    attention, remat = attention_for(shape, hw), effective_remat(layout)
    none_layer, head = layer_bytes(shape, layout, 'none', attention)
    passes = 4 + (1 if remat != 'none' else 0)
    kept_layer, _ = layer_bytes(shape, layout, remat, attention)  # what `hw.stash_passes` charges
    split = layout.tensor * layout.context  # a replica's work over its tensor group and context ring
    per_replica = plan_moe.imbalanced(per_replica, shape, layout)  # MoE: routed matmuls at their buffer
    return ComputeWork(matmul_flops=per_replica / layout.pipeline / split,
                       memory_bytes=passes * (shape.num_layers * none_layer + head) / layout.pipeline,
                       layer_flops=fl.layer_forward / split, layers=shape.num_layers / layout.pipeline,
                       num_devices=layout.num_devices, dtype=shape.dtype,
                       stash_bytes=shape.num_layers * kept_layer / layout.pipeline)


def gemm_efficiency(hw: hw_lib.Hardware, layer_flops: float) -> float:
    """Share of the peak a layer's matmuls reach: `matmul_efficiency`, less for small GEMMs."""
    if hw.gemm_half_flops <= 0:
        return hw.matmul_efficiency
    return hw.matmul_efficiency * layer_flops / (layer_flops + hw.gemm_half_flops)


def compute_s(work: ComputeWork, hw: hw_lib.Hardware) -> float:
    """Roofline time of `work` (one micro-batch through one pipeline stage of one replica) on `hw`.

    Matmuls run at `gemm_efficiency` of the dense peak (`hw.matmul_efficiency` for large
    GEMMs); everything else is memory bound (`compute_work`), the residuals kept for the
    backward `hw.stash_passes` more times; a fixed cost per layer on top.
    """
    peak = hw.compute_flops(work.dtype, work.num_devices) * gemm_efficiency(hw, work.layer_flops)
    memory_s = (work.memory_bytes + hw.stash_passes * work.stash_bytes) / hw.memory_bytes_per_s
    return work.matmul_flops / peak + memory_s + hw.layer_overhead_s * work.layers


def accumulate_s(mem: Memory, layout, hw: hw_lib.Hardware) -> float:
    """Adding one micro-batch's gradients to the running sum: read both, write one (per micro-batch).

    The pipeline's tick loop does it every tick, idle or not (a `b_none` unit adds zeros).
    """
    if layout.pipeline == 1:
        return 3 * mem.params_bytes / hw.memory_bytes_per_s if layout.accum_steps > 1 else 0.0
    return 3 * (mem.grads_bytes - mem.params_bytes) / hw.memory_bytes_per_s


def update_s(mem: Memory, hw: hw_lib.Hardware) -> float:
    """Optimizer update: `UPDATE_PASSES` over the update layout's arrays (memory bound)."""
    return mem.update_traffic_bytes / hw.memory_bytes_per_s
