"""LoRA's parameters on the JAX side: the adapters apart from the base, and merged into it.

A model built with adapters (model/layers/linear.py `adapt`) has one params dict holding both: the
base weights under their usual paths and the adapters beside them (`<weight>_lora_a`, `_lora_b`;
families/lora.py). The train state keeps the two apart (training/state.py): `split` gives the adapters
(what is trained and checkpointed) and the base (frozen, read from checkpoint.init_params_from), `join`
puts them back together for the model to bind. `merge` folds the adapters into the base weights
(W + alpha / r a b), the model without adapters that export and inference run. `adapters_off` (from
model/layers/linear.py) makes a model built with adapters compute its base: DPO's reference model under LoRA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfrontier.families import Lora
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.model.layers.linear import adapters_off

__all__ = ['adapters_off', 'join', 'merge', 'split']

Params = dict[str, Any]


def split(params: Params) -> tuple[Params, Params]:
    """(the adapters, the rest) of a nested params dict (or any tree of dicts, e.g. its shardings)."""
    adapters: Params = {}
    base: Params = {}
    for key, value in params.items():
        if isinstance(value, dict):
            a, b = split(value)
            if a:
                adapters[key] = a
            if b:
                base[key] = b
        elif lora_lib.is_adapter(key):
            adapters[key] = value
        else:
            base[key] = value
    return adapters, base


def join(base: Params, adapters: Params) -> Params:
    """`split`'s inverse: one nested dict with both (no copies: the same leaves)."""
    out = dict(base)
    for key, value in adapters.items():
        out[key] = join(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def merge(params: Params, lora: Lora) -> Params:
    """The base weights with their adapters merged in (W + alpha / r a b per layer), the adapters dropped:
    the parameters of the model without adapters that computes the same (fp32 sums)."""
    adapters, base = split(params)
    blocks = dict(base['blocks'])

    def leaf(tree: Params, path: str) -> Any:
        for part in path.split('/'):
            tree = tree[part]
        return tree

    def put(tree: Params, path: str, value: Any) -> Params:
        head, _, rest = path.partition('/')
        return {**tree, head: put(tree[head], rest, value) if rest else value}

    for weight, t in lora.weights().items():
        a, b, w = leaf(adapters['blocks'], weight + '_lora_a'), leaf(adapters['blocks'], weight + '_lora_b'), \
            leaf(blocks, weight)
        delta = jax.vmap(lambda a_l, b_l, w_l, t=t, weight=weight: _delta(a_l, b_l, t.contracted,
                                                                          lora.slices(weight), w_l.shape))(a, b, w)
        blocks = put(blocks, weight, w + jnp.asarray(lora.scale, w.dtype) * delta.astype(w.dtype))
    return {**base, 'blocks': blocks}


def _delta(a: jax.Array, b: jax.Array, contracted: int, slices: tuple[int, ...] | None,
           shape: tuple[int, ...]) -> jax.Array:
    """One layer's a b shaped like its weight (families/lora.py `delta`, in JAX)."""
    if slices is None:
        return jnp.tensordot(a, b, axes=1)
    parts = [jnp.zeros(shape[:contracted] + shape[contracted + 1:], a.dtype)] * shape[contracted]
    for s, i in enumerate(slices):
        parts[i] = jnp.tensordot(a[..., s, :], b[s], axes=1)
    return jnp.stack(parts, axis=contracted)
