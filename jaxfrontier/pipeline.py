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
their gradients are summed over stages with one `psum` after the loop.

Activation checkpointing inside stages is per layer: a forward unit keeps each layer's input
(the stash), and the backward unit recomputes every layer from it under `jax.vjp` — 4
forward-equivalents per layer, Megatron's full recomputation, for every P, so executed FLOPs
do not grow with the pipeline. Inside a pipeline every `model.remat` policy therefore acts as
`full`: saving more of a layer would mean stashing it for up to 2P micro-batches.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import schedules
from jaxfrontier import train_state as ts

AXIS = 'pipeline'


def build_schedule(c: ml_collections.ConfigDict) -> schedules.Schedule | schedules.Staggered:
    """1F1B runs staggered (pipeline_1f1b.py); GPipe and interleaved on the lockstep tick executor."""
    return schedules.build(c.pipeline.schedule, c.mesh.pipeline, c.train.accum_steps, c.pipeline.virtual_stages)


def _split_shared(params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    shared = {k: v for k, v in params.items() if k != 'blocks'}
    return params['blocks'], shared


class ChunkOps:
    """Forward and backward units of one chunk (Lc layers), as functions of explicit arrays.

    Forward units run the chunk and return its output and every layer's input (the stash);
    backward units walk the layers in reverse, recomputing each from its stashed input under
    `jax.vjp`. All units of a `lax.switch` share one signature:
    forward (chunk, shared, tokens, stash_lx, m, c) -> (y, stash_lx);
    backward (chunk, shared, tokens, stash_lx, g, m, c) -> (g_chunk, g_shared, g_x, loss).
    Stash slots, y, g and g_x are held split over `tensor` (`TokenSplit`) between units.
    """

    def __init__(self, model_def: ts.ModelDef, seq_len: int, layers_per_chunk: int, num_micro: int, dropout_key_fn,
                 tokens: TokenSplit):
        self.model_def, self.seq_len, self.lc = model_def, seq_len, layers_per_chunk
        self.num_micro, self.dropout_key_fn, self.tokens = num_micro, dropout_key_fn, tokens

    def _model(self, chunk, shared):
        return self.model_def.bind({'blocks': chunk, **shared})

    def _layer_keys(self, m, c):
        key = self.dropout_key_fn(m)
        if key is None:
            return None
        return jax.vmap(lambda j: jax.random.fold_in(key, j))(c * self.lc + jnp.arange(self.lc))

    def _forward(self, chunk, shared, x, m, c):
        """Runs the chunk from x; returns the output and each layer's input [Lc, N, d]."""
        graphdef, stacked = nnx.split(self._model(chunk, shared).blocks)
        keys = self._layer_keys(m, c)

        def body(h, xs):
            layer, key = xs
            return nnx.merge(graphdef, layer)(h, self.seq_len, key), h

        return jax.lax.scan(body, x, (stacked, keys))

    def _backward(self, chunk, shared, stash_lx, g, m, c, stashed=True):
        """Reverse pass over the layers from their inputs (split, when `stashed`); (g_chunk, g_input)."""
        graphdef, stacked = nnx.split(self._model(chunk, shared).blocks)
        keys = self._layer_keys(m, c)
        gather = self.tokens.gather if stashed else (lambda x: x)

        def body(g_out, xs):
            layer, x, key = xs
            x = gather(x)  # one all-gather per layer, just before its recomputation
            _, pull = jax.vjp(lambda ly, h: nnx.merge(graphdef, ly)(h, self.seq_len, key), layer, x)
            g_layer, g_in = pull(g_out)
            return g_in, g_layer

        g_in, g_stacked = jax.lax.scan(body, g, (stacked, stash_lx, keys), reverse=True)
        return nnx.to_pure_dict(g_stacked), g_in

    def _embed_vjp(self, chunk, shared, tokens, m):
        fn = lambda sh: self._model(chunk, sh).embed(tokens[:, :-1], self.dropout_key_fn(m))
        return jax.vjp(fn, shared)

    def _loss_vjp(self, chunk, shared, y, tokens):
        fn = lambda sh, yy: self._model(chunk, sh).head_loss(yy, tokens[:, 1:]) / self.num_micro
        loss, pull = jax.vjp(fn, shared, y)
        g_shared, g_y = pull(jnp.ones((), jnp.float32))
        return loss, g_shared, g_y

    def f_none(self, chunk, shared, tokens, stash_lx, m, c):
        return stash_lx[0], stash_lx

    def f_first(self, chunk, shared, tokens, stash_lx, m, c):
        x = self._model(chunk, shared).embed(tokens[:, :-1], self.dropout_key_fn(m))
        y, stash = self._forward(chunk, shared, x.astype(stash_lx.dtype), m, c)
        return self.tokens.split(y), self.tokens.split(stash)

    def f_mid(self, chunk, shared, tokens, stash_lx, m, c):
        y, stash = self._forward(chunk, shared, self.tokens.gather(stash_lx[0]), m, c)
        return self.tokens.split(y), self.tokens.split(stash)

    def b_none(self, chunk, shared, tokens, stash_lx, g, m, c):
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
        return zeros(chunk), zeros(shared), jnp.zeros_like(g), jnp.zeros((), jnp.float32)

    def b_first(self, chunk, shared, tokens, stash_lx, g, m, c):
        g_chunk, g_x = self._backward(chunk, shared, stash_lx, self.tokens.gather(g), m, c)
        _, pull = self._embed_vjp(chunk, shared, tokens, m)
        (g_shared,) = pull(g_x.astype(stash_lx.dtype))
        return g_chunk, g_shared, jnp.zeros_like(g), jnp.zeros((), jnp.float32)

    def b_mid(self, chunk, shared, tokens, stash_lx, g, m, c):
        g_chunk, g_x = self._backward(chunk, shared, stash_lx, self.tokens.gather(g), m, c)
        return g_chunk, jax.tree.map(jnp.zeros_like, shared), self.tokens.split(g_x), jnp.zeros((), jnp.float32)

    def b_last(self, chunk, shared, tokens, stash_lx, g, m, c):
        y, stash_lx = self._forward(chunk, shared, self.tokens.gather(stash_lx[0]), m, c)
        loss, g_shared, g_y = self._loss_vjp(chunk, shared, y, tokens)
        g_chunk, g_x = self._backward(chunk, shared, stash_lx, g_y.astype(g.dtype), m, c, stashed=False)
        return g_chunk, g_shared, self.tokens.split(g_x), loss

    def b_only(self, chunk, shared, tokens, stash_lx, g, m, c):
        x, embed_pull = self._embed_vjp(chunk, shared, tokens, m)
        y, stash_lx = self._forward(chunk, shared, x.astype(g.dtype), m, c)
        loss, g_head, g_y = self._loss_vjp(chunk, shared, y, tokens)
        g_chunk, g_x = self._backward(chunk, shared, stash_lx, g_y.astype(g.dtype), m, c, stashed=False)
        (g_embed,) = embed_pull(g_x.astype(x.dtype))
        return g_chunk, jax.tree.map(jnp.add, g_head, g_embed), jnp.zeros_like(g), loss


class TokenSplit:
    """Activations that wait (the stash) or travel (the sends between stages), split over `tensor`.

    Every tensor-parallel rank holds the whole [tokens, d] activations between layers; a copy
    that waits or travels needs only 1/TP of it (Megatron's sequence-parallel stash and
    scatter-gather sends). `split` cuts the rank's slice of the tokens locally; `gather`
    all-gathers it over `tensor` (within a node) where a unit uses it. Both are explicit
    collectives in a nested `shard_map`, so XLA's sharding propagation cannot carry the split
    into the layers (it did, with a sharding constraint: several all-gathers per layer).
    Off (identity) with `pipeline.shard_activations=False`, without tensor parallelism, or when
    the tokens are also split over an automatic batch axis (fsdp).
    """

    def __init__(self, enabled: bool):
        batch = mesh_lib.active_axes('batch')
        tensor = tuple(a for a in (mesh_lib.active_axes('heads') or ()) if a not in (batch or ()))
        self.axes = tensor if enabled and batch == () and tensor else ()

    def _spec(self, ndim: int) -> P:
        return P(*([None] * (ndim - 2)), self.axes if len(self.axes) > 1 else self.axes[0], None)

    def split(self, x: jax.Array) -> jax.Array:
        if not self.axes:
            return x
        size = jax.sharding.get_abstract_mesh().shape
        parts = int(np.prod([size[a] for a in self.axes]))

        def local(a):
            n = a.shape[-2] // parts
            return jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(self.axes) * n, n, axis=a.ndim - 2)

        return jax.shard_map(local, in_specs=P(), out_specs=self._spec(x.ndim), axis_names=set(self.axes),
                             check_vma=False)(x)

    def gather(self, x: jax.Array) -> jax.Array:
        if not self.axes:
            return x
        return jax.shard_map(lambda a: jax.lax.all_gather(a, self.axes, axis=a.ndim - 2, tiled=True),
                             in_specs=self._spec(x.ndim), out_specs=P(), axis_names=set(self.axes),
                             check_vma=False)(x)


