"""Ctrl-C during training: the first SIGINT stops like a preemption, a second stops at once.

The first SIGINT asks the loop to stop after the current step, exactly like SIGTERM
(run/control/preemption.py PreemptionWatcher: the step finishes, a checkpoint is committed, the
run exits 0 with the resume line); a second SIGINT restores the default action and re-sends
itself, so the process ends immediately (nothing more is saved; committed checkpoints stay).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator


@contextlib.contextmanager
def first_interrupt_stops(watcher: Any) -> Iterator[None]:
    """Within the block, SIGINT sets `watcher.received = 'SIGINT'` once; the second kills the process.

    Args:
      watcher: a preemption.PreemptionWatcher (its `received` is what the loop asks).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum, frame):  # pylint: disable=unused-argument
        if watcher.received is None:
            watcher.received = 'SIGINT'
            print('SIGINT: stopping after this step with a committed checkpoint; press Ctrl-C again to stop at '
                  'once', file=sys.stderr, flush=True)
            return
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
