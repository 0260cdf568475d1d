"""The mixture-of-experts MLP (families/moe.py declares its fields, shape and table; docs/models.md).

A token's MLP output is the weighted sum of k of E routed SwiGLU experts, chosen by a router, plus
S always-on shared experts (one SwiGLU of width S x F, DeepSeek):

  router   logits = x W_router [d, E] in fp32 (`linear.project` with fp32 activations; the pipeline
           does not cast it ahead: `linear.FP32_WEIGHTS`).
           softmax (Mixtral, Qwen3): probabilities p = softmax(logits), the k largest chosen, their
             weights p_i (renormalised over the k with `norm_topk`).
           sigmoid (DeepSeek-V3): scores s = sigmoid(logits); the k largest of s + b chosen, b the
             per-expert `router_bias` (selection only, no gradient; moved outside the gradient after
             each step by `update_router_bias`), weights s_i normalised over the k with `norm_topk`;
             the router's probabilities (for the balancing loss and the entropy) s / sum(s).
           Node-limited (`groups` > 0, DeepSeek-V3's n_group / topk_group): the experts in `groups` equal
             groups, a group's score the sum of its two best choice values, and a token's choice values
             outside its `topk_groups` best groups set to 0 before the top k (as transformers' DeepseekV3).
           Weights x `routed_scale` (DeepSeek-V3's routed_scaling_factor).
  experts  dropless: the (token, choice) pairs sorted by expert and a grouped matmul per projection
           (`linear.project_grouped`, `jax.lax.ragged_dot`); capacity (`dropless` False): expert i takes
           its first C = ceil(cf k N / E) assignments of the micro-batch's N tokens in token order (row,
           then position: the same ones in every layout), the rest dropped (their weight 0) and counted.
           Expert parallelism and the collectives: model/layers/moe_parallel.py.

Auxiliary outputs (model/auxiliary.py; every one the micro-batch's global value in every layout):
  loss_lb      Switch/GShard load balancing, lb_coef x E x sum_i f_i P_i: f_i the fraction of the k N
               assignments routed to i (no gradient), P_i the mean router probability of i (only with
               lb_coef > 0)
  loss_z       router z-loss, z_coef x mean over tokens of logsumexp(logits)^2 (only with z_coef > 0)
  moe_load     [E] f: the fraction of the assignments each expert received (before any drop)
  moe_load_max_over_mean  E x max_i f_i: the busiest expert's load over the mean (1: balanced; a scalar
               for TensorBoard / W&B, which take no arrays)
  moe_dropped  the fraction of the assignments dropped (0 when dropless)
  moe_dispatch_fallback  under expert parallelism with the all_to_all or ragged dispatch only: 1 where the
               layer's buffer would have overflowed and it took the exact gather dispatch (moe_dispatch.py);
               its mean over layers and micro-batches is the fallback's frequency
  moe_entropy  the router probabilities' entropy, mean over tokens (nats; log E when uniform)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.families.moe import MoEShape
from jaxfrontier.model import sequence
from jaxfrontier.model.context import flatten_tokens
from jaxfrontier.model.layers import moe_parallel
from jaxfrontier.model.layers.base import param
from jaxfrontier.model.layers.mlp import SwiGLU

# Logical names of the routed part's parameters (families/moe.py `mlp_specs` lists the same).
NAMES = {'w_router': ('embed', None), 'w_gate': ('experts', 'embed', 'expert_mlp'),
         'w_up': ('experts', 'embed', 'expert_mlp'), 'w_down': ('experts', 'expert_mlp', 'embed'),
         'router_bias': (None,)}
BIAS = 'router_bias'  # updated outside the gradient (`update_router_bias`); no optimizer touches it


class MoE(nnx.Module):
    """The MoE MLP on flat activations [N, d]: routed experts (moe_parallel) and shared ones (SwiGLU)."""

    def __init__(self, d_model: int, s: MoEShape, *, init_std: float, out_std: float, rngs: nnx.Rngs):
        e, f = s.experts, s.mlp_dim
        self.moe = s
        self.w_router = param(rngs.params(), (d_model, e), NAMES['w_router'], init_std)
        self.w_gate = param(rngs.params(), (e, d_model, f), NAMES['w_gate'], init_std)
        self.w_up = param(rngs.params(), (e, d_model, f), NAMES['w_up'], init_std)
        self.w_down = param(rngs.params(), (e, f, d_model), NAMES['w_down'], out_std)
        if s.router_bias:
            self.router_bias = param(None, (e,), NAMES[BIAS], 0.0)
        if s.shared:
            self.shared = SwiGLU(d_model, s.shared * f, init_std=init_std, out_std=out_std, rngs=rngs)

    def __call__(self, x_nd: jax.Array, seq: int | sequence.Seq, dropless: bool | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(output [N, d] in x's dtype, aux: the module docstring's entries). `seq`: the tokens' sequence
        (its length, or a Seq; model/sequence.py): the capacity mode's token order. `dropless`
        overrides the shape's (decoding computes every assignment)."""
        s = self.moe if dropless is None or dropless == self.moe.dropless else _with_dropless(self.moe, dropless)
        weights = {name: getattr(self, name)[...] for name in NAMES if hasattr(self, name)}
        keys_n3 = None if s.dropless else token_keys(seq, x_nd.shape[0])
        rows = x_nd.shape[0] // sequence.as_seq(seq).length
        y_nd, aux = moe_parallel.routed(weights, NAMES, x_nd, keys_n3, rows, s, route)
        if s.shared:
            y_nd = y_nd + self.shared(x_nd)
        return y_nd, aux


