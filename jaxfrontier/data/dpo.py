"""`python -m jaxfrontier.prepare --dpo`: preference pairs JSONL -> example-aligned rows with a response mask.

A record is `{"prompt": ..., "chosen": ..., "rejected": ...}`: the prompt a string (a user turn)
or a list of messages, each answer a string or an assistant message (or a list holding one).
Each side is rendered as prompt + answer with the tokenizer directory's chat template (the
answer's tokens and its end-of-turn counted, data/chat.py), or without a template as plain text
(prompt tokens, then answer tokens). Pair i becomes rows 2i (chosen) and 2i + 1 (rejected) of
`seq_len + 1` tokens each, right-padded with the end-of-text token, whose mask counts only the
answer's predictions: the layout training/dpo.py reads, each step taking whole rows.

A side longer than a row is cut (`--overlong=truncate`: the prompt first, from its start, keeping
at least one prompt token; then the answer, from its end) or the pair dropped (`drop`); a pair whose
cut leaves an answer no token is dropped. Every case is counted in the header (`dpo.pairs`) and the
log line. A pair whose chosen and rejected answers are the same, or a record missing a field, is
refused with one line naming the file and line, before anything is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import numpy as np

from jaxfrontier.data import chat, corpus, encode, loss_mask, prepared, token_files
from jaxfrontier.errors import ConfigError, FlagError

FIELDS = ('prompt', 'chosen', 'rejected')
OBJECTIVES = tuple(token_files.OBJECTIVE_KINDS)  # train.objective: ('lm', 'dpo')


@dataclasses.dataclass
class Counts:
    written: int = 0
    truncated: int = 0  # pairs with a side cut to the row
    dropped_overlong: int = 0  # --overlong=drop, or no answer token left after the cut


def _bad(record: corpus.Record, problem: str, fix: str) -> FlagError:
    return FlagError('input', record.path, f'line {record.line}: {problem}', fix)


def _answer(record: corpus.Record, name: str) -> str:
    value = record.value[name]
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict) and value.get('role') == 'assistant':
        value = value.get('content')
    if not isinstance(value, str):
        raise _bad(record, f'"{name}" is a JSON {type(value).__name__}, not a string or an assistant message',
                   f'write "{name}": "..." or {{"role": "assistant", "content": "..."}}')
    return value


def parse(record: corpus.Record) -> tuple[Any, str, str]:
    """(prompt: a string or messages, chosen, rejected) of a record; one line for a bad one."""
    missing = [f for f in FIELDS if f not in record.value]
    if missing:
        raise _bad(record, f'has no {", ".join(repr(f) for f in missing)} (its fields: {sorted(record.value)})',
                   'write {"prompt": ..., "chosen": ..., "rejected": ...}')
    prompt = record.value['prompt']
    if isinstance(prompt, list):
        prompt = chat._messages(record, prompt, '"prompt"')  # pylint: disable=protected-access
    elif not isinstance(prompt, str):
        raise _bad(record, f'"prompt" is a JSON {type(prompt).__name__}', 'write "prompt" as a string or messages')
    chosen, rejected = _answer(record, 'chosen'), _answer(record, 'rejected')
    if chosen == rejected:
        raise _bad(record, 'the chosen and rejected answers are identical: the pair prefers nothing',
                   'drop the pair, or give it two different answers')
    return prompt, chosen, rejected


def render_side(renderer: chat.Renderer, record: corpus.Record, prompt: Any,
                answer: str) -> tuple[list[int], list[int], int]:
    """(tokens, mask, prompt length) of prompt + answer."""
    messages = ([{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else list(prompt))
    messages.append({'role': 'assistant', 'content': answer})
    pair = (prompt, answer) if isinstance(prompt, str) else None
    conversation = chat.Conversation(messages, (len(messages) - 1,), None, pair)
    tokens, mask = renderer.render(record, conversation, 'assistant')
    return tokens, mask, (mask.index(1) if 1 in mask else len(mask))


def fit_row(tokens: list[int], mask: list[int], start: int, row: int) -> tuple[list[int], list[int]] | None:
    """The side within `row` tokens: the prompt cut from its start (keeping one token), then the answer from its
    end; None if no answer token is left."""
    over = len(tokens) - row
    if over <= 0:
        return tokens, mask
    from_prompt = min(over, max(0, start - 1))
    tokens, mask = tokens[from_prompt:][:row], mask[from_prompt:][:row]
    return (tokens, mask) if any(mask) else None


def render_pairs(renderer: chat.Renderer, records: list[corpus.Record], seq_len: int, overlong: str,
                 pad_id: int) -> tuple[np.ndarray, np.ndarray, Counts]:
    """Rows [2P, seq_len + 1] and their mask (uint8) of the records' pairs, and what happened to them."""
    row, counts, rows, masks = seq_len + 1, Counts(), [], []
    for record in records:
        prompt, chosen, rejected = parse(record)
        sides = [render_side(renderer, record, prompt, answer) for answer in (chosen, rejected)]
        if any(len(tokens) > row for tokens, _, _ in sides):
            if overlong == 'drop':
                counts.dropped_overlong += 1
                continue
            fitted = [fit_row(*side, row) for side in sides]
            if any(f is None for f in fitted):
                counts.dropped_overlong += 1
                continue
            counts.truncated += 1
        else:
            fitted = [(tokens, mask) for tokens, mask, _ in sides]
        for tokens, mask in fitted:
            rows.append(tokens + [pad_id] * (row - len(tokens)))
            masks.append(mask + [0] * (row - len(mask)))
        counts.written += 1
    return np.asarray(rows, np.int64).reshape(-1, row), np.asarray(masks, np.uint8).reshape(-1, row), counts


