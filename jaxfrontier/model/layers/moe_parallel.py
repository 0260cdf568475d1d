"""The routed experts of a MoE layer (model/layers/moe.py) on any layout: per device, with the collectives.

Where the tokens are split over automatic mesh axes (data, fsdp, context, expert: the rules' `tokens`),
the layer runs inside one `jax.shard_map` manual over those axes (`inner`), so every device routes,
sorts and multiplies its own tokens; axes already manual around it (`outer`: `data` in the
once-per-step reduction's map or the pipeline's) are used as they are. `tensor` stays automatic: each
expert's width is split over it like the dense MLP's (`expert_mlp` -> tensor), and XLA partitions the
grouped matmuls along it without a collective before the down projection's all-reduce.

Expert parallelism (`expert` > 1, each device holding E / EP experts' weights): how the assignments reach
their experts' devices and come back is the layer's dispatch (`model.moe_dispatch`: gather, all_to_all,
ragged; model/layers/moe_dispatch.py, with the bytes each moves and when each is chosen).

Global statistics: the load f_i and the capacity mode's drop decisions count every token of the
micro-batch (psum / all-gather over inner and outer axes). The balancing loss's P_i, the z-loss and the
entropy are means over the replica's tokens (psum over `inner` only): the outer maps average replicas
with a `pmean` (training/reduction.py, pipeline/__init__.py), which makes them the global means, and
their gradients right. shard_map runs with check_vma=False, where a psum's transpose is a psum: a
value summed over `inner` and returned replicated has its cotangent divided by the inner size on the
way in, so the gradient of the psummed local sums is exactly the global mean's.
"""

from __future__ import annotations

import functools
import math
import types
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.families.moe import MoEShape
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers import moe_dispatch

EXPERT = moe_dispatch.EXPERT  # the mesh axis that splits the experts
INT_MAX = jnp.iinfo(jnp.int32).max


class Axes:
    """The mesh axes a MoE layer sees where it is traced: `inner` (automatic axes splitting the tokens, made
    manual by its map), `outer` (token axes already manual around it), the expert-parallel size."""

    def __init__(self):
        mesh = jax.sharding.get_abstract_mesh()
        manual = set() if mesh.empty else set(mesh.manual_axes)
        tokens = mesh_lib.active_axes('tokens') or ()
        self.inner = tuple(a for a in tokens if a not in manual)
        self.outer = tuple(a.name for a in axes_lib.AXES if a.role in ('batch', 'sequence') and a.name in manual
                           and mesh.shape.get(a.name, 1) > 1)
        if any(axes_lib.get(a).role == 'sequence' for a in self.outer):  # never: no map is manual over context
            raise NotImplementedError(f'a MoE layer inside a map manual over {self.outer}')
        self.sizes = {} if mesh.empty else dict(mesh.shape)
        self.ep = self.sizes.get(EXPERT, 1)
        if self.ep > 1 and EXPERT not in self.inner:
            raise ValueError(f'expert parallelism needs the tokens split over {EXPERT!r} (the rules\' `tokens`)')

    def size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    @property
    def all(self) -> tuple[str, ...]:
        return self.outer + self.inner


def routed(weights: dict[str, jax.Array], names: dict[str, tuple], x_nd: jax.Array, keys_n3: jax.Array | None,
           rows: int, s: MoEShape, route) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The routed experts' output [N, d] (x's dtype) and the layer's aux, on the active mesh and rules.

    `weights`: the layer's routed parameters by name (router, experts, bias) with their logical `names`;
    `keys_n3`: the tokens' order (moe.token_keys) for the capacity mode, else None; `rows`: the batch rows
    of x (a replica's, where outer axes are manual); `route(logits, bias, s)`: the router's choice (moe.route).
    """
    ax = Axes()
    body = functools.partial(_body, s, ax, route, names, rows)
    if not ax.inner:
        return body(weights, x_nd, keys_n3)
    tokens = P(ax.inner if len(ax.inner) > 1 else ax.inner[0])
    weight_specs = {name: _local_spec(names[name], ax) for name in weights}
    run = jax.shard_map(body, in_specs=(weight_specs, tokens, None if keys_n3 is None else tokens),
                        out_specs=(tokens, P()), axis_names=set(ax.inner), check_vma=False)
    return run(weights, x_nd, keys_n3)


def _local_spec(logical: tuple, ax: Axes) -> P:
    """A weight's spec over the map's manual axes only (the automatic ones, tensor, stay XLA's)."""
    spec = mesh_lib.logical_to_spec(logical, mesh_lib.active_rules())
    entries = [tuple(a for a in mesh_lib.entry_axes(e) if a in ax.inner) for e in spec]
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in entries))


def _gather_weights(weights: dict[str, jax.Array], names: dict[str, tuple], ax: Axes) -> types.SimpleNamespace:
    """The weights as this device multiplies them: gathered over the manual axes that split them (fsdp's
    ZeRO-3 gather; the transpose reduce-scatters their gradients), the experts still split over `expert`."""
    out = {}
    for name, w in weights.items():
        spec = _local_spec(names[name], ax) if ax.inner else P()
        for dim, entry in enumerate(spec):
            for axis in reversed(mesh_lib.entry_axes(entry)):
                if axis != EXPERT:
                    w = jax.lax.all_gather(w, axis, axis=dim, tiled=True)
        out[name] = w
    return types.SimpleNamespace(**out)


