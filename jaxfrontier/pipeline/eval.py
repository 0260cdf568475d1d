"""Evaluation of a pipelined model: a forward-only wave (`schedules.forward_only`).

No stash, no backward, one activation send per tick; the unpipelined eval step's loss and
a third of the training step's FLOPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import auxiliary
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model.params import ModelDef
from jaxfrontier.pipeline import schedules
from jaxfrontier.pipeline.chunk import (AXIS, PIPELINED, ChunkOps, TokenSplit, check_groups, data_local_scope,
                                        split_shared, stage_chunks, zero_activation)


def make_pipeline_eval(layout: layout_lib.Layout, shape: config_lib.ModelShape, model_def: ModelDef, split_micro,
                       data_local_rules: mesh_lib.Rules | None = None, packing=None):
    """`eval_loss_and_aux(params, tokens) -> (mean loss, mean aux)` of a pipelined layout: forward units only.

    A wave of chunk forwards (`schedules.forward_only`): no stash, no backward, one activation
    send per tick; a third of the training step's FLOPs. `data_local_rules` (the layout's rules,
    where the batch is split over `data` and no parameter is): the map is manual over `data`
    too, each replica's loss averaged over `data` inside it, as the training step's
    (pipeline.make_pipeline_grads). jax 0.11.2 aborts compiling the wave with both `data` and
    `fsdp` > 1 left automatic inside the pipeline's map (spmd_partitioner_util.cc:498).
    `packing` (model/packing.py): each micro-batch's documents, positions and loss weights, as training's.
    The aux (model/auxiliary.py, `{name: [L, ...]}`) is each micro-batch's forward's, averaged over
    the micro-batches as the loss.
    """
    schedule = schedules.forward_only(layout.pipeline, layout.accum_steps,
                                      layout.virtual_stages if layout.schedule == 'interleaved' else 1)
    p_size, v_size = schedule.num_stages, schedule.virtual
    check_groups(model_def, p_size, v_size)
    lc = model_def.group_sizes()[PIPELINED] // (p_size * v_size)
    dtype = jnp.dtype(shape.dtype)
    dp = layout.dp
    ring_fwd = [(i, (i + 1) % p_size) for i in range(p_size)]
    data_axes, scope = data_local_scope(data_local_rules)
    e_table, recv = jnp.asarray(schedule.e_table), jnp.asarray(schedule.recv)

    def engine(blocks, shared, micro_tokens):
        ops = ChunkOps(model_def, shape.seq_len, lc, schedule.num_micro, lambda m: None,
                       TokenSplit(layout.shard_activations), order=TokenOrder.of(layout, shape.seq_len, packing))
        stage = jax.lax.axis_index(AXIS)
        chunks = stage_chunks(blocks, v_size)
        x_zero = zero_activation(micro_tokens, shape.d_model, dtype)
        ops.probe_aux(jax.tree.map(lambda a: a[0], chunks), shared, micro_tokens)

        def run(kind):
            def unit(chunk, tokens, x_split, m, chunk_index):
                if kind == schedules.E_NONE:
                    return x_split, jnp.zeros((), jnp.float32), ops.aux_zeros()
                model = ops.model(chunk, shared)
                stem_aux = None
                if kind == schedules.E_FIRST:
                    x, stem_aux = ops.embed(chunk, shared, tokens, m)
                    x = x.astype(dtype)
                else:
                    x = ops.tokens.gather(x_split)
                y, aux, _ = ops.forward(chunk, shared, x, m, chunk_index, ops.seq(tokens))
                aux = ops.aux_rows(chunk_index, aux, stem_aux)
                if kind == schedules.E_LAST:
                    return jnp.zeros_like(x_split), ops.head_loss(model, y, tokens), aux
                return ops.tokens.split(y), jnp.zeros((), jnp.float32), aux
            return unit

        units = [run(k) for k in (schedules.E_NONE, schedules.E_FIRST, schedules.E_MID, schedules.E_LAST)]

        def tick(carry, t):
            buf, loss_sum, aux_sum = carry
            kind, m, v, slot = e_table[t, stage]
            y, loss, aux = jax.lax.switch(kind, units, jax.tree.map(lambda a: a[v], chunks), micro_tokens[m],
                                          buf[slot], m, v * p_size + stage)
            y_in = jax.lax.ppermute(y.astype(dtype), AXIS, ring_fwd)
            valid, to = recv[t, stage]
            buf = buf.at[to].set(jnp.where(valid > 0, y_in, buf[to]))
            return (buf, loss_sum + loss, jax.tree.map(jnp.add, aux_sum, aux)), None

        carry = (ops.tokens.split(jnp.zeros((schedule.slots, *x_zero.shape), dtype)), jnp.zeros((), jnp.float32),
                 ops.aux_zeros())
        (_, loss_sum, aux_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
        out = (jax.lax.psum(loss_sum, AXIS), jax.lax.psum(aux_sum, AXIS))
        return jax.lax.pmean(out, data_axes) if data_axes else out

    def eval_loss_and_aux(params, tokens_gt):
        blocks, shared = split_shared(params)
        block_spec = jax.tree.map(lambda _: P(None, AXIS) if v_size > 1 else P(AXIS), blocks)
        run = jax.shard_map(engine, in_specs=(block_spec, jax.tree.map(lambda _: P(), shared), P(None, *data_axes)),
                            out_specs=(P(), P()), axis_names={AXIS, *data_axes}, check_vma=False)
        with scope():
            loss, aux = run(blocks, shared, split_micro(tokens_gt, layout.accum_steps, dp))
        aux = jax.tree.map(lambda a: a / schedule.num_micro, aux)  # the mean over micro-batches, as the loss's
        return loss, auxiliary.merge(aux, model_def.groups)

    return eval_loss_and_aux
