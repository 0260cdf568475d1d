"""Stateless sampling: per-epoch window permutations and blends of several token files.

Everything here is a pure function of (seed, split, step, row): no state is saved, so a run
resumed at any step reads exactly the batches a continuous run would have read.

Epochs: a split of L tokens holds W = (L - 1) // seq_len windows of seq_len + 1 tokens at
stride seq_len (window j is tokens [j * seq_len, j * seq_len + seq_len + 1), so consecutive
windows share one boundary token and every token after the first is a target exactly once).
The k-th window a source reads (k = step * rows_per_step + row) is window
`permutation(seed, split, epoch)[k % W]` of epoch `k // W`, where the permutation is a keyed
Feistel network on [0, W) (cycle-walking): O(1) memory whatever the file size.

Blends (`data.blend = 'w1:path1,w2:path2'`): each step's global batch of B rows gives file i
a fixed n_i rows (B * w_i / sum(w), rounded by largest remainder, every n_i >= 1), at rows
chosen by a seeded permutation of the batch per step; file i's k-th window is then
k = step * n_i + rank, so each file runs its own epochs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

from jaxfrontier.errors import ConfigError


_ROUNDS = 4


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """A 64-bit hash (splitmix64 finaliser) of x ^ key, uint64 -> uint64."""
    with np.errstate(over='ignore'):
        z = (x ^ key) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(index: np.ndarray, size: int, key: Any) -> np.ndarray:
    """The images of `index` (ints in [0, size)) under a pseudorandom permutation of [0, size).

    A balanced Feistel network on the smallest even power of two >= size, keyed by `key`
    (anything np.random.default_rng accepts), with cycle-walking back into [0, size).
    """
    index = np.asarray(index, dtype=np.uint64)
    if size <= 1:
        return np.zeros_like(index, dtype=np.int64)
    half_bits = max(1, math.ceil(math.log2(size) / 2))
    half_mask = np.uint64((1 << half_bits) - 1)
    keys = np.random.default_rng(key).integers(0, 2**63, size=_ROUNDS, dtype=np.int64).astype(np.uint64)

    def once(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half_bits), x & half_mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & half_mask)
        return (left << np.uint64(half_bits)) | right

    out = once(index)
    outside = out >= np.uint64(size)
    while outside.any():  # cycle-walk: the domain is < 4 * size, so a few rounds at most on average
        out[outside] = once(out[outside])
        outside = out >= np.uint64(size)
    return out.astype(np.int64)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len in num_tokens tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def window_starts(k: np.ndarray, num_tokens: int, seq_len: int, seed: int, split_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(start offsets relative to the split, epochs) of the source's k-th windows."""
    k = np.asarray(k, dtype=np.int64)
    w = num_windows(num_tokens, seq_len)
    epochs, positions = k // w, k % w
    starts = np.empty_like(k)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        starts[sel] = permute(positions[sel], w, [seed, split_id, int(epoch)]) * seq_len
    return starts, epochs


# --------------------------------------------------------------------------- blends


def _bad_blend(value: Any, problem: str, fix: str = '') -> ConfigError:
    return ConfigError('data.blend', value, problem,
                       fix or "write data.blend as 'WEIGHT:PATH,WEIGHT:PATH', e.g. '0.7:/data/a.bin,0.3:/data/b.bin'")


def parse_blend(blend: str) -> list[tuple[float, str]]:
    """'0.7:/data/a.bin,0.3:/data/b.bin' -> [(0.7, '/data/a.bin'), (0.3, '/data/b.bin')].

    Raises:
      ConfigError: naming data.blend, for an entry without WEIGHT:PATH or a weight that is
        not a finite number > 0.
    """
    entries = []
    for entry in (e.strip() for e in blend.split(',')):
        weight_text, sep, path = entry.partition(':')
        if not sep or not path.strip() or not weight_text.strip():
            raise _bad_blend(blend, f'the entry {entry!r} is not WEIGHT:PATH')
        try:
            weight = float(weight_text)
        except ValueError:
            raise _bad_blend(blend, f'the weight {weight_text.strip()!r} of {path.strip()} is not a number') from None
        if not (math.isfinite(weight) and weight > 0):
            raise _bad_blend(blend, f'the weight of {path.strip()} is {weight_text.strip()}; weights must be > 0',
                             'give every file a positive weight (they need not sum to 1), or drop the file')
        entries.append((weight, path.strip()))
    return entries


def blend_counts(weights: list[float], global_batch: int) -> list[int]:
    """Rows per step of each file: B * w / sum(w), largest remainder, ties to the earlier file."""
    total = sum(weights)
    exact = [global_batch * w / total for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[:global_batch - sum(counts)]:
        counts[i] += 1
    return counts


def check_blend_counts(blend: str, paths: list[str], weights: list[float], global_batch: int) -> list[int]:
    counts = blend_counts(weights, global_batch)
    for path, count in zip(paths, counts):
        if count == 0:
            raise _bad_blend(blend, f'{path} gets 0 of the {global_batch} rows of a step (its weight is too '
                             'small for train.global_batch)', 'raise its weight or train.global_batch')
    return counts


def source_names(paths: list[str]) -> list[str]:
    """Each file's name in metrics (`data/epoch/<name>`, `eval/loss/<name>`): its stem; a repeated
    stem gets its position appended."""
    stems = [os.path.basename(p)[:-4] if p.endswith('.bin') else os.path.basename(p) for p in paths]
    return [s if stems.count(s) == 1 else f'{s}_{i}' for i, s in enumerate(stems)]


@dataclasses.dataclass(frozen=True, eq=False)
class BlendSource:
    """Rows of each step drawn from several sources, a fixed number n_i per step from source i."""

    sources: tuple[Any, ...]  # TokenSources (one split of each file)
    counts: tuple[int, ...]  # rows per step of each source; sum == global batch
    names: tuple[str, ...]  # each source's name in metrics, source_names()
    weights: tuple[float, ...]  # the blend's weights: the overall eval loss weighs each file's by them
    seed: int
    split_id: int

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    def assignment(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, rank within that source's rows of the step) of each row of step's batch."""
        owner = np.repeat(np.arange(len(self.counts)), self.counts)
        rank = np.concatenate([np.arange(n) for n in self.counts])
        order = np.random.default_rng([self.seed, self.split_id, step, 1]).permutation(len(owner))
        return owner[order], rank[order]

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        if global_batch != sum(self.counts):
            raise ValueError(f'the blend was built for a global batch of {sum(self.counts)}, not {global_batch}')
        owner, rank = self.assignment(step)
        rows = np.asarray(rows, dtype=np.int64)
        out_rl = np.empty((len(rows), self.seq_len + 1), np.int32)
        for i, (source, n) in enumerate(zip(self.sources, self.counts)):
            mine = owner[rows] == i
            if mine.any():
                out_rl[mine] = source.read_windows(step * n + rank[rows][mine])
        return out_rl

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        del global_batch
        return {f'data/epoch/{name}': source.epoch_progress(step, n)
                for name, source, n in zip(self.names, self.sources, self.counts)}

    def describe(self) -> str:
        total = sum(self.counts)
        return 'blend of ' + '; '.join(f'{n}/{total} rows per step from {s.describe()}'
                                       for s, n in zip(self.sources, self.counts))
