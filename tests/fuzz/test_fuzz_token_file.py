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
