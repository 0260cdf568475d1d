"""Bounded words for tokenizer training: one long run of characters must not take hours.

The byte-level pre-tokenizer keeps a run of letters (or of spaces, digits, punctuation) as one
word, and BPE training works on each distinct word's symbols merge after merge: a 1 MiB line of
one repeated character took over 4 minutes to train on, 30 MiB over 10 with no output, though
encoding it takes a second. `bounded(texts)` cuts every run of more than LIMIT non-space (or
space) characters into LIMIT-character pieces, handed to the trainer as separate texts: the
identical pieces of a repeated character count as one word. Text without such runs passes
unchanged, so ordinary corpora train exactly as before; a merge longer than LIMIT characters
cannot be learned (GPT-2's longest token is 128 bytes).
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator

LIMIT = 256  # characters of one word for training
_LONG_RUN = re.compile(r'\S{%d,}|\s{%d,}' % (LIMIT + 1, LIMIT + 1))


def bounded(texts: Iterable[str], limit: int = LIMIT) -> Iterator[str]:
    """`texts`, with each run of more than `limit` non-space (or space) characters cut into pieces of `limit`."""
    long_run = _LONG_RUN if limit == LIMIT else re.compile(r'\S{%d,}|\s{%d,}' % (limit + 1, limit + 1))
    for text in texts:
        start = 0
        for match in long_run.finditer(text):
            if match.start() > start:
                yield text[start:match.start()]
            for i in range(match.start(), match.end(), limit):
                yield text[i:min(i + limit, match.end())]
            start = match.end()
        if start == 0:
            yield text
        elif start < len(text):
            yield text[start:]
