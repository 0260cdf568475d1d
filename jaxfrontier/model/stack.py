"""The layer runner every family's stack of blocks uses: forward, and the pipeline's recomputation.

A family's blocks are created once with `nnx.vmap` (every parameter gets a leading `layers`
axis) and applied with `jax.lax.scan` (`apply_stack`), so compile time does not grow with
depth; per-layer activation checkpointing wraps the scanned body. `model.scan_unroll=k` trades
compile time for step time: k layers per iteration of the loop (a scan over groups of k),
every layer unrolled at k >= the layer count; `layer_bodies` counts the copies XLA compiles. A block is any NNX module
called as `block(x_nd, seq, key) -> (x_nd, aux)` on flat activations [B*T, d]; `seq` is the sequence
length or a `model.sequence.Seq` (positions and documents), passed through unchanged; `aux` is a dict
of small arrays (model/auxiliary.py), which every runner here returns stacked over the layers
[L, ...]: the scan as its per-layer outputs, the unrolled loop stacked, `recompute_stack_vjp` seeding
the `loss_` entries' cotangents.

A model may hold several stacks (layer groups, model/decoder.py), each created here and run by its
own call: `create(..., axis_name=STEM_LAYERS)` names the stacked axis of a group that a pipeline does
not split over its stages (the rules map `layers`, not `stem_layers`, to `pipeline`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxfrontier.model import auxiliary
from jaxfrontier.model.attention import saved
from jaxfrontier.model.layers.linear import without_adapter_products

LAYERS = 'layers'  # the stacked axis of the pipelined group (`params['blocks']`): split over `pipeline`
STEM_LAYERS = 'stem_layers'  # the stacked axis of any other group: not mapped by the rules (replicated)

REMAT_POLICIES = {  # none saves a LoRA adapter's product (layers/linear.py `without_adapter_products`)
    'full': None,  # save only each layer's input, recompute everything inside it
    'save_dots': without_adapter_products(jax.checkpoint_policies.checkpoint_dots),
    'save_dots_no_batch': without_adapter_products(jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    # save_dots_no_batch and attention's output and softmax statistics (attention/saved.py): the backward
    # recomputes only the element-wise work (norms, activations, rotary), as torch.compile's partitioner does.
    'save_dots_attention': without_adapter_products(jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names(*saved.NAMES))),
}


def create(make_block, num_layers: int, rngs: nnx.Rngs, axis_name: str = LAYERS) -> nnx.Module:
    """`num_layers` blocks `make_block(rngs)` as one module whose parameters lead with an `axis_name` axis."""

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis_name})
    def make_blocks(rngs: nnx.Rngs) -> nnx.Module:
        return make_block(rngs)

    return make_blocks(rngs)


def layer_key(dropout_key: jax.Array | None, index: int | jax.Array) -> jax.Array | None:
    """Layer `index`'s dropout key (its global index, so every layout draws the same masks)."""
    return None if dropout_key is None else jax.random.fold_in(dropout_key, index)


def apply_layer(graphdef: nnx.GraphDef, layer_state: nnx.State, x_nd: jax.Array, seq_len: int,
                key: jax.Array | None) -> tuple[jax.Array, auxiliary.Aux]:
    """One layer of a stack (its state without the layers axis) on `x_nd`: the per-layer function
    the layer runner (`apply_stack`) and the pipeline's per-layer recomputation both call.
    Returns the output and the layer's aux (fp32; reported entries without gradient)."""
    x_nd, aux = nnx.merge(graphdef, layer_state)(x_nd, seq_len, key)
    return x_nd, auxiliary.prepare(aux)


def recompute_after_cotangent(layer_fn):
    """`layer_fn(x, state, key) -> (x, aux)` with remat=full for a plain (unrolled) loop of layers.

    Saves the layer's input and recomputes the layer in the backward pass, like
    `jax.checkpoint(policy=None)`, and makes the recomputation's input depend on the incoming
    cotangent: `where(isnan(g), nan, x)`, with g and x of one shape and sharding, is x wherever
    the gradient is finite and needs no communication. So no scheduler can run the recomputation
    before the backward reaches the layer. Outside a scan, `jax.checkpoint` relies on
    optimization barriers (prevent_cse); XLA:CPU removes those before scheduling and runs every
    recomputation early, in the forward pass, so remat=full saved no memory there (measured: the
    compiled memory of an unrolled remat=full step equalled remat=none's before this).
    A data dependency survives every backend's passes. The aux's cotangents (a `loss_` term's
    seed) enter the recomputation's pullback with the activation's.
    """

    @jax.custom_vjp
    def run(x, state, key):
        return layer_fn(x, state, key)

    def fwd(x, state, key):
        return layer_fn(x, state, key), (x, state, key)

    def bwd(res, g):
        x, state, key = res
        g_x, g_aux = g
        x = jnp.where(jnp.isnan(g_x), jnp.array(jnp.nan, x.dtype), x)  # elementwise: no collective
        _, vjp = jax.vjp(lambda x, state: layer_fn(x, state, key), x, state)
        g_x, g_state = vjp((g_x, g_aux))
        return g_x, g_state, None if key is None else np.zeros(key.shape, jax.dtypes.float0)  # keys: no tangent

    run.defvjp(fwd, bwd)
    return run


