"""The mixture-of-experts MLP's declaration, for a family whose blocks may use it (llama): not a family.

Its model.* fields and checks, the shape the NNX layer is built from (`MoEShape`, model/layers/moe.py),
its rows of the parameter table and its FLOPs. The family that uses it adds the fields to its own and
asks these functions from its declaration (families/llama.py), so the registry has no `FAMILY` here
(families/__init__.py skips this module). No JAX (families/base.py says why).

A model with `moe_experts` E > 0: the first `moe_first_dense` layers keep the dense SwiGLU (a stem
layer group `dense_blocks`, DeepSeek's first_k_dense_replace), every other layer's MLP is the MoE
layer (the pipelined group `blocks`): a router w_router [d, E] in fp32, k of E routed SwiGLU experts
of width F per token (w_gate, w_up [E, d, F], w_down [E, F, d]), and `moe_shared_experts` S always-on
experts as one SwiGLU of width S F (`mlp/shared/...`, DeepSeek). docs/models.md "Mixture of experts".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from jaxfrontier.families import hf_moe
from jaxfrontier.families.base import Family, ParamSpec

ROUTERS = ('softmax', 'sigmoid')  # model.moe_router: Mixtral / Qwen3; DeepSeek-V3
DENSE_GROUP = 'dense_blocks'  # the stem layer group of the first moe_first_dense layers

# The MoE layer's model.* fields (the family that uses it adds them to its FIELDS).
FIELDS = dict(
    moe_experts=0,  # routed experts E; 0: a dense model
    moe_top_k=2,  # experts per token k
    moe_mlp_dim=0,  # each expert's width F; 0: the dense MLP's (model.mlp_dim or the family's rule)
    moe_shared_experts=0,  # always-on experts S, one SwiGLU of width S x F beside the routed ones (DeepSeek)
    moe_first_dense=0,  # the first layers keep the dense MLP (DeepSeek's first_k_dense_replace); the rest MoE
    moe_router='softmax',  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3)
    moe_norm_topk=True,  # the k weights renormalised to sum 1 (Mixtral; Qwen3's norm_topk_prob; DeepSeek-V3)
    moe_routed_scale=1.0,  # the routed experts' sum x this (DeepSeek-V3's routed_scaling_factor, 2.5)
    # A per-expert bias added to the scores for the top-k choice only (DeepSeek-V3's auxiliary-loss-free
    # balancing: `mlp/router_bias`), moved after every step by moe_bias_rate x sign(mean load - load).
    moe_router_bias=False,
    moe_bias_rate=0.0,  # DeepSeek-V3: 0.001; 0: the bias stays as loaded
    moe_lb_coef=0.01,  # Switch/GShard load-balancing loss coefficient (0: off)
    moe_z_coef=0.0,  # router z-loss coefficient (ST-MoE: 0.001; 0: off)
    # Dropless: every (token, expert) assignment computed (sorted by expert, a grouped matmul). False:
    # each expert takes at most ceil(moe_capacity_factor x k x N / E) of a micro-batch's N tokens' assignments.
    moe_dropless=True,
    moe_capacity_factor=1.25,
    # How assignments reach the devices holding their experts under expert parallelism
    # (model/layers/moe_dispatch.py): auto | gather | all_to_all | ragged; auto: ragged where
    # mesh.expert > moe_top_k (it moves k / EP of gather's bytes), gather otherwise.
    moe_dispatch='auto',
    # all_to_all: rows per peer, ragged: rows received, over the even share (x k N / EP, x k N); a device
    # that would overflow sends its layer through gather instead (exact, counted in aux/moe_dispatch_fallback).
    moe_dispatch_buffer=2.0,
    # all_to_all and ragged: a device's tokens in this many chunks, each dispatched, computed and combined on
    # its own, so that one chunk's transfers can run beside another's expert matmuls (XLA's scheduler on
    # GPUs). The same numbers; 1: one dispatch a layer.
    moe_chunks=1,
    # Node-limited routing (DeepSeek-V3's n_group / topk_group): the experts in moe_groups groups, a token's
    # k experts from its moe_topk_groups best groups (a group's score: the sum of its two best scores). 0: off.
    moe_groups=0,
    moe_topk_groups=0,
)
DISPATCHES = ('auto', 'gather', 'all_to_all', 'ragged')
# Fields that fix the parameters' shapes (a checkpoint restores only into a config that agrees).
SHAPE_FIELDS = ('moe_experts', 'moe_mlp_dim', 'moe_shared_experts', 'moe_first_dense', 'moe_router_bias')
# Fields that decide which experts a token goes to and with what weight: a checkpoint's router and experts
# were trained for its values, so a resume with others is refused (checkpoint/format.check_routing_matches).
# Not moe_dispatch or moe_dispatch_buffer: they move the same assignments otherwise (the same numbers).
ROUTING_FIELDS = ('moe_top_k', 'moe_router', 'moe_norm_topk', 'moe_routed_scale', 'moe_dropless', 'moe_groups',
                  'moe_topk_groups')
ROUTING_BEFORE = {'moe_groups': 0, 'moe_topk_groups': 0}  # what a checkpoint saved before the field trained with
# The router's scores (softmax probabilities, sigmoid scores) lie in [0, 1] and the bias is added to them:
# a rate above this (100 x DeepSeek-V3's 0.001) moves it by a tenth of that range every step.
MAX_BIAS_RATE = 0.1
MAX_CHUNKS = 64  # model.moe_chunks: more only adds per-chunk latency
MAX_SIZES = {'moe_experts': 2**16, 'moe_top_k': 2**16, 'moe_mlp_dim': 2**24, 'moe_shared_experts': 2**10,
             'moe_first_dense': 2**16}


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The numbers the MoE layer (model/layers/moe.py) is built from."""

    experts: int
    top_k: int
    mlp_dim: int  # F, each expert's width
    shared: int = 0  # S shared experts: one SwiGLU of width S x F
    first_dense: int = 0
    router: str = 'softmax'
    norm_topk: bool = True
    routed_scale: float = 1.0
    router_bias: bool = False
    bias_rate: float = 0.0
    lb_coef: float = 0.01
    z_coef: float = 0.0
    dropless: bool = True
    capacity_factor: float = 1.25
    dispatch: str = 'auto'
    dispatch_buffer: float = 2.0
    chunks: int = 1  # model.moe_chunks
    groups: int = 0  # node-limited routing: n_group (0: off)
    topk_groups: int = 0

    def capacity(self, tokens: int) -> int:
        """C: the assignments each expert takes of a micro-batch of `tokens` tokens without `dropless`."""
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.experts)


