"""Tokenising a corpus into a token file (docs/data.md): the logic of `python -m jaxfrontier.prepare`.

`prepare` streams the corpus (jaxfrontier.data.corpus) in batches of about `batch_bytes` of text,
encodes each batch with a Hugging Face `tokenizers` tokenizer (in this process, whose
`encode_batch_fast` uses the library's own threads, or in `workers` processes, results kept in
input order), puts the end-of-text token after every document and appends the tokens to a
temporary file. Memory stays near a few batches whatever the corpus size: at most
`2 * workers` batches are in flight.

Output `DIR/NAME` is three files: `NAME.bin` (tokens), `NAME.tokenizer.json` and the header
`NAME.json`, which records the tokenizer's relative path and the end-of-text id. With a split by
documents (documents.py), NAME_train.bin / .json and NAME_val.bin / .json instead of NAME.bin /
.json: the in-order stream goes to a temporary file, counting each document's tokens, and is then
copied into the parts document by document (also for --shuffle). prepared.py writes them all
atomically (temporaries renamed into place, the header last). Conversations for supervised
fine-tuning (`--sft`, with a loss mask) are sft.py's.
"""

from __future__ import annotations

import array
import collections
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing
import os
import time
from typing import Any, Callable, Iterator

import numpy as np

from jaxfrontier.data import corpus, documents, long_words, prepared, token_files
from jaxfrontier.errors import FlagError

EOT_CANDIDATES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>')  # first found is used
TRAINED_EOT = '<|endoftext|>'
MAX_VOCAB = 1 << 32  # token ids must fit uint32


@dataclasses.dataclass(frozen=True)
class Result:
    """What prepare wrote."""

    bin_paths: dict[str, str]  # by part: '' (one file), or 'train' and 'val'
    headers: dict[str, dict[str, Any]]
    seconds: float  # tokenizer training excluded
    input_bytes: int


# --------------------------------------------------------------------------- tokenizer


def dtype_for_vocab(vocab_size: int, flag: str = 'tokenizer', value: Any = None) -> str:
    """The token dtype of a vocabulary: uint16 up to 65536 tokens, else uint32.

    Raises:
      FlagError: naming --flag=value, when the vocabulary does not fit uint32.
    """
    if vocab_size > MAX_VOCAB:
        raise FlagError(flag, vocab_size if value is None else value, f'a vocabulary of {vocab_size:,} tokens does not fit '
                        f'uint32 (at most {MAX_VOCAB:,})', 'use a tokenizer with a smaller vocabulary')
    return 'uint16' if vocab_size <= 1 << 16 else 'uint32'


def _json_vocab_size(tokenizer_json: dict[str, Any]) -> int:
    """1 + the largest token id named in a tokenizer.json (model vocabulary and added tokens)."""
    model = tokenizer_json.get('model')
    vocab = model.get('vocab') if isinstance(model, dict) else None
    ids = (list(vocab.values()) if isinstance(vocab, dict) else
           [len(vocab) - 1] if isinstance(vocab, list) else [])  # Unigram: a list of [piece, score]
    added = tokenizer_json.get('added_tokens')
    ids += [t.get('id') for t in added if isinstance(t, dict)] if isinstance(added, list) else []
    return 1 + max((i for i in ids if isinstance(i, int)), default=-1)


