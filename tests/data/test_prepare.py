"""Tests of `python -m jaxfrontier.prepare`: corpus in, token file out, decoded back to the corpus.

Run through the command line where a user meets it (formats, workers, bad input, a kill), and
in-process where a failure has to be injected mid-way.
"""

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from jaxfrontier.data import corpus
from jaxfrontier.data import token_files
from jaxfrontier.data import encode as tokenize_lib
from jaxfrontier.errors import ConfigError, FlagError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EOT = '<|endoftext|>'
SPECIAL = ['héllo wörld — ünïcode ✓ 🚀\n\n  indented\ttab\n', 'a document that mentions <|endoftext|> literally',
           ' leading space', 'x']


def _documents(num_files=40):
    """Deterministic documents: some stdlib sources, then a few edge cases (unicode, a literal EOT)."""
    stdlib = sysconfig.get_paths()['stdlib']
    names = sorted(n for n in os.listdir(stdlib) if n.endswith('.py'))[:num_files]
    docs = []
    for name in names:
        with open(os.path.join(stdlib, name), encoding='utf-8') as f:
            docs.append(f.read()[:6000])
    return docs + SPECIAL


def _write(tmp_path, kind, docs, field='text'):
    """Writes docs as one corpus of `kind`; returns the --input value."""
    if kind == 'txt':
        folder = tmp_path / 'txt'
        folder.mkdir()
        for i, doc in enumerate(docs):
            (folder / f'doc{i:03d}.txt').write_bytes(doc.encode())
        return str(folder / '*.txt')
    if kind == 'jsonl':
        path = tmp_path / 'c.jsonl'
        path.write_text(''.join(json.dumps({field: d, 'id': i}) + '\n' for i, d in enumerate(docs)))
        return str(path)
    path = tmp_path / 'c.parquet'
    pq.write_table(pa.table({field: docs, 'id': list(range(len(docs)))}), path, row_group_size=7)
    return str(path)


def _prepare(*args, check=True):
    """Runs `python -m jaxfrontier.prepare args`; returns the CompletedProcess."""
    env = {**os.environ, 'PYTHONPATH': REPO}
    done = subprocess.run([sys.executable, '-m', 'jaxfrontier.prepare', *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def _decoded_documents(bin_path):
    """The documents of a prepared token file, decoded with the tokenizer its header names."""
    header = json.load(open(token_files.token_paths(bin_path)[1]))
    token_file = token_files.open_token_file(bin_path, header['vocab_size'])
    tokenizer = Tokenizer.from_file(token_files.tokenizer_path(token_file))
    tokens = np.asarray(token_file.tokens)
    assert tokens[-1] == header['eot_id'], 'every document, the last included, ends with end-of-text'
    cuts = np.flatnonzero(tokens == header['eot_id'])
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tokenizer.decode(tokens[s:e].tolist(), skip_special_tokens=False) for s, e in zip(starts, cuts)]


@pytest.mark.parametrize('kind', ['txt', 'jsonl', 'parquet'])
def test_round_trip_with_trained_tokenizer(tmp_path, kind):
    docs = _documents()
    field = 'text' if kind == 'txt' else 'body'
    _prepare(f'--input={_write(tmp_path, kind, docs, field)}', f'--output={tmp_path}/out/c',
             '--train_tokenizer=600', f'--text_field={field}')
    header = json.load(open(tmp_path / 'out' / 'c.json'))
    assert header['tokenizer'] == 'c.tokenizer.json' and header['eot_token'] == EOT
    assert header['dtype'] == 'uint16' and header['vocab_size'] == 600
    assert header['num_documents'] == len(docs)
    assert _decoded_documents(tmp_path / 'out' / 'c.bin') == docs
    assert sorted(os.listdir(tmp_path / 'out')) == ['c.bin', 'c.json', 'c.tokenizer.json']  # no temporaries


def test_workers_give_identical_bytes(tmp_path):
    source = _write(tmp_path, 'jsonl', _documents())
    _prepare(f'--input={source}', f'--output={tmp_path}/a', '--train_tokenizer=500', '--batch_mb=0.01')
    outputs = []
    for workers in (1, 2):
        _prepare(f'--input={source}', f'--output={tmp_path}/w{workers}', f'--tokenizer={tmp_path}/a.tokenizer.json',
                 f'--workers={workers}', '--batch_mb=0.01')  # 0.01 MB: many batches, several in flight
        outputs.append((tmp_path / f'w{workers}.bin').read_bytes())
    assert outputs[0] == outputs[1] == (tmp_path / 'a.bin').read_bytes()


def test_tokenizer_directory_eot_token_and_uint32(tmp_path):
    """--tokenizer=DIR reads DIR/tokenizer.json; a vocabulary over 65536 gives uint32 tokens."""
    from tokenizers import models, pre_tokenizers  # pylint: disable=g-import-not-at-top
    vocab = {'[UNK]': 0, '</s>': 1, **{f'w{i}': i for i in range(2, 70_000)}, 'x': 70_000}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='[UNK]'))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / 'tok').mkdir()
    tokenizer.save(str(tmp_path / 'tok' / 'tokenizer.json'))
    source = _write(tmp_path, 'jsonl', ['w5 w69999 x', 'x w2'])
    _prepare(f'--input={source}', f'--output={tmp_path}/o', f'--tokenizer={tmp_path}/tok')
    header = json.load(open(tmp_path / 'o.json'))
    assert header['dtype'] == 'uint32' and header['vocab_size'] == 70_001 and header['eot_token'] == '</s>'
    tokens = token_files.open_token_file(tmp_path / 'o.bin', 70_001).tokens
    np.testing.assert_array_equal(tokens, [5, 69_999, 70_000, 1, 70_000, 2, 1])


