"""Auxiliary outputs of the layers: what a block returns besides its activations, and how they add up.

A block is called `block(x_nd, seq, key) -> (x_nd, aux)`, `aux` a dict name -> array (a scalar, or a
small vector such as a mixture-of-experts layer's [E] token fractions), possibly empty; the layer
runner (model/stack.py) casts the values to fp32 and stacks each over the layers: [L, ...].

The convention every executor relies on:
- Every value is a statistic of one micro-batch that is a mean over its tokens (a fraction, not a
  count). So the values of equal-sized micro-batches, and of data-parallel replicas holding equal
  parts of one, combine by averaging, exactly as the loss does (the accumulation loop's mean, the
  data-local maps' `pmean`): every layout reports what one device reports.
- An entry whose name starts with `loss_` (`is_loss`) is a term of the training objective: summed
  over the layers, added to its micro-batch's cross-entropy, averaged over the micro-batches like
  it, and differentiated (the layer has applied its coefficient). The cotangent of such a term is
  the constant d objective / d term (`seeds`): 1 per micro-batch, 1/M where an executor divides the
  cross-entropy by the M micro-batches, times float16's loss scale where there is one.
- Every other entry is reported only: the runner stops its gradient (`prepare`).

The train step reports `train/loss` as the cross-entropy alone (what `eval/loss` measures, so the
two stay comparable with or without such terms), and each entry as `aux/<name>` (the mean over
its layers) and `aux/<name>/layers` (the per-layer array; `metrics`).

Layer groups (a model holding several stacks, model/decoder.py): inside the model and the
executors aux is kept per group, `{group: {name: [L_g, ...]}}`; `merge` concatenates each name's
rows over the groups in model order, so a name's per-layer array covers the layers that return it.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

LOSS_PREFIX = 'loss_'

Aux = dict[str, jax.Array]  # one layer's (or a stack's: [L, ...]) auxiliary outputs
GroupAux = dict[str, Aux]  # a stack's per group


def is_loss(name: str) -> bool:
    """Whether entry `name` is a term of the training objective (see the module docstring)."""
    return name.startswith(LOSS_PREFIX)


def prepare(aux: Aux) -> Aux:
    """One layer's aux as the runner keeps it: fp32, the gradient of every reported-only entry stopped."""
    aux = {name: jnp.asarray(v).astype(jnp.float32) for name, v in aux.items()}
    return {name: v if is_loss(name) else jax.lax.stop_gradient(v) for name, v in aux.items()}


def loss_terms(aux: Aux) -> jax.Array | None:
    """The sum over layers of every `loss_` entry of a stacked aux (None where there is none)."""
    terms = [jnp.sum(v) for name, v in sorted(aux.items()) if is_loss(name)]
    return functools.reduce(operator.add, terms) if terms else None


def objective(ce: jax.Array, aux: Aux, weight: jax.Array | float | None = None) -> jax.Array:
    """One micro-batch's training objective: its cross-entropy plus its aux's loss terms (x `weight`).

    Exactly `ce` (the same array, no added operation) without loss terms, so models without
    them compile the program they did before aux existed.
    """
    terms = loss_terms(aux)
    if terms is None:
        return ce
    return ce + (terms if weight is None else terms * weight)


def seeds(aux: Aux, value) -> Aux:
    """Cotangents for `aux` in a backward pass: `value` (d objective / d term) for every `loss_`
    entry, zero for the reported ones. `value` may be a function returning it, called only where
    `aux` has loss terms (so a model without them compiles no operation for it)."""
    if callable(value) and any(is_loss(name) for name in aux):
        value = value()

    def seed(name, v):
        if not is_loss(name):
            return jnp.zeros_like(v)
        return jnp.broadcast_to(jnp.asarray(value, jnp.float32).astype(v.dtype), v.shape)

    return {name: seed(name, v) for name, v in aux.items()}


def merge(by_group: GroupAux, order: tuple[str, ...]) -> Aux:
    """`{group: {name: [L_g, ...]}}` -> `{name: [L, ...]}`: a name's rows over the groups in `order`."""
    rows: dict[str, list[jax.Array]] = {}
    for group in order:
        for name, v in by_group.get(group, {}).items():
            rows.setdefault(name, []).append(v)
    return {name: vs[0] if len(vs) == 1 else jnp.concatenate(vs) for name, vs in rows.items()}


def zeros_like(tree):
    """fp32 zeros shaped like an aux tree: the executors' accumulators."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def metrics(aux: Aux) -> dict[str, jax.Array]:
    """The train step's aux metrics: `aux/<name>` (mean over the layers) and `aux/<name>/layers` ([L, ...])."""
    out = {}
    for name, v in sorted(aux.items()):
        out[f'aux/{name}'] = jnp.mean(v, axis=0)
        out[f'aux/{name}/layers'] = v
    return out
