"""The planner's mixture-of-experts terms: active parameters, the FLOP conventions, expert traffic, imbalance.

A model shape with `moe` set (families/moe.py) has MoE layers; everything here is a no-op for a dense one.

Parameters: total from the family's table (`estimate.param_specs`); active per token = total less the
E - k routed experts a token does not visit, in every MoE layer (the embedding table counted whole).

FLOPs per token of the active path, two conventions (docs/planner.md "Mixture of experts"):
  * Megatron-LM (`num_floating_point_operations` with its MoE term): the family's formula with the MLP
    width replaced by the layers' mean active width, k x F plus the shared experts (families/moe.py;
    the planner's `model` FLOPs are this count plus the router's d x E, which MaxText counts too);
  * MaxText (`calculate_tflops_training_per_device`): 6 x the active matmul parameters (the router and
    the head included, the embedding lookup not) + causal attention, half of the s x s scores:
    6 s h K per token and layer (fwd + bwd).

Expert parallelism (`expert` = EP > 1) as the core compiles it (model/layers/moe_parallel.py): XLA:CPU has
no ragged all-to-all, so each MoE layer all-gathers its n tokens over `expert` (x [EP n, d] in the
compute dtype, the k expert ids int32 and gates fp32; capacity mode: the kept mask too), every device
runs its E / EP experts over the group's assignments, and a reduce-scatter of the fp32 output [EP n, d]
returns each device's tokens. The backward transposes them: an all-gather of the fp32 output gradient and
reduce-scatters of the input's (compute dtype) and the gates' (fp32). Full recomputation repeats the
forward's gathers. The expert weights are not gathered over `expert` and their gradients are summed over
the other data-parallel axes only (each device holds its experts' whole gradient).

Imbalance: the routed experts' buffer is fixed per device (its compiled shape, what memory holds): EP k n
rows dropless (room for the worst case, every assignment of the group on its experts) and (E / EP) C rows
with a capacity factor; an even routing fills k n of them (`buffer_factor`). The step waits for the
busiest device: the plan charges the routed matmuls `imbalance` x their even share, the capacity factor
with a capacity (no expert computes more), DROPLESS_IMBALANCE dropless (stated below), each at most the
buffer.
"""

from __future__ import annotations

import dataclasses
import math

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier import layout as layout_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.families import moe as families_moe

EXPERT = next(a.name for a in axes_lib.AXES if a.holds_experts)
# Dropless: the busiest expert group's load over the even share, a stated assumption (a trained router
# with a balancing loss or DeepSeek-V3's bias keeps the hottest expert within tens of percent of the mean;
# the worst case, every assignment on one device's experts, is EP and is what the buffer is sized for).
DROPLESS_IMBALANCE = 1.25


def of(shape):
    """The MoE shape of a model shape (families/moe.MoEShape), None for a dense model."""
    return getattr(shape, 'moe', None)