def make_engine(c: ml_collections.ConfigDict, model_def: ts.ModelDef, schedule: schedules.Schedule, dropout_key_fn):
    """The per-stage tick loop: (local blocks, shared, micro tokens) -> (loss, grads)."""
    p_size, v_size = schedule.num_stages, schedule.virtual
    lc = c.model.num_layers // (p_size * v_size)
    ops = ChunkOps(model_def, c.model.seq_len, lc, schedule.num_micro, dropout_key_fn,
                    TokenSplit(c.pipeline.shard_activations))
    f_ops = [ops.f_none, ops.f_first, ops.f_mid]
    b_ops = [ops.b_none, ops.b_first, ops.b_mid, ops.b_last, ops.b_only]
    dtype = jnp.dtype(c.model.dtype)
    f_table, b_table = jnp.asarray(schedule.f_table), jnp.asarray(schedule.b_table)
    recv_f, recv_b = jnp.asarray(schedule.recv_f), jnp.asarray(schedule.recv_b)
    ring_fwd = [(i, (i + 1) % p_size) for i in range(p_size)]
    ring_bwd = [(i, (i - 1) % p_size) for i in range(p_size)]

    def engine(blocks, shared, micro_tokens):
        stage = jax.lax.axis_index(AXIS)
        # This stage's chunks, [V, Lc, ...] in virtual-stage order (V == 1 arrives as [Lc, ...]).
        chunks = blocks if v_size > 1 else jax.tree.map(lambda a: a[None], blocks)
        rows, seq = micro_tokens.shape[1], micro_tokens.shape[2] - 1
        x_zero = jnp.zeros((rows * seq, c.model.d_model), dtype)

        def tick(carry, t):
            stash, grad, g_chunks, g_shared, loss_sum = carry
            f_kind, f_m, f_v, f_slot = f_table[t, stage]
            b_kind, b_m, b_v, b_slot, b_gslot = b_table[t, stage]
            chunk_f = jax.tree.map(lambda a: a[f_v], chunks)
            chunk_b = jax.tree.map(lambda a: a[b_v], chunks)
            y, stash_f = jax.lax.switch(f_kind, f_ops, chunk_f, shared, micro_tokens[f_m], stash[f_slot], f_m,
                                        f_v * p_size + stage)
            stash = stash.at[f_slot].set(stash_f)
            gc, gs, g_x, loss = jax.lax.switch(b_kind, b_ops, chunk_b, shared, micro_tokens[b_m], stash[b_slot],
                                               grad[b_gslot], b_m, b_v * p_size + stage)
            g_chunks = jax.tree.map(lambda acc, g: acc.at[b_v].add(g.astype(acc.dtype)), g_chunks, gc)
            g_shared = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), g_shared, gs)
            y_in = jax.lax.ppermute(y.astype(dtype), AXIS, ring_fwd)  # split over tensor: 1/TP on the wire
            g_in = jax.lax.ppermute(g_x.astype(dtype), AXIS, ring_bwd)
            f_valid, f_to = recv_f[t, stage]
            g_valid, g_to = recv_b[t, stage]
            stash = stash.at[f_to, 0].set(jnp.where(f_valid > 0, y_in, stash[f_to, 0]))
            grad = grad.at[g_to].set(jnp.where(g_valid > 0, g_in, grad[g_to]))
            return (stash, grad, g_chunks, g_shared, loss_sum + loss), None

        carry = (ops.tokens.split(jnp.zeros((schedule.act_slots, lc, *x_zero.shape), dtype)),
                 ops.tokens.split(jnp.zeros((schedule.grad_slots, *x_zero.shape), dtype)),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), chunks),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), shared),
                 jnp.zeros((), jnp.float32))
        (_, _, g_chunks, g_shared, loss_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
        g_blocks = g_chunks if v_size > 1 else jax.tree.map(lambda a: a[0], g_chunks)
        return (jax.lax.psum(loss_sum, AXIS), g_blocks, jax.lax.psum(g_shared, AXIS))

    return engine


def make_pipeline_grads(c: ml_collections.ConfigDict, layout: ts.StateLayout, dropout_key_fn):
    """`(params, micro_abt, step) -> (mean loss, grads)` of a pipelined layout (train.py lays out the result)."""
    schedule = build_schedule(c)

    def pipeline_grads(params, micro_abt, step):
        blocks, shared = _split_shared(params)
        if isinstance(schedule, schedules.Staggered):
            from jaxfrontier import pipeline_1f1b  # pylint: disable=g-import-not-at-top  (it imports this module)
            engine = pipeline_1f1b.make_engine(c, layout.model_def, schedule, lambda m: dropout_key_fn(c, step, m))
        else:
            engine = make_engine(c, layout.model_def, schedule, lambda m: dropout_key_fn(c, step, m))
        block_spec = jax.tree.map(lambda _: P(None, AXIS) if schedule.virtual > 1 else P(AXIS), blocks)
        shared_spec = jax.tree.map(lambda _: P(), shared)
        run = jax.shard_map(engine, in_specs=(block_spec, shared_spec, P()),
                            out_specs=(P(), block_spec, shared_spec), axis_names={AXIS}, check_vma=False)
        loss, g_blocks, g_shared = run(blocks, shared, micro_abt)
        return loss, {'blocks': g_blocks, **g_shared}

    return pipeline_grads


def schedule_branch_weights(schedule: schedules.Schedule):
    """Branch weights for flop_count: the tick loop's forward then backward `lax.switch`.

    Weight of branch b = (stages x ticks running b) / ticks, since the tick scan already
    multiplies its body by the number of ticks; the total is summed over all stages.
    """
    if isinstance(schedule, schedules.Staggered):
        from jaxfrontier import pipeline_1f1b  # pylint: disable=g-import-not-at-top
        return pipeline_1f1b.branch_weights(schedule)
    tables = (schedule.f_table[..., 0], schedule.b_table[..., 0])

    def weights(occurrence: int, n_branches: int) -> list[float]:
        kinds = tables[occurrence % 2]
        return [float(np.sum(kinds == b)) / schedule.num_ticks for b in range(n_branches)]

    return weights


def make_pipeline_eval(c: ml_collections.ConfigDict, layout: ts.StateLayout, split_micro):
    """`eval_loss(params, tokens) -> mean loss` of a pipelined layout: forward units only.

    A wave of chunk forwards (`schedules.forward_only`): no stash, no backward, one activation
    send per tick; a third of the training step's FLOPs.
    """
    schedule = schedules.forward_only(c.mesh.pipeline, c.train.accum_steps,
                                      c.pipeline.virtual_stages if c.pipeline.schedule == 'interleaved' else 1)
    p_size, v_size = schedule.num_stages, schedule.virtual
    lc = c.model.num_layers // (p_size * v_size)
    dtype = jnp.dtype(c.model.dtype)
    dp = config_lib.data_parallel_size(c)
    ring_fwd = [(i, (i + 1) % p_size) for i in range(p_size)]
    e_table, recv = jnp.asarray(schedule.e_table), jnp.asarray(schedule.recv)

    def engine(blocks, shared, micro_tokens):
        ops = ChunkOps(layout.model_def, c.model.seq_len, lc, schedule.num_micro, lambda m: None,
                       TokenSplit(c.pipeline.shard_activations))
        stage = jax.lax.axis_index(AXIS)
        chunks = blocks if v_size > 1 else jax.tree.map(lambda a: a[None], blocks)
        rows, seq = micro_tokens.shape[1], micro_tokens.shape[2] - 1
        x_zero = jnp.zeros((rows * seq, c.model.d_model), dtype)

        def run(kind):
            def unit(chunk, tokens, x_split, m, chunk_index):
                if kind == schedules.E_NONE:
                    return x_split, jnp.zeros((), jnp.float32)
                model = ops._model(chunk, shared)  # pylint: disable=protected-access
                x = (model.embed(tokens[:, :-1]).astype(dtype) if kind == schedules.E_FIRST
                     else ops.tokens.gather(x_split))
                y, _ = ops._forward(chunk, shared, x, m, chunk_index)  # pylint: disable=protected-access
                if kind == schedules.E_LAST:
                    return jnp.zeros_like(x_split), model.head_loss(y, tokens[:, 1:]) / schedule.num_micro
                return ops.tokens.split(y), jnp.zeros((), jnp.float32)
            return unit

        units = [run(k) for k in (schedules.E_NONE, schedules.E_FIRST, schedules.E_MID, schedules.E_LAST)]

        def tick(carry, t):
            buf, loss_sum = carry
            kind, m, v, slot = e_table[t, stage]
            y, loss = jax.lax.switch(kind, units, jax.tree.map(lambda a: a[v], chunks), micro_tokens[m], buf[slot],
                                     m, v * p_size + stage)
            y_in = jax.lax.ppermute(y.astype(dtype), AXIS, ring_fwd)
            valid, to = recv[t, stage]
            buf = buf.at[to].set(jnp.where(valid > 0, y_in, buf[to]))
            return (buf, loss_sum + loss), None

        carry = (ops.tokens.split(jnp.zeros((schedule.slots, *x_zero.shape), dtype)), jnp.zeros((), jnp.float32))
        (_, loss_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
        return jax.lax.psum(loss_sum, AXIS)

    def eval_loss(params, tokens_gt):
        blocks, shared = _split_shared(params)
        block_spec = jax.tree.map(lambda _: P(None, AXIS) if v_size > 1 else P(AXIS), blocks)
        run = jax.shard_map(engine, in_specs=(block_spec, jax.tree.map(lambda _: P(), shared), P()),
                            out_specs=P(), axis_names={AXIS}, check_vma=False)
        return run(blocks, shared, split_micro(tokens_gt, c.train.accum_steps, dp))

    return eval_loss


def eval_branch_weights(schedule: schedules.ForwardOnly):
    """flop_count weights of the forward-only loop's one switch."""
    kinds = schedule.e_table[..., 0]
    return lambda occurrence, n: [float(np.sum(kinds == b)) / schedule.num_ticks for b in range(n)]