def prepare(inputs: list[str], output: str, *, tokenizer_path: str, seq_len: int, overlong: str = 'truncate',
            val_fraction: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Writes OUTPUT.bin (or OUTPUT_train.bin and OUTPUT_val.bin with `val_fraction`) of pair rows; returns the
    headers by part. Raises FlagError for any input the user can fix, before anything is written."""
    if seq_len < 2:
        raise FlagError('seq_len', seq_len, 'a row needs a prompt and an answer token', 'pass the model\'s seq_len')
    if overlong not in ('truncate', 'drop'):
        raise FlagError('overlong', overlong, 'unknown setting', 'pass truncate or drop')
    if not 0 <= val_fraction < 1:
        raise FlagError('val_fraction', val_fraction, 'must be in [0, 1)', 'pass e.g. 0.05')
    files = corpus.expand_inputs(inputs)
    corpus.require_jsonl(files)
    tokenizer = chat.load_tokenizer(tokenizer_path)
    renderer = chat.Renderer(tokenizer, tokenizer_path)
    vocab_size = encode.vocab_size_of(tokenizer.backend_tokenizer)
    eot, eot_id = encode.eot_id_of(tokenizer.backend_tokenizer, '', tokenizer_path)
    rows, masks, counts = render_pairs(renderer, list(corpus.read_records(files)), seq_len, overlong, eot_id)
    if not counts.written and not counts.dropped_overlong:
        raise FlagError('input', ','.join(inputs), 'the files hold no preference pair (no non-blank line)',
                        'pass JSONL of {"prompt": ..., "chosen": ..., "rejected": ...}, one pair per line')
    if not counts.written:
        raise FlagError('input', ','.join(inputs), f'no pair to write (all {counts.dropped_overlong:,} dropped as '
                        f'longer than a row of --seq_len={seq_len} + 1 tokens)', 'raise --seq_len' + (
                            ', or pass --overlong=truncate (cut the prompt first)' if overlong == 'drop' else ''))
    pairs = np.random.default_rng(seed).permutation(counts.written)
    n_val = int(round(val_fraction * counts.written)) if val_fraction else 0
    if val_fraction and counts.written < 2:
        raise FlagError('val_fraction', val_fraction, 'one pair cannot be split into training and held-out pairs',
                        'pass more pairs, or drop --val_fraction')
    if val_fraction and not 0 < n_val < counts.written:
        raise FlagError('val_fraction', val_fraction, f'leaves no pair on one side of {counts.written} pairs',
                        'pass more pairs or another --val_fraction')
    parts = {'': np.arange(counts.written)} if not n_val else {'train': np.sort(pairs[n_val:]),
                                                                'val': np.sort(pairs[:n_val])}
    base = output[:-len('.bin')] if output.endswith('.bin') else output
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    tokenizer_name = os.path.basename(base) + '.tokenizer.json'
    headers: dict[str, Any] = {}
    try:
        _write(base, tokenizer.backend_tokenizer.to_str(), rows, masks, parts, vocab_size, headers, {
            'tokenizer': tokenizer_name, 'eot_id': eot_id, 'eot_token': eot, 'row_length': seq_len + 1,
            'dpo': {'pairs': dataclasses.asdict(counts), 'seq_len': seq_len, 'overlong': overlong,
                    'rendering': renderer.rendering, 'tokenizer_source': tokenizer_path},
            'sft': {'chat_template': tokenizer.chat_template if renderer.has_template else None}})
    except BaseException:  # a full disk: no header is left that describes a part of this run
        for part in headers:
            with contextlib.suppress(OSError):
                os.remove(token_files.token_paths(f'{base}_{part}' if part else base)[1])
        raise
    return headers


def _write(base: str, tokenizer_json: str, rows: np.ndarray, masks: np.ndarray, parts: dict[str, np.ndarray],
           vocab_size: int, headers: dict[str, Any], common: dict[str, Any]) -> None:
    """The tokenizer (by temporary file and rename), then each part's token file (write_token_file: the header
    last); `headers` gets each part's as it is written."""
    tmp = f'{base}.tokenizer.json.tmp-{os.getpid()}'
    try:
        prepared.write_small(tmp, tokenizer_json)
        os.replace(tmp, base + '.tokenizer.json')
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    for part, ids in parts.items():
        index = np.stack([2 * ids, 2 * ids + 1], 1).reshape(-1)  # the pair's two rows, in order
        metadata = {**common, 'dpo': {**common['dpo'], 'pairs_in_file': len(ids)}}
        path = f'{base}_{part}.bin' if part else base + '.bin'
        token_files.write_token_file(path, rows[index].reshape(-1), vocab_size, metadata=metadata,
                                     mask=masks[index].reshape(-1))
        headers[part] = metadata