def _body(s: MoEShape, ax: Axes, route, names, rows, weights, x_nd, keys_n3):
    """One device's routed experts (the module docstring): (y [n, d], aux)."""
    owner = _gather_weights(weights, names, ax)
    n, e, k = x_nd.shape[0], s.experts, s.top_k
    logits_ne = linear.project(owner, 'w_router', 'nd,de->ne', x_nd.astype(jnp.float32), preferred=jnp.float32)
    experts_nk, gates_nk, probs_ne = route(logits_ne, getattr(owner, 'router_bias', None), s)
    tokens = n * ax.size(ax.all)  # the micro-batch's
    local = n * ax.size(ax.inner)  # the replica's
    counts_e = jax.lax.stop_gradient(_psum(jnp.sum(jax.nn.one_hot(experts_nk, e, dtype=jnp.float32), axis=(0, 1)),
                                           ax.all))
    load_e = counts_e / (k * tokens)
    entropy_n = -jnp.sum(probs_ne * jnp.log(jnp.maximum(probs_ne, jnp.finfo(jnp.float32).tiny)), axis=-1)
    aux = {'moe_load': load_e, 'moe_load_max_over_mean': e * jnp.max(load_e), 'moe_entropy': jax.lax.stop_gradient(_psum(jnp.sum(entropy_n), ax.inner) / local)}
    if s.lb_coef:
        prob_e = _psum(jnp.sum(probs_ne, axis=0), ax.inner) / local
        aux['loss_lb'] = s.lb_coef * e * jnp.sum(load_e * prob_e)
    if s.z_coef:
        lse_n = jax.nn.logsumexp(logits_ne, axis=-1)
        aux['loss_z'] = s.z_coef * _psum(jnp.sum(jnp.square(lse_n)), ax.inner) / local
    kept_nk, buffer = None, None
    if s.dropless:
        aux['moe_dropped'] = jnp.zeros((), jnp.float32)
    else:
        capacity = s.capacity(tokens)
        kept_nk = _capacity_kept(experts_nk, _global_rows(keys_n3, ax, rows), capacity, e, ax)
        aux['moe_dropped'] = jnp.sum(jnp.maximum(counts_e - capacity, 0.0)) / (k * tokens)
        buffer = (e // ax.ep) * capacity
    valid_nk = jnp.ones(experts_nk.shape, bool) if kept_nk is None else kept_nk
    y_nd, fallback = moe_dispatch.routed_output(owner, x_nd, experts_nk, gates_nk, valid_nk, s, ax.ep, buffer)
    if fallback is not None:
        aux['moe_dispatch_fallback'] = fallback
    return y_nd, aux


def _psum(x, axes: tuple[str, ...]):
    return jax.lax.psum(x, axes) if axes else x


def _global_rows(keys_n3: jax.Array, ax: Axes, rows: int) -> jax.Array:
    """The token keys with rows counted over the micro-batch: the replicas of the outer manual axes hold
    consecutive blocks of `rows` rows (the batch axes in mesh order, data outermost)."""
    if not ax.outer:
        return keys_n3
    index = 0
    for a in ax.outer:
        index = index * ax.sizes[a] + jax.lax.axis_index(a)
    return keys_n3.at[:, 0].add(index * rows)


def _capacity_kept(experts_nk, keys_n3, capacity: int, e: int, ax: Axes) -> jax.Array:
    """Which of this device's assignments [n, k] their experts take: each expert its first `capacity`
    assignments of the micro-batch in token order (keys lexicographic), counted over every device.

    Every device gathers every assignment's (expert, key) (int32: N k x 4 x 4 bytes), sorts them and
    reads each expert's threshold key (its `capacity`-th assignment's), then keeps its own assignments
    below it; the same decisions whatever the layout. Costs N k log(N k) per device and layer: the price
    of layout-independent drops (dropless costs none of it)."""
    k = experts_nk.shape[1]
    cols = [experts_nk.reshape(-1)] + [jnp.repeat(keys_n3[:, i], k) for i in range(3)]
    for a in reversed(ax.all):  # order does not matter: the sort decides
        cols = [jax.lax.all_gather(c, a, axis=0, tiled=True) for c in cols]
    sorted_cols = jax.lax.sort(tuple(cols), num_keys=4)
    counts_e = jnp.sum(jax.nn.one_hot(cols[0], e, dtype=jnp.int32), axis=0)
    at_e = jnp.clip(jnp.cumsum(counts_e) - counts_e + capacity, 0, cols[0].shape[0] - 1)
    full_e = counts_e > capacity
    threshold_e3 = jnp.stack([jnp.where(full_e, c[at_e], INT_MAX) for c in sorted_cols[1:]], axis=-1)
    mine_nk3 = jnp.broadcast_to(keys_n3[:, None, :], (*experts_nk.shape, 3))
    return _before(mine_nk3, threshold_e3[experts_nk])


def _before(a: jax.Array, b: jax.Array) -> jax.Array:
    """Whether key a [..., 3] comes before key b [..., 3] (lexicographic)."""
    return (a[..., 0] < b[..., 0]) | ((a[..., 0] == b[..., 0]) & (
        (a[..., 1] < b[..., 1]) | ((a[..., 1] == b[..., 1]) & (a[..., 2] < b[..., 2]))))
