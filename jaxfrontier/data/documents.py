"""Held-out data by documents: prepare's seeded split of a corpus into train and validation files, and shuffle.

The last part of a token stream is a poor validation set when the corpus came in some order
(files sorted by name, a crawl by site): its documents are unlike the ones trained on, and the
eval loss says little. So prepare can pick the validation documents at random (`--val_fraction`
or `--val_documents`, seeded by `--seed`) and write them to their own file, and shuffle the
order of documents (`--shuffle`). A document is what prepare encodes with one end-of-text token
after it: a `.txt` file, a JSONL line, a Parquet row (corpus.py).

prepare first encodes the corpus in order into one temporary stream, counting each document's
tokens; this module then turns the document count into an order (`plan`) and copies documents
from the memory-mapped stream into each output (`write_parts`): O(documents) memory, the tokens
never loaded. Same inputs, tokenizer and seed give byte-identical files.
"""

from __future__ import annotations

import dataclasses
from typing import Any, BinaryIO

import numpy as np

from jaxfrontier.errors import FlagError

_COPY_BUFFER_TOKENS = 1 << 22  # tokens gathered before each write


@dataclasses.dataclass(frozen=True)
class Split:
    """What prepare's split and shuffle flags ask for; `active` is False for a plain, in-order file."""

    val_fraction: float = 0.0
    val_documents: int = 0
    seed: int = 0
    shuffle: bool = False

    @property
    def splits(self) -> bool:
        return bool(self.val_fraction or self.val_documents)

    @property
    def active(self) -> bool:
        return self.splits or self.shuffle

    def check(self) -> None:
        """Raises FlagError for values no corpus could satisfy (before anything is encoded)."""
        if self.val_fraction and self.val_documents:
            raise FlagError('val_fraction', self.val_fraction, 'both --val_fraction and --val_documents are set',
                            'pass one of them')
        if not 0.0 <= self.val_fraction < 1.0:
            raise FlagError('val_fraction', self.val_fraction, 'the validation share must be in [0, 1)',
                            'pass e.g. --val_fraction=0.01')
        if self.val_documents < 0:
            raise FlagError('val_documents', self.val_documents, 'a count of documents must be >= 0',
                            'pass e.g. --val_documents=1000')
        if self.seed < 0:
            raise FlagError('seed', self.seed, 'the seed must be >= 0', 'pass e.g. --seed=0')

    def num_val(self, num_documents: int) -> int:
        """Validation documents of a corpus of num_documents: --val_documents, or the rounded share."""
        n = self.val_documents or round(num_documents * self.val_fraction)
        flag, value = ('val_documents', self.val_documents) if self.val_documents else ('val_fraction', self.val_fraction)
        if num_documents < 2:
            raise FlagError(flag, value, 'one document cannot be split into training and validation documents (a '
                            '.txt file is one document, a JSONL line or Parquet row one each)',
                            f'pass more documents, or drop --{flag}')
        if n < 1:
            raise FlagError(flag, value, f'{value} of {num_documents:,} documents is no document',
                            f'raise --val_fraction to at least {1 / num_documents:.3g}, or pass --val_documents=N')
        if n >= num_documents:
            raise FlagError(flag, value, f'{n:,} validation documents leave none of the {num_documents:,} to train on',
                            f'ask for fewer than {num_documents:,} validation documents')
        return n


def plan(num_documents: int, split: Split) -> dict[str, np.ndarray]:
    """The document ids of each output, in the order written: {'train': ids, 'val': ids} or {'': ids}.

    A seeded permutation of the documents: its first num_val are validation. Without
    --shuffle each output keeps the corpus order; with it, the permutation's order.
    """
    order = np.random.default_rng([split.seed, num_documents]).permutation(num_documents)
    num_val = split.num_val(num_documents) if split.splits else 0
    parts = {'train': order[num_val:], 'val': order[:num_val]} if split.splits else {'': order}
    return {name: ids if split.shuffle else np.sort(ids) for name, ids in parts.items()}


def write_parts(tokens: np.ndarray, lengths: np.ndarray, parts: dict[str, np.ndarray],
                files: dict[str, BinaryIO]) -> dict[str, int]:
    """Copies each part's documents (ids into `lengths`) from the stream `tokens` to its file; tokens written."""
    starts = np.concatenate([[0], np.cumsum(lengths)])
    written = {}
    for name, ids in parts.items():
        out, buffered, size, total = files[name], [], 0, 0
        for i in ids:
            buffered.append(tokens[starts[i]:starts[i + 1]])
            size += int(lengths[i])
            if size >= _COPY_BUFFER_TOKENS:
                out.write(np.concatenate(buffered).tobytes())
                total, buffered, size = total + size, [], 0
        if buffered:
            out.write(np.concatenate(buffered).tobytes())
            total += size
        written[name] = total
    return written


def header_fields(split: Split, part: str, parts: dict[str, np.ndarray]) -> dict[str, Any]:
    """What a header records about the split and shuffle (the trainer warns on an unshuffled tail split)."""
    fields: dict[str, Any] = {'documents_shuffled': split.shuffle}
    if split.splits:
        fields['split'] = {'part': part, 'by': 'document', 'seed': split.seed,
                           'val_fraction': split.val_fraction or None, 'val_documents': len(parts['val']),
                           'train_documents': len(parts['train'])}
    elif split.shuffle:
        fields['shuffle_seed'] = split.seed
    return fields
