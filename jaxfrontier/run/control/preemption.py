"""Preemption: signals (Slurm's SIGTERM, an early-warning SIGUSR1) become a stop that every process agrees on.

The loop finishes its step, saves, waits for the commit and returns (checkpoint/manager.py,
docs/checkpoints.md).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
import ml_collections

_BARRIER_TIMEOUT_MS = 30 * 60 * 1000


class PreemptionWatcher:
    """Turns the signals in config.checkpoint.preemption_signals into a stop request.

    The handler only records the signal. `should_stop(step)` is asked after every step; with
    several processes they agree (through the JAX coordination service, every
    config.checkpoint.preemption_sync_every steps) so that all stop after the same step even
    if the signal reached them at different steps. Use as a context manager: the previous
    handlers come back on exit.
    """

    def __init__(self, cc: ml_collections.ConfigDict):
        self.signals = [signal.Signals[name] for name in cc.preemption_signals]
        self.sync_every = int(cc.preemption_sync_every)
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum, frame) -> None:  # pylint: disable=unused-argument
        self.received = signal.Signals(signum).name

    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def should_stop(self, step: int) -> bool:
        """Whether every process should stop after `step` (the step just dispatched)."""
        if jax.process_count() == 1:
            return self.received is not None
        if step % self.sync_every:
            return False
        from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top  (no public API)
        agreed = agree_any(global_state.client, f'jaxfrontier/preempt/{step}', self.received, jax.process_index())
        self.received = self.received or agreed
        return agreed is not None


def agree_any(client: Any, key: str, value: str | None, process: int) -> str | None:
    """On every process, the smallest `value` any process holds (None if none does).

    One barrier on the JAX coordination service: each process holding a value writes it to
    `<key>/<process>` before the barrier; after it every process reads the same directory, so
    all decide alike. Host-only: the devices are not touched.
    """
    if value is not None:
        client.key_value_set(f'{key}/{process}', value)
    client.wait_at_barrier(key.replace('/', '_'), _BARRIER_TIMEOUT_MS)
    return min((v for _, v in client.key_value_dir_get(f'{key}/')), default=None)
