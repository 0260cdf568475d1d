"""The optimizer and its learning-rate schedule, from `config.optim` (docs/training.md has the table).

Every optimizer is global-norm clipping (`optim.clip_norm`) followed by one of:
  adamw      AdamW (the default): two fp32 moments per parameter (8 B).
  lion       Lion (Chen et al. 2023): one fp32 moment (4 B); the update is lr * sign(...), so the
             usual lr is 3-10x smaller than AdamW's and weight decay 3-10x larger (same lr * wd).
  adafactor  Adafactor (Shazeer & Stern 2018) with factored second moments and no first moment:
             a weight whose two largest dimensions are >= optim.factor_min_dim keeps a row and a
             column factor instead of a full moment (~0 B per parameter). Its step is relative to
             the weight's RMS (optax's multiply_by_parameter_scale), so its lr is ~1e-2.
Weight decay is decoupled (lr * wd * param) on weight matrices and embeddings, never on biases
or norms (`_decay_mask`), for all three.

The factored state is not shaped like the parameters, so `optax.tree_map_params` cannot place
it; `state_shardings` places every optimizer-state leaf by its path instead (layout.py's
`factored_dims` decides the factors for trainer and planner alike).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import layout as layout_lib
from jaxfrontier.model.params import OUTSIDE_GRADIENT, Params


def _warmup(o: ml_collections.ConfigDict) -> optax.Schedule:
    return optax.linear_schedule(0.0, o.lr, o.warmup_steps)


def total_steps(c: ml_collections.ConfigDict) -> int:
    """Steps the schedule spans: optim.decay_steps, else train.steps (more steps hold its end value)."""
    return c.optim.decay_steps or c.train.steps


def wsd_decay_steps(c: ml_collections.ConfigDict) -> int:
    """The wsd schedule's decay length: optim.decay_fraction of the steps, rounded."""
    return round(c.optim.decay_fraction * total_steps(c))


def learning_rate_schedule(c: ml_collections.ConfigDict) -> optax.Schedule:
    """The learning rate at each step: a linear warm-up from 0 to optim.lr, then optim.schedule.

    With T = total_steps, W = optim.warmup_steps, lr = optim.lr, m = optim.min_lr, t the step:
      cosine        m + (lr - m) (1 + cos(pi (t - W) / (T - W))) / 2
      linear        lr + (m - lr) (t - W) / (T - W)
      constant      lr (min_lr unused)
      wsd           lr until T - D, then m + (lr - m) (1 - sqrt((t - T + D) / D)), D = decay_fraction T
      inverse_sqrt  max(m, lr sqrt(W / t))
    Each holds its last value after T.
    """
    o = c.optim
    steps, warmup, lr, min_lr = total_steps(c), o.warmup_steps, float(o.lr), float(o.min_lr)
    if o.schedule == 'cosine':  # unchanged from before the other schedules (the default programs)
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
            end_value=o.min_lr)
    if o.schedule == 'linear':
        after = optax.linear_schedule(lr, min_lr, max(steps - warmup, 1))
    elif o.schedule == 'constant':
        after = optax.constant_schedule(lr)
    elif o.schedule == 'wsd':
        decay = max(wsd_decay_steps(c), 1)
        # 1 - sqrt rather than linear: Hagele et al. 2024 (arXiv 2405.18392) find the 1-sqrt
        # cooldown reaches cosine's final loss where a linear one stays above it.
        def cooldown(t):
            return min_lr + (lr - min_lr) * (1 - jnp.sqrt(jnp.clip(jnp.asarray(t, jnp.float32) / decay, 0.0, 1.0)))
        after = optax.join_schedules([optax.constant_schedule(lr), cooldown], [max(steps - decay - warmup, 0)])
    elif o.schedule == 'inverse_sqrt':
        def after(t):  # join_schedules evaluates it at the warm-up's steps too (t < 0): keep t + W >= 1
            return jnp.maximum(min_lr, lr * jnp.sqrt(warmup / jnp.maximum(jnp.asarray(t, jnp.float32) + warmup, 1.0)))
    else:
        raise ValueError(f'unknown optim.schedule {o.schedule!r}')  # config.validate names it first
    return optax.join_schedules([_warmup(o), after], [warmup])