def load_tokenizer(path: str) -> tuple[Any, str]:
    """Loads a Hugging Face tokenizer.json (or the one in directory `path`); returns (it, its JSON).

    Raises:
      FlagError: the file is missing or cannot be read, or its vocabulary exceeds uint32.
    """
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

    file = os.path.join(path, 'tokenizer.json') if os.path.isdir(path) else path
    fix = 'pass a Hugging Face tokenizer.json (or a directory holding one), or --train_tokenizer=VOCAB'
    try:
        with open(file, encoding='utf-8') as f:
            text = f.read()
        parsed = json.loads(text)
    except (OSError, ValueError) as e:
        raise FlagError('tokenizer', path, f'cannot read {file} ({" ".join(str(e).split())})', fix) from None
    dtype_for_vocab(_json_vocab_size(parsed) if isinstance(parsed, dict) else 0, 'tokenizer', path)
    try:
        tokenizer = Tokenizer.from_str(text)
    except BaseException as e:  # pylint: disable=broad-except  (plain Exception, or a Rust panic: BaseException)
        if not isinstance(e, Exception) and type(e).__name__ != 'PanicException':
            raise  # KeyboardInterrupt, SystemExit
        raise FlagError('tokenizer', path, f'{file} is not a tokenizer.json the tokenizers library '
                        f'reads ({" ".join(str(e).split())[:200]})', fix) from None
    return tokenizer, text


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> tuple[Any, str]:
    """Trains a GPT-2-style byte-level BPE with the special token <|endoftext|>; returns (it, its JSON).

    The vocabulary is at most vocab_size (smaller when the corpus has fewer distinct merges).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top

    if vocab_size < 257:
        raise FlagError('train_tokenizer', vocab_size, 'a byte-level BPE needs 256 byte tokens and '
                        '<|endoftext|>', 'pass --train_tokenizer=257 or more (GPT-2: 50257)')
    dtype_for_vocab(vocab_size, 'train_tokenizer')
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(long_words.bounded(texts), trainer)  # a long run trains in seconds
    return tokenizer, tokenizer.to_str()


def vocab_size_of(tokenizer: Any) -> int:
    """1 + the largest token id, added tokens included."""
    return 1 + max(tokenizer.get_vocab(with_added_tokens=True).values())


def eot_id_of(tokenizer: Any, eot_token: str, flag_value: str) -> tuple[str, int]:
    """(end-of-text token, its id): eot_token, or the first of EOT_CANDIDATES the tokenizer has."""
    for token in [eot_token] if eot_token else EOT_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    problem = (f'the tokenizer has no token {eot_token!r}' if eot_token else
               f'the tokenizer has none of the end-of-text tokens {list(EOT_CANDIDATES)}')
    raise FlagError('eot_token' if eot_token else 'tokenizer', eot_token or flag_value, problem,
                    'pass --eot_token=<the token that ends a document in this tokenizer>')


def _ready_for_documents(tokenizer: Any) -> Any:
    """No truncation or padding, and special-token text in a document encoded as plain text."""
    tokenizer.no_truncation()
    tokenizer.no_padding()
    tokenizer.encode_special_tokens = True  # a literal '<|endoftext|>' in a document is not a boundary
    return tokenizer


# --------------------------------------------------------------------------- encoding


def encode_batch(tokenizer: Any, texts: list[str], ends: list[bool], eot_id: int,
                 dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [n], tokens of each piece [pieces]) of a batch of pieces, eot_id after each that ends a document.

    The per-piece counts let prepare cut the stream into documents again (split and shuffle).
    """
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    eot = (eot_id,)
    ids = itertools.chain.from_iterable(
        itertools.chain(e.ids, eot) if end else e.ids for e, end in zip(encodings, ends))
    lengths = np.fromiter((len(e.ids) + end for e, end in zip(encodings, ends)), np.int64, len(texts))
    return np.fromiter(ids, dtype=np.dtype(token_files.NUMPY_DTYPES[dtype])), lengths


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, eot_id: int, dtype: str, threads: int) -> None:
    os.environ['RAYON_NUM_THREADS'] = str(threads)  # read when the library first runs in parallel
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
    _WORKER.update(tokenizer=_ready_for_documents(Tokenizer.from_str(tokenizer_json)), eot_id=eot_id,
                   dtype=dtype)


def _encode_in_worker(texts: list[str], ends: list[bool]) -> tuple[bytes, np.ndarray]:
    tokens, lengths = encode_batch(_WORKER['tokenizer'], texts, ends, _WORKER['eot_id'], _WORKER['dtype'])
    return tokens.tobytes(), lengths


