"""`python -m jaxfrontier.prepare --sft`: conversation JSONL -> tokens with a per-token loss mask.

Each conversation (a JSONL record, data/chat.py) is rendered with the tokenizer directory's chat
template and becomes one document: its tokens, then the end-of-text token, with a mask of one
uint8 per token (1: the prediction of this token counts; `--loss_on`: the assistant turns, the
last one, or all). The rest is prepare's: batches of records rendered in order (in this process
or in `--workers` processes), held-out documents drawn at random (`--val_fraction`), shuffle,
the header, atomic output with stale temporaries removed (prepared.py), progress. The mask is
written beside each token file as NAME.mask.bin and named in its header (`loss_mask`), so the
trainer counts only those predictions (data/loss_mask.py).

`--max_tokens` bounds a conversation's tokens (end-of-text included): a longer one is cut
(`--overlong=truncate`, the default: its first max_tokens - 1 tokens and the end-of-text) or
dropped (`drop`); one whose cut leaves no counted token is dropped too. Every such case is
counted, printed and recorded in the header (`sft`), never silent.
"""

from __future__ import annotations

import array
import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from typing import Any, Callable, Iterator

import numpy as np

from jaxfrontier.data import chat, corpus, documents, encode, loss_mask, prepared, token_files
from jaxfrontier.errors import FlagError, UserError

OVERLONG = ('truncate', 'drop')
# A conversation this large renders for seconds (transformers encodes it whole, twice per learned turn, about
# 0.5 MB/s): one line says so before it starts, as no batch finishes meanwhile to move the progress bar.
LARGE_RECORD_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True)
class Options:
    """What `--sft` asks for: which tokens count, the length bound, where the conversation is."""

    loss_on: str = 'assistant'
    max_tokens: int = 0  # 0: no bound
    overlong: str = 'truncate'
    messages_field: str = 'messages'

    def check(self) -> None:
        """Raises FlagError for a value no corpus could satisfy (before anything is read)."""
        if self.loss_on not in chat.LOSS_ON:
            raise FlagError('loss_on', self.loss_on, 'unknown setting', f'pass one of {", ".join(chat.LOSS_ON)}')
        if self.overlong not in OVERLONG:
            raise FlagError('overlong', self.overlong, 'unknown setting', f'pass one of {", ".join(OVERLONG)}')
        if self.max_tokens < 0 or self.max_tokens == 1:
            raise FlagError('max_tokens', self.max_tokens, 'a conversation needs a token and its end-of-text',
                            'pass 0 (no bound) or e.g. model.seq_len + 1')
        if not self.messages_field:
            raise FlagError('messages_field', '', 'names no field', 'pass e.g. --messages_field=messages')


@dataclasses.dataclass
class Counts:
    """What happened to the conversations (the header's `sft.conversations`, the log line)."""

    written: int = 0
    truncated: int = 0  # cut to --max_tokens
    cut_tokens: int = 0  # tokens removed by those cuts
    dropped_overlong: int = 0  # --overlong=drop
    dropped_empty: int = 0  # cut so far that no counted token was left
    counted_tokens: int = 0  # mask ones written
    eot_inside: int = 0  # written conversations whose rendering holds the end-of-text token (packing cuts there)

    def add(self, other: Counts) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def _bounded(tokens: list[int], mask: list[int], options: Options,
             counts: Counts) -> tuple[list[int], list[int]] | None:
    """The document (end-of-text included) within --max_tokens, counted; None when dropped."""
    if not options.max_tokens or len(tokens) <= options.max_tokens:
        return tokens, mask
    if options.overlong == 'drop':
        counts.dropped_overlong += 1
        return None
    keep = options.max_tokens - 1
    counts.truncated += 1
    counts.cut_tokens += len(tokens) - options.max_tokens
    if not any(mask[:keep]):
        counts.dropped_empty += 1
        return None
    return tokens[:keep] + tokens[-1:], mask[:keep] + mask[-1:]