def on(m: Mapping[str, Any]) -> bool:
    """Whether model.* `m` (a config's, or a saved config's) has MoE layers."""
    return bool(m.get('moe_experts', 0))


def expert_width(m: Mapping[str, Any], dense_width: int) -> int:
    """F: model.moe_mlp_dim, or the dense MLP's width where it is 0."""
    return m.get('moe_mlp_dim', 0) or dense_width


def shape_of(m: Mapping[str, Any], dense_width: int) -> MoEShape | None:
    """The MoE layer's shape of model.* `m`, None for a dense model."""
    if not on(m):
        return None
    return MoEShape(experts=m['moe_experts'], top_k=m['moe_top_k'], mlp_dim=expert_width(m, dense_width),
                    shared=m['moe_shared_experts'], first_dense=m['moe_first_dense'], router=m['moe_router'],
                    norm_topk=bool(m['moe_norm_topk']), routed_scale=float(m['moe_routed_scale']),
                    router_bias=bool(m['moe_router_bias']), bias_rate=float(m['moe_bias_rate']),
                    lb_coef=float(m['moe_lb_coef']), z_coef=float(m['moe_z_coef']), dropless=bool(m['moe_dropless']),
                    capacity_factor=float(m['moe_capacity_factor']), dispatch=m.get('moe_dispatch', 'auto'),
                    dispatch_buffer=float(m.get('moe_dispatch_buffer', 2.0)), chunks=m.get('moe_chunks', 1),
                    groups=m.get('moe_groups', 0),
                    topk_groups=m.get('moe_topk_groups', 0))


