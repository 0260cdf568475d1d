"""`--mode=sample`: continue prompts with the newest checkpoint of a run (or init_params_from).

Prompts are encoded with the run's tokenizer (bytes for the built-in corpus), right-padded into
one batch (rows padded up to a multiple of the data-parallel size), prefilled into a key/value
cache and continued one token per step in one compiled loop (inference/generate.py), on the
config's mesh: batch rows over data x fsdp, heads and vocabulary over tensor.
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
from jaxfrontier.inference import generate as gen
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import text


@dataclasses.dataclass(frozen=True)
class Result:
    prompts: list[str]
    tokens: list[list[int]]  # the new tokens of each prompt
    texts: list[str]
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
    for prompt, ids in zip(prompts, encoded):
        if not ids:
            raise UserError(f'prompt {prompt!r} encodes to no tokens. Fix: give a non-empty prompt.')
        if len(ids) + max_new - 1 > seq_len:
            raise UserError(f'prompt of {len(ids)} tokens + --max_new_tokens={max_new} exceeds the model\'s '
                            f'{seq_len} positions (model.seq_len). Fix: shorten the prompt or lower '
                            f'--max_new_tokens to {max(1, seq_len + 1 - len(ids))}.')
    return encoded


def batch_prompts(encoded: list[list[int]], rows_multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts [B, P] and lengths [B]; B rounded up to a multiple (extra rows repeat the first)."""
    b = -(-len(encoded) // rows_multiple) * rows_multiple
    rows = encoded + [encoded[0]] * (b - len(encoded))
    p = max(len(r) for r in rows)
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


def sample(c: ml_collections.ConfigDict, workdir: str, prompts: list[str], *, max_new: int, rule: gen.Sampling,
           seed: int) -> Result:
    """Continues each prompt by `max_new` tokens; see the module docstring."""
    loaded = load_lib.load(c, workdir)
    c = loaded.config
    check_rule(rule, c.model.vocab_size)
    codec = text.run_codec(loaded.run_config.get('data', {}), c.model.vocab_size, loaded.hf_dir)
    encoded = encode_prompts(codec, prompts, max_new, c.model.seq_len)
    prompt_bp, lengths_b = batch_prompts(encoded, config_lib.data_parallel_size(c))
    layout = loaded.layout
    rows = NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules, 1))
    run = gen.make_generate(layout.model_def, max_new=max_new, rule=rule)
    with jax.set_mesh(layout.mesh), mesh_lib.use_rules(layout.rules):
        args = (loaded.params, jax.device_put(prompt_bp, NamedSharding(layout.mesh, mesh_lib.batch_spec(layout.rules))),
                jax.device_put(lengths_b, rows), jax.device_put(jax.random.key(seed), NamedSharding(layout.mesh, P())))
        t0 = time.perf_counter()
        compiled = run.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out_bn = np.asarray(jax.block_until_ready(compiled(*args)))
        seconds = time.perf_counter() - t0
    tokens = [out_bn[i].tolist() for i in range(len(prompts))]
    return Result(list(prompts), tokens, [codec.decode(t) for t in tokens],
                  len(prompts) * max_new / max(seconds, 1e-9), compile_s, loaded.source)


def report(result: Result) -> str:
    """What --mode=sample prints: each prompt and its continuation, then one JSON line of numbers."""
    lines = []
    for prompt, continuation in zip(result.prompts, result.texts):
        lines += [f'--- prompt: {prompt!r}', prompt + continuation]
    summary = {'tokens': result.tokens, 'tokens_per_s': round(result.tokens_per_s, 1),
               'compile_s': round(result.compile_s, 2), 'source': result.source}
    lines.append(f'sample: {json.dumps(summary)}')
    return '\n'.join(lines)


def read_prompts(prompt: str, prompt_file: str) -> list[str]:
    """--prompt, or the non-empty lines of --prompt_file."""
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
    try:
        prompt.encode('utf-8')  # bytes that are not UTF-8 reach argv as lone surrogates
    except UnicodeEncodeError:
        raise UserError(f'--prompt={prompt!r} is not UTF-8 text. Fix: pass the prompt as UTF-8, or write it to a '
                        'UTF-8 file and pass --prompt_file=FILE.') from None
    return [prompt] if prompt else []
