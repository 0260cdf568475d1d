"""The planner's communication model: what each mesh axis carries per step, and for how long.

Per device and optimizer step, following what XLA emits for `training.step.make_train_step` (the
comparison with the compiled HLO is in tests/plan/test_planner.py; docs/planner.md has the table):

  tensor    per layer and micro-batch, 2 all-reduces of the [tokens, d] activations forward
            and 2 backward (Megatron's f/g), 1 more when full remat recomputes the forward (the
            layer's output all-reduce is not needed again); the backward's carry one [tokens, d]
            input gradient per column-parallel input projection (fused QKV and MLP-in: 2; separate
            q, k/v, gate and up: 4);
            the vocabulary-parallel embedding's psum (fp32) and the head's input gradient.
  fsdp      every weight all-gathered before its forward and again for its backward (fp32,
            as stored); gradients reduce-scattered (all-reduce + slice on XLA:CPU).
  data      with several micro-batches (or a pipeline) and no dropout, gradients are
            accumulated per replica and all-reduced over `data` once per step
            (jaxfrontier/training/reduction.py); otherwise all-reduced on their fsdp shard once per
            micro-batch. With ZeRO-1 they are then sliced into the optimizer layout and the
            updated parameters all-gathered once per step.
            With `sharding.sequence_parallel` each of those all-reduces is a reduce-scatter
            plus an all-gather of the same payload (the same bytes on the wire).
  context   ring attention (`ring_traffic`, model/attention/ring.py): per layer the positions all-gathered
            and c - 1 collective-permutes of a k/v chunk forward (again when recomputed), c - 1
            of k/v and c of fp32 dk/dv backward; every other activation term above carries this
            device's T/c tokens.
  pipeline  each micro-batch's activations sent forward and their gradient sent back at
            every stage boundary (per virtual stage with the interleaved schedule), split over
            tensor (1/TP each) with `pipeline.shard_activations`, which also all-gathers over
            tensor each stashed layer input before its recomputation, and the received
            activation and gradient before use.

Reductions over fsdp (and over data when not once) run once per micro-batch: the running
gradient sum keeps the parameters' (or, per micro-batch, the update) layout at every
accumulation step. A tied embedding's gradient is reduced twice (its head and its lookup
contributions are separate sums).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxfrontier.families import lora as lora_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.plan import estimate as pm
from jaxfrontier.plan import moe as plan_moe


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One kind of collective traffic of a step, per device."""

    what: str
    kind: str  # all-reduce | all-gather | reduce-scatter | collective-permute | all-to-all | ragged-all-to-all
    axes: tuple[str, ...]
    payload_bytes: float  # per device per step, summed over executions (hlo_collectives convention)
    count: float  # executions per step (per device, averaged over pipeline stages)
    level: str  # slowest link crossed: package | node | network
    time_s: float  # on the wire, not overlapped
    exposed_s: float  # not hidden behind compute (docs/planner.md)
    per_micro_batch: bool  # repeats with every micro-batch (inside the pipeline timeline)


# Share of a step's compute the ring's transfers can hide behind (the attention blocks of each
# layer, forward and backward; an assumption until kern's ring is timed, docs/long_context.md).
RING_HIDDEN_SHARE = 0.5

_WIRE_FACTOR = {'all-reduce': lambda n: 2 * (n - 1) / n, 'all-gather': lambda n: (n - 1) / n,
                'reduce-scatter': lambda n: (n - 1) / n, 'collective-permute': lambda n: 1.0}
ALL_TO_ALL = ('all-to-all', 'ragged-all-to-all')  # each device sends (n - 1) / n of its buffer straight to its peers