def resolve_dispatch(s: MoEShape, ep: int) -> str:
    """The dispatch a MoE layer of shape `s` uses at expert-parallel size `ep` (model.moe_dispatch; `auto`:
    ragged where ep > k, which moves k / ep of gather's bytes, else gather). The same on every platform."""
    if s.dispatch != 'auto':
        return s.dispatch
    return 'ragged' if ep > s.top_k else 'gather'


def send_buffer_rows(s: MoEShape, dispatch: str, ep: int, n: int) -> int:
    """The sent dispatch's buffer for `n` tokens a device (model/layers/moe_dispatch.py; the planner's too):
    all_to_all, rows per peer (moe_dispatch_buffer x the even share k n / EP); ragged, rows of the receive
    buffer (moe_dispatch_buffer x k n, at most the worst case EP k n)."""
    even = s.top_k * n
    if dispatch == 'all_to_all':
        return min(even, max(1, math.ceil(s.dispatch_buffer * even / ep)))
    return min(ep * even, max(1, math.ceil(s.dispatch_buffer * even)))


def effective(m: Mapping[str, Any], dense_width: int) -> dict[str, Any]:
    """The fields with what a rule's value stands for (moe_mlp_dim 0: the dense width)."""
    return {f: m[f] for f in FIELDS} | {'moe_mlp_dim': expert_width(m, dense_width) if on(m) else 0}


def pipelined_layers(m: Mapping[str, Any]) -> int:
    """Layers of the group a pipeline splits: all but the dense stem."""
    return m['num_layers'] - (m.get('moe_first_dense', 0) if on(m) else 0)


def check_fields(m: Mapping[str, Any], require: Callable[..., None]) -> None:
    """The MoE fields: counts in range (k <= E, a MoE layer left after the dense ones), a known router,
    finite coefficients, a capacity factor > 0."""
    require(isinstance(m.moe_experts, int) and not isinstance(m.moe_experts, bool) and m.moe_experts >= 0,
            'model.moe_experts', m.moe_experts, 'must be an integer >= 0', 'set 0 (dense) or the routed experts')
    if not m.moe_experts:
        return
    require(isinstance(m.moe_top_k, int) and 1 <= m.moe_top_k <= m.moe_experts, 'model.moe_top_k', m.moe_top_k,
            f'each token chooses k of the model.moe_experts = {m.moe_experts} experts, so 1 <= k <= {m.moe_experts}',
            f'set model.moe_top_k to at most {m.moe_experts}, e.g. {min(2, m.moe_experts)}')
    for field in ('moe_mlp_dim', 'moe_shared_experts', 'moe_first_dense'):
        require(isinstance(m[field], int) and not isinstance(m[field], bool) and m[field] >= 0, f'model.{field}',
                m[field], 'must be an integer >= 0', f'set model.{field} to 0 or a positive integer')
    require(m.moe_first_dense < m.num_layers, 'model.moe_first_dense', m.moe_first_dense,
            f'leaves no MoE layer of the model.num_layers = {m.num_layers}',
            f'set model.moe_first_dense below {m.num_layers}, or model.moe_experts=0 for a dense model')
    require(m.moe_router in ROUTERS, 'model.moe_router', m.moe_router, 'unknown router', f'use one of {ROUTERS}')
    for field in ('moe_norm_topk', 'moe_router_bias', 'moe_dropless'):
        require(isinstance(m[field], bool), f'model.{field}', m[field], 'must be True or False',
                f'set model.{field}=True or False')
    require(math.isfinite(m.moe_routed_scale) and m.moe_routed_scale > 0, 'model.moe_routed_scale',
            m.moe_routed_scale, 'must be a finite number > 0', 'set 1.0, or DeepSeek-V3\'s 2.5')
    for field in ('moe_bias_rate', 'moe_lb_coef', 'moe_z_coef'):
        require(math.isfinite(m[field]) and m[field] >= 0, f'model.{field}', m[field], 'must be a finite number >= 0',
                f'set model.{field} to 0 (off) or e.g. 0.001')
    require(m.moe_bias_rate <= MAX_BIAS_RATE, 'model.moe_bias_rate', m.moe_bias_rate, 'moves the router bias by '
            f'more than {MAX_BIAS_RATE} a step, a tenth of the [0, 1] range of the scores it is added to (the choice '
            'of experts would follow the bias, not the router)', 'set e.g. 0.001 (DeepSeek-V3\'s)')
    require(m.moe_bias_rate == 0 or m.moe_router_bias, 'model.moe_bias_rate', m.moe_bias_rate,
            'moves the router bias, but model.moe_router_bias is False (the model has none)',
            'set model.moe_router_bias=True, or model.moe_bias_rate=0.0')
    require(math.isfinite(m.moe_capacity_factor) and m.moe_capacity_factor > 0, 'model.moe_capacity_factor',
            m.moe_capacity_factor, 'must be a finite number > 0 (each expert takes capacity_factor x its even '
            'share of the assignments)', 'set e.g. 1.25, or model.moe_dropless=True to drop nothing')
    most = m.moe_experts / m.moe_top_k  # C = ceil(cf k N / E) >= N, the most an expert can receive, from here on
    require(m.moe_dropless or m.moe_capacity_factor <= most, 'model.moe_capacity_factor', m.moe_capacity_factor,
            f'exceeds experts / top_k = {m.moe_experts} / {m.moe_top_k} = {most:g}: each expert would have room '
            'for more than all N tokens of the micro-batch (a token picks an expert at most once), so nothing '
            'is dropped and the buffers are larger than dropless routing needs',
            f'set model.moe_capacity_factor <= {most:g}, or model.moe_dropless=True to drop nothing')
    check_dispatch_and_groups(m, require)