def layer_bodies(num_layers: int, unroll: int) -> int:
    """Copies of the layer in the program `apply_stack(..., unroll=unroll)` builds (forward; the
    backward has as many): what its compile time grows with (plan/compile_time.py).

    `lax.scan(unroll=k)` puts k layers in the loop's body and unrolls the `num_layers % k`
    left over after it (jax's `_scan_impl`); k >= num_layers is the plain loop; 0 scans.
    """
    k = max(unroll, 1)
    return num_layers if k >= num_layers else k + num_layers % k


def apply_stack(graphdef: nnx.GraphDef, stacked: nnx.State, x_nd: jax.Array, *, seq_len: int, remat: str,
                dropout_key: jax.Array | None, first_layer: int | jax.Array = 0, unroll: int = 1,
                keep_inputs: bool = False):
    """Applies the layers of `stacked` (leading axis = layers) in order: the one layer runner.

    A pure function of the stacked block state: the model, and every pipeline executor on its
    chunk of layers (`first_layer` keeps dropout keys tied to the global layer index), call it.
    Returns (output, aux stacked over the layers [layers, ...]), and each layer's input
    [layers, N, d] third with `keep_inputs` (the lockstep pipeline's stash). `unroll` >= the
    layer count runs a plain loop; 0 always scans (the pipeline's chunks, whatever their
    length); in between, a scan over groups of `unroll` layers (and the remainder unrolled after it).
    """
    num_layers = jax.tree.leaves(stacked)[0].shape[0]

    fully_unrolled = 0 < unroll and num_layers <= unroll
    late_full = remat == 'full' and fully_unrolled  # see recompute_after_cotangent

    def run_layer(x, layer_state, key):
        return apply_layer(graphdef, layer_state, x, seq_len, key)

    run = recompute_after_cotangent(run_layer) if late_full else run_layer

    def body(x, xs):
        layer_state, index = xs
        y, aux = run(x, layer_state, layer_key(dropout_key, index))
        return y, (aux, x if keep_inputs else None)

    if remat != 'none' and not late_full:
        # prevent_cse=False is safe only inside a scan, whose loop keeps XLA from merging the
        # recomputation into the forward pass; the unrolled plain loop needs the optimization
        # barrier, or the policy compiles to the same program as remat=none (the program digests showed it).
        # XLA:CPU removes the barriers before scheduling and runs the recomputation early, so
        # there these policies save no memory unrolled; remat=full avoids it (late_full).
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=fully_unrolled)
    indices = first_layer + jnp.arange(num_layers)
    if fully_unrolled:  # a plain loop, no while loop around the layers
        outs = []
        for i in range(num_layers):
            x_nd, out = body(x_nd, (jax.tree.map(lambda a, i=i: a[i], stacked), indices[i]))
            outs.append(out)
        aux = jax.tree.map(lambda *a: jnp.stack(a), *[layer_aux for layer_aux, _ in outs])
        inputs = jnp.stack([x_in for _, x_in in outs]) if keep_inputs else None
    else:
        x_nd, (aux, inputs) = jax.lax.scan(body, x_nd, (stacked, indices), unroll=max(unroll, 1))
    return (x_nd, aux, inputs) if keep_inputs else (x_nd, aux)


def recompute_stack_vjp(graphdef: nnx.GraphDef, stacked: nnx.State, inputs_lnd: jax.Array, g_nd: jax.Array, *,
                        seq_len: int, dropout_key: jax.Array | None, first_layer: int | jax.Array = 0,
                        fetch_input=lambda x: x, aux_seed: jax.Array | float = 1.0) -> tuple[nnx.State, jax.Array]:
    """The backward of `apply_stack` from each layer's stashed input (its `keep_inputs` output).

    Megatron's per-layer full recomputation: a reverse scan that recomputes one layer at a
    time under `jax.vjp` (`apply_layer`, the runner's own per-layer function) and pulls the
    cotangent through it, so one layer's residuals are live at a time. `fetch_input` brings a
    stashed input back just before its recomputation (the pipeline's all-gather over tensor).
    `aux_seed`: the cotangent of each layer's `loss_` aux terms (d objective / d term; the
    recomputed aux itself is not returned: the forward that stashed the inputs reported it).
    Not `jax.vjp(apply_stack)`: the stash comes from an earlier, separate forward unit, so
    that would run the forward a second time. Returns (gradients of `stacked`, of the input).
    """

    def body(g_out, xs):
        layer_state, x, index = xs
        key = layer_key(dropout_key, index)
        (_, aux), pull = jax.vjp(lambda ly, h: apply_layer(graphdef, ly, h, seq_len, key), layer_state,
                                 fetch_input(x))
        g_layer, g_in = pull((g_out, auxiliary.seeds(aux, aux_seed)))
        return g_in, g_layer

    indices = first_layer + jnp.arange(inputs_lnd.shape[0])
    g_in, g_stacked = jax.lax.scan(body, g_nd, (stacked, inputs_lnd, indices), reverse=True)
    return g_stacked, g_in
