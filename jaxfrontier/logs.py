"""Loggers that write on process 0 only (no JAX import: JAX is asked only once it is loaded).

Every module logs under its own name, `logs.process0(__name__)`, so a line is attributed to
the module that wrote it. Under `absl.app` (every entry point) absl's handler on the root
logger formats and shows these records at the verbosity `main` sets.

At that verbosity (INFO) the libraries' own INFO records show too; `quiet_library_logs` keeps
the ones that say nothing a user can act on to their warnings (QUIET_LOGGERS).
"""

from __future__ import annotations

import logging
import os
import sys


# Library loggers whose INFO records are noise to a user: JAX's backend probing ("Unable to initialize backend
# 'tpu': ... libtpu.so" on every machine without a TPU, and likewise for each GPU plugin absent), and the
# Hugging Face `datasets` library's start-up notes ("JAX version ... available"; --mode=lm_eval). Their
# warnings and errors still show; JAX's other loggers (jax._src.distributed: joining a job) keep INFO.
# Orbax's INFO chatter is dropped by checkpoint/manager.quiet_orbax_logs (Orbax logs through absl's logger).
QUIET_LOGGERS = ('jax._src.xla_bridge', 'datasets')
# Libraries that log INFO through absl's own logger, by the file that writes it: optax's schedules
# ("A polynomial schedule was set with a non-positive `transition_steps`": --mode=verify's shrunk
# configs have no warmup, issue 39).
QUIET_ABSL_FILES = (os.path.join('optax', 'schedules', ''),)


class _QuietAbslInfo(logging.Filter):
    """Drops INFO (and lower) records of QUIET_ABSL_FILES from absl's logger; their warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not any(f in record.pathname for f in QUIET_ABSL_FILES)


def quiet_library_logs() -> None:
    """Raises QUIET_LOGGERS to WARNING and filters QUIET_ABSL_FILES' INFO (idempotent; before or after the
    libraries are imported)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    absl_logger = logging.getLogger('absl')
    if not any(isinstance(f, _QuietAbslInfo) for f in absl_logger.filters):
        absl_logger.addFilter(_QuietAbslInfo())


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