def check_dispatch_and_groups(m: Mapping[str, Any], require: Callable[..., None]) -> None:
    """model.moe_dispatch and its buffer; node-limited routing's groups (DeepSeek-V3's n_group / topk_group)."""
    require(m.moe_dispatch in DISPATCHES, 'model.moe_dispatch', m.moe_dispatch, 'unknown dispatch',
            f'use one of {DISPATCHES} (docs/models.md "Expert dispatch")')
    require(isinstance(m.moe_dispatch_buffer, (int, float)) and not isinstance(m.moe_dispatch_buffer, bool)
            and math.isfinite(m.moe_dispatch_buffer) and m.moe_dispatch_buffer > 0, 'model.moe_dispatch_buffer',
            m.moe_dispatch_buffer, 'must be a finite number > 0 (the dispatch buffer over the even share)',
            'set e.g. 2.0; a device that would overflow it takes the gather dispatch for that layer')
    chunks = m.moe_chunks
    require(isinstance(chunks, int) and not isinstance(chunks, bool) and 1 <= chunks <= MAX_CHUNKS, 'model.moe_chunks',
            chunks, f'must be an integer from 1 to {MAX_CHUNKS} (a device\'s tokens dispatched in that many chunks)',
            'set 1 (one dispatch a layer) or e.g. 2 or 4 to overlap the chunks\' transfers with the experts')
    require(chunks == 1 or m.moe_dispatch in ('all_to_all', 'ragged', 'auto'), 'model.moe_chunks', chunks,
            f'chunks the sent dispatches only, not model.moe_dispatch = {m.moe_dispatch!r}',
            'set model.moe_dispatch=ragged (or all_to_all), or model.moe_chunks=1')
    for field in ('moe_groups', 'moe_topk_groups'):
        require(isinstance(m[field], int) and not isinstance(m[field], bool) and m[field] >= 0, f'model.{field}',
                m[field], 'must be an integer >= 0', f'set model.{field} to 0 (off) or a positive integer')
    groups, best = m.moe_groups, m.moe_topk_groups
    if not groups:
        require(best == 0, 'model.moe_topk_groups', best, 'needs model.moe_groups (the experts\' groups)',
                'set model.moe_groups (DeepSeek-V3: 8), or model.moe_topk_groups=0')
        return
    require(m.moe_experts % groups == 0, 'model.moe_groups', groups, f'must divide model.moe_experts = '
            f'{m.moe_experts} (each group holds the same number of experts)',
            f'choose a divisor of {m.moe_experts}, e.g. {math.gcd(m.moe_experts, 8)}')
    require(1 <= best <= groups, 'model.moe_topk_groups', best, f'a token picks its experts from 1 to '
            f'model.moe_groups = {groups} groups', f'set model.moe_topk_groups between 1 and {groups}')
    per_group = m.moe_experts // groups
    require(m.moe_top_k <= best * per_group, 'model.moe_top_k', m.moe_top_k, f'exceeds the {best} x {per_group} '
            f'experts of the model.moe_topk_groups = {best} groups a token may use',
            f'raise model.moe_topk_groups, or lower model.moe_top_k to at most {best * per_group}')
    require(per_group >= 2, 'model.moe_groups', groups, 'leaves a group with fewer than 2 experts (a group\'s '
            'score is the sum of its two best)', f'choose at most {m.moe_experts // 2} groups')


