"""Sampling controls: repetition penalty (against transformers), stop strings, end-of-text, several prompts.

The CLI tests run `--mode=sample` on random parameters written as our safetensors (read through
checkpoint.init_params_from): weights scaled up so greedy choices are far from ties, and the
embedding rows of every token outside printable ASCII zeroed (tied head: their logits are 0,
below the largest of the others), so the continuations are text a stop string can be cut from.
"""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxfrontier import config as config_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.errors import UserError
from jaxfrontier.inference import generate as gen
from jaxfrontier.inference import sample
from jaxfrontier.inference import stops
from jaxfrontier.model.params import ModelDef
import processes
from test_inference import FAMILIES, SHAPE, prompts, sharp_params, small_config

PROMPTS = ['Hello', 'ab', 'The quick fox']
MAX_NEW = 24
PRINTABLE = range(32, 127)


@pytest.mark.parametrize('penalty', [1.3, 0.7])
def test_repetition_penalty_equals_transformers(penalty):
    torch = pytest.importorskip('torch')
    processors = pytest.importorskip('transformers.generation.logits_process')
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 37)).astype(np.float32) * 4
    ids = rng.integers(0, 37, size=(3, 9))
    expected = processors.RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor(ids), torch.tensor(logits)).numpy()
    seen = gen.seen_tokens(jnp.asarray(ids, jnp.int32), jnp.full((3,), 9), 37)
    np.testing.assert_array_equal(np.asarray(gen.penalise(jnp.asarray(logits), seen, penalty)), expected)
    # prompt padding (positions >= a row's length) counts as no token
    short = gen.seen_tokens(jnp.asarray(ids, jnp.int32), jnp.array([9, 4, 1]), 37)
    assert np.asarray(short).sum(1).tolist() == [len(set(ids[0])), len(set(ids[1, :4])), 1]


@pytest.mark.slow  # a model compile (~10 s); the processor itself is checked exactly in the fast tier
def test_greedy_repetition_penalty_as_transformers_defines_it():
    """Each greedy token with the penalty is the argmax of the full model's logits after HF's processor."""
    torch = pytest.importorskip('torch')
    processors = pytest.importorskip('transformers.generation.logits_process')
    c = small_config()
    model_def, params = ModelDef.create(config_lib.model_shape(c)), sharp_params(c)
    prompt_bp, lengths_b = prompts()
    rule = gen.Sampling(0.0, repetition_penalty=1.8)
    got = np.asarray(gen.make_generate(model_def, max_new=8, rule=rule)(params, prompt_bp, lengths_b, jax.random.key(0)))
    plain = np.asarray(gen.make_generate(model_def, max_new=8, rule=gen.Sampling(0.0))(
        params, prompt_bp, lengths_b, jax.random.key(0)))
    assert (got != plain).any()  # the penalty changed the continuation
    forward = jax.jit(lambda p, t: model_def.bind(p)(t))
    real = config_lib.model_shape(c).real_vocab_size
    for r in range(len(lengths_b)):
        history = list(np.asarray(prompt_bp[r, :lengths_b[r]]))
        for n in range(8):
            seq = np.zeros((1, SHAPE['seq_len']), np.int32)
            seq[0, :len(history)] = history
            logits = np.asarray(forward(params, seq))[0, len(history) - 1, :real]
            penalty = processors.RepetitionPenaltyLogitsProcessor(1.8)
            processed = penalty(torch.tensor([history]), torch.tensor(logits[None]))
            assert got[r, n] == int(processed.argmax()), (r, n)
            history.append(int(got[r, n]))


class Pieces:
    """A codec whose tokens are multi-character pieces, so a stop string can span or split tokens."""

    PIECES = ['he', 'llo', ' wo', 'r', 'ld', '\n', '\n\n', '!']

    def decode(self, tokens):
        return ''.join(self.PIECES[t] for t in tokens)