def device_tokens(shape, layout) -> int:
    """n: a device's tokens of a micro-batch."""
    return layout.micro_batch * -(-shape.seq_len // layout.context)


def moe_layers(shape) -> int:
    s = of(shape)
    return 0 if s is None else shape.num_layers - s.first_dense


def expert_params(shape) -> int:
    """Parameters of one routed expert (gate, up, down)."""
    return 3 * shape.d_model * of(shape).mlp_dim


def active_params(shape, total: int) -> int:
    """Parameters a token's path reads: `total` less the experts it does not visit."""
    s = of(shape)
    if s is None:
        return total
    return total - moe_layers(shape) * (s.experts - s.top_k) * expert_params(shape)


def maxtext_flops_per_token(shape, total: int) -> float:
    """MaxText's training FLOPs per token: 6 x active matmul parameters + causal attention (6 s h K per layer)."""
    # The embedding table: a gather, no FLOPs (tied: the same table is the head's matmul).
    lookup = 0 if shape.tied_embeddings else shape.vocab_size * shape.d_model
    vectors = sum(math.prod(p.shape) for p in families.get(shape.family).param_specs(shape)
                  if len(p.shape) - p.is_block <= 1)  # norm scales, biases: no matmul
    matmul = active_params(shape, total) - lookup - vectors
    return 6.0 * matmul + 6.0 * shape.seq_len * shape.num_heads * shape.head_dim * shape.num_layers


def megatron_flops_per_token(shape, recompute: bool = False) -> float:
    """Megatron-LM's count with its MoE term, per token: the family's `megatron_flops` (families/moe.py: the
    active width k x F plus the shared experts, and the router) less the router, which Megatron-LM leaves out."""
    s = of(shape)
    router = 0.0 if s is None else (4 if recompute else 3) * 2 * moe_layers(shape) * shape.d_model * s.experts
    return families.get(shape.family).megatron_flops(1, shape, recompute) / shape.seq_len - router


def buffer_factor(shape, layout) -> float:
    """Routed rows a device's buffer holds over the even share k n (its compiled shape: memory)."""
    s = of(shape)
    if s is None:
        return 1.0
    ep = getattr(layout, EXPERT, 1)
    n = device_tokens(shape, layout)
    if s.dropless:
        return float(ep)
    tokens = n * layout.data * layout.fsdp * ep * layout.context  # the micro-batch's, over the token axes
    return min(ep * n * s.top_k, (s.experts // ep) * s.capacity(tokens)) / (n * s.top_k)


def computed_rows(shape, layout) -> float:
    """Rows a device's experts compute over per micro-batch (their compiled shape): gather's buffer
    (`buffer_factor` x k n); all_to_all's EP per-peer buffers; ragged's receive buffer
    (families/moe.send_buffer_rows), per chunk. The sent dispatches' gather fallback is not counted (module docstring)."""
    s, ep, n = of(shape), getattr(layout, EXPERT, 1), device_tokens(shape, layout)
    how, c = dispatch(shape, layout), chunks(shape, layout)
    if how in ('all_to_all', 'ragged'):  # c chunks, each with the buffer of n / c tokens
        return c * families_moe.send_buffer_rows(s, how, ep, n // c) * (ep if how == 'all_to_all' else 1)
    return buffer_factor(shape, layout) * s.top_k * n


def imbalance(shape, layout) -> float:
    """The busiest device's routed work over the even share (time): the capacity factor with a capacity
    (no expert computes more), DROPLESS_IMBALANCE dropless; at most the buffer (`buffer_factor`)."""
    s = of(shape)
    if s is None:
        return 1.0
    return min(buffer_factor(shape, layout), DROPLESS_IMBALANCE if s.dropless else s.capacity_factor)


def routed_flops_share(shape) -> float:
    """The routed experts' share of a layer-average forward's matmul FLOPs."""
    s = of(shape)
    if s is None:
        return 0.0
    layer, _ = families.get(shape.family).forward_flops(shape)
    routed = 2 * shape.seq_len * 3 * shape.d_model * s.mlp_dim * s.top_k * moe_layers(shape) / shape.num_layers
    return routed / layer


def imbalanced(flops: float, shape, layout) -> float:
    """`flops` of the layers with the routed experts' share charged at their buffer (`imbalance`)."""
    share = routed_flops_share(shape)
    return flops * (1.0 + share * (imbalance(shape, layout) - 1.0))


def dispatch(shape, layout) -> str:
    """The MoE layers' dispatch at this layout (model.moe_dispatch resolved: families/moe.resolve_dispatch);
    '' for a dense model, 'local' without expert parallelism."""
    s, ep = of(shape), getattr(layout, EXPERT, 1)
    if s is None:
        return ''
    return 'local' if ep <= 1 else families_moe.resolve_dispatch(s, ep)


def chunks(shape, layout) -> int:
    """Chunks a sent dispatch splits a device's n tokens into (model.moe_chunks; 1 where n does not divide, as
    the layer does, and for gather)."""
    s = of(shape)
    if s is None or dispatch(shape, layout) not in ('all_to_all', 'ragged'):
        return 1
    n = device_tokens(shape, layout)
    return s.chunks if n % s.chunks == 0 else 1


def dispatch_overlap(shape, layout) -> tuple[float, int]:
    """(share of the step's compute the sent dispatch's transfers can hide behind, chunks); (0, 1) unchunked.

    With c chunks, chunk i's transfers run beside the expert matmuls of the others (XLA's latency-hiding
    scheduler on GPUs: the chunks do not depend on each other): at most the routed experts' share of the
    compute x (c - 1) / c, and at least one chunk's transfers a layer stay exposed (`comm.timed`). An
    assumption until a GPU run times it (docs/planner.md)."""
    c = chunks(shape, layout)
    if c <= 1:
        return 0.0, 1
    return routed_flops_share(shape) * (c - 1) / c, c


def expert_traffic(add, shape, layout, remat: str, dtype_bytes: int) -> None:
    """The expert axis's collectives of one step by dispatch (the module docstring), through
    `add(what, kind, axes, bytes, count)`; forward ones again under full recomputation."""
    s, ep = of(shape), getattr(layout, EXPERT, 1)
    if s is None or ep <= 1:
        return
    n = device_tokens(shape, layout)
    d, k, how = shape.d_model, s.top_k, dispatch(shape, layout)
    calls = layout.accum_steps * moe_layers(shape) / layout.pipeline
    forwards = calls * (2 if remat == 'full' else 1)
    if how == 'gather':
        rows = ep * n
        routing = rows * k * (4 + 4 + (0 if s.dropless else 1))  # expert ids, gates (and the kept mask)
        add('MoE tokens gathered to the experts', 'all-gather', (EXPERT,), rows * d * dtype_bytes + routing, forwards)
        add('MoE expert outputs returned', 'reduce-scatter', (EXPERT,), rows * d * 4, calls)
        add('MoE backward: output gradient gathered', 'all-gather', (EXPERT,), rows * d * 4, calls)
        add('MoE backward: token and gate gradients', 'reduce-scatter', (EXPERT,),
            rows * d * dtype_bytes + rows * k * 4, calls)
        return
    c = chunks(shape, layout)  # each chunk of n / c tokens dispatched on its own: c x the collectives
    forwards, calls, n = forwards * c, calls * c, n // c
    add('MoE dispatch: overflow check', 'all-reduce', (EXPERT,), 1, forwards)  # a pmax of one pred
    if how == 'all_to_all':
        rows = ep * families_moe.send_buffer_rows(s, how, ep, n)  # per-peer buffers, the whole buffer
        add('MoE all_to_all: tokens to the experts', 'all-to-all', (EXPERT,), rows * (d * dtype_bytes + 4), forwards)
        add('MoE all_to_all: expert outputs back', 'all-to-all', (EXPERT,), rows * d * dtype_bytes, forwards)
        add('MoE all_to_all backward: output and token gradients', 'all-to-all', (EXPERT,),
            rows * d * dtype_bytes, 2 * calls)
        return
    # ragged: what the busiest device receives (each sends its k n assignments; `imbalance` x that lands on
    # the busiest), counted as sent and received alike (the op's two directions have the same rows).
    add('MoE ragged: expert counts gathered', 'all-gather', (EXPERT,), ep * s.experts * 4, forwards)
    rows = imbalance(shape, layout) * k * n
    add('MoE ragged: tokens to the experts', 'ragged-all-to-all', (EXPERT,), rows * d * dtype_bytes, forwards)
    add('MoE ragged: expert outputs back', 'ragged-all-to-all', (EXPERT,), rows * d * dtype_bytes, forwards)
    add('MoE ragged backward: output and token gradients', 'ragged-all-to-all', (EXPERT,),
        rows * d * dtype_bytes, 2 * calls)


def capacity_traffic(add, shape, layout, remat: str) -> None:
    """Capacity mode's drop decisions (moe_parallel._capacity_kept): every device gathers every assignment's
    expert id and 3 int32 sort keys [n k] over each token axis in turn (expert first, the output growing
    with each axis). The ids per MoE layer (again under full remat); the keys, the same tokens in every
    layer, once per micro-batch (XLA hoists them out of the layer loop)."""
    s = of(shape)
    if s is None or s.dropless:
        return
    n = device_tokens(shape, layout)
    column = n * s.top_k * 4
    calls = layout.accum_steps * moe_layers(shape) / layout.pipeline * (2 if remat == 'full' else 1)
    gathered = column
    for axis in ('expert', 'fsdp', 'data', 'context'):  # moe_parallel: reversed(the rules' token axes)
        size = getattr(layout, axis, 1)
        if size <= 1:
            continue
        gathered *= size
        add('MoE capacity: expert ids gathered', 'all-gather', (axis,), gathered, calls)
        add('MoE capacity: token keys gathered', 'all-gather', (axis,), 3 * gathered, layout.accum_steps)


def tensor_traffic(add, shape, layout, remat: str, dtype_bytes: int) -> None:
    """What tensor parallelism adds in a MoE layer to the dense count (comm._activation_traffic's 4 [n, d]
    all-reduces a layer: attention and MLP, forward and backward): the experts' width is split over
    `tensor`, so their partial sums are over the routed buffer's R = `buffer_factor` k n rows, the output
    [R, d] forward and the gate's and up's input gradients [R, d] each backward, and the attention's
    separate q and k/v input gradients one [n, d] more (the dense count finds them among the separate
    projections, which the experts' table rows are not). Full recomputation repeats the output's [R, d]
    (the dense MLP's output all-reduce is not recomputed; this one is: XLA:CPU, tiny model)."""
    s = of(shape)
    if s is None or layout.tensor <= 1:
        return
    n = device_tokens(shape, layout)
    rows_per_token = computed_rows(shape, layout) / n
    calls = layout.accum_steps * moe_layers(shape) / layout.pipeline
    add("MoE experts' partial sums over the routed buffer", 'all-reduce', ('tensor',),
        n * shape.d_model * dtype_bytes, calls * ((4 if remat == 'full' else 3) * rows_per_token - 1))


def is_router(path: str) -> bool:
    """The router's weight: read by every token, never split over tensor (not a k/v projection)."""
    return path.endswith('w_router')


def holds_experts(spec_axes: tuple[str, ...], names: tuple) -> tuple[str, ...]:
    """The expert axis where a parameter's `experts` dimension is split over it (its weights stay put)."""
    return (EXPERT,) if 'experts' in names and EXPERT in spec_axes else ()


def act_shape(shape, layout):
    """The shape whose MLP width sizes the activations' `f` arrays: the routed buffer's rows per token
    (`buffer_factor` x k) x the expert width, plus the shared experts' width (dense layers keep theirs)."""
    s = of(shape)
    if s is None:
        return shape
    width = buffer_factor(shape, layout) * s.top_k * s.mlp_dim + s.shared * s.mlp_dim
    return dataclasses.replace(shape, mlp_dim=max(int(width), shape.mlp_dim if s.first_dense else 0))


@dataclasses.dataclass(frozen=True)
class Summary:
    """The MoE lines of a plan."""

    experts: int
    top_k: int
    expert_parallel: int
    total_params: int
    active_params: int
    maxtext_flops_per_token: float
    megatron_flops_per_token: float
    imbalance: float
    dropless: bool
    capacity_factor: float
    routed_share: float  # the routed experts' share of the layers' matmul FLOPs (even routing)
    dispatch: str = 'local'  # `dispatch`: gather | all_to_all | ragged at EP > 1


def summary(shape, layout, total: int) -> Summary | None:
    s = of(shape)
    if s is None:
        return None
    return Summary(s.experts, s.top_k, getattr(layout, EXPERT, 1), total, active_params(shape, total),
                   maxtext_flops_per_token(shape, total), megatron_flops_per_token(shape), imbalance(shape, layout),
                   s.dropless, s.capacity_factor, routed_flops_share(shape), dispatch(shape, layout))


def format_lines(x: Summary | None, flops_model: float, tokens: float, compute_s: float) -> list[str]:
    """The plan's MoE lines; `compute_s`: the step's compute time, of which the imbalance's share is shown."""
    if x is None:
        return []
    extra = x.routed_share * (x.imbalance - 1.0)
    cost_s = compute_s * extra / (1.0 + extra)
    if x.expert_parallel == 1:
        mode = 'no expert parallelism: each device routes its own tokens to every expert'
    elif x.dropless:
        mode = f'dropless: assumed (DROPLESS_IMBALANCE; buffers sized for the worst case, {x.expert_parallel}x)'
    else:
        mode = f'capacity factor {x.capacity_factor}'
    return [
        f'mixture of experts: {x.experts} experts, top {x.top_k}, EP {x.expert_parallel}'
        f'{f" ({x.dispatch} dispatch)" if x.expert_parallel > 1 else ""}; '
        f'{x.total_params / 1e9:,.2f} B total, {x.active_params / 1e9:,.2f} B active per token',
        f'  FLOPs per token (fwd + bwd): planned {flops_model / tokens / 1e9:,.2f} G; MaxText convention '
        f'{x.maxtext_flops_per_token / 1e9:,.2f} G; Megatron-LM {x.megatron_flops_per_token / 1e9:,.2f} G',
        f'  routing imbalance {x.imbalance:.2f}x the even share of routed work, {mode}: '
        f'{cost_s:.3f} s of the step\'s compute',
    ]


def config_summary(c) -> Summary | None:
    """`summary` of a config's model and layout (tests, benchmarks)."""
    shape = config_lib.model_shape(c)
    total = sum(math.prod(p.shape) for p in families.get(shape.family).param_specs(shape))
    return summary(shape, layout_lib.Layout.from_config(c), total)