def divergence_suspect(m: Mapping[str, Any]) -> str:
    """A clause naming the router bias as the first suspect of a divergence ('' unless model.* `m` moves one).

    The bias moves by moe_bias_rate x sign(...) every step whatever the learning rate, so a loss that
    blows up after it tipped every token onto a few experts is not cured by a lower learning rate.
    """
    rate = m.get('moe_bias_rate', 0.0) if on(m) and m.get('moe_router_bias') else 0.0
    if not rate:
        return ''
    return (f'the MoE router bias, which model.moe_bias_rate = {rate:g} moves every step whatever the learning rate '
            f'(lower it, e.g. --config.model.moe_bias_rate={rate / 10:g}, or set 0 to rule it out)')


def check_mesh(m: Mapping[str, Any], mesh: Mapping[str, int], require: Callable[..., None], dense_width: int) -> None:
    """What the mesh asks of the MoE layer: the experts' width split evenly over `tensor` (config/checks.py
    holds the experts' split over `expert`, `Family.experts`)."""
    if not on(m):
        return
    width, tensor = expert_width(m, dense_width), mesh.get('tensor', 1)
    chunks, local = m.get('moe_chunks', 1), m['seq_len'] // mesh.get('context', 1)
    require(local % chunks == 0, 'model.moe_chunks', chunks, f'must divide a device\'s {local} positions of a '
            f'sequence (model.seq_len / mesh.context), so that every chunk holds as many tokens',
            f'choose a divisor of {local}, e.g. {math.gcd(local, chunks)}')
    require(width % tensor == 0, 'model.moe_mlp_dim', m['moe_mlp_dim'], f'the experts\' width {width} must be '
            f'divisible by mesh.tensor = {tensor} (each expert is split over the tensor axis)',
            f'choose model.moe_mlp_dim as a multiple of {tensor}')


# --------------------------------------------------------------------------- parameter table and FLOPs


def mlp_specs(s: MoEShape, d: int) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """One MoE layer's MLP parameters (path under the block, shape, logical names), for a family's table.

    The experts' dimension is `experts` (split over `expert`), their width `expert_mlp` (over `tensor`),
    the model dimension `embed` (fsdp); the router and its bias are not split along the experts (every
    token scores every expert).
    """
    e, f = s.experts, s.mlp_dim
    rows = [('mlp/w_router', (d, e), ('embed', None)),
            ('mlp/w_gate', (e, d, f), ('experts', 'embed', 'expert_mlp')),
            ('mlp/w_up', (e, d, f), ('experts', 'embed', 'expert_mlp')),
            ('mlp/w_down', (e, f, d), ('experts', 'expert_mlp', 'embed'))]
    if s.router_bias:
        rows.append(('mlp/router_bias', (e,), (None,)))
    if s.shared:
        width = s.shared * f
        rows += [('mlp/shared/w_gate', (d, width), ('embed', 'mlp')), ('mlp/shared/w_up', (d, width), ('embed', 'mlp')),
                 ('mlp/shared/w_down', (width, d), ('mlp', 'embed'))]
    return rows


