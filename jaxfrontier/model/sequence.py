"""What a block knows about the tokens of its micro-batch: `Seq` (length, positions, documents).

Training's blocks are called as `block(x_nd, seq, key)` on flat activations [B*T, d]. `seq`
is an int (the sequence length T: contiguous sequences, positions 0..T-1, one document per
row: causal attention) or a `Seq`, which adds
  positions_bt  [B, T] int32: each token's position in its row (or in its document, where
                documents are packed and positions restart; and in the token order context
                parallelism's load balancing chooses); the causal mask and RoPE / learned
                positions read these.
  segments_bt   [B, T] int32: the document each token belongs to (packed documents); a
                token attends only to tokens of its own segment. None: one document per row.
A `Seq` is a pytree (positions and segments are its leaves, the length is static), so it
travels through scans, remat and custom VJPs like an activation.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Seq:
    length: int
    positions_bt: jax.Array | None = None
    segments_bt: jax.Array | None = None

    @property
    def plain(self) -> bool:
        """Contiguous positions 0..T-1 and one document per row: the kernels' causal fast path."""
        return self.positions_bt is None and self.segments_bt is None


jax.tree_util.register_dataclass(Seq, data_fields=['positions_bt', 'segments_bt'], meta_fields=['length'])


def as_seq(seq: int | Seq) -> Seq:
    """`seq` as a Seq (an int is a plain sequence of that length)."""
    return seq if isinstance(seq, Seq) else Seq(int(seq))


def positions(seq: int | Seq, batch: int) -> jax.Array:
    """Positions [B, T] of `seq`: its own, or 0..T-1 in every row."""
    seq = as_seq(seq)
    if seq.positions_bt is not None:
        return seq.positions_bt
    return jnp.broadcast_to(jnp.arange(seq.length, dtype=jnp.int32)[None, :], (batch, seq.length))


def balanced_order(seq_len: int, context: int) -> np.ndarray:
    """The causal load-balanced token order of context parallelism (zigzag): a permutation of 0..T-1.

    The sequence is cut into 2c equal chunks and context rank r holds chunks r and 2c-1-r (one
    from the front, its mirror from the back), laid out rank by rank: [0, 2c-1, 1, 2c-2, ...].
    Under a causal mask the work of a query chunk grows with its position, so each rank's pair
    sums to the same work (ring.ring_block_pairs counts it). The order doubles as the tokens'
    positions (position = index in the natural sequence).
    """
    if context < 1 or seq_len % (2 * context):
        raise ValueError(f'balanced_order needs the sequence ({seq_len}) to split into 2 x context '
                         f'({2 * context}) equal chunks')
    chunks = np.arange(seq_len).reshape(2 * context, seq_len // (2 * context))
    return np.concatenate([chunks[i] for r in range(context) for i in (r, 2 * context - 1 - r)])
