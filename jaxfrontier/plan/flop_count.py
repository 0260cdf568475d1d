"""Executed matmul FLOPs of a traced function, from its jaxpr.

XLA's cost analysis counts a while loop's body once and cannot know which branch of a
conditional runs. This counter walks the jaxpr instead: `dot_general` costs 2 x (output
elements) x (contracted size); a scan body counts `length` times; nested jaxprs (jit, remat,
shard_map, custom derivatives) are entered. A `cond`/`switch` counts the branches weighted by
how often each runs, which the caller supplies (`branch_weights`), e.g. from a pipeline
schedule's tables; without weights a conditional is an error rather than a guess.

Inside `shard_map` the shapes are per device along the manual axes; the caller scales.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr has no public name yet
from jax.extend import core as jex_core

BranchWeights = Callable[[int, int], list[float]]  # (cond occurrence, n_branches) -> weights


def _sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _dot_flops(eqn) -> float:
    lhs = eqn.invars[0].aval
    (lhs_contract, _), _ = eqn.params['dimension_numbers']
    contracted = math.prod(lhs.shape[d] for d in lhs_contract)
    return 2.0 * math.prod(eqn.outvars[0].aval.shape) * contracted


class _Counter:
    def __init__(self, branch_weights: BranchWeights | None):
        self.branch_weights, self.conds = branch_weights, 0

    def count(self, jaxpr) -> float:
        total = 0.0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == 'dot_general':
                total += _dot_flops(eqn)
            elif name == 'scan':
                total += eqn.params['length'] * self.count(eqn.params['jaxpr'].jaxpr)
            elif name == 'cond':
                branches = eqn.params['branches']
                if self.branch_weights is None:
                    raise ValueError('a conditional needs branch weights to count executed FLOPs')
                weights = self.branch_weights(self.conds, len(branches))
                self.conds += 1
                total += sum(w * self.count(b.jaxpr) for w, b in zip(weights, branches) if w)
            elif name == 'while':
                if any(eqn.primitive.name == 'dot_general' for eqn in eqn.params['body_jaxpr'].jaxpr.eqns):
                    raise ValueError('a while loop with matmuls has no static trip count')
            else:
                total += sum(self.count(sub) for sub in _sub_jaxprs(eqn.params))
        return total


def executed_dot_flops(fn: Callable, *args, branch_weights: BranchWeights | None = None) -> float:
    """Matmul FLOPs that running `fn(*args)` executes (args may be ShapeDtypeStructs).

    Dead code is removed first, as XLA would: e.g. the primal output of a `jax.vjp` whose
    only use is its pullback.
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return _Counter(branch_weights).count(jaxpr)