def read_rows(path: str, vocab_size: int) -> np.ndarray:
    """The flagged int32 rows [2P, seq_len + 1] of a --dpo token file (data/loss_mask.py's flag where not counted)."""
    token_file = token_files.open_token_file(path, vocab_size)
    row, kind = token_file.header.get('row_length'), token_files.file_kind(token_file.header)
    if not row or kind != 'dpo':
        raise FlagError('data.path', path, f'is not a file of preference pairs (kind {kind}: no "dpo" header)',
                        'write it with python -m jaxfrontier.prepare --dpo')
    tokens = loss_mask.mark(np.asarray(token_file.tokens), np.asarray(token_file.mask))
    return tokens.reshape(-1, row)


class PairSource:
    """Whole pairs for the trainer: step s's batch is pairs s * G/2 ... of an epoch's order (shuffled per epoch
    with `shuffle`, in file order without: held-out pairs read the same every evaluation), row 2i chosen, 2i + 1
    rejected (make_global_batch's `read_rows`)."""

    def __init__(self, rows_rb: np.ndarray, seed: int, shuffle: bool, name: str):
        self.rows_rb, self.seed, self.shuffle, self.name = rows_rb, seed, shuffle, name
        self.num_pairs, self.seq_len = rows_rb.shape[0] // 2, rows_rb.shape[1] - 1

    def _pairs(self, k: np.ndarray) -> np.ndarray:
        epoch, within = np.divmod(k, self.num_pairs)
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for e in np.unique(epoch):
            order = np.random.default_rng([self.seed, int(e)]).permutation(self.num_pairs)
            out[epoch == e] = order[within[epoch == e]]
        return out

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        """Rows [len(rows), seq_len + 1] int32 of step's global batch (flagged: data/loss_mask.py)."""
        pairs = self._pairs(step * (global_batch // 2) + np.asarray(rows) // 2)
        return self.rows_rb[2 * pairs + np.asarray(rows) % 2].astype(np.int32)

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        return {'data/epoch': (step + 1) * (global_batch // 2) / self.num_pairs}

    def describe(self) -> str:
        return f'{self.num_pairs:,} preference pairs of {self.name} (kind dpo)'


def make_sources(d: Any, vocab_size: int, seed: int) -> tuple[PairSource, PairSource]:
    """(train, held-out) pair sources of `data.path` and `data.val_path` (the latter required)."""
    if not d.val_path:
        raise FlagError('data.val_path', '', 'DPO evaluates on held-out pairs', 'pass the _val.bin of prepare --dpo '
                        '--val_fraction=F')
    train, val = read_rows(d.path, vocab_size), read_rows(d.val_path, vocab_size)
    if train.shape[1] != val.shape[1]:
        raise FlagError('data.val_path', d.val_path, f'has rows of {val.shape[1]} tokens, data.path of '
                        f'{train.shape[1]}', 'prepare both with the same --seq_len')
    return PairSource(train, seed, True, d.path), PairSource(val, seed, False, d.val_path)


def check_run(c: Any) -> None:
    """One line before compiling (no JAX: run/validation.py) for a train.objective the run cannot have, or a DPO
    run that cannot keep pairs whole or is not supported (training/dpo.py)."""
    if c.train.objective not in OBJECTIVES:
        raise ConfigError('train.objective', c.train.objective, 'unknown objective', f'use one of {OBJECTIVES}')
    if c.train.objective != 'dpo':
        return
    if c.mesh.context > 1:
        raise ConfigError('mesh.context', c.mesh.context, 'DPO runs without a context split for now (untested)',
                          'use mesh.context=1')
    if c.mesh.pipeline > 1:
        raise ConfigError('mesh.pipeline', c.mesh.pipeline, 'DPO runs without a pipeline for now (the stages\' '
                          'head-loss unit gives a batch mean, not per-row log-probability sums)',
                          'use mesh.pipeline=1 with fsdp or tensor for the model\'s memory')
    rows = c.train.global_batch // max(1, c.train.accum_steps * c.mesh.data * c.mesh.fsdp)
    if rows % 2:
        raise ConfigError('train.micro_batch', rows, 'a DPO micro-batch holds whole pairs (chosen and rejected '
                          'rows), so each replica\'s rows must be even', 'make train.micro_batch even')
    if not c.checkpoint.init_params_from:
        raise ConfigError('checkpoint.init_params_from', '', 'DPO starts from a trained model, which is also its '
                          'reference', 'pass the SFT run\'s workdir or a Hugging Face directory')
    for field, value, bad in (('model.dtype', c.model.dtype, c.model.dtype == 'float16'),
                              ('train.spike_skip', c.train.spike_skip, c.train.spike_skip),
                              ('data.pack_documents', c.data.pack_documents, c.data.pack_documents)):
        if bad:
            raise ConfigError(field, value, 'not supported with train.objective=dpo (pair rows are not packed; the '
                              'DPO step has no loss scaling or spike guard)', 'use bfloat16 or float32, '
                              'spike_skip=False, pack_documents=False')
    if c.train.dpo_beta <= 0:
        raise ConfigError('train.dpo_beta', c.train.dpo_beta, 'must be positive', 'use e.g. 0.1 (TRL\'s default)')
