"""Staggered 1F1B: at most P stashed stage inputs per stage, no arithmetic in bubbles.

The lockstep tick executor (pipeline/lockstep.py) runs one forward and one backward unit per stage per
tick, so a hop between stages costs a whole tick in both directions and stage p holds
2(P - p) - 1 micro-batches. Asynchronous 1F1B holds P - p because a forward hop costs one
forward and a backward hop one backward. This executor reproduces that timing in SPMD
lockstep (schedules.Staggered): time runs in half-slots; neighbouring stages are always in
opposite phases (A: forward work, B: backward work), and one `ppermute` after every
half-slot swaps neighbours' messages, so every hop costs one half-slot.

For the half-slots to cost the same on every busy stage, the backward's recomputation moves
into the A phase: A = forward of micro-batch m (a plain forward; its input is stashed) +
recomputation, from the stash, of the chunk whose backward comes next, keeping `jax.vjp`'s
residuals; B = the backward from those residuals. Both are two forward-equivalents, and the
total (forward, recomputation, backward: 4 per layer) is the lockstep executor's. The
residuals cross one half-slot in the loop carry as arrays (the `jax.vjp` closure flattened);
the weights among them are not carried but taken from the parameters again (`Residuals`).

The stash holds each micro-batch's chunk input only (not every layer's input), split over
`tensor` like the lockstep executor's (`TokenSplit`); the price is one chunk's
residuals for one micro-batch, live from A to B. `model.remat` decides what they are
(`RESIDUAL_POLICY`): `full` and `save_dots_no_batch` keep each layer's input and its weight
matmuls' outputs, so the backward half-slot recomputes only the attention core and the
elementwise work; `save_dots` also keeps the attention matmuls; `save_dots_attention` the
attention kernel's output and statistics (only elementwise work left); `none` keeps everything.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfrontier import config as config_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.model import auxiliary
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model.layers.linear import cast_ahead
from jaxfrontier.model.params import ModelDef
from jaxfrontier.pipeline import schedules
from jaxfrontier.pipeline.chunk import (AXIS, PIPELINED, ChunkOps, TokenSplit, f32_zeros, sum_over_stages,
                                         zero_activation)


def cast_chunk(chunk: dict[str, Any], dtype) -> dict[str, Any]:
    """The chunk's matmul weights and biases in the compute dtype, ahead of the matmul seam's cast at use
    (model/layers/linear.py's dtype policy and prefix rule), which is then a no-op."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a.astype(dtype) if cast_ahead(str(path[-1].key)) else a, chunk)


class Residuals:
    """A chunk's `jax.vjp` residuals as loop-carriable arrays, without the weights among them.

    `fn(chunk, x, m, c, seq) -> (y, aux)` is traced once abstractly (`probe`) to learn the closure's
    tree structure, which residuals are the chunk's own weight arrays, and the aux's shapes
    (`aux_avals`); `capture` runs the forward and returns ((y, aux), the other residuals);
    `pullback` rebuilds the closure from those and the weights (it takes the cotangents of y and
    of the aux: model/auxiliary.py's seeds). `seq` (the micro-batch's length, or its packed
    documents) is not differentiated; its arrays travel among the residuals.
    """

    def __init__(self, fn):
        self.fn = fn
        self.treedef = None
        self.weight_of: list[int] = []  # per residual: index of the weight it is, or -1 (carried)
        self.avals: list[jax.ShapeDtypeStruct] = []
        self.aux_avals = {}  # the chunk's aux {name: [Lc, ...]}

    def _split(self, pull, chunk) -> tuple[list[int], list[jax.Array], Any]:
        leaves, treedef = jax.tree_util.tree_flatten(pull)
        weights = jax.tree.leaves(chunk)
        weight_of = [next((i for i, w in enumerate(weights) if r is w), -1) for r in leaves]
        return weight_of, [r for r, i in zip(leaves, weight_of) if i < 0], treedef

    def probe(self, chunk, x, m, c, seq) -> None:
        arrays = None if isinstance(seq, int) else seq  # a plain length stays a Python int

        def trace(chunk, x, m, c, arrays):
            (_, aux), pull = jax.vjp(lambda w, h: self.fn(w, h, m, c, seq if arrays is None else arrays), chunk, x)
            self.weight_of, carried, self.treedef = self._split(pull, chunk)
            return carried, aux

        self.avals, self.aux_avals = jax.eval_shape(trace, chunk, x, m, c, arrays)

    def zeros(self) -> list[jax.Array]:
        def zero(a):
            if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(jnp.zeros((*a.shape, 2), jnp.uint32))
            return jnp.zeros(a.shape, a.dtype)

        return [zero(a) for a in self.avals]

    def capture(self, chunk, x, m, c, seq) -> tuple[tuple[jax.Array, Any], list[jax.Array]]:
        out, pull = jax.vjp(lambda w, h: self.fn(w, h, m, c, seq), chunk, x)
        weight_of, carried, _ = self._split(pull, chunk)
        if weight_of != self.weight_of:
            raise AssertionError('the chunk vjp residuals changed between traces')
        return out, carried

    def pullback(self, carried: list[jax.Array], chunk):
        weights, it = jax.tree.leaves(chunk), iter(carried)
        leaves = [next(it) if i < 0 else weights[i] for i in self.weight_of]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


class StaggeredOps:
    """The A and B branches of one half-slot (schedules.A_* / BS_* kinds), on explicit arrays.

    A (chunk, shared, tokens_f, tokens_r, stash, msg, res, g_self, m_f, m_r, slot_f, slot_r, c)
      -> (y, stash, res, g_self, loss, g_shared, aux);
    B (chunk, shared, tokens_b, msg, res, g_self, acc, m_b, c) -> (acc, g_shared, g_x).
    `aux`: what the half-slot adds to the stage's aux sums (ChunkOps.aux_rows): a forward's, and
    the last stage's fused forward-and-recomputation's; a recomputation from the stash adds nothing.
    """

    def __init__(self, ops: ChunkOps, dtype, remat: str):
        self.ops, self.dtype, self.tokens = ops, dtype, ops.tokens
        self.policy = RESIDUAL_POLICY[remat]
        self.res = Residuals(self._chunk_forward)

    def _chunk_forward(self, chunk_w, x, m, c, seq):
        return self.ops.run(chunk_w, self._shared, x, m, c, seq, remat=self.policy)

    def bind_shared(self, shared) -> None:
        self._shared = shared  # the model binding needs them; the blocks never read them

    # ------------------------------------------------------------------ A: forward + recomputation
    def _forward_part(self, f_kind, chunk_w, shared, tokens, stash, msg, m, c, slot):
        if f_kind == 'none':
            return jnp.zeros_like(msg), stash, self.ops.aux_zeros()
        stem_aux = None
        if f_kind == 'first':
            x, stem_aux = self.ops.embed(chunk_w, shared, tokens, m)
            x = x.astype(self.dtype)
        else:
            x = self.tokens.gather(msg)
        y, aux = self._chunk_forward(chunk_w, x, m, c, self.ops.seq(tokens))
        return self.tokens.split(y), stash.at[slot].set(self.tokens.split(x)), self.ops.aux_rows(c, aux, stem_aux)

    def a_branch(self, f_kind: str, r_kind: str):
        def branch(chunk, shared, tokens_f, tokens_r, stash, msg, res, g_self, m_f, m_r, slot_f, slot_r, c):
            chunk_w = cast_chunk(chunk, self.dtype)
            zero_shared = jax.tree.map(jnp.zeros_like, shared)
            loss = jnp.zeros((), jnp.float32)
            aux_r = self.ops.aux_zeros()
            seq_r = self.ops.seq(tokens_r)  # the recomputed micro-batch's documents (packing)
            if r_kind == 'stash':  # read before this half-slot's forward stores (a different slot)
                _, res = self.res.capture(chunk_w, self.tokens.gather(stash[slot_r]), m_r, c, seq_r)
            elif r_kind == 'last':  # the last chunk's forward is this recomputation: its aux counts
                (y, aux), res = self.res.capture(chunk_w, self.tokens.gather(msg), m_r, c, seq_r)
                loss, zero_shared, g_y = self.ops.loss_vjp(chunk, shared, y, tokens_r)
                g_self = g_y.astype(g_self.dtype)
                aux_r = self.ops.aux_rows(c, aux)
            y_send, stash, aux_f = self._forward_part(f_kind, chunk_w, shared, tokens_f, stash, msg, m_f, c, slot_f)
            aux = jax.tree.map(jnp.add, aux_r, aux_f)
            return y_send, stash, res, g_self, loss, zero_shared, aux

        return branch

    # ------------------------------------------------------------------ B: backward from residuals
    def b_branch(self, kind: str):
        """Backward branches add the chunk's weight gradients into `acc` (the stage's fp32 sum)
        themselves: returning them for an add outside would keep one more chunk-sized buffer."""
        def branch(chunk, shared, tokens_b, msg, res, g_self, acc, m_b, c):
            if kind == 'none':
                return acc, jax.tree.map(jnp.zeros_like, shared), jnp.zeros_like(msg)
            chunk_w = cast_chunk(chunk, self.dtype)
            g = g_self if kind == 'last' else self.tokens.gather(msg)
            g_aux = auxiliary.seeds(auxiliary.zeros_like(self.res.aux_avals), self.ops.aux_seed)
            g_w, g_x = self.res.pullback(res, chunk_w)((g.astype(self.dtype), g_aux))
            acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, g_w)
            g_shared = jax.tree.map(jnp.zeros_like, shared)
            if kind == 'first':
                _, _, pull = self.ops.embed_vjp(chunk, shared, tokens_b, m_b)
                g_shared = pull(g_x.astype(self.dtype))
                return acc, g_shared, jnp.zeros_like(msg)
            return acc, g_shared, self.tokens.split(g_x)

        return branch