def encoded_batches(batches: Iterator[list[corpus.Piece]], tokenizer: Any, tokenizer_json: str,
                    eot_id: int, dtype: str, workers: int) -> Iterator[tuple[list[corpus.Piece], tuple[bytes, np.ndarray]]]:
    """(batch, (its tokens as bytes, tokens per piece)) for each batch, in input order.

    workers == 1 encodes in this process: two threads each encode a batch with the library's
    own thread pool (it releases the GIL), so one batch's slowest document does not idle the
    cores. More workers start that many processes, each with its share of the cores. At most
    2 * max(workers, 2) batches are in flight, so memory stays bounded.
    """
    if workers == 1:
        executor = concurrent.futures.ThreadPoolExecutor(2)

        def encode(texts: list[str], ends: list[bool]) -> tuple[bytes, np.ndarray]:
            tokens, lengths = encode_batch(tokenizer, texts, ends, eot_id, dtype)
            return tokens.tobytes(), lengths
    else:
        threads = max(1, (os.cpu_count() or 1) // workers)
        executor = concurrent.futures.ProcessPoolExecutor(
            workers, multiprocessing.get_context('spawn'),  # spawn: no fork of the library's threads
            initializer=_init_worker, initargs=(tokenizer_json, eot_id, dtype, threads))
        encode = _encode_in_worker
    yield from in_order(executor, encode, batches, lambda batch: ([p.text for p in batch],
                                                                 [p.end_of_document for p in batch]),
                        2 * max(workers, 2))


def in_order(executor: concurrent.futures.Executor, fn: Callable[..., Any], batches: Iterator[Any],
             args_of: Callable[[Any], tuple[Any, ...]], limit: int) -> Iterator[tuple[Any, Any]]:
    """(batch, fn(*args_of(batch))) for each batch, in input order, with at most `limit` batches
    submitted to `executor` at once (memory stays bounded); shuts the executor down at the end."""
    with executor:
        in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        for batch in itertools.chain(batches, [None]):
            if batch is not None:
                in_flight.append((batch, executor.submit(fn, *args_of(batch))))
            while in_flight and (batch is None or len(in_flight) >= limit):
                done, future = in_flight.popleft()
                yield done, future.result()


# --------------------------------------------------------------------------- output


def _write_stream(batches: Iterator[tuple[list[corpus.Piece], tuple[bytes, np.ndarray]]], bin_file: Any, dtype: str,
                  progress: Callable[[int, int], None] | None) -> tuple[int, array.array]:
    """Writes the encoded batches in order; returns (tokens written, tokens of each document)."""
    num_tokens, lengths, document_tokens = 0, array.array('q'), 0
    for batch, (tokens, piece_lengths) in batches:
        bin_file.write(tokens)
        num_tokens += len(tokens) // (2 if dtype == 'uint16' else 4)
        for piece, n in zip(batch, piece_lengths.tolist()):  # a .txt document comes in several pieces
            document_tokens += n
            if piece.end_of_document:
                lengths.append(document_tokens)
                document_tokens = 0
        if progress:
            progress(sum(p.num_bytes for p in batch), num_tokens)
    return num_tokens, lengths


# --------------------------------------------------------------------------- prepare


def prepare(inputs: list[str], output: str, *, tokenizer_path: str = '', train_vocab: int = 0,
            text_field: str = 'text', eot_token: str = '', workers: int = 1, batch_bytes: int = 1 << 20,
            progress: Callable[[int, int], None] | None = None,
            split: documents.Split = documents.Split()) -> Result:
    """Tokenises the corpus `inputs` into the token file `output` (docs/data.md).

    Args:
      inputs: files or globs (comma-separated allowed) of .txt, .jsonl or .parquet.
      output: DIR/NAME of the token file (NAME.bin, NAME.json and NAME.tokenizer.json); with a
        split NAME_train.bin / .json and NAME_val.bin / .json instead of NAME.bin / .json.
      tokenizer_path: a tokenizer.json or a directory holding one; or
      train_vocab: > 0 trains a byte-level BPE of at most this vocabulary on the inputs.
      text_field: the JSONL field or Parquet column holding the text.
      eot_token: the end-of-text token; '' picks the first of EOT_CANDIDATES the tokenizer has.
      workers: encoding processes; 1 encodes in this process (with the library's threads).
      batch_bytes: input bytes per encoded batch.
      progress: called with (input bytes, tokens) after each batch.
      split: validation documents drawn at random and / or documents shuffled (data/documents.py).

    Raises:
      FlagError: any input the user can fix; nothing is left that looks like a token file.
    """
    if bool(tokenizer_path) == bool(train_vocab):
        raise FlagError('tokenizer', tokenizer_path, 'pass exactly one of --tokenizer and --train_tokenizer',
                        'pass --tokenizer=PATH (a tokenizer.json) or --train_tokenizer=VOCAB (e.g. 50257)')
    if workers < 1:
        raise FlagError('workers', workers, 'need at least one worker', 'pass --workers=1 or more')
    split.check()
    files = corpus.expand_inputs(inputs)
    input_bytes = sum(os.path.getsize(f) for f in files)
    if not input_bytes:
        raise FlagError('input', ','.join(inputs), 'the corpus is empty (its files hold 0 bytes)',
                        'pass files that hold text')
    out, bin_file, _ = prepared.open_output(output, ('train', 'val') if split.splits else ('',), split.active)
    try:
        with bin_file:
            if tokenizer_path:
                tokenizer, tokenizer_json = load_tokenizer(tokenizer_path)
            else:
                tokenizer, tokenizer_json = train_tokenizer(
                    (p.text for p in corpus.read_pieces(files, text_field)), train_vocab)
            vocab_size = vocab_size_of(tokenizer)
            dtype = dtype_for_vocab(vocab_size)
            eot, eot_id = eot_id_of(tokenizer, eot_token, tokenizer_path)
            start = time.perf_counter()
            batches = encoded_batches(corpus.batches(corpus.read_pieces(files, text_field), batch_bytes),
                                      _ready_for_documents(tokenizer), tokenizer_json, eot_id, dtype, workers)
            num_tokens, lengths = _write_stream(batches, bin_file, dtype, progress)
            if not lengths:
                raise FlagError('input', ','.join(inputs), 'the corpus is empty (no document holds text)',
                                'pass files that hold text (check --text_field)')
            bin_file.flush()
            os.fsync(bin_file.fileno())
        common = header_common(out, dtype, vocab_size, eot, eot_id, files, input_bytes)
        parts, written = split_or_keep(out, dtype, np.frombuffer(lengths, np.int64), num_tokens, split)
        headers = {part: {**common, 'num_tokens': written[part], 'num_documents': len(ids),
                          **documents.header_fields(split, part, parts)} for part, ids in parts.items()}
        seconds = time.perf_counter() - start
        prepared.publish(out, tokenizer_json, headers)
    except BaseException:
        prepared.discard(out)
        raise
    return Result({part: out.paths[prepared.part_key(part) + 'bin'] for part in parts}, headers, seconds, input_bytes)


def header_common(out: prepared.Output, dtype: str, vocab_size: int, eot: str, eot_id: int, files: list[str],
                  input_bytes: int) -> dict[str, Any]:
    """The header fields every part of a prepared output shares (docs/data.md)."""
    return {'format': token_files.FORMAT, 'version': token_files.VERSION, 'dtype': dtype, 'vocab_size': vocab_size,
            'tokenizer': os.path.basename(out.paths['tokenizer']), 'eot_token': eot, 'eot_id': eot_id,
            'source': 'jaxfrontier.prepare', 'num_input_files': len(files), 'input_bytes': input_bytes}


def split_or_keep(out: prepared.Output, dtype: str, lengths: np.ndarray, num_tokens: int,
                  split: documents.Split) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """(document ids, tokens) of each part: the streams split by documents, or the one file as written."""
    if split.active:
        return prepared.split_streams(out, dtype, lengths, split)
    return {'': np.arange(len(lengths))}, {'': num_tokens}
