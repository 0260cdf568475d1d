"""The train and eval steps as pure functions, and their jitted, compiled forms.

`make_train_step(c, layout)` returns `train_step(state, tokens) -> (state, metrics)`: the
micro-batch split, the loss and gradients (the accumulation scan, or the pipeline), the
data-parallel reduction (once per step where `reduce_once` holds, training/reduction.py), the
optimizer update and float16's loss scaling. `compile_steps` jits them with donated state and
explicit shardings. Under LoRA (training/state.py) the state's `params` are the adapters and its
`frozen` the base: the loss binds both, the gradients and the update are the adapters' alone.
Nothing here touches the workdir: the loop (loop.py) runs the steps, the planner's compile check
(plan/compile_check.py) lowers them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import jmp
import ml_collections
import optax
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import pipeline
from jaxfrontier.checkpoint import target as target_lib
from jaxfrontier.checkpoint.format import FROZEN
from jaxfrontier.model import auxiliary
from jaxfrontier.model import lora as lora_lib
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.training import loss_scale
from jaxfrontier.training import reduction
from jaxfrontier.training import spikes
from jaxfrontier.training import state as ts

State = dict[str, Any]


def split_micro_batches(tokens_gt: jax.Array, accum_steps: int, dp_size: int,
                        strided: bool = False) -> jax.Array:
    """[G, T] -> [A, G/A, T] such that every device keeps its own rows (no communication).

    The batch's rows are split into dp_size contiguous blocks, one per data-parallel replica. Blocked
    (the default): micro-batch a takes rows a*mb .. (a+1)*mb - 1 of every block, so its rows depend on
    dp_size. `strided` (`Layout.strided_micro_batches`: a model whose per-micro-batch statistics are not
    linear in the rows, MoE): micro-batch a is global rows a, a + A, a + 2A, ... in every layout (each
    block's size is a multiple of A, so a replica's rows of it are still its own), the one-device run's too.
    """
    g, t = tokens_gt.shape
    mb = g // (dp_size * accum_steps)
    if strided:
        x = tokens_gt.reshape(g // accum_steps, accum_steps, t).transpose(1, 0, 2)  # [A, G/A, T]
        return mesh_lib.constrain(x, (None, 'batch', None))
    x = tokens_gt.reshape(dp_size, accum_steps, mb, t).transpose(1, 0, 2, 3)  # [A, DP, mb, T]
    return mesh_lib.constrain(x.reshape(accum_steps, dp_size * mb, t), (None, 'batch', None))


def dropout_keys(c: ml_collections.ConfigDict):
    """`key(step, micro)`: dropout randomness as a function of (seed, step, micro-batch), so the
    state holds no RNG and every layout draws the same masks; None without dropout."""
    seed, on = c.seed, c.model.dropout_rate > 0.0 or config_lib.lora_dropout(c) > 0.0

    def key(step: jax.Array, micro: jax.Array) -> jax.Array | None:
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), micro) if on else None

    return key


def _accumulate(c: ml_collections.ConfigDict, layout: ts.StatePlacement, grad_specs):
    """`(params, micro_abt, step, scale=None, aux_weight=None, frozen=None) -> (mean loss, mean aux, mean grads)`
    over the micro-batches (no pipeline); the contract of `make_loss_aux_and_grads`' `micro_fn`. `frozen`: LoRA's
    base, bound with the params (the adapters) but not differentiated.

    Each micro-batch's gradient is that of its objective, the cross-entropy plus `aux_weight` x
    its aux's loss terms (model/auxiliary.py); the loss returned is the cross-entropy, the aux
    each entry's mean over the micro-batches. The running gradient sum is held in fp32 with
    `grad_specs` (where gradients live inside the loop).
    """
    accum, model_def, dropout_key = layout.layout.accum_steps, layout.model_def, dropout_keys(c)
    order = TokenOrder.of(layout.layout, layout.shape.seq_len, packing_lib.from_config(c))

    def micro_objective(params, tokens_bt, key, aux_weight, frozen):
        bound = model_def.bind(params if frozen is None else lora_lib.join(frozen, params))
        loss, aux = order.loss_and_aux(bound, tokens_bt, key)
        return auxiliary.objective(loss, aux, aux_weight), (loss, aux)

    value_and_grad = jax.value_and_grad(micro_objective, has_aux=True)  # of the params alone

    def grad_fn(params, tokens_bt, key, scale, aux_weight, frozen):
        if scale is None:
            (_, (loss, aux)), grads = value_and_grad(params, tokens_bt, key, aux_weight, frozen)
            return loss, aux, grads
        # Loss scaling (float16): the backward pass starts from `scale`, not 1; the loss is unscaled.
        _, pull, (loss, aux) = jax.vjp(lambda p: micro_objective(p, tokens_bt, key, aux_weight, frozen), params,
                                       has_aux=True)
        return loss, aux, pull(scale.astype(loss.dtype))[0]

    constrain = lambda tree: jax.lax.with_sharding_constraint(tree, grad_specs)  # noqa: E731

    def accumulate(params, micro_abt, step, scale=None, aux_weight=None, frozen=None):
        if accum == 1:
            return grad_fn(params, micro_abt[0], dropout_key(step, 0), scale, aux_weight, frozen)

        def body(carry, xs):
            loss_sum, grad_sum = carry
            tokens_bt, index = xs
            loss, aux, grads = grad_fn(params, tokens_bt, dropout_key(step, index), scale, aux_weight, frozen)
            return (loss_sum + loss, constrain(jax.tree.map(jnp.add, grad_sum, grads))), aux

        zeros = constrain(jax.tree.map(jnp.zeros_like, params))
        (loss_sum, grad_sum), aux_a = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                                   (micro_abt, jnp.arange(accum)))
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), aux_a)  # [A, L, ...] -> [L, ...]
        return loss_sum / accum, aux, jax.tree.map(lambda g: g / accum, grad_sum)

    return accumulate


def make_loss_aux_and_grads(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Returns `loss_aux_and_grads(params, tokens, step, scale=None, frozen=None) -> (loss, aux, grads)` over the
    accumulation steps (`frozen`: LoRA's base, `params` its adapters).

    The loss is the mean cross-entropy over all tokens of the global batch (over the counted ones
    with packed documents: model/packing.py); `aux` the layers' auxiliary outputs `{name: [L, ...]}`
    averaged over the micro-batches (model/auxiliary.py); the gradients those of the objective
    (cross-entropy plus the aux's loss terms), averaged over the micro-batches in fp32 and laid
    out like the optimizer state (`layout.update_shardings`).
    Where `Layout.reduce_once` holds, each data-parallel replica accumulates its own rows'
    gradients and they cross the `data` axis once per step (jaxfrontier/training/reduction.py).
    """
    lay = layout.layout
    accum, dp, once = lay.accum_steps, lay.dp, lay.reduce_once
    packing = packing_lib.from_config(c)
    if lay.pipeline > 1:  # reduced once: the pipeline's own map is manual over `data` too
        micro_fn = pipeline.make_pipeline_grads(lay, layout.shape, layout.model_def, layout.pipeline_schedule,
                                                dropout_keys(c), layout.rules if once else None, packing)
    else:
        # Per micro-batch reduction: gradients meet the optimizer layout (ZeRO-1: a reduce-scatter)
        # in every step. Reduced once: they stay where the parameters are until the end.
        specs = layout.param_shardings if once else layout.update_shardings
        micro_fn = _accumulate(c, layout, jax.tree.map(lambda s: s.spec, specs))
        if once:
            micro_fn = reduction.data_local(micro_fn, layout.rules)

    def loss_aux_and_grads(params, tokens_gt, step, scale=None, frozen=None):
        # float16: gradients come back multiplied by `scale`. Packed documents: the gradients are
        # multiplied by count_scale below, so the aux's loss terms enter divided by it (aux_weight).
        scale_n = None if packing is None else packing_lib.count_scale(tokens_gt, packing)
        aux_weight = None if packing is None or packing.boundary_loss else 1.0 / scale_n
        micro_abt = split_micro_batches(tokens_gt, accum, dp, lay.strided_micro_batches)
        if frozen is None:
            loss, aux, grads = micro_fn(params, micro_abt, step, scale, aux_weight)
        else:  # LoRA (config.validate keeps it out of pipelines)
            loss, aux, grads = micro_fn(params, micro_abt, step, scale, aux_weight, frozen)
        if packing is not None:  # the mean over all predictions -> over the counted ones (model/packing.py)
            loss, grads = loss * scale_n, jax.tree.map(lambda g: g * scale_n, grads)
        return loss, aux, jax.lax.with_sharding_constraint(grads, layout.update_shardings)

    return loss_aux_and_grads