def render_batch(renderer: chat.Renderer, records: list[corpus.Record], options: Options, eot_id: int,
                 dtype: str) -> tuple[bytes, bytes, np.ndarray, Counts]:
    """(tokens, mask, tokens of each written document, counts) of a batch of records."""
    counts, tokens_all, mask_all, lengths = Counts(), array.array('q'), bytearray(), []
    eot_mask = int(options.loss_on == 'all')  # the end-of-text after a conversation is prepare's, not the model's turn
    for record in records:
        conversation = chat.parse(record, options.loss_on, options.messages_field)
        tokens, mask = renderer.render(record, conversation, options.loss_on)
        document = _bounded(tokens + [eot_id], mask + [eot_mask], options, counts)
        if document is None:
            continue
        counts.eot_inside += eot_id in document[0][:-1]
        tokens_all.extend(document[0])
        mask_all.extend(document[1])
        lengths.append(len(document[0]))
        counts.written += 1
        counts.counted_tokens += sum(document[1])
    np_dtype = np.dtype(token_files.NUMPY_DTYPES[dtype])
    return (np.frombuffer(tokens_all, np.int64).astype(np_dtype).tobytes(), bytes(mask_all),
            np.asarray(lengths, np.int64), counts)


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer_path: str, options: Options, eot_id: int, dtype: str) -> None:
    _WORKER.update(renderer=chat.Renderer(chat.load_tokenizer(tokenizer_path), tokenizer_path), options=options,
                   eot_id=eot_id, dtype=dtype)


def _render_in_worker(records: list[corpus.Record]) -> tuple[bytes, bytes, np.ndarray, Counts]:
    try:
        return render_batch(_WORKER['renderer'], records, _WORKER['options'], _WORKER['eot_id'], _WORKER['dtype'])
    except UserError as e:  # FlagError does not unpickle; its one line does
        raise UserError(str(e)) from None


def rendered_batches(batches: Iterator[list[corpus.Record]], renderer: chat.Renderer, tokenizer_path: str,
                     options: Options, eot_id: int, dtype: str,
                     workers: int) -> Iterator[tuple[list[corpus.Record], Any]]:
    """(batch, render_batch's result) for each batch, in input order: rendered beside this process's
    writing (workers == 1), or in `workers` processes (Jinja and the tokenizer hold the GIL)."""
    if workers == 1:
        executor = concurrent.futures.ThreadPoolExecutor(1)
        fn: Callable[..., Any] = lambda records: render_batch(renderer, records, options, eot_id, dtype)  # noqa: E731
    else:
        executor = concurrent.futures.ProcessPoolExecutor(
            workers, multiprocessing.get_context('spawn'), initializer=_init_worker,
            initargs=(tokenizer_path, options, eot_id, dtype))
        fn = _render_in_worker
    return encode.in_order(executor, fn, batches, lambda batch: (batch,), 2 * max(workers, 2))


def _eot(tokenizer: Any, eot_token: str, path: str) -> tuple[str, int]:
    """--eot_token, else the first of encode.EOT_CANDIDATES the tokenizer has, else its eos_token."""
    try:
        return encode.eot_id_of(tokenizer.backend_tokenizer, eot_token, path)
    except FlagError:
        eos = getattr(tokenizer, 'eos_token', None)
        if eot_token or not eos or tokenizer.backend_tokenizer.token_to_id(eos) is None:
            raise
        return eos, tokenizer.backend_tokenizer.token_to_id(eos)


def _write_streams(batches: Iterator[tuple[list[corpus.Record], Any]], bin_file: Any, mask_file: Any,
                   progress: Callable[[int, int], None] | None) -> tuple[int, array.array, Counts]:
    """Writes the rendered batches in order; returns (tokens written, tokens of each document, counts)."""
    num_tokens, lengths, counts = 0, array.array('q'), Counts()
    for batch, (tokens, mask, batch_lengths, batch_counts) in batches:
        bin_file.write(tokens)
        mask_file.write(mask)
        num_tokens += len(mask)
        lengths.extend(batch_lengths.tolist())
        counts.add(batch_counts)
        if progress:
            progress(sum(r.num_bytes for r in batch), num_tokens)
    return num_tokens, lengths, counts


def _noticed(records: Iterator[corpus.Record], notify: Callable[[str], None] | None,
             options: Options) -> Iterator[corpus.Record]:
    """`records`, calling notify(line) as one of LARGE_RECORD_BYTES or more is read (before it is rendered)."""
    for record in records:
        if notify and record.num_bytes >= LARGE_RECORD_BYTES:
            bound = (f'--max_tokens={options.max_tokens} cuts it only once rendered' if options.max_tokens else
                     'without --max_tokens all of it is kept')
            notify(f'sft: {record.path} line {record.line} is a conversation of {record.num_bytes / 1e6:.1f} MB; '
                   f'rendering it takes a while (about 2 s per MB), and {bound}')
        yield record


