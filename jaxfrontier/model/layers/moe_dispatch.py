"""How a MoE layer's assignments reach the devices holding their experts and come back (`model.moe_dispatch`).

`routed_output(owner, x_nd, experts_nk, gates_nk, valid_nk, s, ep, buffer)` is the one entry: inside
moe_parallel's map (manual over `expert`), this device's n tokens x [n, d], their k experts [n, k]
(global ids) and gates, which assignments count (`valid_nk`: the capacity mode's kept ones); it returns
the routed output of this device's tokens [n, d] in x's dtype by one function per dispatch. With EP = 1
every dispatch is the local one (no collective).

  gather      all-gather the expert group's tokens over `expert`, every device computes its experts'
              assignments of the whole group, a reduce-scatter returns each device's sum: 2 (EP - 1) n d
              per device per layer, whatever the routing (moe_parallel's original dispatch).
  all_to_all  the assignments sorted by destination into a fixed buffer of P rows per peer (P =
              moe_dispatch_buffer x the even share k n / EP), one `all_to_all` out (the rows and their
              experts' ids), the experts, one back: 2 (EP - 1) P d. Dropless: where any device of the
              group would send a peer more than P rows, the whole group takes `gather` for that layer
              (`lax.cond` on a max over `expert`: exact, and bounded by gather's cost); the fallback's
              frequency is `aux/moe_dispatch_fallback`.
  ragged      the assignments sorted by expert and sent as they are (`ragged.ragged_all_to_all`: the op on
              GPUs, its exact stand-in on the CPU) into a receive buffer of R rows (moe_dispatch_buffer x
              k n, at most the worst case EP k n), re-sorted by local expert, the experts, and back the same
              way: 2 (EP - 1) / EP k n d moved on average, flat in EP. Offsets from the group's per-expert
              counts (an all-gather of [EP, E] int32). A receive buffer that would overflow takes `gather`
              as above; at moe_dispatch_buffer >= EP it never does.

`families.moe.resolve_dispatch` picks `auto`: ragged where EP > k (it moves k / EP of gather's bytes), gather otherwise (the
same decision on every platform, so the CPU checks run the GPU's code around the collective).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfrontier.config import axes as axes_lib
from jaxfrontier.families.moe import MoEShape, resolve_dispatch, send_buffer_rows
from jaxfrontier.model.layers import linear
from jaxfrontier.model.layers import ragged

EXPERT = next(a.name for a in axes_lib.AXES if a.holds_experts)  # the mesh axis that splits the experts


def routed_output(owner, x_nd, experts_nk, gates_nk, valid_nk, s: MoEShape, ep: int, buffer: int | None):
    """The routed output of this device's tokens [n, d] (x's dtype) by the layer's dispatch, and whether the
    exact fallback to `gather` ran (a scalar fp32 0/1, the same on every device of the expert group; with
    chunks, the share of chunks that took it; None where nothing is sent: EP 1 or gather, so those programs'
    aux is what it was). The sent dispatches take the tokens in `s.chunks` chunks (`n` divisible, else one:
    decoding's few tokens), each on its own: the same numbers, transfers that can run beside another
    chunk's experts."""
    dispatch = resolve_dispatch(s, ep)
    if ep == 1 or dispatch == 'gather':
        return gathered(owner, x_nd, experts_nk, gates_nk, valid_nk, s, ep, buffer), None
    n = x_nd.shape[0]
    chunks = s.chunks if n % s.chunks == 0 else 1
    outs, flags = [], []
    for i in range(chunks):
        part = slice(i * n // chunks, (i + 1) * n // chunks)
        y_nd, flag = _sent_chunk(owner, x_nd[part], experts_nk[part], gates_nk[part], valid_nk[part], s, ep,
                                 buffer, dispatch)
        outs.append(y_nd)
        flags.append(flag)
    y_nd = outs[0] if chunks == 1 else jnp.concatenate(outs, axis=0)
    return y_nd, sum(flags) / chunks


def _sent_chunk(owner, x_nd, experts_nk, gates_nk, valid_nk, s: MoEShape, ep: int, buffer: int | None,
                dispatch: str):
    """One chunk's tokens by the sent `dispatch`, through the exact gather where a buffer would overflow."""
    sent = {'all_to_all': all_to_all, 'ragged': ragged_sent}[dispatch]
    rows = send_buffer_rows(s, dispatch, ep, x_nd.shape[0])
    plan = _Plan(experts_nk, valid_nk, s, ep, group_counts=dispatch == 'ragged')
    overflow = jax.lax.pmax(plan.overflows(rows), EXPERT)
    y_nd = jax.lax.cond(overflow, lambda a: gathered(owner, *a, s, ep, buffer),
                        lambda a: sent(owner, *a, plan, s, ep, rows),
                        (x_nd, experts_nk, gates_nk, valid_nk))
    return y_nd, overflow.astype(jnp.float32)


# --------------------------------------------------------------------------- the experts, locally


def swiglu_grouped(owner, x_md: jax.Array, group_sizes_g: jax.Array) -> jax.Array:
    """This device's experts over rows sorted by local expert (rows past the groups' sum get zeros)."""
    h_mf = (jax.nn.silu(linear.project_grouped(owner, 'w_gate', x_md, group_sizes_g))
            * linear.project_grouped(owner, 'w_up', x_md, group_sizes_g))
    return linear.project_grouped(owner, 'w_down', h_mf, group_sizes_g)


def _combine(y_rd: jax.Array, gates_nk: jax.Array, valid_nk: jax.Array, dtype) -> jax.Array:
    """Each token's weighted sum of its k rows [n k, d] (choice order): [n, d] in `dtype`."""
    n, k = gates_nk.shape
    weight_r = jnp.where(valid_nk, gates_nk, 0.0).reshape(-1)
    y_nd = jnp.sum((y_rd.astype(jnp.float32) * weight_r[:, None]).reshape(n, k, -1), axis=1)
    return y_nd.astype(dtype)


# --------------------------------------------------------------------------- gather


def gathered(owner, x_nd, experts_nk, gates_nk, valid_nk, s: MoEShape, ep: int, buffer: int | None):
    """This device's experts over the expert group's tokens (all-gathered over `expert`), their weighted
    sum per token reduce-scattered back (moe_parallel's dispatch before the choices)."""
    k = s.top_k
    local_experts = s.experts // ep
    if ep > 1:
        x_nd, experts_nk, gates_nk, valid_nk = (jax.lax.all_gather(a, EXPERT, axis=0, tiled=True)
                                                 for a in (x_nd, experts_nk, gates_nk, valid_nk))
        experts_nk = experts_nk - jax.lax.axis_index(EXPERT) * local_experts
    mine_nk = valid_nk & (experts_nk >= 0) & (experts_nk < local_experts)
    group_r = jnp.where(mine_nk, experts_nk, local_experts).reshape(-1)  # R = tokens x k assignments
    order_r = jnp.argsort(group_r, stable=True)  # this device's experts' assignments first, by expert
    group_sizes_g = jnp.sum(jax.nn.one_hot(group_r, local_experts, dtype=jnp.int32), axis=0)
    rows = group_r.shape[0] if buffer is None else min(group_r.shape[0], buffer)  # capacity: <= C per expert
    order_m = order_r[:rows]
    x_md = x_nd[order_m // k]
    y_md = swiglu_grouped(owner, x_md, group_sizes_g)
    weight_m = jnp.where(group_r[order_m] < local_experts, gates_nk.reshape(-1)[order_m], 0.0)
    y_rd = jnp.zeros((group_r.shape[0], y_md.shape[1]), jnp.float32).at[order_m].set(
        y_md.astype(jnp.float32) * weight_m[:, None], unique_indices=True)
    y_nd = jnp.sum(y_rd.reshape(-1, k, y_md.shape[1]), axis=1)  # each token's k choices, in choice order
    if ep > 1:
        y_nd = jax.lax.psum_scatter(y_nd, EXPERT, scatter_dimension=0, tiled=True)
    return y_nd.astype(x_md.dtype)


# --------------------------------------------------------------------------- sent: all_to_all, ragged


class _Plan:
    """This device's assignments sorted by global expert (the invalid ones last), the rows it sends each peer,
    and with `group_counts` (ragged: its offsets need them) every device's counts per expert."""

    def __init__(self, experts_nk, valid_nk, s: MoEShape, ep: int, group_counts: bool):
        e, self.local = s.experts, s.experts // ep
        expert_r = jnp.where(valid_nk, experts_nk, e).reshape(-1)  # e: not sent
        self.order_r = jnp.argsort(expert_r, stable=True)
        self.expert_sorted_r = expert_r[self.order_r]
        counts_e = jnp.sum(jax.nn.one_hot(expert_r, e, dtype=jnp.int32), axis=0)  # the invalid ones: no column
        self.me = jax.lax.axis_index(EXPERT)
        self.send_d = jnp.sum(counts_e.reshape(ep, self.local), axis=-1)
        self.send_offsets_d = jnp.cumsum(self.send_d) - self.send_d
        self.counts_se = self.pairs_sd = None
        if group_counts:
            self.counts_se = jax.lax.all_gather(counts_e, EXPERT)  # [EP sources, E]
            self.pairs_sd = jnp.sum(self.counts_se.reshape(ep, ep, self.local), axis=-1)  # rows source -> destination

    def overflows(self, rows: int) -> jax.Array:
        """Whether this device would overflow its buffer: more than `rows` received (ragged, with the group's
        counts), or a peer's rows past `rows` (all_to_all)."""
        if self.pairs_sd is not None:
            return jnp.sum(self.pairs_sd[:, self.me]) > rows
        return jnp.any(self.send_d > rows)

    def received_expert(self, rows: int) -> jax.Array:
        """The local expert of each row of the ragged receive buffer (sources in order, each source's rows
        by expert), `self.local` past the rows received."""
        mine_se = jax.lax.dynamic_slice_in_dim(self.counts_se, self.me * self.local, self.local, axis=1)
        ends_q = jnp.cumsum(mine_se.reshape(-1))  # segments (source, local expert) in that order
        segment_r = jnp.searchsorted(ends_q, jnp.arange(rows, dtype=ends_q.dtype), side='right')
        return jnp.where(segment_r < ends_q.shape[0], segment_r % self.local, self.local)


def _local_experts(owner, recv_md, expert_m, local: int):
    """The experts over received rows in any order: sorted by local expert, multiplied, put back."""
    order_m = jnp.argsort(expert_m, stable=True)
    group_sizes_g = jnp.sum(jax.nn.one_hot(expert_m, local, dtype=jnp.int32), axis=0)
    y_md = swiglu_grouped(owner, recv_md[order_m], group_sizes_g)
    return jnp.zeros_like(y_md).at[order_m].set(y_md, unique_indices=True)


def all_to_all(owner, x_nd, experts_nk, gates_nk, valid_nk, plan: _Plan, s: MoEShape, ep: int, rows: int):
    """Per-peer buffers of `rows` rows, one all_to_all each way (the module docstring); never overflows here."""
    k, r = s.top_k, plan.order_r.shape[0]
    dest_r = plan.expert_sorted_r // plan.local  # ep (the sentinel expert E): not sent
    sent_r = dest_r < ep
    slot_r = jnp.arange(r) - plan.send_offsets_d[jnp.minimum(dest_r, ep - 1)]
    x_rd = x_nd[plan.order_r // k]
    where = (dest_r, slot_r)  # the unsent rows' destination ep is out of range: dropped by the scatter
    send_pmd = jnp.zeros((ep, rows, x_nd.shape[1]), x_nd.dtype).at[where].set(x_rd, mode='drop')
    ids_pm = jnp.full((ep, rows), plan.local, jnp.int32).at[where].set(
        plan.expert_sorted_r - dest_r * plan.local, mode='drop')
    recv_pmd = jax.lax.all_to_all(send_pmd, EXPERT, 0, 0, tiled=True)
    recv_ids_pm = jax.lax.all_to_all(ids_pm, EXPERT, 0, 0, tiled=True)
    y_md = _local_experts(owner, recv_pmd.reshape(ep * rows, -1), recv_ids_pm.reshape(-1), plan.local)
    back_pmd = jax.lax.all_to_all(y_md.reshape(ep, rows, -1), EXPERT, 0, 0, tiled=True)
    y_sorted_rd = jnp.where(sent_r[:, None], back_pmd[jnp.minimum(dest_r, ep - 1), jnp.clip(slot_r, 0, rows - 1)], 0)
    y_rd = jnp.zeros_like(y_sorted_rd).at[plan.order_r].set(y_sorted_rd, unique_indices=True)
    return _combine(y_rd, gates_nk, valid_nk, x_nd.dtype)


def ragged_sent(owner, x_nd, experts_nk, gates_nk, valid_nk, plan: _Plan, s: MoEShape, ep: int, rows: int):
    """The assignments as they are, by `ragged_all_to_all` into a receive buffer of `rows` rows and back."""
    k, r, me = s.top_k, plan.order_r.shape[0], plan.me
    x_rd = x_nd[plan.order_r // k]
    pairs = plan.pairs_sd
    recv_s = pairs[:, me]
    # Where this device's rows land on each destination: after those of the sources before it.
    land_d = (jnp.cumsum(pairs, axis=0) - pairs)[me]
    recv_md = ragged.ragged_all_to_all(x_rd, jnp.zeros((rows, x_nd.shape[1]), x_nd.dtype), plan.send_offsets_d,
                                       plan.send_d, land_d, recv_s, EXPERT)
    y_md = _local_experts(owner, recv_md, plan.received_expert(rows), plan.local)
    # Back: source s's rows from this buffer (at its offset here) to where they came from on s.
    recv_offsets_s = jnp.cumsum(recv_s) - recv_s
    back_s = (jnp.cumsum(pairs, axis=1) - pairs)[:, me]
    y_sorted_rd = ragged.ragged_all_to_all(y_md, jnp.zeros((r, y_md.shape[1]), y_md.dtype), recv_offsets_s,
                                           recv_s, back_s, plan.send_d, EXPERT)
    y_rd = jnp.zeros_like(y_sorted_rd).at[plan.order_r].set(y_sorted_rd, unique_indices=True)
    return _combine(y_rd, gates_nk, valid_nk, x_nd.dtype)
