"""Pipeline parallelism over the `pipeline` mesh axis: the tick executor of `schedules.py`.

The stacked block parameters are sharded over `pipeline` (logical axis `layers`); the tick
loop runs inside `jax.shard_map(..., axis_names={'pipeline'})`, so data, fsdp and tensor
sharding stay automatic inside a stage. Each tick is one `lax.scan` step: a stage looks up
its forward and backward unit in the schedule's tables (indexed by tick and
`axis_index('pipeline')`), runs them under `lax.switch` (an idle slot runs no matmul), then
one `ppermute` passes activations forward and one passes input gradients backward.

Embedding runs on the stage holding chunk 0 and head + loss on the stage holding the last
chunk, inside the pipeline: 1F1B must start a micro-batch's backward as soon as its forward
ends, and computing embeddings or logits outside would keep all M micro-batches' activations
alive. Their parameters are replicated over `pipeline` (sharded over tensor/fsdp as usual);
their gradients are summed over stages with one `psum` after the loop. Layer groups before the
pipelined one run with the embedding (pipeline/chunk.py). Each stage sums its forward units'
auxiliary outputs into its rows of the layers' aux (ChunkOps.aux_rows): one more small `psum`.

Activation checkpointing inside stages is per layer: a forward unit keeps each layer's input
(the stash), and the backward unit recomputes every layer from it under `jax.vjp` — 4
forward-equivalents per layer, Megatron's full recomputation, for every P, so executed FLOPs
do not grow with the pipeline. Inside a pipeline every `model.remat` policy therefore acts as
`full`: saving more of a layer would mean stashing it for up to 2P micro-batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model.params import ModelDef
from jaxfrontier.pipeline import schedules
from jaxfrontier.pipeline.chunk import (AXIS, PIPELINED, ChunkOps, TokenSplit, f32_zeros, stage_chunks,
                                         sum_over_stages, zero_activation)


def make_engine(layout: layout_lib.Layout, shape: config_lib.ModelShape, model_def: ModelDef,
                schedule: schedules.Schedule, dropout_key_fn, loss_scale=None, packing=None, aux_weight=None):
    """The per-stage tick loop: (local blocks, shared, micro tokens) -> (loss, aux sums, grads);
    `packing`, `loss_scale`, `aux_weight`: ChunkOps'."""
    p_size, v_size = schedule.num_stages, schedule.virtual
    lc = model_def.group_sizes()[PIPELINED] // (p_size * v_size)
    ops = ChunkOps(model_def, shape.seq_len, lc, schedule.num_micro, dropout_key_fn,
                   TokenSplit(layout.shard_activations), loss_scale, TokenOrder.of(layout, shape.seq_len, packing),
                   aux_weight)
    f_ops = [ops.f_none, ops.f_first, ops.f_mid]
    b_ops = [ops.b_none, ops.b_first, ops.b_mid, ops.b_last, ops.b_only]
    dtype = jnp.dtype(shape.dtype)
    f_table, b_table = jnp.asarray(schedule.f_table), jnp.asarray(schedule.b_table)
    recv_f, recv_b = jnp.asarray(schedule.recv_f), jnp.asarray(schedule.recv_b)
    ring_fwd = [(i, (i + 1) % p_size) for i in range(p_size)]
    ring_bwd = [(i, (i - 1) % p_size) for i in range(p_size)]

    def engine(blocks, shared, micro_tokens):
        stage = jax.lax.axis_index(AXIS)
        # This stage's chunks, [V, Lc, ...] in virtual-stage order (V == 1 arrives as [Lc, ...]).
        chunks = stage_chunks(blocks, v_size)
        x_zero = zero_activation(micro_tokens, shape.d_model, dtype)
        ops.probe_aux(jax.tree.map(lambda a: a[0], chunks), shared, micro_tokens)

        def tick(carry, t):
            stash, grad, g_chunks, g_shared, loss_sum, aux_sum = carry
            f_kind, f_m, f_v, f_slot = f_table[t, stage]
            b_kind, b_m, b_v, b_slot, b_gslot = b_table[t, stage]
            chunk_f = jax.tree.map(lambda a: a[f_v], chunks)
            chunk_b = jax.tree.map(lambda a: a[b_v], chunks)
            y, stash_f, aux_f = jax.lax.switch(f_kind, f_ops, chunk_f, shared, micro_tokens[f_m], stash[f_slot], f_m,
                                               f_v * p_size + stage)
            stash = stash.at[f_slot].set(stash_f)
            gc, gs, g_x, loss, aux_b = jax.lax.switch(b_kind, b_ops, chunk_b, shared, micro_tokens[b_m],
                                                      stash[b_slot], grad[b_gslot], b_m, b_v * p_size + stage)
            aux_sum = jax.tree.map(lambda acc, a, b: acc + a + b, aux_sum, aux_f, aux_b)
            g_chunks = jax.tree.map(lambda acc, g: acc.at[b_v].add(g.astype(acc.dtype)), g_chunks, gc)
            g_shared = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), g_shared, gs)
            y_in = jax.lax.ppermute(y.astype(dtype), AXIS, ring_fwd)  # split over tensor: 1/TP on the wire
            g_in = jax.lax.ppermute(g_x.astype(dtype), AXIS, ring_bwd)
            f_valid, f_to = recv_f[t, stage]
            g_valid, g_to = recv_b[t, stage]
            stash = stash.at[f_to, 0].set(jnp.where(f_valid > 0, y_in, stash[f_to, 0]))
            grad = grad.at[g_to].set(jnp.where(g_valid > 0, g_in, grad[g_to]))
            return (stash, grad, g_chunks, g_shared, loss_sum + loss, aux_sum), None

        carry = (ops.tokens.split(jnp.zeros((schedule.act_slots, lc, *x_zero.shape), dtype)),
                 ops.tokens.split(jnp.zeros((schedule.grad_slots, *x_zero.shape), dtype)),
                 f32_zeros(chunks), f32_zeros(shared), jnp.zeros((), jnp.float32), ops.aux_zeros())
        (_, _, g_chunks, g_shared, loss_sum, aux_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
        g_blocks = g_chunks if v_size > 1 else jax.tree.map(lambda a: a[0], g_chunks)
        return sum_over_stages(loss_sum, aux_sum, g_blocks, g_shared)

    return engine