def test_stop_strings_are_matched_in_the_text_whatever_the_tokens():
    codec = Pieces()
    # 'lo w' spans three tokens; the text is cut before it, the tokens run through the one completing it
    assert stops.ending(codec, [0, 1, 2, 3, 4], ['lo w'], ()) == stops.Ending([0, 1, 2], 'hel', 'stop')
    # '\n\n' as one token or as two: the same stop
    assert stops.ending(codec, [0, 6, 1], ['\n\n'], ()) == stops.Ending([0, 6], 'he', 'stop')
    assert stops.ending(codec, [0, 5, 5, 1], ['\n\n'], ()) == stops.Ending([0, 5, 5], 'he', 'stop')
    # the stop completed first wins; end-of-text (7 here) ends a row and is not part of its text
    assert stops.ending(codec, [0, 1, 2, 3, 4], ['world', 'r'], ()).text == 'hello wo'
    assert stops.ending(codec, [0, 1, 7, 2, 3], ['world'], (7,)) == stops.Ending([0, 1], 'hello', 'eot')
    assert stops.ending(codec, [0, 1, 2], ['x'], (3, 7)) == stops.Ending([0, 1, 2], 'hello wo', 'length')
    assert stops.has_stopped(codec, [0, 1, 2], ['o w'], ()) and not stops.has_stopped(codec, [0, 1], ['o w'], ())
    with pytest.raises(UserError, match='--stop=""'):
        stops.check_stops(['ok', ''])


@pytest.mark.slow  # a decode compile; the fast tier decodes in test_inference's kv-cache check and matches stops here
def test_end_of_text_ends_a_row_and_the_loop():
    c = small_config()
    model_def, params = ModelDef.create(config_lib.model_shape(c)), sharp_params(c)
    prompt_bp, lengths_b = prompts()
    key = jax.random.key(0)
    plain = np.asarray(gen.make_generate(model_def, max_new=10, rule=gen.Sampling(0.0))(params, prompt_bp,
                                                                                        lengths_b, key))
    eot = int(plain[0, 3])
    got = np.asarray(gen.make_generate(model_def, max_new=10, rule=gen.Sampling(0.0, eot_ids=(eot,)))(
        params, prompt_bp, lengths_b, key))
    for r in range(3):
        n = list(plain[r]).index(eot) + 1 if eot in plain[r] else 10
        np.testing.assert_array_equal(got[r, :n], plain[r, :n])  # identical up to and including its end
    # rows 0 and 2 need no output (batch padding), row 1 ends at its first token: no step after is run
    start, advance = gen.make_chunked(model_def, max_new=10, rule=gen.Sampling(0.0, eot_ids=(int(plain[1, 0]),)))
    st = start(params, prompt_bp, lengths_b, jnp.array([True, False, True]), key)
    st = advance(params, st, lengths_b, key, jnp.int32(10))
    assert int(st['i']) == 1 and not np.asarray(st['out'])[:, 1:].any()


def test_prompt_flags_errors():
    assert sample.read_prompts(['a', 'b'], '') == ['a', 'b']
    with pytest.raises(UserError, match='both --prompt'):
        sample.read_prompts(['a'], 'prompts.txt')
    codec = type('C', (), {'encode': staticmethod(lambda s: [1] * len(s))})()
    with pytest.raises(UserError, match='no prompt'):
        sample.encode_prompts(codec, [], max_new=4, seq_len=40)
    with pytest.raises(UserError, match='prompt 2 of 38 tokens'):
        sample.encode_prompts(codec, ['ok', 'x' * 38], max_new=4, seq_len=40)
    with pytest.raises(UserError, match='--repetition_penalty=0.0'):
        sample.check_rule(gen.Sampling(repetition_penalty=0.0), 259)


# --------------------------------------------------------------------------- through the CLI


def cli_config(family):
    """configs/tiny.py (data 2 x fsdp 2 x tensor 2) with this file's model, and the flags that make it."""
    overrides = {**SHAPE, **FAMILIES[family], 'attention': 'reference'}
    from configs import tiny  # pylint: disable=import-outside-toplevel
    c = tiny.get_config()
    c.model.update(**overrides)
    return c, [f'--config.model.{k}={v}' for k, v in overrides.items()]


@functools.cache
def printable_params(family, path):
    c, _ = cli_config(family)
    names = {n: np.asarray(a, np.float32) for n, a in readers.flatten_names(sharp_params(c)).items()}
    keep = np.zeros(names['wte'].shape[0], bool)
    keep[list(PRINTABLE)] = True
    names['wte'] = names['wte'] * keep[:, None]
    save_file(names, path)
    return path


def run_sample(family, tmp_path, *flags):
    _, model_flags = cli_config(family)
    params = printable_params(family, str(tmp_path.parent / f'{family}.safetensors'))
    proc = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', *model_flags,
                           '--mode=sample', f'--workdir={tmp_path / "none"}', f'--config.checkpoint.init_params_from={params}',
                           f'--max_new_tokens={MAX_NEW}', '--temperature=0', *[f'--prompt={p}' for p in PROMPTS],
                           *flags], cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line for line in lines if line.startswith('--- prompt:')] == [f'--- prompt: {p!r}' for p in PROMPTS]
    return json.loads(lines[-1][len('sample: '):]), params


