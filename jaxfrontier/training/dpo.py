"""Direct Preference Optimization (Rafailov et al. 2023, arXiv 2305.18290): the objective and its loss-and-gradients.

A DPO batch is example rows, not windows of a stream: row 2i is pair i's chosen answer and row
2i + 1 its rejected one, each its prompt and response right-padded to seq_len + 1 tokens, with
the loss mask's flag (data/loss_mask.py) on every token whose prediction is not the response's
(prompt and padding). Per pair, with logp the sum of the response tokens' log-probabilities,

    loss = -log sigmoid(beta * ((logp_c - ref_c) - (logp_r - ref_r))),

the mean over pairs; `ref` are the log-probabilities under the reference model (the start of
training), which gets no gradient. Reported (`dpo/*`): the loss, the implicit rewards
beta * (logp - ref) of chosen and rejected, their margin, and the accuracy (the share of pairs
whose chosen reward is higher).

The per-row sums and the loss of pairs live in model/preference.py (inference's `--mode=eval` of a DPO
run uses them too): the model's own masked cross-entropy with one weight vector per row, vmapped, so
every non-pipelined layout computes them as the plain loss is computed.

The reference: a frozen copy of the initial parameters, an input of the compiled step (no gradient, no
optimizer state, sharded like the parameters). The memory trade-off
(docs/post_training.md): the copy costs one more set of parameters per device (fp32: 4 bytes per
parameter, divided over fsdp and tensor like the parameters) and one more forward pass per step
(about a third more FLOPs than the policy's forward and backward); a precomputed first pass
(ref_c, ref_r written beside the pairs, as TRL's `precompute_ref_log_probs`) saves both but costs a
pass over the data before training and pins the data order. With LoRA the reference is the base
with the adapters off (`model/lora.adapters_off`): the weights the policy already holds, no copy
(`reference` None in `logps`; the compiled steps take no reference argument).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding

from jaxfrontier.data import loader as data_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.checkpoint import target as target_lib

from jaxfrontier.checkpoint.format import FROZEN
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.model.preference import dpo_loss, logps
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib

METRICS = ('dpo/loss', 'dpo/reward_chosen', 'dpo/reward_rejected', 'dpo/margin', 'dpo/accuracy')


def make_dpo_loss_and_grads(c: ml_collections.ConfigDict, layout: ts.StatePlacement) -> Callable[..., Any]:
    """`(params, reference, tokens_gt, frozen=None) -> (loss, metrics, grads)` over the accumulation steps.

    Each micro-batch holds whole pairs (an even number of rows per replica: checked by
    `check_config`), so the mean over the step's pairs is the mean of the micro-batches' means.
    The reference's log-probabilities are computed in the same micro-batch, without gradient.
    """
    lay, model_def, beta = layout.layout, layout.model_def, c.train.dpo_beta
    order = TokenOrder.of(lay, layout.shape.seq_len, packing_lib.Packing(None, loss_mask=True))

    def micro(params, reference, tokens_bt1, frozen):
        return dpo_loss(*logps(model_def, order, params, reference, tokens_bt1, frozen), beta)

    value_and_grad = jax.value_and_grad(micro, has_aux=True)

    def loss_and_grads(params, reference, tokens_gt, frozen=None):
        micro_abt = step_lib.split_micro_batches(tokens_gt, lay.accum_steps, lay.dp, lay.strided_micro_batches)

        def body(grad_sum, tokens_bt1):
            (_, metrics), grads = value_and_grad(params, reference, tokens_bt1, frozen)
            return jax.tree.map(jnp.add, grad_sum, grads), metrics

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, metrics_a = jax.lax.scan(body, zeros, micro_abt)
        metrics = jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_a)
        grads = jax.tree.map(lambda g: g / lay.accum_steps, grad_sum)
        return metrics['dpo/loss'], metrics, jax.lax.with_sharding_constraint(grads, layout.update_shardings)

    return loss_and_grads


def make_train_step(c: ml_collections.ConfigDict, layout: ts.StatePlacement) -> Callable[..., Any]:
    """`train_step(state, reference, tokens) -> (state, metrics)`: the DPO loss's update (no loss scaling or
    spike guard: `check_run` refuses them), reported as `train/*` and `dpo/*`; `reference` None under LoRA."""
    tx, lr_schedule = layout.tx, layout.lr_schedule
    loss_and_grads = make_dpo_loss_and_grads(c, layout)

    def train_step(state, reference, tokens_gt):
        params, frozen = state['params'], state.get(FROZEN)
        loss, metrics, grads = loss_and_grads(params, reference, tokens_gt, frozen)
        updates, opt_state = tx.update(grads, state['opt_state'], params)
        new_params = jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), layout.param_shardings)
        new_state = {'step': state['step'] + 1, 'params': new_params, 'opt_state': opt_state}
        if frozen is not None:  # LoRA's base, unchanged (donated with the state: the same buffers)
            new_state[FROZEN] = frozen
        return new_state, {
            'train/loss': loss, 'train/grad_norm': optax.tree.norm(grads), 'train/param_norm': optax.tree.norm(new_params),
            'train/lr': lr_schedule(state['step']), **metrics}

    return train_step


def make_eval_step(c: ml_collections.ConfigDict, layout: ts.StatePlacement) -> Callable[..., Any]:
    """`eval_step(params, reference, tokens) -> the dpo/* metrics` of held-out pairs, micro-batched like training
    (`params` the model's whole params dict; `reference` None under LoRA)."""
    lay, model_def, beta = layout.layout, layout.model_def, c.train.dpo_beta
    order = TokenOrder.of(lay, layout.shape.seq_len, packing_lib.Packing(None, loss_mask=True))

    def eval_step(params, reference, tokens_gt):
        def micro(tokens_bt1):
            return dpo_loss(*logps(model_def, order, params, reference, tokens_bt1), beta)[1]

        micro_abt = step_lib.split_micro_batches(tokens_gt, lay.accum_steps, lay.dp, lay.strided_micro_batches)
        metrics_a = jax.lax.map(micro, micro_abt)
        return jax.tree.map(lambda m: jnp.mean(m, axis=0), metrics_a)

    return eval_step


class WithReference:
    """A compiled step called without the reference, which it holds (the loop calls `train(state, batch)` and
    `eval(params, batch)`); its memory analysis is the compiled step's."""

    def __init__(self, compiled: Any, reference: Any):
        self.compiled, self.reference = compiled, reference

    def __call__(self, first: Any, batch: Any) -> Any:
        return self.compiled(first, self.reference, batch)

    def memory_analysis(self) -> Any:
        return self.compiled.memory_analysis()


def compile_steps(c: ml_collections.ConfigDict, layout: ts.StatePlacement, reference: Any):
    """The DPO train and eval steps compiled for this layout, each holding `reference`, and the batch sharding
    (as training/step.compile_steps). Under LoRA `reference` is None and the steps take none (the base with the
    adapters off is the reference)."""
    batch_sharding = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32, sharding=batch_sharding)
    state = target_lib.abstract_target(layout.abstract_state, layout.state_shardings)
    whole, model = ts.model_params(state), layout.model_shardings
    train_step, eval_step = make_train_step(c, layout), make_eval_step(c, layout)
    if layout.lora:
        train_jit = jax.jit(lambda s, t: train_step(s, None, t), in_shardings=(layout.state_shardings, batch_sharding),
                            out_shardings=(layout.state_shardings, None), donate_argnums=0)
        eval_jit = jax.jit(lambda p, t: eval_step(p, None, t), in_shardings=(model, batch_sharding))
        with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
            return train_jit.lower(state, batch).compile(), eval_jit.lower(whole, batch).compile(), batch_sharding
    train_jit = jax.jit(train_step, in_shardings=(layout.state_shardings, model, batch_sharding),
                        out_shardings=(layout.state_shardings, None), donate_argnums=0)
    eval_jit = jax.jit(eval_step, in_shardings=(model, model, batch_sharding))
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        train = train_jit.lower(state, whole, batch).compile()
        evaluate = eval_jit.lower(whole, whole, batch).compile()
    return WithReference(train, reference), WithReference(evaluate, reference), batch_sharding


def evaluate(eval_step, params, *, source: Any, batch_sharding: Any, eval_batches: int, global_batch: int,
             packing: Any = None) -> dict[str, jax.Array]:
    """`eval/loss` (the DPO loss) and `eval/dpo/*` over `eval_batches` batches of held-out pairs (the loop's
    evaluation, as training/evaluation.evaluate; `packing` unused: pair rows are not packed)."""
    del packing
    batches = [data_lib.make_global_batch(source, i, batch_sharding, global_batch) for i in range(eval_batches)]
    metrics = [eval_step(params, batch) for batch in batches]
    mean = {k: jnp.mean(jnp.stack([m[k] for m in metrics])) for k in metrics[0]}
    return {'eval/loss': mean['dpo/loss'], **{f'eval/{k}': v for k, v in mean.items()}}