def make_loss_and_grads(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Returns `loss_and_grads(params, tokens, step, scale=None, frozen=None) -> (loss, grads)`:
    `make_loss_aux_and_grads` without the aux (the planner, verify, benchmarks)."""
    loss_aux_and_grads = make_loss_aux_and_grads(c, layout)

    def loss_and_grads(params, tokens_gt, step, scale=None, frozen=None):
        loss, _, grads = loss_aux_and_grads(params, tokens_gt, step, scale, frozen)
        return loss, grads

    return loss_and_grads


def make_train_step(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Returns the pure `train_step(state, tokens) -> (state, metrics)` for this layout."""
    tx, lr_schedule = layout.tx, layout.lr_schedule
    loss_aux_and_grads = make_loss_aux_and_grads(c, layout)

    def train_step(state: State, tokens_gt: jax.Array) -> tuple[State, dict[str, jax.Array]]:
        params, scale_state, frozen = state['params'], state.get('loss_scale'), state.get(FROZEN)
        scale = None if scale_state is None else scale_state['scale']
        loss, aux, grads = loss_aux_and_grads(params, tokens_gt, state['step'], scale, frozen)
        if scale_state is not None:
            grads = loss_scale.unscale(c, scale_state, grads)
        updates, opt_state = tx.update(grads, state['opt_state'], params)
        new_params = optax.apply_updates(params, updates)
        new_params = layout.model_def.update_outside_gradient(new_params, aux)  # e.g. the MoE router's bias
        new_params = jax.lax.with_sharding_constraint(new_params, layout.param_shardings)
        new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state}
        if frozen is not None:  # LoRA's base, unchanged (donated with the state: the same buffers)
            new_state[FROZEN] = frozen
        extra, grad_norm = {}, optax.tree.norm(grads)
        if scale_state is not None:  # float16: an overflowing step keeps the old params and moments
            (new_state['params'], new_state['opt_state']), new_state['loss_scale'], extra = loss_scale.finish_step(
                c, scale_state, grads, (new_params, opt_state), (params, state['opt_state']))
        if 'spike' in state:  # a loss spike keeps the old params and moments too (training/spikes.py)
            overflow = None if scale_state is None else extra['train/step_skipped'] > 0
            skip, new_state['spike'], spike_metrics = spikes.judge(c, state['spike'], loss, grad_norm, overflow)
            new_state['params'], new_state['opt_state'] = jmp.select_tree(
                skip, (params, state['opt_state']), (new_state['params'], new_state['opt_state']))
            extra = {**extra, **spike_metrics}
        metrics = {'train/loss': loss, 'train/grad_norm': grad_norm,
                   'train/param_norm': optax.tree.norm(new_state['params']), 'train/lr': lr_schedule(state['step']),
                   **extra, **auxiliary.metrics(aux)}
        return new_state, metrics

    return train_step


