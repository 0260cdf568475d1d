"""Sources: what a batch's rows are read from, each row a pure function of (seed, split, step, row).

A TokenSource reads windows of one split of a token file, drawn without replacement within
an epoch (sampling.py: a seeded permutation of the split's windows per epoch); a
SyntheticSource generates random tokens; sampling.BlendSource mixes several TokenSources.
A TokenSource given the file's loss mask flags the tokens whose prediction does not count
(data/loss_mask.py).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxfrontier.data import loss_mask, sampling

TRAIN, VAL = 0, 1  # split ids, part of every sampling seed


class Source(Protocol):
    """What batches are read from: TokenSource or SyntheticSource."""

    seq_len: int

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        ...  # rows `rows` of step's global batch: [len(rows), seq_len + 1] int32

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        ...  # `data/epoch` (per file for a blend): epochs completed once step is read

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSource:
    """Windows of seq_len + 1 tokens sampled from tokens[start:stop] of a token file."""

    tokens: np.ndarray  # [num_tokens], memory-mapped
    start: int
    stop: int
    seq_len: int
    seed: int
    split_id: int  # TRAIN or VAL
    name: str
    mask: np.ndarray | None = None  # [num_tokens] uint8, memory-mapped: sets loss_mask.NOT_COUNTED where 0

    @property
    def num_windows(self) -> int:
        """Windows of one epoch: seq_len + 1 tokens at stride seq_len (sampling.num_windows)."""
        return sampling.num_windows(self.stop - self.start, self.seq_len)

    def offsets_of(self, k: np.ndarray) -> np.ndarray:
        """Start offsets of the source's k-th windows: epoch k // W, permuted position k % W."""
        starts, _ = sampling.window_starts(k, self.stop - self.start, self.seq_len, self.seed, self.split_id)
        return self.start + starts

    def offsets(self, step: int, global_batch: int) -> np.ndarray:
        """Window start offsets [global_batch] of step; windows k = step * global_batch + row."""
        return self.offsets_of(step * global_batch + np.arange(global_batch, dtype=np.int64))

    def read_windows(self, k: np.ndarray) -> np.ndarray:
        """The source's k-th windows: [len(k), seq_len + 1] int32."""
        offsets = self.offsets_of(k)
        out_rl = np.empty((len(offsets), self.seq_len + 1), np.int32)
        for i, offset in enumerate(offsets):
            out_rl[i] = self.tokens[offset:offset + self.seq_len + 1]
            if self.mask is not None:
                out_rl[i] = loss_mask.mark(out_rl[i], self.mask[offset:offset + self.seq_len + 1])
        return out_rl

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        """Reads only rows `rows` of step's global batch: [len(rows), seq_len + 1] int32."""
        return self.read_windows(step * global_batch + np.asarray(rows, dtype=np.int64))

    def epoch_progress(self, step: int, rows_per_step: int) -> float:
        """Epochs completed once `step` is read (1.25: a quarter into epoch 1, counting from 0)."""
        return (step + 1) * rows_per_step / self.num_windows

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        return {'data/epoch': self.epoch_progress(step, global_batch)}

    def describe(self) -> str:
        return (f'{self.name}: tokens [{self.start:,}, {self.stop:,}) of {len(self.tokens):,}, '
                f'{self.num_windows:,} windows per epoch' + (', with its loss mask' if self.mask is not None else ''))


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """Uniformly random tokens for benchmarks; each row a pure function of (seed, split, step, row)."""

    vocab_size: int
    seq_len: int
    seed: int
    split_id: int

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        """Generates rows `rows` of step's global batch: [len(rows), seq_len + 1] int32."""
        del global_batch  # each row has its own stream
        out_rl = np.empty((len(rows), self.seq_len + 1), np.int32)
        for i, row in enumerate(np.asarray(rows, dtype=np.int64)):
            rng = np.random.default_rng([self.seed, self.split_id, step, int(row)])
            out_rl[i] = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return out_rl

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        del step, global_batch
        return {}

    def describe(self) -> str:
        return f'synthetic: uniform tokens in [0, {self.vocab_size})'
