"""Where a row's generation ends: its end-of-text token, a stop string in its text, or the length.

Stop strings are matched on the decoded text, on the host, not on token ids: one string has
many tokenizations (`"\\n\\n"` may be one token or two, or end inside a token that also holds
the next word), and only the text sees them all. The decode loop runs on the device in chunks
of `CHECK_EVERY` steps (inference/generate.py: the tokens do not depend on the chunking); after
each chunk the host decodes every unfinished row and marks the rows whose text holds a stop
string, so they stop counting towards "every row done". Cost: one host sync and a decode of
each unfinished row per chunk, and up to `CHECK_EVERY - 1` steps decoded past a stop.

The returned text is cut before the stop string, as vLLM's `stop` does (its default,
`include_stop_str_in_output=False`); Hugging Face's `stop_strings` keeps it. The returned
tokens run through the token that completed the stop string (what the model produced), and
stop before an end-of-text token, which is not part of the text either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxfrontier.errors import UserError

CHECK_EVERY = 16  # decode steps between the host's looks at the text


@dataclasses.dataclass(frozen=True)
class Ending:
    tokens: list[int]
    text: str
    reason: str  # 'stop' (a stop string), 'eot' (the end-of-text token) or 'length' (--max_new_tokens)


def check_stops(stops: list[str]) -> list[str]:
    """The stop strings, refusing an empty one (it would match before the first token)."""
    for s in stops:
        if not s:
            raise UserError('--stop="" would stop every row before its first token. Fix: give a non-empty '
                            'string, or leave --stop out.')
    return list(stops)


def before_eot(tokens: list[int], eot_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    at = next((i for i, t in enumerate(tokens) if t in eot_ids), None)
    return (tokens, False) if at is None else (tokens[:at], True)


def first_stop(text: str, stops: list[str]) -> int:
    """Where the earliest stop string starts in `text` (-1: none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def has_stopped(codec: Any, tokens: list[int], stops: list[str], eot_ids: tuple[int, ...]) -> bool:
    """Whether a row's tokens so far end its generation (end-of-text, or a stop string in its text)."""
    tokens, eot = before_eot(tokens, eot_ids)
    return eot or (bool(stops) and first_stop(codec.decode(tokens), stops) >= 0)


def ending(codec: Any, tokens: list[int], stops: list[str], eot_ids: tuple[int, ...]) -> Ending:
    """A row's output: the tokens and text it keeps, and why it ended (see the module docstring)."""
    tokens, eot = before_eot(tokens, eot_ids)
    text = codec.decode(tokens)
    at = first_stop(text, stops) if stops else -1
    if at < 0:
        return Ending(tokens, text, 'eot' if eot else 'length')
    n = next(n for n in range(1, len(tokens) + 1) if first_stop(codec.decode(tokens[:n]), stops) >= 0)
    kept = codec.decode(tokens[:n])
    return Ending(tokens[:n], kept[:first_stop(kept, stops)], 'stop')
