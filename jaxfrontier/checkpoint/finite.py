"""Parameters that come from outside a run are finite, or refused with a line naming the tensor.

Parameters enter from files a user hands us: `checkpoint.init_params_from` (a safetensors file,
a Hugging Face directory, another run's checkpoint) for training, and the same sources, or the
run's own newest checkpoint, for `--mode=sample` and `--mode=eval`. NaN or Inf there would
sample token 0 forever, score NaN, or stop training at its first step blaming the learning
rate. `check(params, source)` counts the non-finite values of every tensor in one jitted
reduction (on the arrays' own shardings: each device counts its shard) and raises
`NonFiniteParamsError` naming the first bad tensor, its count and the fix.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfrontier.errors import NonFiniteParamsError


def _name(path) -> str:
    return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


@jax.jit
def _nonfinite(leaves: list[Any]) -> list[Any]:
    return [jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros((), jnp.int32)
            for x in leaves]


def nonfinite_counts(params: Any) -> dict[str, tuple[int, int]]:
    """{'/'-joined tensor name: (NaN or Inf values, size)} of the tensors that hold any."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    if not flat:
        return {}
    counts = jax.device_get(_nonfinite([x for _, x in flat]))
    return {_name(path): (int(n), int(x.size)) for (path, x), n in zip(flat, counts) if int(n)}


def check(params: Any, source: str) -> Any:
    """Returns `params` when every value is finite; else raises NonFiniteParamsError naming the tensor."""
    bad = nonfinite_counts(params)
    if bad:
        name, (count, size) = next(iter(bad.items()))
        more = f' (and {len(bad) - 1} more tensors)' if len(bad) > 1 else ''
        raise NonFiniteParamsError(
            f'{source}: parameter {name!r} has {count} of {size} values NaN or Inf{more}; refusing to use them. '
            'Fix: name finite parameters (an older checkpoint step of the run that wrote them, or a file '
            'exported from one).')
    return params
