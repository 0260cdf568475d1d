"""Fuzz: token files (header JSON + .bin) through data.token_files.open_token_file (docs/data.md)."""

import json
import os
import tempfile

import numpy as np
from hypothesis import strategies as st

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier.data import token_files as data_lib

HEADER = {'format': data_lib.FORMAT, 'version': data_lib.VERSION, 'dtype': 'uint16', 'num_tokens': 40,
          'vocab_size': 256, 'tokenizer': 'x.tokenizer.json', 'eot_token': '<|endoftext|>', 'eot_id': 0}
TOKENS = (np.arange(40) * 7 % 256).astype(np.uint16)

headers = st.one_of(
    mutated_dict(HEADER).map(lambda h: json.dumps(h, allow_nan=True).encode()),
    mutated_bytes(json.dumps(HEADER).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.just(b'[' * 100_000),  # nesting deeper than json's recursion limit
)
bins = st.one_of(st.just(TOKENS.tobytes()), mutated_bytes(TOKENS.tobytes()), st.binary(max_size=200))
cases = st.tuples(headers, bins, st.integers(0, 70_000), st.one_of(st.none(), st.integers(0, 64)))


def check(case):
    header, data, vocab, seq_len = case
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, 'f.json'), 'wb') as f:
            f.write(header)
        with open(os.path.join(d, 'f.bin'), 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: data_lib.open_token_file(os.path.join(d, 'f.bin'), vocab, seq_len=seq_len))
        assert snapshot(d) == before
        if isinstance(out, data_lib.TokenFile):  # a correct result: what the header promised, below the vocabulary
            assert out.num_tokens == out.header['num_tokens'] == len(out.tokens)
            assert len(data) == out.num_tokens * np.dtype(out.tokens.dtype).itemsize
            assert not len(out.tokens) or int(np.max(out.tokens)) < vocab
            assert seq_len is None or out.num_tokens >= seq_len + 1
            del out


@tiers()
def test_token_file(budget):
    fuzz('token file (header + .bin)', cases, check, budget,
         examples=[(b'[' * 100_000, TOKENS.tobytes(), 256, None),
                   (json.dumps(HEADER | {'dtype': []}).encode(), TOKENS.tobytes(), 256, None)])


MASK = (np.arange(40) % 3 == 0).astype(np.uint8)
MASKED_HEADER = HEADER | {'loss_mask': 'f.mask.bin'}
masked_headers = st.one_of(mutated_dict(MASKED_HEADER, ['loss_mask', 'num_tokens']).map(
    lambda h: json.dumps(h, allow_nan=True).encode()), st.just(json.dumps(MASKED_HEADER).encode()))
masks = st.one_of(st.just(MASK.tobytes()), mutated_bytes(MASK.tobytes()), st.binary(max_size=60), st.none())


def check_masked(case):
    header, data, mask = case
    with tempfile.TemporaryDirectory() as d:
        for name, content in (('f.json', header), ('f.bin', data), ('f.mask.bin', mask)):
            if content is not None:
                with open(os.path.join(d, name), 'wb') as f:
                    f.write(content)
        before = snapshot(d)
        out = user_error_or(lambda: data_lib.open_token_file(os.path.join(d, 'f.bin'), 256))
        assert snapshot(d) == before
        if isinstance(out, data_lib.TokenFile) and out.mask is not None:  # one 0 or 1 per token
            assert len(out.mask) == out.num_tokens and set(np.unique(out.mask)) <= {0, 1}
            del out


@tiers()
def test_token_file_with_a_loss_mask(budget):
    fuzz('token file with a loss mask (header + .bin + .mask.bin)', st.tuples(masked_headers, bins, masks),
         check_masked, budget)


# Every file a header names (data_lib.NAMED_FILES) must be a plain file beside the .bin (issue 48: a header's
# "tokenizer": "/abs/secret" was accepted and an HF export copied the file). Outside the data directory lies a
# secret that would pass as a mask (40 bytes of 0/1), reached by a path, by '..' or by a link.
PLACES = ['SECRET', '../secret', 'link', 'inner', 'fifo', 'sub/f.mask.bin', 'f.mask.bin', 'x.tokenizer.json', 'f.bin',
          '.', '..', '', '/', './f.mask.bin', 'f.mask.bin/', 'f.mask.bin\\..\\..\\secret', 'f.mask.bin\x00',
          'f.mask.bin\n', '\u202ef.mask.bin', 'C:\\secret']
named_values = st.one_of(
    st.sampled_from(PLACES), json_values,
    st.text(st.one_of(st.characters(categories=['Cc', 'Cf', 'Zl', 'Zp', 'Zs']), st.sampled_from('./\\~')),
            max_size=8),
    st.tuples(st.sampled_from(['', '.', '..', '~', 'SECRET']), st.sampled_from(['/', '//', '\\']), st.text(max_size=6))
    .map(''.join))
named_cases = st.tuples(st.sampled_from(sorted(data_lib.NAMED_FILES)), named_values, st.booleans())


def check_named_file(case):
    field, value, masked = case
    with tempfile.TemporaryDirectory() as root:
        d = os.path.join(root, 'data')
        os.makedirs(os.path.join(d, 'sub'))
        with open(os.path.join(root, 'secret'), 'wb') as f:
            f.write(MASK.tobytes())
        for name, content in (('f.bin', TOKENS.tobytes()), ('f.mask.bin', MASK.tobytes()),
                              ('sub/f.mask.bin', MASK.tobytes()), ('x.tokenizer.json', b'{}')):
            with open(os.path.join(d, name), 'wb') as f:
                f.write(content)
        os.symlink(os.path.join(root, 'secret'), os.path.join(d, 'link'))
        os.symlink('f.mask.bin', os.path.join(d, 'inner'))
        os.mkfifo(os.path.join(d, 'fifo'))  # a reader that opened it would hang
        value = value.replace('SECRET', os.path.join(root, 'secret')) if isinstance(value, str) else value
        header = HEADER | ({'loss_mask': 'f.mask.bin'} if masked else {}) | {field: value}
        with open(os.path.join(d, 'f.json'), 'w') as f:
            json.dump(header, f, allow_nan=True)
        before = snapshot(root)
        out = user_error_or(lambda: data_lib.open_token_file(os.path.join(d, 'f.bin'), 256))
        assert snapshot(root) == before
        if isinstance(out, data_lib.TokenFile):  # a correct result: every named file lies in the data directory
            for key in data_lib.NAMED_FILES:
                if out.header.get(key) is not None:
                    named = os.path.join(d, out.header[key])
                    assert os.path.dirname(named) == d and os.path.dirname(os.path.realpath(named)) == d, (key, named)
            tokenizer = data_lib.tokenizer_path(out)
            assert tokenizer is None or os.path.dirname(tokenizer) == d
            assert (out.mask is None) == (header.get('loss_mask') is None)
            del out


@tiers()
def test_token_file_names_only_files_beside_it(budget):
    fuzz('token file header naming files (tokenizer, loss_mask)', named_cases, check_named_file, budget,
         examples=[(field, place, masked) for field in sorted(data_lib.NAMED_FILES)
                   for place in ('SECRET', '../secret', 'link', 'fifo', 'inner') for masked in (False,)])
