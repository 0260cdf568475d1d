"""`--mode=sample`: continue prompts with the newest checkpoint of a run (or init_params_from).

Prompts (every --prompt, or the lines of --prompt_file) are encoded with the run's tokenizer
(bytes for the built-in corpus), right-padded into one batch (rows padded up to a multiple of
the data-parallel size), prefilled into a key/value cache and continued one token per step in
a compiled loop (inference/generate.py), on the config's mesh: batch rows over data x fsdp,
heads and vocabulary over tensor. A row ends at its end-of-text token, a stop string
(inference/stops.py: checked on the host every few steps) or --max_new_tokens; the loop ends
when every row has.
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import UserError
from jaxfrontier.inference import chat_prompts
from jaxfrontier.inference import generate as gen
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import stops as stops_lib
from jaxfrontier.inference import text


@dataclasses.dataclass(frozen=True)
class Result:
    prompts: list[str]
    tokens: list[list[int]]  # the new tokens of each prompt (through a stop string, before end-of-text)
    texts: list[str]  # their text, cut before a stop string
    finish: list[str]  # why each row ended: 'stop', 'eot' or 'length'
    tokens_per_s: float
    compile_s: float
    source: str


def encode_prompts(codec, prompts: list[str], max_new: int, seq_len: int) -> list[list[int]]:
    """Token ids of each prompt; one-line errors for an empty prompt or one too long for the model."""
    if not prompts:
        raise UserError('no prompt. Fix: pass --prompt=TEXT or --prompt_file=FILE (one prompt per line).')
    if max_new < 1:
        raise UserError(f'--max_new_tokens={max_new}: must be at least 1.')
    encoded = [codec.encode(p) for p in prompts]
    for n, (prompt, ids) in enumerate(zip(prompts, encoded), 1):
        if not ids:
            raise UserError(f'prompt {n} ({prompt!r}) encodes to no tokens. Fix: give a non-empty prompt.')
        if len(ids) + max_new - 1 > seq_len:
            raise UserError(f'prompt {n} of {len(ids)} tokens + --max_new_tokens={max_new} exceeds the model\'s '
                            f'{seq_len} positions (model.seq_len). Fix: shorten the prompt or lower '
                            f'--max_new_tokens to {max(1, seq_len + 1 - len(ids))}.')
    return encoded


def batch_prompts(encoded: list[list[int]], rows_multiple: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts [B, P] and lengths [B]; B rounded up to a multiple (extra rows repeat the first),
    P the longest prompt or `width` if wider."""
    b = -(-len(encoded) // rows_multiple) * rows_multiple
    rows = encoded + [encoded[0]] * (b - len(encoded))
    p = max(width, *(len(r) for r in rows))
    prompt_bp = np.zeros((b, p), np.int32)
    for i, r in enumerate(rows):
        prompt_bp[i, :len(r)] = r
    return prompt_bp, np.array([len(r) for r in rows], np.int32)


def check_rule(rule: gen.Sampling, vocab: int) -> None:
    if rule.temperature < 0:
        raise UserError(f'--temperature={rule.temperature}: must be >= 0 (0 = greedy).')
    if not 0 <= rule.top_k <= vocab:
        raise UserError(f'--top_k={rule.top_k}: must be in [0, {vocab}] (0 = off).')
    if not 0 < rule.top_p <= 1:
        raise UserError(f'--top_p={rule.top_p}: must be in (0, 1] (1 = off).')
    if not rule.repetition_penalty > 0:
        raise UserError(f'--repetition_penalty={rule.repetition_penalty}: must be > 0 (1 = off, > 1 discourages '
                        'repeats).')


class _Rendered:
    """The token ids of prompts already rendered (chat), for encode_prompts' checks."""

    def __init__(self, texts: list[str], ids: list[list[int]]):
        self.ids = dict(zip(texts, ids))

    def encode(self, prompt: str) -> list[int]:
        return self.ids[prompt]


def sample(c: ml_collections.ConfigDict, workdir: str, prompts: list[str], *, max_new: int, rule: gen.Sampling,
           seed: int, stops: tuple[str, ...] = (), eot: bool = True, chats: list | None = None) -> Result:
    """Continues each prompt by up to `max_new` tokens (`eot`: a row ends at end-of-text); see the module docstring.

    `chats` (conversations, instead of `prompts`) are rendered with the run's chat template and end
    at its end-of-turn token too (inference/chat_prompts.py).
    """
    stops = stops_lib.check_stops(list(stops))
    loaded = load_lib.load(c, workdir)
    vocab, run_data = loaded.config.model.vocab_size, loaded.run_config.get('data', {})
    check_rule(rule, vocab)
    codec = text.run_codec(run_data, vocab, loaded.hf_dir)
    eot_ids = codec.eot_ids
    if chats:
        tokenizer = chat_prompts.chat_tokenizer(loaded.hf_dir, run_data, vocab)
        prompts, ids = chat_prompts.render(tokenizer, chats)
        eot_ids = tuple(dict.fromkeys(eot_ids + chat_prompts.end_of_turn_ids(tokenizer)))
        encoded = encode_prompts(_Rendered(prompts, ids), prompts, max_new, loaded.config.model.seq_len)
    else:
        encoded = encode_prompts(codec, prompts, max_new, loaded.config.model.seq_len)
    rule = dataclasses.replace(rule, eot_ids=eot_ids if eot else ())
    return continue_tokens(loaded, codec, prompts, encoded, max_new=max_new, rule=rule, seed=seed, stops=stops)


def continue_tokens(loaded: load_lib.Loaded, codec, prompts: list[str], encoded: list[list[int]], *, max_new: int,
                    rule: gen.Sampling, seed: int, stops: list[str], rows: int = 0, width: int = 0) -> Result:
    """Continues the checked token ids `encoded` of `prompts` (each fits the model with `max_new`).

    `rows` and `width` pad the batch to at least that many rows and prompt positions, so that
    callers with many batches (the lm-eval adapter, inference/harness.py) compile one shape.
    """
    c, layout = loaded.config, loaded.layout
    rows_multiple = -(-max(rows, 1) // config_lib.data_parallel_size(c)) * config_lib.data_parallel_size(c)
    prompt_bp, lengths_b = batch_prompts(encoded, rows_multiple, width)
    by_row = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules, 1))
    start, advance = gen.make_chunked(layout.model_def, max_new=max_new, rule=rule)
    chunk = stops_lib.CHECK_EVERY if stops else max_new  # without stop strings the host never needs to look
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        lengths = jax.device_put(lengths_b, by_row)
        key = jax.device_put(jax.random.key(seed), NamedSharding(layout.mesh, P()))
        args = (loaded.params, jax.device_put(prompt_bp, NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))),
                lengths, jax.device_put(np.arange(len(prompt_bp)) >= len(prompts), by_row), key)  # padding: done
        t0 = time.perf_counter()
        start = start.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        state = start(*args)
        t1 = time.perf_counter()
        advance = advance.lower(loaded.params, state, lengths, key, np.int32(1)).compile()
        compile_s += time.perf_counter() - t1
        t0 += time.perf_counter() - t1
        state = decode_in_chunks(advance, state, (loaded.params, lengths, key), len(prompts), max_new, chunk,
                                 lambda tokens: stops_lib.has_stopped(codec, tokens, stops, rule.eot_ids), by_row)
        out_bn, steps = np.asarray(state['out']), int(state['i'])
        seconds = time.perf_counter() - t0
    ends = [stops_lib.ending(codec, out_bn[r, :steps].tolist(), stops, rule.eot_ids) for r in range(len(prompts))]
    return Result(list(prompts), [e.tokens for e in ends], [e.text for e in ends], [e.reason for e in ends],
                  len(prompts) * steps / max(seconds, 1e-9), compile_s, loaded.source)


