"""FLOP counts of one optimizer step: the convention every reported number uses (no JAX).

FLOP convention (used for every number this module reports):
  * Megatron's formula (Narayanan et al. 2021, eq. 3, as printed by Megatron-DeepSpeed and by
    Dash et al. 2024 on Frontier):
    `24 * f * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))`.
  * Only matrix multiplies are counted (2 FLOPs per multiply-add). Causal attention is counted
    as full (s x s) attention, although half of it is masked. Layer norms, softmax, GeLU,
    biases, dropout, the embedding lookup and the optimizer update are ignored.
  * The MLP is assumed to be 4h wide (that is where the 24 comes from).
  * V is the padded vocabulary (`config.padded_vocab`), as in Megatron.
  * Model FLOPs use f = 3 (forward + backward), whatever the remat policy: that is what the
    user gets, and it is the basis of MFU. Megatron's hardware FLOPs use f = 4 when
    activations are recomputed (one extra forward), f = 3 otherwise; this is the figure the
    paper reported as TFLOP/s per GCD and is reported here under a `megatron_hw` name.

The formula is GPT's (a 4h-wide MLP). A model family counts its own FLOPs in this convention
(`Family.megatron_flops`, jaxfrontier/families/, which calls the formulas here), and
`config.flops_per_step` gives the configured family's numbers per step. Pure arithmetic, no
imports: the family declarations, below the config, use it.
"""

from __future__ import annotations


def megatron_flops_per_step(global_batch: int, seq_len: int, num_layers: int, d_model: int,
                            vocab_size: int, recompute: bool) -> float:
    """Megatron's hardware FLOPs of one optimizer step (the paper's TFLOP/s counter).

    `24 * f * B * s * l * h**2 * (1 + s/(6h) + V/(16 l h))` with f = 4 when activations are
    recomputed (forward, recomputed forward, backward = 2 forwards), f = 3 otherwise. Counts
    matmuls only; causal attention is counted as full attention; layer norms, softmax and
    other element-wise work are ignored; the MLP is 4h wide. Because f also multiplies the
    logits term, that term is counted at f/4 of 3 passes (Megatron-DeepSpeed's convention).

    Args:
      global_batch: B, sequences per optimizer step (all accumulation steps and replicas).
      seq_len: s, tokens per sequence.
      num_layers: l, transformer blocks.
      d_model: h, hidden size.
      vocab_size: V, the padded vocabulary.
      recompute: whether activations are recomputed in the backward pass.

    Returns:
      FLOPs per step, as a float.
    """
    f = 4 if recompute else 3
    b, s, l, h, v = (float(x) for x in (global_batch, seq_len, num_layers, d_model, vocab_size))
    return 24.0 * f * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def gated_gqa_flops_per_step(global_batch: int, seq_len: int, num_layers: int, d_model: int, vocab_size: int,
                             kv_ratio: float, mlp_dim: int, recompute: bool, query_projection_size: int = 0) -> float:
    """Megatron-LM's count for grouped-query attention and a gated (SwiGLU) MLP, same convention.

    As Megatron-LM's `num_floating_point_operations` (training.py) with query groups and
    SwiGLU. Multiply-adds per token and pass: q and output projections 2 h q, k and v
    2 kv_ratio h q, attention 2 s q (scores and values, counted in full), the MLP 3 h F, where
    q = heads x head width is the query projection's width (h, unless the heads' width is set
    apart from h / heads: Megatron's `kv_channels`, its `query_projection_to_hidden_size_ratio`
    q / h); times 2 FLOPs, f passes (f = 4 with recomputation, else 3), B s tokens and l layers;
    the head's 2 h V per token at f/4 of 3 passes, as in `megatron_flops_per_step`. With
    kv_ratio = 1, q = h and F = 8h/3 (three matrices as wide as GPT's two 4h ones) it equals
    `megatron_flops_per_step` (a test holds it).

    Args:
      kv_ratio: key/value heads / query heads (1: multi-head; GQA below 1).
      mlp_dim: F, the MLP's width (three F x h matrices: gate, up, down).
      query_projection_size: q, heads x head width; 0: d_model.
    """
    f = 4 if recompute else 3
    b, s, l, h, v, F = (float(x) for x in (global_batch, seq_len, num_layers, d_model, vocab_size, mlp_dim))
    q = float(query_projection_size or d_model)
    per_layer = 2.0 * h * q * (1.0 + kv_ratio) + 2.0 * s * q + 3.0 * h * F  # multiply-adds per token
    return 2.0 * f * b * s * l * per_layer + 2.0 * f * b * s * h * v * 3.0 / 4.0


def model_flops_per_step(global_batch: int, seq_len: int, num_layers: int, d_model: int, vocab_size: int) -> float:
    """Model FLOPs of one optimizer step: Megatron's formula with f = 3 always (basis of MFU).

    Same convention as `megatron_flops_per_step` (matmuls only, causal attention counted as
    full, layer norms/softmax ignored, padded vocabulary V), but recomputation is never
    counted: this is the useful work of forward + backward, independent of the remat policy.
    """
    return megatron_flops_per_step(global_batch, seq_len, num_layers, d_model, vocab_size, recompute=False)
