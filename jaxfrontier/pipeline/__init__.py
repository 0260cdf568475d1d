"""Pipeline parallelism over the `pipeline` mesh axis: the front door.

Modules, bottom up: `schedules` (static tables, NumPy only) -> `chunk` (one chunk's units,
`TokenSplit`) -> `lockstep` (GPipe, `1f1b_lockstep`, interleaved tick executor) and
`staggered` (`1f1b`, half-slots) -> `eval` (forward-only wave) -> this module, which picks
the executor for a config and wraps it in `jax.shard_map`.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import auxiliary
from jaxfrontier.model.params import ModelDef
from jaxfrontier.pipeline import lockstep, schedules, staggered
from jaxfrontier.pipeline.chunk import AXIS, check_groups, data_local_scope, split_shared
from jaxfrontier.pipeline.eval import make_pipeline_eval  # noqa: F401  (front door)


def build_schedule(layout: layout_lib.Layout) -> schedules.Schedule | schedules.Staggered:
    """1F1B runs staggered (pipeline/staggered.py); GPipe and interleaved on the lockstep tick executor."""
    return schedules.build(layout.schedule, layout.pipeline, layout.accum_steps, layout.virtual_stages)


def make_pipeline_grads(layout: layout_lib.Layout, shape: config_lib.ModelShape, model_def: ModelDef,
                        schedule: schedules.Schedule | schedules.Staggered, dropout_key_fn,
                        data_local_rules: mesh_lib.Rules | None = None, packing=None):
    """`(params, micro_abt, step, scale=None, aux_weight=None) -> (mean loss, mean aux, grads)` of a
    pipelined layout (training/step.py's `micro_fn` contract; it lays out the result).

    `schedule`: `build_schedule(layout)`, built once per run; `dropout_key_fn(step, micro)`: the
    dropout key of a micro-batch (None without dropout); `packing`: packed documents
    (model/packing.py: each unit builds them from its micro-batch's tokens), or None.

    `data_local_rules`: the layout's rules when gradients cross `data` once per step
    (`layout.reduce_once`, training/reduction.py). The map is then manual over `data` too: each
    data-parallel replica runs the pipeline on its own rows (micro_abt's rows, laid out
    data-major) and loss and gradients are averaged over `data` once, inside the same map. One
    map over both axes, not the pipeline's nested in a data map: jax 0.11's Shardy rejects
    that nesting ("Manual axes must be sorted by mesh axis index"; benchmarks/repro_nested_shard_map.py).

    Layer groups (model/decoder.py) are checked here, before anything compiles (chunk.check_groups).
    The aux (model/auxiliary.py): each stage's rows summed over micro-batches, one `psum` over
    `pipeline` (and `pmean` over `data`), then / M and merged into `{name: [L, ...]}`.
    """
    data_axes, scope = data_local_scope(data_local_rules)
    check_groups(model_def, schedule.num_stages, schedule.virtual)

    def pipeline_grads(params, micro_abt, step, scale=None, aux_weight=None):
        # scale: float16's loss scale (grads come back scaled); aux_weight: of the aux's loss terms
        with scope():
            return traced(params, micro_abt, step, scale, aux_weight)

    def traced(params, micro_abt, step, scale, aux_weight):
        blocks, shared = split_shared(params)
        make_engine = staggered.make_engine if isinstance(schedule, schedules.Staggered) else lockstep.make_engine
        engine = make_engine(layout, shape, model_def, schedule, lambda m: dropout_key_fn(step, m), scale, packing,
                             aux_weight)

        def run_replica(blocks, shared, micro_abt):
            out = engine(blocks, shared, micro_abt)  # (loss, aux sums, block grads, shared grads)
            return jax.lax.pmean(out, data_axes) if data_axes else out

        block_spec = jax.tree.map(lambda _: P(None, AXIS) if schedule.virtual > 1 else P(AXIS), blocks)
        shared_spec = jax.tree.map(lambda _: P(), shared)
        run = jax.shard_map(run_replica, in_specs=(block_spec, shared_spec, P(None, *data_axes)),
                            out_specs=(P(), P(), block_spec, shared_spec), axis_names={AXIS, *data_axes},
                            check_vma=False)
        loss, aux, g_blocks, g_shared = run(blocks, shared, micro_abt)
        aux = jax.tree.map(lambda a: a / schedule.num_micro, aux)  # the mean over micro-batches, as the loss's
        return loss, auxiliary.merge(aux, model_def.groups), {'blocks': g_blocks, **g_shared}

    return pipeline_grads
