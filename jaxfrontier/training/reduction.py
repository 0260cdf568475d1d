"""When gradients cross the data-parallel axis: once per step, not once per micro-batch.

With the `data` axis left to XLA's automatic partitioning, the weight gradient of every
micro-batch is born replicated over `data`, so XLA all-reduces it inside every accumulation
step (and inside every backward unit of a pipeline): M all-reduces of the full gradients per
step. For the paper's 1T layout (M = 512) that is 4 TB per device per step.

Instead, the accumulation loop (step.py, through `data_local` here) or the pipeline's tick
loop (pipeline.make_pipeline_grads, whose one map is then manual over `pipeline` and `data`:
jax 0.11 rejects a pipeline map nested in a data map) runs inside
`jax.shard_map(..., axis_names={'data', ...})`: each data-parallel replica sums the gradients
of its own rows locally, and one `pmean` over `data` after the loop reduces them — M times
fewer bytes. `fsdp`, `tensor` (and `pipeline` outside the pipeline's own map) stay
automatic inside, so FSDP still reduce-scatters per micro-batch, as ZeRO-3 must (its gradients
are sharded like its parameters).

Not used when dropout is on: the masks are drawn for the whole micro-batch from one key
(layout-independent); a replica drawing for its rows alone would draw different ones.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib

AXIS = layout_lib.DATA


def data_local(fn, rules: mesh_lib.Rules):
    """`fn(params, micro_abt, step, scale, aux_weight[, frozen]) -> (loss, aux, grads)` run per data-parallel
    replica, reduced once.

    micro_abt's rows are split over `data` (each replica keeps the rows it already holds:
    step.split_micro_batches lays rows out data-major); loss, aux (per-micro-batch means over
    tokens, model/auxiliary.py) and gradients are averaged over the replicas with one `pmean` each.
    `scale` (float16's loss scale), `aux_weight` and `frozen` (LoRA's base, replicated over `data` like the
    parameters) may be None.
    """
    inner_rules = mesh_lib.without_axis(rules, AXIS)  # inside, `data` is no longer an automatic axis

    def local(params, micro_abt, step, scale, aux_weight, frozen):
        with mesh_lib.use_rules(inner_rules):
            loss, aux, grads = fn(params, micro_abt, step, scale, aux_weight, *(() if frozen is None else (frozen,)))
        return jax.lax.pmean(loss, AXIS), jax.lax.pmean(aux, AXIS), jax.lax.pmean(grads, AXIS)

    def run(params, micro_abt, step, scale=None, aux_weight=None, frozen=None):
        return jax.shard_map(local, in_specs=(P(), P(None, AXIS), P(), P(), P(), P()), out_specs=(P(), P(), P()),
                             axis_names={AXIS}, check_vma=False)(params, micro_abt, step, scale, aux_weight, frozen)

    return run
