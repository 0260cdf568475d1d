"""Pipeline parallelism over the `pipeline` mesh axis: the front door.

Modules, bottom up: `schedules` (static tables, NumPy only) -> `chunk` (one chunk's units,
`TokenSplit`) -> `lockstep` (GPipe, `1f1b_lockstep`, interleaved tick executor) and
`staggered` (`1f1b`, half-slots) -> `eval` (forward-only wave) -> this module, which picks
the executor for a config and wraps it in `jax.shard_map`.
"""

from __future__ import annotations

import jax
import ml_collections
from jax.sharding import PartitionSpec as P

from jaxfrontier.model.params import ModelDef
from jaxfrontier.pipeline import lockstep, schedules, staggered
from jaxfrontier.pipeline.chunk import AXIS, split_shared
from jaxfrontier.pipeline.eval import make_pipeline_eval  # noqa: F401  (front door)


def build_schedule(c: ml_collections.ConfigDict) -> schedules.Schedule | schedules.Staggered:
    """1F1B runs staggered (pipeline/staggered.py); GPipe and interleaved on the lockstep tick executor."""
    return schedules.build(c.pipeline.schedule, c.mesh.pipeline, c.train.accum_steps, c.pipeline.virtual_stages)


def make_pipeline_grads(c: ml_collections.ConfigDict, model_def: ModelDef, dropout_key_fn):
    """`(params, micro_abt, step[, scale]) -> (mean loss, grads)` of a pipelined layout (train.py lays out the result)."""
    schedule = build_schedule(c)

    def pipeline_grads(params, micro_abt, step, scale=None):  # scale: float16's loss scale (grads come back scaled)
        blocks, shared = split_shared(params)
        make_engine = staggered.make_engine if isinstance(schedule, schedules.Staggered) else lockstep.make_engine
        engine = make_engine(c, model_def, schedule, lambda m: dropout_key_fn(c, step, m), scale)
        block_spec = jax.tree.map(lambda _: P(None, AXIS) if schedule.virtual > 1 else P(AXIS), blocks)
        shared_spec = jax.tree.map(lambda _: P(), shared)
        run = jax.shard_map(engine, in_specs=(block_spec, shared_spec, P()),
                            out_specs=(P(), block_spec, shared_spec), axis_names={AXIS}, check_vma=False)
        loss, g_blocks, g_shared = run(blocks, shared, micro_abt)
        return loss, {'blocks': g_blocks, **g_shared}

    return pipeline_grads
