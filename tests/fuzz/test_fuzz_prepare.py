"""Fuzz: prepare's inputs: corpus files (.txt, .jsonl, .parquet), tokenizer.json files, and a whole
prepare run (nothing but NAME.bin, NAME.json and NAME.tokenizer.json written in the output's directory)."""

import io
import json
import os
import tempfile

from hypothesis import strategies as st

from fuzzing import fuzz, json_values, mutated_bytes, mutated_dict, snapshot, tiers, user_error_or
from jaxfrontier.data import corpus, documents
from jaxfrontier.data import token_files as data_lib
from jaxfrontier.data import encode


def _parquet() -> bytes:
    import pyarrow as pa  # pylint: disable=import-outside-toplevel
    import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
    out = io.BytesIO()
    pq.write_table(pa.table({'text': ['one doc', 'another one', ''], 'n': [1, 2, 3]}), out)
    return out.getvalue()


PARQUET = _parquet()
JSONL = b'{"text": "hello"}\n{"text": "world", "id": 2}\n'
texts = st.one_of(st.text(max_size=200).map(lambda t: t.encode('utf-8', 'surrogatepass')), st.binary(max_size=200))
jsonl = st.one_of(st.lists(st.one_of(mutated_dict({'text': 'doc', 'id': 1}), json_values), max_size=4).map(
    lambda rs: b'\n'.join(json.dumps(r, allow_nan=True).encode() for r in rs)), mutated_bytes(JSONL))
inputs = st.one_of(texts.map(lambda b: ('.txt', b)), jsonl.map(lambda b: ('.jsonl', b)),
                   mutated_bytes(PARQUET).map(lambda b: ('.parquet', b)), st.just(('.parquet', PARQUET)))
fields = st.sampled_from(['text', 'id', 'n', ''])


def check_corpus(case):
    (suffix, data), field = case
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'in' + suffix)
        with open(path, 'wb') as f:
            f.write(data)
        before = snapshot(d)
        out = user_error_or(lambda: list(corpus.read_pieces([path], field)))
        assert snapshot(d) == before
        if isinstance(out, list):  # accepted: text pieces, documents ended
            assert all(isinstance(p.text, str) for p in out)
            assert not out or out[-1].end_of_document


@tiers(fast=120)
def test_corpus_files(budget):
    fuzz('prepare inputs (.txt/.jsonl/.parquet)', st.tuples(inputs, fields), check_corpus, budget, deadline_ms=5000,
         examples=[(('.jsonl', b'[1, 2]\n'), 'text'), (('.jsonl', b'{"text": 5}\n'), 'text'),
                   (('.parquet', PARQUET.replace(b'another one', b'\x9enother one')), 'text'),  # invalid UTF-8
                   (('.parquet', PARQUET[:4] + b'\xea' + PARQUET[5:]), 'text'),  # a damaged page header
                   (('.parquet', PARQUET[:231] + b'\x8b' + PARQUET[232:]), 'text')])  # a schema name not UTF-8


_TOKENIZER, TOKENIZER_JSON = encode.train_tokenizer(iter(['hello world, hello tokens'] * 3), 300)
TOKENIZER = json.loads(TOKENIZER_JSON)
tokenizers = st.one_of(mutated_dict(TOKENIZER).map(lambda t: json.dumps(t, allow_nan=True).encode()),
                       st.sampled_from(['model', 'added_tokens', 'pre_tokenizer', 'decoder']).flatmap(
                           lambda k: json_values.map(lambda v, k=k: json.dumps(TOKENIZER | {k: v}).encode())),
                       mutated_dict(TOKENIZER['model']).map(lambda m: json.dumps(TOKENIZER | {'model': m}).encode()),
                       mutated_bytes(TOKENIZER_JSON.encode()[:2000]), json_values.map(lambda v: json.dumps(v).encode()))


def check_tokenizer(data: bytes):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'tokenizer.json')
        with open(path, 'wb') as f:
            f.write(data)
        out = user_error_or(lambda: encode.load_tokenizer(path))
        if isinstance(out, tuple):  # accepted: it encodes, and the vocabulary fits the token dtype
            tokenizer, _ = out
            tokenizer.encode('hello')
            encode.dtype_for_vocab(encode.vocab_size_of(tokenizer))


@tiers(fast=100, slow=600)
def test_tokenizer_json(budget):
    fuzz('prepare --tokenizer (tokenizer.json)', tokenizers, check_tokenizer, budget, deadline_ms=5000,
         examples=[json.dumps(TOKENIZER | {'model': TOKENIZER['model'] | {  # a Rust panic in tokenizers
             'continuing_subword_prefix': '\xe7p\x15', 'unk_token': '\xe7p\x15'}}).encode()])


