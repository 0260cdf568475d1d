"""Token generation: sampling rules and the decode loop, compiled once per (batch, prompt, length).

`start` prefills the prompts into a key/value cache (model/decode.py) and picks the first
token; `advance` produces one token per step in a `lax.while_loop` up to a step bound, and
stops early once every row has finished (its end-of-text token). A caller that must look at
the text between steps (stop strings, inference/stops.py) calls `advance` in chunks with the
same state: the draws are keyed by the absolute step (`fold_in(key, i)`) and rows never read
each other, so the tokens do not depend on where the chunks end. `generate` is the whole
thing in one call. `generate_recompute` is the reference without a cache (each step re-runs
the whole padded sequence through the model's `__call__`): the benchmark's baseline, and a
test that the cache changes nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxfrontier.model import decode

State = dict[str, Any]  # out [B, N] tokens, cache, seen [B, V] (repetition penalty), done [B], i: next step


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy; top_k 0, top_p 1 and repetition_penalty 1 are off.

    `eot_ids` (the tokenizer's end-of-text tokens; none: empty) end a row's generation when drawn.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    eot_ids: tuple[int, ...] = ()


def penalise(logits_bv: jax.Array, seen_bv: jax.Array, penalty: float) -> jax.Array:
    """CTRL's repetition penalty as Hugging Face defines it (RepetitionPenaltyLogitsProcessor).

    The logit of every token already in the row's prompt or output is divided by the penalty
    where positive and multiplied where negative, so a penalty > 1 makes a repeat less likely
    whatever the logit's sign. Applied to the raw logits, before temperature, top-k and top-p.

    XLA turns a division by a scalar constant into a multiplication by its reciprocal, one
    rounding off the true quotient; hiding the penalty behind an optimization barrier keeps the
    division a division, so the result is Hugging Face's bit for bit.
    """
    penalty_bv = jax.lax.optimization_barrier(jnp.full(logits_bv.shape, penalty, logits_bv.dtype))
    return jnp.where(seen_bv, jnp.where(logits_bv < 0, logits_bv * penalty_bv, logits_bv / penalty_bv), logits_bv)


def next_token(logits_bv: jax.Array, key: jax.Array, rule: Sampling, real_vocab: int,
               seen_bv: jax.Array | None = None) -> jax.Array:
    """The next token [B] of each row; padded vocabulary entries are never chosen."""
    neg = jnp.finfo(jnp.float32).min
    logits_bv = logits_bv.astype(jnp.float32)
    if rule.repetition_penalty != 1.0:
        logits_bv = penalise(logits_bv, seen_bv, rule.repetition_penalty)
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


def seen_tokens(prompt_bp: jax.Array, lengths_b: jax.Array, vocab: int) -> jax.Array:
    """[B, V] True where the token occurs in the row's prompt (its padding excluded)."""
    real_bp = jnp.arange(prompt_bp.shape[1])[None, :] < lengths_b[:, None]
    ids_bp = jnp.where(real_bp, prompt_bp, vocab)  # padding goes to a column that is dropped
    rows_bp = jnp.broadcast_to(jnp.arange(prompt_bp.shape[0])[:, None], prompt_bp.shape)
    return jnp.zeros((prompt_bp.shape[0], vocab + 1), bool).at[rows_bp, ids_bp].set(True)[:, :vocab]


def mark(seen_bv: jax.Array, token_b: jax.Array) -> jax.Array:
    return seen_bv | (jnp.arange(seen_bv.shape[1])[None, :] == token_b[:, None])


def finished(token_b: jax.Array, rule: Sampling) -> jax.Array:
    return jnp.isin(token_b, jnp.array(rule.eot_ids, jnp.int32)) if rule.eot_ids else jnp.zeros(token_b.shape, bool)


def start(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, done_b: jax.Array, key: jax.Array, *,
          max_new: int, rule: Sampling) -> State:
    """Prefill and the first new token. `done_b` marks rows that need no output (batch padding)."""
    s = model.shape
    logits_bv, cache = decode.prefill(model, prompt_bp, lengths_b, decode.init_cache(s, prompt_bp.shape[0]))
    seen_bv = seen_tokens(prompt_bp, lengths_b, logits_bv.shape[-1]) if rule.repetition_penalty != 1.0 else None
    first_b = next_token(logits_bv, jax.random.fold_in(key, 0), rule, s.real_vocab_size, seen_bv)
    out_bn = jnp.zeros((prompt_bp.shape[0], max_new), jnp.int32).at[:, 0].set(first_b)
    return {'out': out_bn, 'cache': cache, 'seen': None if seen_bv is None else mark(seen_bv, first_b),
            'done': done_b | finished(first_b, rule), 'i': jnp.int32(1)}