RESIDUAL_POLICY = config_lib.STAGGERED_RESIDUALS

_A_KINDS = {  # schedules.A_* -> (forward part, recomputation part)
    schedules.A_NONE: ('none', 'none'), schedules.A_F_FIRST: ('first', 'none'), schedules.A_F_MID: ('mid', 'none'),
    schedules.A_R: ('none', 'stash'), schedules.A_R_LAST: ('none', 'last'),
    schedules.A_F_FIRST_R: ('first', 'stash'), schedules.A_F_MID_R: ('mid', 'stash'),
}
_B_KINDS = {schedules.BS_NONE: 'none', schedules.BS_FIRST: 'first', schedules.BS_MID: 'mid',
            schedules.BS_LAST: 'last'}


def make_engine(layout: layout_lib.Layout, shape: config_lib.ModelShape, model_def: ModelDef,
                schedule: schedules.Staggered, dropout_key_fn, loss_scale=None, packing=None, aux_weight=None):
    """The per-stage half-slot loop: (local blocks, shared, micro tokens) -> (loss, aux sums, grads);
    pipeline/__init__.py's contract."""
    p_size = schedule.num_stages
    lc = model_def.group_sizes()[PIPELINED] // p_size
    dtype = jnp.dtype(shape.dtype)
    ops = StaggeredOps(ChunkOps(model_def, shape.seq_len, lc, schedule.num_micro, dropout_key_fn,
                                TokenSplit(layout.shard_activations), loss_scale,
                                TokenOrder.of(layout, shape.seq_len, packing), aux_weight), dtype, layout.remat)
    a_ops = [ops.a_branch(*_A_KINDS[k]) for k in range(len(_A_KINDS))]
    b_ops = [ops.b_branch(_B_KINDS[k]) for k in range(len(_B_KINDS))]
    a_table, b_table = jnp.asarray(schedule.a_table), jnp.asarray(schedule.b_table)
    pairs = [schedules.exchange_pairs(p_size, h) for h in (0, 1)]

    def engine(blocks, shared, micro_tokens):
        stage = jax.lax.axis_index(AXIS)
        ops.bind_shared(shared)
        x_zero = zero_activation(micro_tokens, shape.d_model, dtype)
        ops.res.probe(cast_chunk(blocks, dtype), x_zero, jnp.int32(0), jnp.int32(0), ops.ops.seq(micro_tokens[0]))
        ops.ops.probe_aux(blocks, shared, micro_tokens)
        chunk_index = stage  # one chunk per stage

        def half_slot(carry, s, h):
            stash, msg, res, g_self, g_blocks, g_shared, loss_sum, aux_sum = carry
            a_kind, m_f, m_r, slot_f, slot_r = a_table[s, stage]
            b_kind, m_b = b_table[s, stage]
            y, stash, res_a, g_self, loss, gs_a, aux = jax.lax.switch(
                a_kind, a_ops, blocks, shared, micro_tokens[m_f], micro_tokens[m_r], stash, msg, res, g_self,
                m_f, m_r, slot_f, slot_r, chunk_index)
            g_blocks, gs_b, g_x = jax.lax.switch(b_kind, b_ops, blocks, shared, micro_tokens[m_b], msg, res, g_self,
                                                 g_blocks, m_b, chunk_index)
            g_shared = jax.tree.map(lambda acc, a, b: acc + a.astype(acc.dtype) + b.astype(acc.dtype), g_shared,
                                    gs_a, gs_b)
            if pairs[h]:  # P = 2 has nothing to exchange after odd half-slots
                a_stage = (s - stage) % 2 == 0
                msg = jax.lax.ppermute(jnp.where(a_stage, y, g_x).astype(dtype), AXIS, pairs[h])
            return (stash, msg, res_a, g_self, g_blocks, g_shared, loss_sum + loss,
                    jax.tree.map(jnp.add, aux_sum, aux))

        def iteration(carry, i):
            carry = half_slot(carry, 2 * i, 0)
            return half_slot(carry, 2 * i + 1, 1), None

        carry = (ops.tokens.split(jnp.zeros((schedule.act_slots, *x_zero.shape), dtype)),
                 ops.tokens.split(x_zero), ops.res.zeros(), x_zero,
                 f32_zeros(blocks), f32_zeros(shared), jnp.zeros((), jnp.float32), ops.ops.aux_zeros())
        (*_, g_blocks, g_shared, loss_sum, aux_sum), _ = jax.lax.scan(iteration, carry,
                                                                      jnp.arange(schedule.num_half_slots // 2))
        return sum_over_stages(loss_sum, aux_sum, g_blocks, g_shared)

    return engine
