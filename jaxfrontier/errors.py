"""The errors that end a run with one line and no traceback (no JAX import)."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad config, data or workdir): shown without a traceback, exit 2."""

    exit_code = 2


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf."""

    exit_code = 3