def wire_time_s(kind: str, payload_bytes: float, count: float, group: int, level: str, hw: hw_lib.Hardware,
                shares: dict[str, float] | None = None) -> float:
    """Time of `count` collectives over `group` devices moving `payload_bytes` in all: ring algorithms at the
    slowest level's bandwidth; an all-to-all sends each peer its slice at that peer's level (`shares`:
    hardware.peer_shares), the levels' links at once (the slowest level's bytes set the time)."""
    if group <= 1 or payload_bytes <= 0:
        return 0.0
    if kind in ALL_TO_ALL:
        sent = payload_bytes * (group - 1) / group
        shares = shares or {level: 1.0}
        wire = max(share * sent / hw_lib.link_bytes_per_s(hw, at) for at, share in shares.items() if share > 0)
        return count * (group - 1) * hw.link_latency_s[level] + wire
    steps = 2 * (group - 1) if kind == 'all-reduce' else 1 if kind == 'collective-permute' else group - 1
    bandwidth = hw_lib.link_bytes_per_s(hw, level)
    return count * steps * hw.link_latency_s[level] + _WIRE_FACTOR[kind](group) * payload_bytes / bandwidth


def _topology(per_package: int, per_node: int) -> hw_lib.Hardware:
    """A hardware description with only these device counts mattering (the caches' key)."""
    return dataclasses.replace(hw_lib.HARDWARE['mi250x'], devices_per_package=per_package, devices_per_node=per_node)


@functools.lru_cache(maxsize=4096)
def _level(mesh_items: tuple[tuple[str, int], ...], axes: tuple[str, ...], per_package: int, per_node: int) -> str:
    return hw_lib.axis_level(dict(mesh_items), axes, _topology(per_package, per_node))


@functools.lru_cache(maxsize=4096)
def _shares(mesh_items: tuple[tuple[str, int], ...], axes: tuple[str, ...], per_package: int, per_node: int
            ) -> tuple[tuple[str, float], ...]:
    return tuple(hw_lib.peer_shares(dict(mesh_items), axes, _topology(per_package, per_node)).items())


@dataclasses.dataclass
class _Traffic:
    """Accumulates (what, kind, axes) -> [payload bytes, executions] before timing."""

    items: dict = dataclasses.field(default_factory=dict)

    def add(self, what: str, kind: str, axes: tuple[str, ...], payload_bytes: float, count: float,
            per_micro_batch: bool = True) -> None:
        axes = tuple(a for a in axes if a)
        if not axes or payload_bytes <= 0 or count <= 0:
            return
        key = (what, kind, axes, per_micro_batch)
        old = self.items.get(key, (0.0, 0.0))
        self.items[key] = (old[0] + payload_bytes * count, old[1] + count)


def input_projections(specs, rules) -> tuple[int, int]:
    """Matrices of one block that read the block's [tokens, d] stream, as the backward reduces them.

    Returns (how many are column-parallel: each one's input gradient is a partial sum over
    tensor; a fused QKV and MLP-in: 2; separate q, k/v, gate and up: 4), and the output width
    per token of those that are not split over tensor (grouped k/v where the k/v heads do not
    divide tensor: 2 g K): every tensor rank holds a part of their output gradient (the part
    its query heads read), which XLA sums over tensor.
    """
    split, whole = 0, 0
    for p in specs:
        lead = sum(1 for n in p.names if n in ('virtual', 'layers'))  # the stacked (and interleaved) axes
        names, shape = p.names[lead:], p.shape[lead:]
        if p.is_block and len(shape) > 1 and names[0] == 'embed' and not plan_moe.is_router(p.path):
            if 'tensor' in mesh_lib.spec_axes(mesh_lib.logical_to_spec(names[1:], rules)):
                split += 1
            else:
                whole += math.prod(shape[1:])
    return split, whole