def earliest_end(text, candidates):
    """The expected cut, computed directly: the stop completed first, the text before where it starts."""
    ends = [text.find(s) + len(s) for s in candidates if s in text]
    if not ends:
        return None
    kept = text[:min(ends)]
    return min(ends), kept[:min(kept.find(s) for s in candidates if s in kept)]


@pytest.mark.slow
@pytest.mark.parametrize('family', FAMILIES)
def test_cli_prompts_stops_and_penalty(family, tmp_path):
    """Three --prompt flags are one batch equal to each prompt alone; --stop cuts; the penalty is HF's."""
    base, params = run_sample(family, tmp_path)
    texts = base['texts']
    assert all(len(t) == MAX_NEW and set(map(ord, t)) <= set(PRINTABLE) for t in texts), texts
    assert base['finish'] == ['length'] * 3 and len(set(texts)) == 3

    c, _ = cli_config(family)
    c.checkpoint.init_params_from = params
    for p, tokens in zip(PROMPTS, base['tokens']):  # greedy: the batch changes nothing
        alone = sample.sample(c, str(tmp_path / 'none'), [p], max_new=MAX_NEW, rule=gen.Sampling(0.0), seed=0)
        assert alone.tokens == [tokens]

    # a stop string for each of the first two rows, absent from the third's text
    chosen = [next(t[i:i + 2] for i in range(4, MAX_NEW - 2) if t[i:i + 2] not in texts[2]) for t in texts[:2]]
    stopped, _ = run_sample(family, tmp_path, *[f'--stop={s}' for s in chosen])
    for r, text in enumerate(texts):
        expected = earliest_end(text, chosen)
        if expected is None:
            assert (stopped['texts'][r], stopped['finish'][r], stopped['tokens'][r]) == (text, 'length', base['tokens'][r])
        else:
            n, cut = expected
            assert (stopped['texts'][r], stopped['finish'][r]) == (cut, 'stop')
            assert stopped['tokens'][r] == base['tokens'][r][:n]  # one byte a token
    assert stopped['finish'][:2] == ['stop', 'stop'] and stopped['finish'][2] == 'length'

    penalised, _ = run_sample(family, tmp_path, '--repetition_penalty=1.5')
    assert penalised['tokens'] != base['tokens']
    rule = gen.Sampling(0.0, repetition_penalty=1.5)
    assert sample.sample(c, str(tmp_path / 'none'), PROMPTS, max_new=MAX_NEW, rule=rule, seed=0).tokens == \
        penalised['tokens']


@pytest.mark.slow  # two decode compiles (~9 s)
def test_chunked_decoding_draws_the_same_tokens(tmp_path):
    """Sampling (not greedy) with a stop string that never matches decodes in chunks of 16: same tokens."""
    c, _ = cli_config('gpt')
    c.checkpoint.init_params_from = printable_params('gpt', str(tmp_path.parent / 'gpt.safetensors'))
    rule = gen.Sampling(0.9, top_k=20)
    whole = sample.sample(c, str(tmp_path / 'none'), PROMPTS, max_new=MAX_NEW, rule=rule, seed=4)
    chunked = sample.sample(c, str(tmp_path / 'none'), PROMPTS, max_new=MAX_NEW, rule=rule, seed=4, stops=('\x00',))
    assert chunked.tokens == whole.tokens and chunked.finish == ['length'] * 3
    assert stops.CHECK_EVERY < MAX_NEW  # so the second run really went in two chunks


def test_end_of_text_ids_of_a_hugging_face_directory(tmp_path):
    from jaxfrontier.inference import text  # pylint: disable=import-outside-toplevel
    (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': 2}))
    assert text.hf_eos_ids(str(tmp_path)) == (2,)
    (tmp_path / 'generation_config.json').write_text(json.dumps({'eos_token_id': [128001, 128009]}))
    assert text.hf_eos_ids(str(tmp_path)) == (128001, 128009)  # generation_config.json first, as transformers
    (tmp_path / 'generation_config.json').write_text('[not an object')
    (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': None}))
    assert text.hf_eos_ids(str(tmp_path)) == ()