def _with_dropless(s: MoEShape, dropless: bool) -> MoEShape:
    return dataclasses.replace(s, dropless=dropless)


def route(logits_ne: jax.Array, bias_e: jax.Array | None, s: MoEShape
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's choice from fp32 logits [n, E]: (experts [n, k] int32, their weights [n, k] fp32
    (normalised and scaled as the module docstring says), the router probabilities [n, E])."""
    if s.router == 'softmax':
        probs_ne = jax.nn.softmax(logits_ne, axis=-1)
        select_ne = values_ne = probs_ne
    else:
        values_ne = jax.nn.sigmoid(logits_ne)
        probs_ne = values_ne / jnp.sum(values_ne, axis=-1, keepdims=True)
        select_ne = values_ne
    if bias_e is not None:  # the choice only: the weights stay the scores'
        select_ne = select_ne + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
    if s.groups:
        select_ne = limit_to_groups(select_ne, s.groups, s.topk_groups)
    _, experts_nk = jax.lax.top_k(select_ne, s.top_k)
    weights_nk = jnp.take_along_axis(values_ne, experts_nk, axis=-1)
    if s.norm_topk:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    if s.routed_scale != 1.0:
        weights_nk = weights_nk * s.routed_scale
    return experts_nk.astype(jnp.int32), weights_nk, probs_ne


def limit_to_groups(select_ne: jax.Array, groups: int, best: int) -> jax.Array:
    """Node-limited routing: the choice values [n, E] outside each token's `best` groups (of `groups`, scored
    by the sum of their two largest values) set to 0; the top-k then picks inside those groups."""
    n, e = select_ne.shape
    value_ngq = jax.lax.stop_gradient(select_ne).reshape(n, groups, e // groups)  # the choice only
    score_ng = jnp.sum(jax.lax.top_k(value_ngq, 2)[0], axis=-1)
    _, best_nb = jax.lax.top_k(score_ng, best)
    keep_ng = jnp.sum(jax.nn.one_hot(best_nb, groups, dtype=jnp.int32), axis=1) > 0
    return jnp.where(jnp.repeat(keep_ng, e // groups, axis=1), select_ne, 0.0)


def token_keys(seq: int | sequence.Seq, n: int) -> jax.Array:
    """Each flat token's place in the micro-batch's token order, [N, 3] int32 (row, document, position):
    ordered lexicographically it is the natural order (row-major [B, T]) whatever the layout's flat order
    (context parallelism's parts and zigzag; packed documents' segments increase along a row and their
    positions within one). The row is the replica's (moe_parallel adds the offset of manual axes)."""
    seq = sequence.as_seq(seq)
    t = seq.length
    b = n // t
    rows_bt = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
    docs_bt = jnp.zeros((b, t), jnp.int32) if seq.segments_bt is None else seq.segments_bt.astype(jnp.int32)
    keys_bt3 = jnp.stack([rows_bt, docs_bt, sequence.positions(seq, b).astype(jnp.int32)], axis=-1)
    return flatten_tokens(keys_bt3)


def update_router_bias(params: dict, load_le: jax.Array, rate: float, groups: tuple[str, ...]) -> dict:
    """DeepSeek-V3's auxiliary-loss-free balancing, outside the gradient: b_i += rate x sign(mean load -
    load_i) per layer from the step's loads `load_le` [L, E] (the `moe_load` aux's rows: the layers of
    `groups` in model order that have MoE layers). Returns `params` with each group's `mlp/router_bias`
    [L_g, E] (or an interleaved pipeline's [V, L_g / V, E]) moved."""
    out, row = dict(params), 0
    for group in groups:
        mlp = params[group].get('mlp', {})
        if BIAS not in mlp:
            continue
        bias = mlp[BIAS]
        layers = bias.size // bias.shape[-1]
        load = load_le[row:row + layers]
        row += layers
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        out[group] = {**params[group], 'mlp': {**mlp, BIAS: bias + step.reshape(bias.shape).astype(bias.dtype)}}
    return out