def _check_written(inputs: list[str], counts: Counts, options: Options) -> None:
    if not counts.written:
        dropped = counts.dropped_overlong + counts.dropped_empty
        raise FlagError('input', ','.join(inputs), 'no conversation to write' + (
            f' ({dropped:,} dropped: longer than --max_tokens={options.max_tokens})' if dropped else
            ' (the files hold none)'), 'pass conversations, or raise --max_tokens')


def prepare(inputs: list[str], output: str, *, tokenizer_path: str, options: Options = Options(), eot_token: str = '',
            workers: int = 1, batch_bytes: int = 1 << 20, progress: Callable[[int, int], None] | None = None,
            split: documents.Split = documents.Split(), notify: Callable[[str], None] | None = None) -> encode.Result:
    """Renders the conversations of the .jsonl files `inputs` into the token file `output` with a loss mask.

    As encode.prepare (output files, split, workers, progress), plus NAME.mask.bin beside each
    .bin; headers record `loss_mask` and `sft` (how it was rendered, what counts, the counts).
    `notify` gets one line before a conversation of LARGE_RECORD_BYTES or more is rendered.

    Raises:
      FlagError: any input the user can fix (module docstring, data/chat.py); nothing is left that
        looks like a token file.
    """
    options.check()
    if workers < 1:
        raise FlagError('workers', workers, 'need at least one worker', 'pass --workers=1 or more')
    split.check()
    files = corpus.expand_inputs(inputs)
    corpus.require_jsonl(files)
    input_bytes = sum(os.path.getsize(f) for f in files)
    tokenizer = chat.load_tokenizer(tokenizer_path)
    renderer = chat.Renderer(tokenizer, tokenizer_path)
    vocab_size = encode.vocab_size_of(tokenizer.backend_tokenizer)
    if vocab_size > loss_mask.MAX_VOCAB:
        raise FlagError('tokenizer', tokenizer_path, f'a vocabulary of {vocab_size:,} tokens reaches the loss mask\'s '
                        f'flag bit (at most {loss_mask.MAX_VOCAB:,})', 'use a tokenizer with a smaller vocabulary')
    dtype, (eot, eot_id) = encode.dtype_for_vocab(vocab_size), _eot(tokenizer, eot_token, tokenizer_path)
    out, bin_file, mask_file = prepared.open_output(output, ('train', 'val') if split.splits else ('',), split.active,
                                                    masks=True)
    try:
        with bin_file, mask_file:
            start = time.perf_counter()
            records = _noticed(corpus.read_records(files), notify, options)
            batches = rendered_batches(corpus.batches(records, batch_bytes), renderer,
                                       tokenizer_path, options, eot_id, dtype, workers)
            num_tokens, lengths, counts = _write_streams(batches, bin_file, mask_file, progress)
            _check_written(inputs, counts, options)
            for f in (bin_file, mask_file):
                f.flush()
                os.fsync(f.fileno())
        parts, written = encode.split_or_keep(out, dtype, np.frombuffer(lengths, np.int64), num_tokens, split)
        common = encode.header_common(out, dtype, vocab_size, eot, eot_id, files, input_bytes)
        sft = {'loss_on': options.loss_on, 'rendering': renderer.rendering, 'tokenizer_source': tokenizer_path,
               'chat_template': tokenizer.chat_template if renderer.has_template else None,
               'special_tokens_in_content': 'text' if renderer.sanitize or not renderer.has_template else 'special',
               'max_tokens': options.max_tokens, 'overlong': options.overlong,
               'conversations': dataclasses.asdict(counts)}
        headers = {}
        for part, ids in parts.items():
            key = prepared.part_key(part)
            mask = np.memmap(out.tmp[key + 'mask'], np.uint8, mode='r')  # every part holds a document
            headers[part] = {**common, 'num_tokens': written[part], 'num_documents': len(ids),
                             'loss_mask': os.path.basename(out.paths[key + 'mask']),
                             'counted_tokens': int(np.count_nonzero(mask)), 'sft': sft,
                             **documents.header_fields(split, part, parts)}
            del mask
        seconds = time.perf_counter() - start
        prepared.publish(out, tokenizer.backend_tokenizer.to_str(), headers)
    except BaseException:
        prepared.discard(out)
        raise
    return encode.Result({part: out.paths[prepared.part_key(part) + 'bin'] for part in parts}, headers, seconds,
                         input_bytes)
