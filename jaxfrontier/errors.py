"""The errors a user can fix: shown as one line without a traceback (no JAX import)."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix (bad config, data or workdir): shown without a traceback, exit 2."""

    exit_code = 2
