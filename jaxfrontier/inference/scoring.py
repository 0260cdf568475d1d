"""Log-likelihoods of continuations: what lm-evaluation-harness asks of a model (inference/harness.py).

A request is a context and a continuation, both token ids; its score is the sum of the
log-probabilities of the continuation's tokens given everything before them, and whether
greedy decoding would have produced exactly the continuation. The row the model sees is
`(context + continuation)[-(S + 1):]` minus its last token (S = model.seq_len): a context too
long for the model loses its oldest tokens, as the harness's Hugging Face model does.

Requests are scored in batches of a fixed number of rows (a multiple of the data-parallel
size, so rows split over `data` x `fsdp`), longest first, each batch right-padded to a width
from a short ladder (powers of two from 16, capped at S): at most log2(S) - 3 compilations
however many requests, and a short request does not pay for S positions. Padding is never
scored and, the attention being causal, never seen by a scored position.

No lm-eval import here: the adapter is a thin layer over this module, tested without it too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import UserError
from jaxfrontier.inference import load as load_lib

MIN_WIDTH = 16  # the narrowest padded batch: a ladder step below this saves nothing worth a compile


@dataclasses.dataclass(frozen=True)
class Score:
    logprob: float  # sum of the continuation tokens' log-probabilities (natural log)
    greedy: bool  # every continuation token is its position's most likely token


def target_logprobs(model, inputs_bt: jax.Array, targets_bt: jax.Array,
                    seq=None) -> tuple[jax.Array, jax.Array]:
    """log p(target) [B*T] and whether each target is the argmax [B*T]; padded vocabulary entries excluded.

    `seq`: the inputs' positions and documents where not plain (model/sequence.Seq; packed
    documents in `--mode=eval`), else their length.

    The target's logit is picked by a compare-and-sum over the vocabulary, not a gather, so a
    vocabulary split over `tensor` stays split (a gather would replicate the logits).
    """
    seq = inputs_bt.shape[1] if seq is None else seq
    positions_bt = None if isinstance(seq, int) else seq.positions_bt
    logits_nv = model.logits(model.apply_blocks(model.embed(inputs_bt, None, positions_bt), seq)).astype(jnp.float32)
    vocab_v = jnp.arange(logits_nv.shape[-1])
    logits_nv = jnp.where(vocab_v < model.shape.real_vocab_size, logits_nv, jnp.finfo(jnp.float32).min)
    target_n = targets_bt.reshape(-1)
    picked_n = jnp.sum(jnp.where(vocab_v == target_n[:, None], logits_nv, 0.0), axis=-1)
    return picked_n - jax.nn.logsumexp(logits_nv, axis=-1), jnp.argmax(logits_nv, axis=-1) == target_n


def make_score_step(layout):
    """`(params, inputs [B, T], targets [B, T], weights [B, T]) -> (log-prob sum [B], all greedy [B])`, jitted.

    Only positions of weight 1 count: a row's continuation.
    """
    def score(params, inputs_bt, targets_bt, weights_bt):
        logp_n, greedy_n = target_logprobs(layout.model_def.bind(params), inputs_bt, targets_bt)
        logp_bt, greedy_bt = logp_n.reshape(inputs_bt.shape), greedy_n.reshape(inputs_bt.shape)
        return jnp.sum(logp_bt * weights_bt, axis=1), jnp.all(greedy_bt | (weights_bt == 0), axis=1)
    return jax.jit(score)


def width_for(length: int, seq_len: int) -> int:
    """The padded width of a batch whose longest row has `length` positions (see the module docstring)."""
    width = MIN_WIDTH
    while width < length:
        width *= 2
    return min(width, seq_len)


def row_of(context: list[int], continuation: list[int], seq_len: int) -> tuple[list[int], list[int], int]:
    """(inputs, targets, scored): the model's row for one request; its last `scored` targets are the continuation."""
    if not context:
        raise ValueError('a request needs at least one context token (the adapter supplies a prefix token)')
    if not continuation:
        return context[-seq_len:], context[-seq_len:], 0  # scores nothing: log-likelihood 0, greedy
    if len(continuation) > seq_len:
        raise UserError(f'a continuation of {len(continuation)} tokens is longer than the model\'s {seq_len} '
                        'positions (model.seq_len). Fix: choose tasks whose answers fit the model.')
    whole = (context + continuation)[-(seq_len + 1):]
    return whole[:-1], whole[1:], len(continuation)


class Scorer:
    """Scores (context, continuation) token requests with a loaded model (see the module docstring)."""

    def __init__(self, loaded: load_lib.Loaded, batch_rows: int):
        self.loaded = loaded
        dp = config_lib.data_parallel_size(loaded.config)
        self.rows = -(-max(batch_rows, 1) // dp) * dp  # the batch splits over data x fsdp
        self.seq_len = loaded.config.model.seq_len
        self.step = make_score_step(loaded.layout)
        self.sharding = NamedSharding(loaded.layout.mesh, mesh_lib.batch_spec(loaded.layout.rules))

    def score(self, requests: list[tuple[list[int], list[int]]]) -> list[Score]:
        """The Score of each (context, continuation) request, in the order given."""
        rows = [row_of(context, continuation, self.seq_len) for context, continuation in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first: batches of like widths
        out: list[Score | None] = [None] * len(rows)
        layout = self.loaded.layout
        with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
            for first in range(0, len(order), self.rows):
                batch = order[first:first + self.rows]
                width = width_for(len(rows[batch[0]][0]), self.seq_len)
                inputs, targets, weights = (np.zeros((self.rows, width), dtype) for dtype in
                                            (np.int32, np.int32, np.float32))
                for r, i in enumerate(batch):
                    row_inputs, row_targets, scored = rows[i]
                    inputs[r, :len(row_inputs)], targets[r, :len(row_targets)] = row_inputs, row_targets
                    weights[r, len(row_targets) - scored:len(row_targets)] = 1.0
                logp_b, greedy_b = self.step(self.loaded.params, *(jax.device_put(a, self.sharding)
                                                                     for a in (inputs, targets, weights)))
                logp_b, greedy_b = np.asarray(logp_b), np.asarray(greedy_b)
                for r, i in enumerate(batch):
                    out[i] = Score(float(logp_b[r]), bool(greedy_b[r]))
        return out
