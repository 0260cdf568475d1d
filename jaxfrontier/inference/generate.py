"""Token generation: sampling rules and the decode loop, compiled once per (batch, prompt, length).

`generate` prefills the prompts into a key/value cache (model/decode.py), then produces one
token per step in a `lax.fori_loop`. `generate_recompute` is the reference without a cache
(each step re-runs the whole padded sequence through the model's `__call__`): the benchmark's
baseline, and a test that the cache changes nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.model import decode


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy; top_k 0 and top_p 1 switch those off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def next_token(logits_bv: jax.Array, key: jax.Array, rule: Sampling, real_vocab: int) -> jax.Array:
    """The next token [B] of each row; padded vocabulary entries are never chosen."""
    neg = jnp.finfo(jnp.float32).min
    logits_bv = logits_bv.astype(jnp.float32)
    logits_bv = jnp.where(jnp.arange(logits_bv.shape[-1]) < real_vocab, logits_bv, neg)
    if rule.temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv / rule.temperature
    if rule.top_k:
        kth_b1 = jax.lax.top_k(logits_bv, rule.top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv < kth_b1, neg, logits_bv)
    if rule.top_p < 1.0:  # the smallest set of most likely tokens whose probability reaches top_p
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        before_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1) - jax.nn.softmax(sorted_bv, axis=-1)
        cut_b1 = jnp.min(jnp.where(before_bv < rule.top_p, sorted_bv, jnp.inf), axis=-1, keepdims=True)
        logits_bv = jnp.where(logits_bv < cut_b1, neg, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


def generate(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, key: jax.Array, *, max_new: int,
             rule: Sampling) -> jax.Array:
    """`max_new` tokens [B, max_new] after each row's prompt (right-padded to P), with a KV cache."""
    s = model.shape
    logits_bv, cache = decode.prefill(model, prompt_bp, lengths_b, decode.init_cache(s, prompt_bp.shape[0]))
    first_b = next_token(logits_bv, jax.random.fold_in(key, 0), rule, s.real_vocab_size)
    out_bn = jnp.zeros((prompt_bp.shape[0], max_new), jnp.int32).at[:, 0].set(first_b)

    def body(i, carry):
        out_bn, cache = carry
        logits_bv, cache = decode.step(model, out_bn[:, i - 1], lengths_b + i - 1, cache)
        token_b = next_token(logits_bv, jax.random.fold_in(key, i), rule, s.real_vocab_size)
        return out_bn.at[:, i].set(token_b), cache

    out_bn, _ = jax.lax.fori_loop(1, max_new, body, (out_bn, cache))
    return out_bn


def generate_recompute(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, key: jax.Array, *, max_new: int,
                       rule: Sampling) -> jax.Array:
    """As `generate`, without a cache: every step runs the whole [B, seq_len] sequence again."""
    s = model.shape
    b = prompt_bp.shape[0]
    seq_bs = jnp.zeros((b, s.seq_len), jnp.int32).at[:, :prompt_bp.shape[1]].set(prompt_bp)
    rows_b = jnp.arange(b)

    def body(i, carry):
        seq_bs, out_bn = carry
        logits_bv = model(seq_bs)[rows_b, lengths_b + i - 1]
        token_b = next_token(logits_bv, jax.random.fold_in(key, i), rule, s.real_vocab_size)
        seq_bs = seq_bs.at[rows_b, jnp.minimum(lengths_b + i, s.seq_len - 1)].set(token_b)
        return seq_bs, out_bn.at[:, i].set(token_b)

    _, out_bn = jax.lax.fori_loop(0, max_new, body, (seq_bs, jnp.zeros((b, max_new), jnp.int32)))
    return out_bn


def make_generate(model_def, *, max_new: int, rule: Sampling, cached: bool = True):
    """A jitted `(params, prompt_bp, lengths_b, key) -> tokens [B, max_new]` for the model of `model_def`."""
    fn = generate if cached else generate_recompute

    def run(params, prompt_bp, lengths_b, key):
        return fn(model_def.bind(params), prompt_bp, lengths_b, key, max_new=max_new, rule=rule)

    return jax.jit(run)
