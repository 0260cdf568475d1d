"""DPO's objective on the model (Rafailov et al. 2023): each row's sum of its response tokens' log-probabilities,
the policy's and the reference's, and the loss of pairs of rows. Below training/dpo.py (the step) and
inference/evaluate_dpo.py (`--mode=eval` of a DPO run), which both use it.

The per-row sums come from the model's own masked cross-entropy (`model.loss`: the same head, padded-vocabulary
exclusion and tensor-parallel logits as every loss here) with one weight vector per row, vmapped: only the
weighting is batched, the forward pass runs once.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfrontier.model import lora as lora_lib
from jaxfrontier.model.context import TokenOrder


def logps(model_def, order: TokenOrder, params: Any, reference: Any, tokens_bt1: jax.Array,
          frozen: Any = None) -> tuple[jax.Array, jax.Array]:
    """([B] the policy's, [B] the reference's, without gradient) sums of the response tokens' log-probabilities.

    `frozen`: LoRA's base, `params` its adapters. `reference` None (LoRA): the reference is the policy's own
    weights with the adapters off, so the step holds no second copy of the base."""
    whole = params if frozen is None else lora_lib.join(frozen, params)
    if reference is None:
        with lora_lib.adapters_off():
            ref_b = sequence_logps(model_def.bind(whole), tokens_bt1, order)
    else:
        ref_b = sequence_logps(model_def.bind(reference), tokens_bt1, order)
    return sequence_logps(model_def.bind(whole), tokens_bt1, order), jax.lax.stop_gradient(ref_b)


def row_weights(tokens_bt1: jax.Array, order: TokenOrder) -> jax.Array:
    """[B, B, T]: for each row b, the response predictions of row b (1) and nothing else (0)."""
    weights_bt = order.weights(tokens_bt1)
    b = weights_bt.shape[0]
    return jnp.eye(b, dtype=weights_bt.dtype)[:, :, None] * weights_bt[None]


def sequence_logps(model, tokens_bt1: jax.Array, order: TokenOrder) -> jax.Array:
    """[B]: each row's sum of the log-probabilities of its counted (response) tokens."""
    b, t = tokens_bt1.shape[0], tokens_bt1.shape[1] - 1
    inputs, targets = order.inputs(tokens_bt1), order.targets(tokens_bt1)
    positions = order.positions(tokens_bt1)

    def row_loss(weights_bt):  # the mean over B * T predictions of weight * token loss
        return model.loss(inputs, targets, None, positions, None, weights_bt)

    return -jax.vmap(row_loss)(row_weights(tokens_bt1, order)) * (b * t)


def dpo_loss(policy_b: jax.Array, reference_b: jax.Array, beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean DPO loss over the pairs of rows [2P] (chosen, rejected, ...) and its metrics."""
    rewards_p2 = beta * (policy_b - reference_b).reshape(-1, 2)  # [P, 2]: chosen, rejected
    margin_p = rewards_p2[:, 0] - rewards_p2[:, 1]
    loss = -jnp.mean(jax.nn.log_sigmoid(margin_p))
    return loss, {'dpo/loss': loss, 'dpo/reward_chosen': jnp.mean(rewards_p2[:, 0]),
                  'dpo/reward_rejected': jnp.mean(rewards_p2[:, 1]), 'dpo/margin': jnp.mean(margin_p),
                  'dpo/accuracy': jnp.mean((margin_p > 0).astype(jnp.float32))}