def test_large_text_file_streams_in_pieces(tmp_path, monkeypatch):
    """A .txt larger than a piece is cut after line ends (or anywhere in a long line), never in a character."""
    monkeypatch.setattr(corpus, 'PIECE_BYTES', 64)
    text = 'ab\n' * 50 + 'é' * 200 + '\nend'  # a 400-byte line of 2-byte characters
    (tmp_path / 'big.txt').write_bytes(text.encode())
    pieces = list(corpus.read_pieces([str(tmp_path / 'big.txt')], 'text'))
    assert len(pieces) > 4 and ''.join(p.text for p in pieces) == text
    assert [p.end_of_document for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert sum(p.num_bytes for p in pieces) == len(text.encode())
    assert all(p.text.endswith('\n') for p in pieces[:3])


def test_dtype_for_vocab():
    assert tokenize_lib.dtype_for_vocab(65536) == 'uint16'
    assert tokenize_lib.dtype_for_vocab(65537) == 'uint32'
    assert tokenize_lib.dtype_for_vocab(1 << 32) == 'uint32'
    with pytest.raises(FlagError, match='does not fit uint32'):
        tokenize_lib.dtype_for_vocab((1 << 32) + 1)


def test_files_without_a_tokenizer_still_load(tmp_path):
    path = token_files.write_token_file(tmp_path / 'old.bin', np.arange(100), 256)
    assert token_files.tokenizer_path(token_files.open_token_file(path, 256)) is None


# --------------------------------------------------------------------------- bad input


def _bad_tokenizer_json(tmp_path):
    (tmp_path / 'bad.json').write_text('{"model": {"type": "BPE", "vocab": 3}}')
    return str(tmp_path / 'bad.json')


def _huge_vocab(tmp_path):
    tokenizer, _ = tokenize_lib.train_tokenizer(iter(SPECIAL), 300)
    parsed = json.loads(tokenizer.to_str())
    parsed['added_tokens'].append({**parsed['added_tokens'][0], 'id': 1 << 32, 'content': '<huge>'})
    (tmp_path / 'huge.json').write_text(json.dumps(parsed))
    return str(tmp_path / 'huge.json')


BAD_INPUTS = {  # name: (extra arguments given tmp_path and a good jsonl corpus, words in the message)
    'missing file': (lambda t, c: [f'--input={t}/nope.jsonl'], ['no such file']),
    'glob matches nothing': (lambda t, c: [f'--input={t}/*.parquet'], ['matches no file']),
    'empty corpus': (lambda t, c: [f'--input={_empty(t)}'], ['corpus is empty']),
    'only empty documents': (lambda t, c: [f'--input={_empty_docs(t)}', '--tokenizer=' + _good_tokenizer(t)],
                             ['corpus is empty']),
    'jsonl field missing': (lambda t, c: [f'--input={c}', '--text_field=content'], ["no field 'content'", "'text'"]),
    'parquet column missing': (lambda t, c: [f'--input={_write(t, "parquet", SPECIAL)}', '--text_field=body'],
                               ["no column 'body'"]),
    'tokenizer missing': (lambda t, c: [f'--input={c}', f'--tokenizer={t}/none.json'], ['cannot read']),
    'tokenizer unreadable': (lambda t, c: [f'--input={c}', f'--tokenizer={_bad_tokenizer_json(t)}'],
                             ['not a tokenizer.json']),
    'vocabulary over uint32': (lambda t, c: [f'--input={c}', f'--tokenizer={_huge_vocab(t)}'], ['does not fit uint32']),
    'no end-of-text token': (lambda t, c: [f'--input={c}', '--tokenizer=' + _good_tokenizer(t), '--eot_token=<eos>'],
                             ["no token '<eos>'"]),
    'output not writable': (lambda t, c: [f'--input={c}', f'--output={_a_file(t)}/sub/x'], ['cannot write']),
    'flag not a number': (lambda t, c: [f'--input={c}', '--workers=many'], ['--workers', 'many']),
    'two tokenizers': (lambda t, c: [f'--input={c}', '--tokenizer=' + _good_tokenizer(t), '--train_tokenizer=300'],
                       ['exactly one']),
}


def _empty(t):
    (t / 'empty.txt').write_text('')
    return str(t / 'empty.txt')


def _empty_docs(t):
    (t / 'blank.jsonl').write_text('{"text": ""}\n\n{"text": ""}\n')
    return str(t / 'blank.jsonl')


def _good_tokenizer(t):
    tokenizer, text = tokenize_lib.train_tokenizer(iter(SPECIAL), 300)
    (t / 'good.json').write_text(text)
    return str(t / 'good.json')


def _a_file(t):
    (t / 'a_file').write_text('not a directory')
    return str(t / 'a_file')


@pytest.mark.parametrize('name', list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(tmp_path, name):
    make_args, words = BAD_INPUTS[name]
    good_corpus = _write(tmp_path, 'jsonl', SPECIAL)
    args = make_args(tmp_path, good_corpus)
    if not any(a.startswith('--output') for a in args):
        args.append(f'--output={tmp_path}/out/x')
    if not any(a.startswith(('--tokenizer', '--train_tokenizer')) for a in args):
        args.append('--train_tokenizer=300')
    done = _prepare(*args, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith('error: ') and 'Fix:' in lines[0], done.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not os.path.exists(tmp_path / 'out') or os.listdir(tmp_path / 'out') == []


# --------------------------------------------------------------------------- crashes


def test_failure_mid_way_keeps_the_old_output_and_leaves_no_temporaries(tmp_path, monkeypatch):
    source = _write(tmp_path, 'jsonl', _documents())
    out = str(tmp_path / 'out' / 'c')
    tokenize_lib.prepare([source], out, train_vocab=400, batch_bytes=10_000)
    before = {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')}
    real_batches = corpus.batches

    def failing_batches(pieces, batch_bytes):
        for i, batch in enumerate(real_batches(pieces, batch_bytes)):
            if i == 3:
                raise RuntimeError('disk full')
            yield batch

    monkeypatch.setattr(corpus, 'batches', failing_batches)
    with pytest.raises(RuntimeError, match='disk full'):
        tokenize_lib.prepare([source], out, train_vocab=500, batch_bytes=10_000)
    assert {n: (tmp_path / 'out' / n).read_bytes() for n in os.listdir(tmp_path / 'out')} == before
    with pytest.raises(RuntimeError, match='disk full'):
        tokenize_lib.prepare([source], str(tmp_path / 'new' / 'c'), train_vocab=500, batch_bytes=10_000)
    assert os.listdir(tmp_path / 'new') == []


def test_killed_run_leaves_nothing_that_looks_complete_and_a_rerun_cleans_up(tmp_path):
    source = _write(tmp_path, 'jsonl', _documents(200) * 3)
    out = tmp_path / 'out'
    args = [sys.executable, '-m', 'jaxfrontier.prepare', f'--input={source}', f'--output={out}/c',
            '--train_tokenizer=2000']
    child = subprocess.Popen(args, cwd=REPO, env={**os.environ, 'PYTHONPATH': REPO},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out.exists() and os.listdir(out)) and time.monotonic() < deadline:
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)  # mid-way: the temporary .bin exists, training is under way
    child.wait()
    left = os.listdir(out)
    assert left == [f'c.bin.tmp-{child.pid}'], left  # no header, no .bin: nothing loads
    with pytest.raises(ConfigError, match='does not exist'):
        token_files.open_token_file(out / 'c.bin', 2000)
    _prepare(f'--input={source}', f'--output={out}/c', '--tokenizer=' + _good_tokenizer(tmp_path))
    assert sorted(os.listdir(out)) == ['c.bin', 'c.json', 'c.tokenizer.json']  # the stale temporary is gone


# --------------------------------------------------------------------------- training on it


@pytest.mark.slow
def test_prepared_file_trains(tmp_path):
    source = _write(tmp_path, 'txt', _documents())
    _prepare(f'--input={source}', f'--output={tmp_path}/c', '--train_tokenizer=512')
    env = {**os.environ, 'PYTHONPATH': REPO}
    done = subprocess.run(
        [sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', f'--workdir={tmp_path}/w',
         '--config.data.kind=tokens', f'--config.data.path={tmp_path}/c.bin', '--config.model.vocab_size=512',
         '--config.train.steps=2', '--config.train.eval_every=2', '--config.train.eval_batches=1'],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