def ring_traffic(t: _Traffic, shape, layout, dtype_bytes: int) -> None:
    """Context parallelism's ring attention (model/attention/ring.py): k/v chunks passed around the `context` ring.

    Per layer and micro-batch, as `ring.ring_send_bytes` counts one call (held against the
    compiled program by tests/model/test_ring.py): the forward all-gathers the int32 positions
    and passes this rank's k and v [B, T/c, H/TP, K] (repeated to the query heads at the call
    site) c - 1 hops; full remat runs that forward again; the backward passes k and v c - 1 hops
    and their fp32 gradients dk, dv c hops (home). Packed documents' segment ids (an int32 more
    per token in the gather) are left out: the layout does not know them.
    """
    c = layout.context
    if c <= 1:
        return
    heads = -(-shape.num_heads // layout.tensor)
    rows = layout.micro_batch * (shape.seq_len // c)
    kv, grads = 2 * rows * heads * shape.head_dim * dtype_bytes, 2 * rows * heads * shape.head_dim * 4
    calls = layout.accum_steps * shape.num_layers / layout.pipeline
    forwards = calls * (2 if pm.effective_remat(layout) == 'full' or pm.staggered(layout) else 1)
    t.add('ring attention: positions', 'all-gather', ('context',), layout.micro_batch * shape.seq_len * 4, forwards)
    t.add('ring attention: k/v chunks', 'collective-permute', ('context',), kv, forwards * (c - 1))
    t.add('ring attention backward: k/v chunks', 'collective-permute', ('context',), kv, calls * (c - 1))
    t.add('ring attention backward: dk/dv home', 'collective-permute', ('context',), grads, calls * c)


def _activation_traffic(t: _Traffic, shape, layout, dtype_bytes: int, projections: tuple[int, int] = (2, 0)
                        ) -> None:
    m, p = layout.accum_steps, layout.pipeline
    act = layout.micro_batch * -(-shape.seq_len // layout.context) * shape.d_model  # this device's tokens
    ring_traffic(t, shape, layout, dtype_bytes)
    if layout.tensor > 1:
        per_layer = 4 + (1 if pm.effective_remat(layout) == 'full' else 0)  # recompute: all but the last
        if pm.staggered(layout):  # forward, recomputation (all of it) and backward; the last stage: no forward
            per_layer = (6 * (p - 1) + 4) / p
        if layout.sequence_parallel:  # Megatron's SP: each all-reduce becomes a reduce-scatter + all-gather
            for kind in ('reduce-scatter', 'all-gather'):
                t.add('activations (Megatron SP g/g-bar)', kind, ('tensor',), act * dtype_bytes,
                      m * shape.num_layers / p * per_layer)
        else:
            t.add('activations (Megatron f/g)', 'all-reduce', ('tensor',), act * dtype_bytes,
                  m * shape.num_layers / p * per_layer)
        # Separate input projections (q and k/v, gate and up) each send their own input
        # gradient: XLA combines them with the sublayer's one all-reduce, whose payload grows.
        split, whole = projections
        t.add('input gradients of separate projections', 'all-reduce', ('tensor',), act * dtype_bytes,
              m * shape.num_layers / p * (split - 2))
        # Unsplit k/v (heads that do not divide tensor): XLA still splits their projection's
        # columns over tensor and all-gathers the output (again when recomputed), and sums the
        # output gradient, of which each rank holds its query heads' part.
        recomputed = 1 if pm.effective_remat(layout) == 'full' or pm.staggered(layout) else 0
        kv_bytes = layout.micro_batch * shape.seq_len * whole * dtype_bytes
        t.add('unsplit k/v projections gathered', 'all-gather', ('tensor',), kv_bytes,
              m * shape.num_layers / p * (1 + recomputed))
        t.add('output gradients of unsplit k/v projections', 'all-reduce', ('tensor',), kv_bytes,
              m * shape.num_layers / p)
        t.add('vocabulary-parallel embedding (fp32)', 'all-reduce', ('tensor',), act * 4, m / p)
        t.add('head input gradient', 'all-reduce', ('tensor',), act * dtype_bytes, m / p)
    if p > 1:
        v = layout.virtual_stages if layout.schedule == 'interleaved' else 1
        ticks = pm.pipeline_slots(layout.schedule, p, m, v).ticks
        split = layout.split_tokens
        staggered = layout.schedule == '1f1b'  # one message per half-slot; lockstep: two per tick
        sends = (ticks // 2 if p == 2 else ticks) if staggered else 2 * ticks  # P = 2: every other half-slot
        t.add('stage activations and their gradients', 'collective-permute', ('pipeline',),
              act * dtype_bytes / split, sends)
        if split > 1:  # pipeline.TokenSplit
            if staggered:  # per micro-batch: forward input, recomputation input, received gradient
                gathers = m * 3 * (p - 1) / p  # stage 0 embeds (no forward gather); the last stage gathers one
            else:  # the stashed layer inputs and the received activation and gradient of each unit
                gathers = m * (p * v - 1) / p * (shape.num_layers / (p * v) + 2)
            t.add('stashed activations gathered (token split)', 'all-gather', ('tensor',), act * dtype_bytes,
                  gathers)


def _param_traffic(t: _Traffic, layout, rules, specs, shape) -> None:
    """FSDP gathers, gradient reductions and the ZeRO-1 gather, parameter by parameter (LoRA's frozen base:
    gathered, never reduced or updated).

    Counts are per device, averaged over pipeline stages: a pipeline runs the embedding on
    its first stage and the head on its last, and sums their gradients over stages once.
    With `layout.reduce_once` (jaxfrontier/training/reduction.py) the `data` axis leaves the
    per-micro-batch reductions: each replica accumulates locally (gradients in the
    parameters' layout) and one all-reduce over `data` per step follows.
    """
    sizes = layout.mesh_shape
    dp_axes = tuple(a for a in mesh_lib.data_parallel_axes(rules) if sizes[a] > 1)
    once = layout.reduce_once and 'data' in dp_axes
    per_mb_axes = tuple(a for a in dp_axes if not (once and a == 'data'))
    m, p = layout.accum_steps, layout.pipeline
    for pl in pm.planned_params(specs, layout, rules):
        spec, local = pl.spec, pl.local * pm.PARAM_BYTES
        # MoE expert weights stay split over `expert`: neither gathered nor reduced over it (plan/moe.py).
        held = plan_moe.holds_experts(mesh_lib.spec_axes(pl.param_spec), spec.names)
        sharded = tuple(a for a in per_mb_axes if a in mesh_lib.spec_axes(pl.param_spec) and a not in held)
        zero1_axes = tuple(a for a in dp_axes if a in mesh_lib.spec_axes(pl.update_spec) and a not in sharded
                           and a not in held)
        # Inside the loop gradients meet the optimizer layout only when reduced per micro-batch.
        extra = () if once else zero1_axes
        rest = tuple(a for a in per_mb_axes if a not in sharded and a not in extra and a not in held)
        gathered = local * math.prod(sizes[a] for a in sharded)
        group = 'block weights' if spec.is_block else 'embedding and head'
        uses = m * (2 if spec.is_block else 1 / p)  # blocks: before the forward and again for the backward
        if sharded:
            t.add(f'FSDP gather of {group}', 'all-gather', sharded, gathered, uses)
        if not lora_lib.trainable(spec, shape):
            continue
        if p > 1 and not spec.is_block:
            t.add('shared gradients summed over stages', 'all-reduce', ('pipeline',), local, 1, per_micro_batch=False)
        per_stage = 1 if spec.is_block else 1 / p
        reductions = m * per_stage * (2 if spec.path == 'wte' else 1)  # tied: head and lookup sum apart
        if spec.path in ('wte', 'wpe') and per_mb_axes:  # the lookup's gradient is summed over every replica at once
            t.add('embedding gradient', 'all-reduce', per_mb_axes, gathered, m * per_stage)
            reductions -= m * per_stage
        what = f'gradients of {group}'
        if sharded:
            t.add(what, 'reduce-scatter', sharded, gathered, reductions)
        if extra:
            t.add(what + ' (ZeRO-1)', 'reduce-scatter', extra, local, reductions)
        if zero1_axes:
            t.add('ZeRO-1 parameter gather', 'all-gather', zero1_axes, local, 1, per_micro_batch=False)
        if rest:
            t.add(what, 'all-reduce', rest, local, reductions)
        if once:  # every stage holds the shared gradients after their sum over stages
            t.add(what + ' (once per step)', 'all-reduce', ('data',), local, 1, per_micro_batch=False)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One kind of collective traffic before timing: what the layout moves, whatever the link speeds."""

    what: str
    kind: str
    axes: tuple[str, ...]
    payload_bytes: float
    count: float
    per_micro_batch: bool
    group: int  # devices in one collective
    level: str
    shares: tuple[tuple[str, float], ...] = ()  # all-to-all: the peers' share at each level (peer_shares)
    overlap: tuple[float, int] = (0.0, 1)  # a chunked MoE dispatch: (compute share it hides behind, chunks)


def traffic(shape, layout, rules, specs, hw: hw_lib.Hardware) -> tuple[Traffic, ...]:
    """Every transfer of one step with its group and link level (`hw`'s topology only)."""
    dtype_bytes = 4 if shape.dtype == 'float32' else 2
    t = _Traffic()
    _activation_traffic(t, shape, layout, dtype_bytes, input_projections(specs, rules))
    _param_traffic(t, layout, rules, specs, shape)
    plan_moe.expert_traffic(t.add, shape, layout, pm.effective_remat(layout), dtype_bytes)
    plan_moe.capacity_traffic(t.add, shape, layout, pm.effective_remat(layout))
    plan_moe.tensor_traffic(t.add, shape, layout, pm.effective_remat(layout), dtype_bytes)
    mesh_items = tuple(layout.mesh_shape.items())
    out = []
    for (what, kind, axes, per_mb), (payload, count) in t.items.items():
        group = math.prod(layout.mesh_shape[a] for a in axes)
        level = _level(mesh_items, axes, hw.devices_per_package, hw.devices_per_node)
        shares = _shares(mesh_items, axes, hw.devices_per_package, hw.devices_per_node) if kind in ALL_TO_ALL else ()
        overlap = plan_moe.dispatch_overlap(shape, layout) if kind in ALL_TO_ALL else (0.0, 1)
        out.append(Traffic(what, kind, axes, payload, count, per_mb, group, level, shares, overlap))
    return tuple(out)


def timed(items: tuple[Traffic, ...], layout, hw: hw_lib.Hardware, compute_mb_s: float,
          num_layers: int) -> tuple[Transfer, ...]:
    """Wire and exposed time of each transfer on `hw` (the overlap rules, scaled by `hw.overlap`).

    Overlap (docs/planner.md): tensor all-reduces, the token split's gathers and pipeline sends
    are exposed; FSDP gathers hide behind compute and show only their excess plus one layer's
    gather; gradient reductions hide behind the backward pass (2/3 of the compute) except the
    last layer's; the ZeRO-1 gather and the pipeline's sum of shared gradients are exposed; a MoE dispatch
    is exposed unless chunked (model.moe_chunks: `plan_moe.dispatch_overlap`).
    `hw.overlap` < 1 hides only that share of what the rules hide.
    """
    layers = num_layers / layout.pipeline
    compute_s = compute_mb_s * layout.accum_steps
    times = [wire_time_s(x.kind, x.payload_bytes, x.count, x.group, x.level, hw, dict(x.shares)) for x in items]
    # A chunked MoE dispatch's transfers share one budget: the routed experts' compute of the other chunks;
    # at least one chunk's share (1 / c) stays exposed.
    chunked = [(t, x.overlap) for t, x in zip(times, items) if x.overlap[1] > 1]
    dispatch_s = sum(t for t, _ in chunked)
    dispatch_exposed = 1.0
    if chunked and dispatch_s > 0:
        share, c = chunked[0][1]
        dispatch_exposed = max(dispatch_s - compute_s * share, dispatch_s / c) / dispatch_s
    out = []
    for x, time_s in zip(items, times):
        if x.overlap[1] > 1:
            exposed = time_s * dispatch_exposed
        elif x.what.startswith('ring attention'):
            # Each step's transfer overlaps the attention block computed on the chunk in hand (the
            # first, the local block): attention is most of a long-context layer. At least one
            # transfer's time shows.
            exposed = max(time_s - compute_s * RING_HIDDEN_SHARE, time_s / max(x.count, 1.0))
        elif x.kind == 'all-gather' and x.per_micro_batch and x.what.startswith('FSDP'):
            exposed = max(0.0, time_s - compute_s) + time_s / max(x.count, 1.0)
        elif x.per_micro_batch and x.what.startswith(('gradients', 'embedding gradient')):
            exposed = max(time_s - compute_s * 2 / 3, time_s / max(layers, 1.0))
        else:
            exposed = time_s
        exposed = min(exposed, time_s)
        if hw.overlap != 1.0:
            exposed = time_s - hw.overlap * (time_s - exposed)
        out.append(Transfer(x.what, x.kind, x.axes, x.payload_bytes, x.count, x.level, time_s, exposed,
                            x.per_micro_batch))
    return tuple(sorted(out, key=lambda x: -x.payload_bytes))
