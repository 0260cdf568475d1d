"""Loggers that write on process 0 only (no JAX import: JAX is asked only once it is loaded).

Every module logs under its own name, `logs.process0(__name__)`, so a line is attributed to
the module that wrote it. Under `absl.app` (every entry point) absl's handler on the root
logger formats and shows these records at the verbosity `main` sets.
"""

from __future__ import annotations

import logging
import sys


class _Process0(logging.Filter):
    """Passes records only in JAX process 0 (or before JAX is imported: one process)."""

    def filter(self, record: logging.LogRecord) -> bool:
        jax = sys.modules.get('jax')
        return jax is None or jax.process_index() == 0


def process0(name: str) -> logging.Logger:
    """The logger `name`, silent on every process but 0 (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Process0) for f in logger.filters):
        logger.addFilter(_Process0())
    return logger
