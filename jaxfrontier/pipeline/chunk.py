"""One pipeline chunk's forward and backward units, and activations split over `tensor`.

Shared by the executors (lockstep.py, staggered.py, eval.py): `ChunkOps` runs a chunk of
Lc layers as functions of explicit arrays; `TokenSplit` holds waiting and travelling
activations split over `tensor`; `check_groups` holds the rule for models with layer groups.

Layer groups (model/decoder.py): the pipelined group is `params['blocks']`, split into P x V
chunks; groups before it form a stem that runs with the embedding on chunk 0's stage (their
parameters travel with the embedding's among the `shared` ones, replicated over `pipeline`, and
their gradients are summed over stages like the embedding's). Groups after it are refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import auxiliary, stack
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model.decoder import PIPELINED
from jaxfrontier.model.params import ModelDef

AXIS = 'pipeline'


def data_local_scope(data_local_rules: mesh_lib.Rules | None):
    """`(axes, scope)` for a pipeline map that is manual over `data` too (gradients reduced once
    per step; pipeline.make_pipeline_grads, eval.make_pipeline_eval): the extra manual axes, and
    a context to trace the map in, where the rules no longer name `data`. `None`: no extra axes."""
    if data_local_rules is None:
        return (), contextlib.nullcontext
    return (layout_lib.DATA,), lambda: mesh_lib.use_rules(mesh_lib.without_axis(data_local_rules, layout_lib.DATA))


def split_shared(params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the pipelined group's parameters, everything else: embedding, head, stem groups)."""
    return params['blocks'], {k: v for k, v in params.items() if k != 'blocks'}


def stage_chunks(blocks: Any, virtual: int) -> Any:
    """This stage's chunks as [V, Lc, ...] in virtual-stage order (V == 1 arrives as [Lc, ...])."""
    return blocks if virtual > 1 else jax.tree.map(lambda a: a[None], blocks)


def zero_activation(micro_tokens, d_model: int, dtype) -> jax.Array:
    """Zeros shaped like one micro-batch's activations [rows * seq, d] (tokens [M, rows, seq + 1])."""
    rows, seq = micro_tokens.shape[1], micro_tokens.shape[2] - 1
    return jnp.zeros((rows * seq, d_model), dtype)


def f32_zeros(tree: Any) -> Any:
    """fp32 zeros shaped like `tree`: gradient accumulators."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def sum_over_stages(loss_sum: jax.Array, aux_sum: auxiliary.GroupAux, g_blocks: Any, g_shared: Any
                    ) -> tuple[jax.Array, auxiliary.GroupAux, Any, Any]:
    """Every executor's end: the loss, the aux (each stage holds its own rows) and the shared
    parameters' gradients summed over stages."""
    return jax.lax.psum(loss_sum, AXIS), jax.lax.psum(aux_sum, AXIS), g_blocks, jax.lax.psum(g_shared, AXIS)


def stem_groups(model_def: ModelDef) -> tuple[str, ...]:
    """The layer groups before the pipelined one (model/decoder.py): they run with the embedding."""
    groups = model_def.groups
    return groups[:groups.index(PIPELINED)]


def check_groups(model_def: ModelDef, stages: int, virtual: int) -> None:
    """Refuses, before anything compiles, layer groups a pipeline cannot run: groups after the pipelined
    one (only the groups before it run, as a stem, with the embedding on the first stage), or a
    pipelined group whose layers do not split into `stages` x `virtual` equal chunks."""
    groups, sizes = model_def.groups, model_def.group_sizes()
    chunks = stages * virtual
    if PIPELINED not in groups or groups[-1] != PIPELINED:
        raise ConfigError('mesh.pipeline', stages, f'the model\'s layer groups {groups} do not end with the '
                          f'pipelined group {PIPELINED!r}: only groups before it can run in a pipeline (with the '
                          'embedding on the first stage)', 'set mesh.pipeline=1')
    if sizes[PIPELINED] % chunks:
        works = [p for p in range(2, sizes[PIPELINED] + 1) if sizes[PIPELINED] % (p * virtual) == 0]
        raise ConfigError('mesh.pipeline', stages, f'the pipelined layer group {PIPELINED!r} holds '
                          f'{sizes[PIPELINED]} layers (of {sum(sizes.values())}), which do not split into '
                          f'mesh.pipeline x pipeline.virtual_stages = {chunks} equal chunks',
                          f'set mesh.pipeline to one of {works[:4]} (or 1)' if works else 'set mesh.pipeline=1')