def advance(model: nnx.Module, state: State, lengths_b: jax.Array, key: jax.Array, until: jax.Array, *,
            rule: Sampling) -> State:
    """Steps i .. min(until, max_new) - 1, ending early once every row is done."""
    s, max_new = model.shape, state['out'].shape[1]

    def more(st):
        return (st['i'] < jnp.minimum(until, max_new)) & ~jnp.all(st['done'])

    def body(st):
        i = st['i']
        logits_bv, cache = decode.step(model, st['out'][:, i - 1], lengths_b + i - 1, st['cache'])
        token_b = next_token(logits_bv, jax.random.fold_in(key, i), rule, s.real_vocab_size, st['seen'])
        return {'out': st['out'].at[:, i].set(token_b), 'cache': cache,
                'seen': None if st['seen'] is None else mark(st['seen'], token_b),
                'done': st['done'] | finished(token_b, rule), 'i': i + 1}

    return jax.lax.while_loop(more, body, state)


def generate(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, key: jax.Array, *, max_new: int,
             rule: Sampling) -> jax.Array:
    """`max_new` tokens [B, max_new] after each row's prompt (right-padded to P), with a KV cache.

    With `rule.eot_ids`, a row's tokens after its end-of-text are whatever the loop left there
    (zeros once every row has finished): the caller cuts each row at its end-of-text.
    """
    done_b = jnp.zeros(prompt_bp.shape[:1], bool)
    state = start(model, prompt_bp, lengths_b, done_b, key, max_new=max_new, rule=rule)
    return advance(model, state, lengths_b, key, jnp.int32(max_new), rule=rule)['out']


def generate_recompute(model: nnx.Module, prompt_bp: jax.Array, lengths_b: jax.Array, key: jax.Array, *, max_new: int,
                       rule: Sampling) -> jax.Array:
    """As `generate` (without ending early), without a cache: every step runs the whole [B, seq_len] sequence."""
    s = model.shape
    b = prompt_bp.shape[0]
    seq_bs = jnp.zeros((b, s.seq_len), jnp.int32).at[:, :prompt_bp.shape[1]].set(prompt_bp)
    rows_b = jnp.arange(b)
    seen_bv = seen_tokens(prompt_bp, lengths_b, s.vocab_size)  # padded, as the logits

    def body(i, carry):
        seq_bs, out_bn, seen_bv = carry
        logits_bv = model(seq_bs)[rows_b, lengths_b + i - 1]
        token_b = next_token(logits_bv, jax.random.fold_in(key, i), rule, s.real_vocab_size, seen_bv)
        seq_bs = seq_bs.at[rows_b, jnp.minimum(lengths_b + i, s.seq_len - 1)].set(token_b)
        return seq_bs, out_bn.at[:, i].set(token_b), mark(seen_bv, token_b)

    _, out_bn, _ = jax.lax.fori_loop(0, max_new, body, (seq_bs, jnp.zeros((b, max_new), jnp.int32), seen_bv))
    return out_bn


def make_generate(model_def, *, max_new: int, rule: Sampling, cached: bool = True):
    """A jitted `(params, prompt_bp, lengths_b, key) -> tokens [B, max_new]` for the model of `model_def`."""
    fn = generate if cached else generate_recompute

    def run(params, prompt_bp, lengths_b, key):
        return fn(model_def.bind(params), prompt_bp, lengths_b, key, max_new=max_new, rule=rule)

    return jax.jit(run)


def make_chunked(model_def, *, max_new: int, rule: Sampling):
    """Jitted `start(params, prompt_bp, lengths_b, done_b, key) -> state` and
    `advance(params, state, lengths_b, key, until) -> state` (the state donated), for decoding in chunks."""

    def run_start(params, prompt_bp, lengths_b, done_b, key):
        return start(model_def.bind(params), prompt_bp, lengths_b, done_b, key, max_new=max_new, rule=rule)

    def run_advance(params, state, lengths_b, key, until):
        return advance(model_def.bind(params), state, lengths_b, key, until, rule=rule)

    return jax.jit(run_start), jax.jit(run_advance, donate_argnums=1)