def decode_in_chunks(advance, state, args, rows: int, max_new: int, chunk: int, stopped, sharding):
    """Runs `advance` `chunk` steps at a time until every real row has stopped or `max_new` tokens exist.

    Between chunks the host marks rows that `stopped(tokens)` (a stop string) as done on the
    device too, so the loop can end early within the next chunk once the rest end by themselves.
    """
    params, lengths, key = args
    while True:
        i = int(state['i'])
        done_b = np.asarray(state['done'])
        if chunk < max_new:  # a stop string can only be seen in the text
            out_bn = np.asarray(state['out'])
            newly = [r for r in range(rows) if not done_b[r] and stopped(out_bn[r, :i].tolist())]
            if newly:
                done_b = done_b.copy()
                done_b[newly] = True
                state['done'] = jax.device_put(done_b, sharding)
        if i >= max_new or done_b[:rows].all():
            return state
        state = advance(params, state, lengths, key, np.int32(min(i + chunk, max_new)))


def report(result: Result) -> str:
    """What --mode=sample prints: each prompt and its continuation, then one JSON line of numbers."""
    lines = []
    for prompt, continuation in zip(result.prompts, result.texts):
        lines += [f'--- prompt: {prompt!r}', prompt + continuation]
    summary = {'tokens': result.tokens, 'texts': result.texts, 'finish': result.finish,
               'tokens_per_s': round(result.tokens_per_s, 1),
               'compile_s': round(result.compile_s, 2), 'source': result.source}
    lines.append(f'sample: {json.dumps(summary)}')
    return '\n'.join(lines)


def read_prompts(prompts: list[str], prompt_file: str) -> list[str]:
    """Every --prompt (in order), or the non-empty lines of --prompt_file; not both."""
    if prompts and prompt_file:
        raise UserError(f'both --prompt ({len(prompts)}) and --prompt_file={prompt_file} given. Fix: pass the '
                        'prompts one way: repeat --prompt, or list them in the file, one per line.')
    if prompt_file:
        try:
            with open(prompt_file, encoding='utf-8') as f:
                return [line.rstrip('\n') for line in f if line.strip()]
        except OSError as e:
            raise UserError(f'cannot read --prompt_file={prompt_file}: {e.strerror}. Fix: name a text file, '
                            'one prompt per line.') from e
        except UnicodeDecodeError as e:
            raise UserError(f'--prompt_file={prompt_file} is not UTF-8 text (byte {e.start}). Fix: save it as '
                            'UTF-8.') from None
    for prompt in prompts:
        try:
            prompt.encode('utf-8')  # bytes that are not UTF-8 reach argv as lone surrogates
        except UnicodeEncodeError:
            raise UserError(f'--prompt={prompt!r} is not UTF-8 text. Fix: pass the prompt as UTF-8, or write it to '
                            'a UTF-8 file and pass --prompt_file=FILE.') from None
    return list(prompts)