def mlp_macs_per_token(s: MoEShape, d: int) -> float:
    """Multiply-adds per token of one MoE layer's MLP on its active path: the router (d E), the k routed
    experts and the S shared ones (3 d F each: gate, up, down)."""
    return float(d * s.experts + 3 * d * s.mlp_dim * (s.top_k + s.shared))


# --------------------------------------------------------------------------- a family with MoE layers


def with_moe(family: Family, dense_width: Callable[[Mapping[str, Any]], int]) -> Family:
    """`family` (whose blocks have a SwiGLU `mlp/w_gate, w_up, w_down` and whose
    shape has a `moe` field) with the MoE layer's fields, checks, shape, table and FLOPs.

    `dense_width(m)`: the dense MLP's width of model.* `m`. Where model.moe_experts is 0 every function
    is the family's own (a dense model's table, FLOPs and checks are unchanged).
    FLOPs count each MoE layer's active path (the router's d x E, k routed and S shared experts) and
    average the MLP over the layers (dense ones as they are), so L x the layer's is the model's: the
    family's own count with the MLP width replaced by that mean active width. That is Megatron-LM's MoE
    count (`num_floating_point_operations`: k x the gated width plus the shared experts) plus the
    router, which MaxText counts and Megatron-LM does not.
    """
    base = family

    def active(s):  # the shape whose dense MLP width stands for the layers' mean active MLP
        if s.moe is None:
            return s
        layers, first, dense = s.num_layers, s.moe.first_dense, 3.0 * s.d_model * s.mlp_dim
        macs = (first * dense + (layers - first) * mlp_macs_per_token(s.moe, s.d_model)) / layers
        return dataclasses.replace(s, mlp_dim=macs / (3.0 * s.d_model), moe=None)

    def param_specs(s):
        return base.param_specs(s) if s.moe is None else _moe_specs(base.param_specs(s), s)

    def check(m, require):
        base.check(m, require)
        check_fields(m, require)

    return dataclasses.replace(
        family, fields={**family.fields, **FIELDS}, shape_fields=family.shape_fields + SHAPE_FIELDS,
        max_sizes={**family.max_sizes, **MAX_SIZES},
        effective=lambda m: dict(base.effective(m) if base.effective else {}) | effective(m, dense_width(m)),
        check=check, shape_fields_of=lambda m: base.shape_fields_of(m) | {'moe': shape_of(m, dense_width(m))},
        param_specs=param_specs, forward_flops=lambda s: base.forward_flops(active(s)),
        megatron_flops=lambda batch, s, recompute: base.megatron_flops(batch, active(s), recompute),
        check_mesh=lambda m, mesh, require: check_mesh(m, mesh, require, dense_width(m)),
        pipelined_layers=pipelined_layers, experts=lambda m: m.get('moe_experts', 0),
        hf=None if family.hf is None else hf_moe.with_moe(family.hf, lambda m: expert_width(m, dense_width(m))))


def _moe_specs(specs: tuple, s: Any) -> tuple:
    """A dense table with MoE layers: the dense layers' rows under `dense_blocks` [first_dense, ...] (stacked
    axis `stem_layers`: model/stack.STEM_LAYERS), the MoE layers' under `blocks` with `mlp_specs`' MLP."""
    dense, moe_layers, out = s.moe.first_dense, s.num_layers - s.moe.first_dense, []
    for p in specs:
        if not p.is_block:
            out.append(p)
            continue
        rest = p.path.removeprefix('blocks/')
        if dense:
            out.append(ParamSpec(f'{DENSE_GROUP}/{rest}', (dense, *p.shape[1:]), ('stem_layers', *p.names[1:])))
        if not rest.startswith('mlp/'):
            out.append(ParamSpec(p.path, (moe_layers, *p.shape[1:]), p.names))
    out += [ParamSpec('blocks/' + path, (moe_layers, *shape), ('layers', *names))
            for path, shape, names in mlp_specs(s.moe, s.d_model)]
    return tuple(sorted(out, key=lambda p: (not p.path.startswith(('blocks/', DENSE_GROUP)), p.path)))