class ChunkOps:
    """Forward and backward units of one chunk (Lc layers), as functions of explicit arrays.

    Forward units run the chunk and return its output and every layer's input (the stash);
    backward units walk the layers in reverse, recomputing each from its stashed input under
    `jax.vjp`. All units of a `lax.switch` share one signature:
    forward (chunk, shared, tokens, stash_lx, m, c) -> (y, stash_lx, aux);
    backward (chunk, shared, tokens, stash_lx, g, m, c) -> (g_chunk, g_shared, g_x, loss, aux).
    Stash slots, y, g and g_x are held split over `tensor` (`TokenSplit`) between units.
    With context parallelism's balanced order and packed documents (`order`, model/context.py)
    every unit builds its micro-batch's inputs, targets, positions, documents and loss weights
    from the micro-batch's tokens, which every stage receives, and the static order.

    Auxiliary outputs (model/auxiliary.py): a unit returns what it adds to the stage's sums
    `{group: {name: [L_g, ...]}}` (`aux_zeros`): the chunk's rows (c Lc onwards of the pipelined
    group) from a forward, the stem groups' from the embedding (groups before the pipelined one
    run inside `embed`, on chunk 0's stage); a backward's recomputation adds nothing, so every
    micro-batch counts once. The `loss_` terms' cotangent is `aux_seed`.
    """

    def __init__(self, model_def: ModelDef, seq_len: int, layers_per_chunk: int, num_micro: int, dropout_key_fn,
                 tokens: TokenSplit, loss_scale: jax.Array | None = None, order: TokenOrder | None = None,
                 aux_weight: jax.Array | None = None):
        self.model_def, self.seq_len, self.lc = model_def, seq_len, layers_per_chunk
        self.num_micro, self.dropout_key_fn, self.tokens = num_micro, dropout_key_fn, tokens
        self.loss_scale = loss_scale  # float16: the backward pass starts from this instead of 1
        self.aux_weight = aux_weight  # the weight of the aux's loss terms (step.make_loss_aux_and_grads)
        self.order = order or TokenOrder(seq_len)
        self.stem, sizes = stem_groups(model_def), model_def.group_sizes()
        self.first_block = sum(sizes[g] for g in self.stem)  # global index of chunk 0's first layer
        self.blocks_layers = sizes[PIPELINED]
        self.aux_avals = None  # {group: {name: [L_g, ...]}} once `probe_aux` ran

    def model(self, chunk, shared):
        return self.model_def.bind({'blocks': chunk, **shared})

    def first_layer(self, c):
        """Global index of chunk c's first layer (its dropout keys): the stem's layers come first."""
        return c * self.lc + self.first_block if self.first_block else c * self.lc  # no `+ 0` in the program

    def seq(self, tokens):
        """What the blocks know of micro-batch `tokens` [rows, T + 1] (TokenOrder.seq)."""
        return self.order.seq(tokens)

    def aux_seed(self) -> jax.Array:
        """d objective / d (a micro-batch's loss term): 1/M, times the loss scale and the aux weight."""
        seed = jnp.float32(1.0 / self.num_micro)
        if self.loss_scale is not None:
            seed = seed * self.loss_scale.astype(jnp.float32)
        return seed if self.aux_weight is None else seed * self.aux_weight

    def embed(self, chunk, shared, tokens, m):
        """The embedding of micro-batch m's inputs in the token order, at their positions, then the stem
        groups: (x, the stem's aux {group: {name: [L_g, ...]}})."""
        model = self.model(chunk, shared)
        x = model.embed(self.order.inputs(tokens), self.dropout_key_fn(m), self.order.positions(tokens))
        if not self.stem:
            return x, {}
        return model.run_groups(x, self.seq(tokens), self.dropout_key_fn(m), groups=self.stem)

    def head_loss(self, model, y, tokens):
        """Micro-batch `tokens`' loss (packing's weights; layers.cross_entropy) / M: the executors sum it."""
        return model.head_loss(y, self.order.targets(tokens), self.order.weights(tokens)) / self.num_micro

    def run(self, chunk, shared, x, m, c, seq, remat: str = 'none', keep_inputs: bool = False):
        """Chunk c's layers on x for micro-batch m (`stack.apply_stack`, dropout keys by global layer):
        (y, the chunk's aux [Lc, ...]), and each layer's input with `keep_inputs`."""
        graphdef, stacked = nnx.split(self.model(chunk, shared).blocks)
        return stack.apply_stack(graphdef, stacked, x, seq_len=seq, remat=remat,
                                 dropout_key=self.dropout_key_fn(m), first_layer=self.first_layer(c),
                                 unroll=0, keep_inputs=keep_inputs)

    def forward(self, chunk, shared, x, m, c, seq):
        """Runs the chunk from x; returns the output, its aux and each layer's input [Lc, N, d]."""
        return self.run(chunk, shared, x, m, c, seq, keep_inputs=True)

    def backward(self, chunk, shared, stash_lx, g, m, c, seq, stashed=True):
        """Reverse pass over the layers from their inputs (split, when `stashed`); (g_chunk, g_input)."""
        graphdef, stacked = nnx.split(self.model(chunk, shared).blocks)
        # one all-gather per layer, just before its recomputation
        g_stacked, g_in = stack.recompute_stack_vjp(graphdef, stacked, stash_lx, g, seq_len=seq,
                                                    dropout_key=self.dropout_key_fn(m),
                                                    first_layer=self.first_layer(c),
                                                    fetch_input=self.tokens.gather if stashed else (lambda x: x),
                                                    aux_seed=self.aux_seed)
        return nnx.to_pure_dict(g_stacked), g_in

    def embed_vjp(self, chunk, shared, tokens, m):
        """(x, the stem's aux, pull: g_x -> g_shared), the stem's loss terms seeded with `aux_seed`."""
        (x, aux), pull = jax.vjp(lambda sh: self.embed(chunk, sh, tokens, m), shared)
        return x, aux, lambda g_x: pull((g_x, self.group_seeds(aux)))[0]

    def loss_vjp(self, chunk, shared, y, tokens):
        fn = lambda sh, yy: self.head_loss(self.model(chunk, sh), yy, tokens)
        loss, pull = jax.vjp(fn, shared, y)
        seed = jnp.ones((), jnp.float32) if self.loss_scale is None else self.loss_scale.astype(jnp.float32)
        g_shared, g_y = pull(seed)
        return loss, g_shared, g_y

    # ------------------------------------------------------------------ auxiliary outputs
    def group_seeds(self, by_group: auxiliary.GroupAux) -> auxiliary.GroupAux:
        return {group: auxiliary.seeds(aux, self.aux_seed) for group, aux in by_group.items()}

    def probe_aux(self, chunk, shared, micro_tokens) -> None:
        """Learns the shapes of the stage's aux sums (`aux_avals`) by tracing the embedding and one
        chunk abstractly (no program: `jax.eval_shape`)."""
        def trace(chunk, shared, tokens):
            x, stem = self.embed(chunk, shared, tokens, 0)
            _, aux = self.run(chunk, shared, x, 0, 0, self.seq(tokens))
            return stem, aux

        stem, aux = jax.eval_shape(trace, chunk, shared, micro_tokens[0])
        rows = lambda a: jax.ShapeDtypeStruct((self.blocks_layers, *a.shape[1:]), a.dtype)  # noqa: E731
        self.aux_avals = {**stem, PIPELINED: jax.tree.map(rows, aux)}

    def aux_zeros(self) -> auxiliary.GroupAux:
        """fp32 zeros of the stage's aux sums {group: {name: [L_g, ...]}} ({} for a model without aux)."""
        return auxiliary.zeros_like(self.aux_avals)

    def aux_rows(self, c, chunk_aux: auxiliary.Aux | None = None, stem_aux: auxiliary.GroupAux | None = None
                 ) -> auxiliary.GroupAux:
        """A unit's contribution to the stage's aux sums: chunk c's aux at its rows c Lc of the pipelined
        group, the stem's whole (each where given), zeros elsewhere."""
        out = self.aux_zeros()
        if stem_aux:
            out.update(stem_aux)
        if chunk_aux:
            out[PIPELINED] = {name: jax.lax.dynamic_update_slice_in_dim(out[PIPELINED][name], v, c * self.lc, 0)
                              for name, v in chunk_aux.items()}
        return out

    # ------------------------------------------------------------------ the lockstep executor's units
    def f_none(self, chunk, shared, tokens, stash_lx, m, c):
        return stash_lx[0], stash_lx, self.aux_zeros()

    def f_first(self, chunk, shared, tokens, stash_lx, m, c):
        x, stem_aux = self.embed(chunk, shared, tokens, m)
        y, aux, stash = self.forward(chunk, shared, x.astype(stash_lx.dtype), m, c, self.seq(tokens))
        return self.tokens.split(y), self.tokens.split(stash), self.aux_rows(c, aux, stem_aux)

    def f_mid(self, chunk, shared, tokens, stash_lx, m, c):
        y, aux, stash = self.forward(chunk, shared, self.tokens.gather(stash_lx[0]), m, c, self.seq(tokens))
        return self.tokens.split(y), self.tokens.split(stash), self.aux_rows(c, aux)

    def b_none(self, chunk, shared, tokens, stash_lx, g, m, c):
        zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
        return zeros(chunk), zeros(shared), jnp.zeros_like(g), jnp.zeros((), jnp.float32), self.aux_zeros()

    def b_first(self, chunk, shared, tokens, stash_lx, g, m, c):
        g_chunk, g_x = self.backward(chunk, shared, stash_lx, self.tokens.gather(g), m, c, self.seq(tokens))
        _, _, pull = self.embed_vjp(chunk, shared, tokens, m)
        g_shared = pull(g_x.astype(stash_lx.dtype))
        return g_chunk, g_shared, jnp.zeros_like(g), jnp.zeros((), jnp.float32), self.aux_zeros()

    def b_mid(self, chunk, shared, tokens, stash_lx, g, m, c):
        g_chunk, g_x = self.backward(chunk, shared, stash_lx, self.tokens.gather(g), m, c, self.seq(tokens))
        return (g_chunk, jax.tree.map(jnp.zeros_like, shared), self.tokens.split(g_x), jnp.zeros((), jnp.float32),
                self.aux_zeros())

    def b_last(self, chunk, shared, tokens, stash_lx, g, m, c):
        seq = self.seq(tokens)
        y, aux, stash_lx = self.forward(chunk, shared, self.tokens.gather(stash_lx[0]), m, c, seq)
        loss, g_shared, g_y = self.loss_vjp(chunk, shared, y, tokens)
        g_chunk, g_x = self.backward(chunk, shared, stash_lx, g_y.astype(g.dtype), m, c, seq, stashed=False)
        return g_chunk, g_shared, self.tokens.split(g_x), loss, self.aux_rows(c, aux)

    def b_only(self, chunk, shared, tokens, stash_lx, g, m, c):
        seq = self.seq(tokens)
        x, stem_aux, embed_pull = self.embed_vjp(chunk, shared, tokens, m)
        y, aux, stash_lx = self.forward(chunk, shared, x.astype(g.dtype), m, c, seq)
        loss, g_head, g_y = self.loss_vjp(chunk, shared, y, tokens)
        g_chunk, g_x = self.backward(chunk, shared, stash_lx, g_y.astype(g.dtype), m, c, seq, stashed=False)
        g_embed = embed_pull(g_x.astype(x.dtype))
        return (g_chunk, jax.tree.map(jnp.add, g_head, g_embed), jnp.zeros_like(g), loss,
                self.aux_rows(c, aux, stem_aux))


class TokenSplit:
    """Activations that wait (the stash) or travel (the sends between stages), split over `tensor`.

    Every tensor-parallel rank holds the whole [tokens, d] activations between layers; a copy
    that waits or travels needs only 1/TP of it (Megatron's sequence-parallel stash and
    scatter-gather sends). `split` cuts the rank's slice of the tokens locally; `gather`
    all-gathers it over `tensor` (within a node) where a unit uses it. Both are explicit
    collectives in a nested `shard_map`, so XLA's sharding propagation cannot carry the split
    into the layers (it did, with a sharding constraint: several all-gathers per layer).
    Off (identity) with `pipeline.shard_activations=False`, without tensor parallelism, or when
    the tokens are also split over an automatic axis (fsdp, context).
    """

    def __init__(self, enabled: bool):
        batch, heads = mesh_lib.active_axes('tokens'), mesh_lib.active_axes('heads')
        self.axes = () if batch is None else layout_lib.token_split_axes(enabled, batch, heads or ())

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
