"""Shared machinery of the fuzz suite (tests/fuzz/, STYLE.md 17, issue 28).

Every reader of a file a user or another tool hands us is fed generated and mutated inputs by
Hypothesis; the property is always the same: a UserError of one line, or a correct result
(checked by the test), never another exception (a traceback), never a hang (each input is bounded
by Hypothesis' deadline), never a write outside the named output (`snapshot` before and after).

Two tiers per reader: `fast` runs in the normal suite, derandomized (the same inputs every run,
a few seconds per reader); `slow` (`-m slow`) draws a larger random budget. Defects found are
fixed and kept as `@example`s (`examples=` of `fuzz`). `COUNTS` holds the inputs tried per reader;
tests/fuzz/conftest.py prints them at the end of the run.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import signal
from typing import Any, Callable, Iterable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxfrontier.errors import UserError

COUNTS: collections.Counter[str] = collections.Counter()
FAST, SLOW = 100, 1000  # inputs per reader and tier (fast: derandomized, a few seconds each)


def tiers(fast: int = FAST, slow: int = SLOW):
    """Parametrizes a test over the budgets: `fast` in the normal suite, `slow` under -m slow."""
    return pytest.mark.parametrize('budget', [fast, pytest.param(slow, marks=pytest.mark.slow)], ids=['fast', 'slow'])


def fuzz(reader: str, strategy: st.SearchStrategy, check: Callable[[Any], None], budget: int, *,
         examples: Iterable[Any] = (), deadline_ms: int = 2000) -> None:
    """Runs `check` on `budget` inputs drawn from `strategy` (and every example), counting them."""
    @settings(max_examples=budget, deadline=datetime.timedelta(milliseconds=deadline_ms), database=None,
              derandomize=budget <= FAST * 4, suppress_health_check=list(HealthCheck), print_blob=True)
    @given(strategy)
    def run(value):
        COUNTS[reader] += 1
        with hang_guard(5 * deadline_ms / 1000):
            check(value)

    for value in examples:
        run = example(value)(run)
    run()


class Hang(Exception):
    """One input ran far past its deadline: a reader that would hang (Hypothesis' deadline waits for it to end)."""


@contextlib.contextmanager
def hang_guard(seconds: float):
    """Raises Hang in the main thread after `seconds` (SIGALRM), so a hanging reader fails instead of stalling."""
    def alarm(signum, frame):
        raise Hang(f'one input ran over {seconds:.0f} s')

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def one_line(e: BaseException) -> str:
    """The message of a user error: non-empty, one line."""
    message = str(e)
    assert message.strip() and '\n' not in message, repr(message)
    return message


def user_error_or(fn: Callable[[], Any], errors: tuple[type[BaseException], ...] = (UserError,)) -> Any:
    """fn()'s result, or the UserError it raised (checked to be one line); anything else propagates."""
    try:
        return fn()
    except errors as e:
        one_line(e)
        return e


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime_ns)} of every file under root (to show a reader wrote nothing)."""
    out = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            st_ = os.stat(path)
            out[path] = (st_.st_size, st_.st_mtime_ns)
    return out


# --------------------------------------------------------------------------- strategies

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=12)


def mutated_dict(base: dict[str, Any], keys: Iterable[str] | None = None) -> st.SearchStrategy:
    """`base` with a few fields replaced by any JSON value, deleted, or added."""
    keys = sorted(keys if keys is not None else base)

    def apply(edits):
        out = dict(base)
        for kind, key, value in edits:
            if kind == 'set':
                out[key] = value
            elif kind == 'del':
                out.pop(key, None)
            else:
                out[f'extra_{key}'] = value
        return out

    edit = st.tuples(st.sampled_from(['set', 'set', 'del', 'add']), st.sampled_from(keys), json_values)
    return st.lists(edit, max_size=3).map(apply)


def mutated_bytes(data: bytes) -> st.SearchStrategy:
    """`data` truncated, extended, or with a few bytes overwritten."""
    def apply(edits):
        out = bytearray(data)
        for kind, position, value in edits:
            if not out:
                out = bytearray(value)
                continue
            i = position % len(out)
            if kind == 'flip':
                out[i] = value[0] if value else (out[i] ^ 0xFF)
            elif kind == 'cut':
                del out[i:]
            elif kind == 'insert':
                out[i:i] = value
        return bytes(out)

    edit = st.tuples(st.sampled_from(['flip', 'flip', 'cut', 'insert']), st.integers(0, 1 << 30),
                     st.binary(max_size=8))
    return st.lists(edit, min_size=1, max_size=4).map(apply)