def make_eval_loss_and_aux(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Returns `eval_loss_and_aux(params, tokens) -> (mean loss, mean aux)` of the model's whole params dict
    (`state.model_params`: LoRA's base joined with its adapters), micro-batched like training
    (with packed documents, the mean over the batch's counted predictions; training/evaluation.py
    weighs batches). The loss is the cross-entropy alone; the aux `{name: [L, ...]}` (model/auxiliary.py)
    averaged over the micro-batches, as training reports it."""
    lay = layout.layout
    accum, dp = lay.accum_steps, lay.dp
    packing = packing_lib.from_config(c)
    if lay.pipeline > 1:  # a forward-only wave through the stages (pipeline.make_pipeline_eval)
        local = lay.reduces_once(training=False)
        mean_all = pipeline.make_pipeline_eval(lay, layout.shape, layout.model_def,
                                               functools.partial(split_micro_batches, strided=lay.strided_micro_batches),
                                               layout.rules if local else None, packing)
    else:
        order = TokenOrder.of(lay, layout.shape.seq_len, packing)

        def mean_all(params, tokens_gt):
            model = layout.model_def.bind(params)
            micro_abt = split_micro_batches(tokens_gt, accum, dp, lay.strided_micro_batches)
            losses, aux = jax.lax.map(lambda tokens_bt: order.loss_and_aux(model, tokens_bt), micro_abt)
            return jnp.mean(losses), jax.tree.map(lambda a: jnp.mean(a, axis=0), aux)

    if packing is None:
        return mean_all

    def counted(params, tokens_gt):
        loss, aux = mean_all(params, tokens_gt)
        return loss * packing_lib.count_scale(tokens_gt, packing), aux

    return counted


def make_eval_step(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Returns `eval_step(params, tokens) -> mean loss`: `make_eval_loss_and_aux` without the aux (the
    loop's evaluation reports the cross-entropy only)."""
    eval_loss_and_aux = make_eval_loss_and_aux(c, layout)
    return lambda params, tokens_gt: eval_loss_and_aux(params, tokens_gt)[0]


def jit_train_step(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """The jitted train step (donated state, explicit shardings) and abstract (state, batch) to lower it with."""
    batch_sharding = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32, sharding=batch_sharding)
    state = target_lib.abstract_target(layout.abstract_state, layout.state_shardings)
    train_jit = jax.jit(make_train_step(c, layout), in_shardings=(layout.state_shardings, batch_sharding),
                        out_shardings=(layout.state_shardings, None), donate_argnums=0)
    return train_jit, state, batch


def compile_steps(c: ml_collections.ConfigDict, layout: ts.StatePlacement):
    """Jits and compiles the train and eval steps ahead of time for this layout (validated: layouts this
    jax cannot compile are refused by `config.validate`, config/checks.check_compiles)."""
    train_jit, state, batch = jit_train_step(c, layout)
    eval_jit = jax.jit(make_eval_step(c, layout), in_shardings=(layout.model_shardings, batch.sharding))
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        train_compiled = train_jit.lower(state, batch).compile()
        eval_compiled = eval_jit.lower(ts.model_params(state), batch).compile()
    return train_compiled, eval_compiled, batch.sharding


def memory_bytes(compiled) -> dict[str, int]:
    """XLA's per-device memory analysis ({} where there is none); 'total' = arguments + outputs
    + temporaries - aliased."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    out = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
           'temporaries': m.temp_size_in_bytes, 'aliased': m.alias_size_in_bytes}
    out['total'] = out['arguments'] + out['outputs'] + out['temporaries'] - out['aliased']
    return out