def _decay_mask(params: Params) -> Params:
    """Weight decay on weight matrices and embeddings (names 'w*' / 'head'); not on biases/norms."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(path[-1].key).startswith(('w', 'head')), params)


def make_optimizer(c: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping, then optim.name (adamw, lion, adafactor) with optim.schedule's learning rate."""
    o = c.optim
    schedule = learning_rate_schedule(c)
    if o.name == 'adamw':
        tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask)
    elif o.name == 'lion':
        # optax applies the decay before the learning rate: lr * (sign(...) + wd * param), as AdamW.
        tx = optax.lion(schedule, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=_decay_mask)
    elif o.name == 'adafactor':
        # optax's adafactor adds its decay after the learning rate; lr(t) * wd keeps it decoupled
        # like AdamW's (a constant rate would subtract wd * param every step).
        tx = optax.adafactor(schedule, min_dim_size_to_factor=o.factor_min_dim,
                             weight_decay_rate=lambda step: o.weight_decay * schedule(step),
                             weight_decay_mask=_decay_mask)
    else:
        raise ValueError(f'unknown optim.name {o.name!r}')  # config.validate names it first
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), tx), schedule


def outside_gradient(tx: optax.GradientTransformation, params: Params) -> optax.GradientTransformation:
    """`tx` leaving the parameters named in model/params.py's `OUTSIDE_GRADIENT` alone: no moments kept for
    them, their updates zero (the model moves them after each step); `tx` itself where `params` (a tree of
    parameters or their shapes) has none, so other models' states and programs are unchanged."""
    def trained(tree):
        return jax.tree_util.tree_map_with_path(lambda path, _: str(path[-1].key) not in OUTSIDE_GRADIENT, tree)

    if all(jax.tree.leaves(trained(params))):
        return tx
    return optax.chain(optax.masked(tx, trained),
                       optax.masked(optax.set_to_zero(), lambda tree: jax.tree.map(lambda t: not t, trained(tree))))


def _param_of(path, params: dict[tuple, Any]) -> tuple[Any, str] | None:
    """The parameter key behind an optimizer-state leaf's path, and the state field holding it.

    A state leaf's path ends in a parameter's dict keys (`.../mu/blocks/attn/w_qkv`); the
    attribute before them names the field (`mu`, `nu`, `v_row`, `v_col`, `v`).
    """
    keys = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            field = getattr(entry, 'name', '')
            return (tuple(reversed(keys)), field) if tuple(reversed(keys)) in params else None
        keys.append(entry.key)
    return None


def state_shardings(abstract_opt: Any, opt_params: Params, opt_param_shardings: Params, mesh,
                    factor_min_dim: int) -> Any:
    """Where each optimizer-state leaf lives: with its parameter, a factor without the reduced dimension.

    A leaf shaped like its parameter (Adam's and Lion's moments, Adafactor's unfactored `v`) takes
    the parameter's sharding (the ZeRO-1 one where `opt_param_shardings` says so). Adafactor's
    factors of a weight [.., d_i, .., d_j, ..] (`layout.factored_dims`) drop one dimension: `v_row`
    the largest, `v_col` the second; each keeps the spec of the dimensions left, so a [d, f] weight
    sharded (fsdp, tensor) has v_row [d] over fsdp and v_col [f] over tensor. Everything else
    (step counters, the (1,) placeholders of the other kind) is replicated.
    """
    flat = {tuple(k.key for k in path): (leaf, sharding) for (path, leaf), sharding in zip(
        jax.tree_util.tree_leaves_with_path(opt_params), jax.tree.leaves(opt_param_shardings))}
    replicated = NamedSharding(mesh, P())

    def place(path, leaf):
        found = _param_of(path, flat)
        if found is None:
            return replicated
        param, sharding = flat[found[0]]
        if leaf.shape == param.shape:
            return sharding
        dims = layout_lib.factored_dims(param.shape, factor_min_dim)
        if dims is None or found[1] not in ('v_row', 'v_col'):
            return replicated
        dropped = dims[1] if found[1] == 'v_row' else dims[0]
        return NamedSharding(mesh, layout_lib.drop_axis(sharding.spec, dropped, len(param.shape)))

    return jax.tree_util.tree_map_with_path(place, abstract_opt)