def check_prepare(case):
    (suffix, data), field, *split = case  # split: held-out documents (one document cannot be split: issue 48)
    split = split[0] if split else documents.Split()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'in' + suffix)
        with open(path, 'wb') as f:
            f.write(data)
        with open(os.path.join(d, 'tok.json'), 'w') as f:
            f.write(TOKENIZER_JSON)
        os.makedirs(os.path.join(d, 'out'))
        before = snapshot(d)
        out = user_error_or(lambda: encode.prepare([path], os.path.join(d, 'out', 'NAME'),
                                                   tokenizer_path=os.path.join(d, 'tok.json'), text_field=field,
                                                   split=split))
        after = snapshot(d)
        assert {k: v for k, v in after.items() if not k.startswith(os.path.join(d, 'out'))} == before
        written = sorted(os.listdir(os.path.join(d, 'out')))
        if isinstance(out, encode.Result):  # the token file(s), readable, and nothing else
            parts = ['_train', '_val'] if split.splits else ['']
            assert written == sorted([f'NAME{p}.{e}' for p in parts for e in ('bin', 'json')] + ['NAME.tokenizer.json'])
            for part, path in out.bin_paths.items():
                data_lib.open_token_file(path, out.headers[part]['vocab_size'])
        else:
            assert written == [], written


@tiers(fast=60, slow=400)
def test_prepare_run(budget):
    splits = st.sampled_from([documents.Split(), documents.Split(val_documents=1), documents.Split(val_fraction=0.5)])
    fuzz('prepare (whole run)', st.tuples(inputs, fields, splits), check_prepare, budget, deadline_ms=10_000,
         examples=[(('.parquet', PARQUET.replace(b'another one', b'\x9enother one')), 'text'),
                   (('.txt', b'one document'), 'text', documents.Split(val_fraction=0.5))])


# --------------------------------------------------------------------------- prepare --sft: conversations

_CHAT_DIR = tempfile.mkdtemp(prefix='fuzz-chat-tokenizer-')


def _chat_tokenizer() -> str:
    from data.test_prepare_sft import make_tokenizer  # pylint: disable=import-outside-toplevel
    return make_tokenizer(os.path.join(_CHAT_DIR, 'chatml'))


MESSAGE = {'role': 'user', 'content': 'hello world'}
CONVERSATION = {'messages': [MESSAGE, {'role': 'assistant', 'content': 'hi there'}], 'tools': []}
messages = st.lists(st.one_of(mutated_dict(MESSAGE), st.sampled_from([MESSAGE, {'role': 'assistant', 'content': 'ok'}]),
                              json_values), max_size=4)
records = st.one_of(mutated_dict(CONVERSATION), messages.map(lambda m: {'messages': m}),
                    st.tuples(st.one_of(st.text(max_size=20), messages), st.one_of(st.text(max_size=20), messages)).map(
                        lambda pc: {'prompt': pc[0], 'completion': pc[1]}), json_values)
conversation_files = st.one_of(st.lists(records, max_size=4).map(
    lambda rs: b'\n'.join(json.dumps(r, allow_nan=True).encode() for r in rs)),
    mutated_bytes(json.dumps(CONVERSATION).encode() + b'\n'))


def check_prepare_sft(case):
    data, max_tokens = case
    from jaxfrontier.data import sft  # pylint: disable=import-outside-toplevel
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, 'in.jsonl')
        with open(path, 'wb') as f:
            f.write(data)
        os.makedirs(os.path.join(d, 'out'))
        before = snapshot(d)
        out = user_error_or(lambda: sft.prepare([path], os.path.join(d, 'out', 'NAME'),
                                                tokenizer_path=_chat_tokenizer(),
                                                options=sft.Options(max_tokens=max_tokens)))
        after = snapshot(d)
        assert {k: v for k, v in after.items() if not k.startswith(os.path.join(d, 'out'))} == before
        written = sorted(os.listdir(os.path.join(d, 'out')))
        if isinstance(out, encode.Result):  # the token file with its mask, readable, and nothing else
            assert written == ['NAME.bin', 'NAME.json', 'NAME.mask.bin', 'NAME.tokenizer.json'], written
            opened = data_lib.open_token_file(out.bin_paths[''], out.headers['']['vocab_size'])
            assert opened.mask is not None and opened.mask.sum() == out.headers['']['counted_tokens'] > 0
            del opened
        else:
            assert written == [], written


@tiers(fast=60, slow=400)
def test_prepare_sft_run(budget):
    fuzz('prepare --sft (whole run)', st.tuples(conversation_files, st.sampled_from([0, 6, 12])), check_prepare_sft,
         budget, deadline_ms=10_000)
