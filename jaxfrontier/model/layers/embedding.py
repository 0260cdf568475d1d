"""The vocabulary-parallel embedding lookup (the head's matmul is linear.py's, model/decoder.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfrontier import mesh as mesh_lib


def embedding_lookup(table_vd: jax.Array, ids_bt: jax.Array) -> jax.Array:
    """Rows of a (vocabulary-parallel) embedding table: [V, d], [B, T] -> [B, T, d].

    Megatron's vocabulary-parallel embedding: each tensor-parallel shard looks up the ids
    in its vocabulary range, zeroes the rest, and one all-reduce (psum) over the vocabulary
    axes sums the pieces. XLA's automatic partitioning of this gather would instead
    replicate the table or the ids.
    """
    vocab_axes = mesh_lib.active_axes('vocab')
    if not vocab_axes:
        return jnp.take(table_vd, ids_bt, axis=0)
    batch = mesh_lib.active_axes('batch') or None
    length = mesh_lib.active_axes('length') or None  # each context rank looks up its own part of T
    vocab = vocab_axes if len(vocab_axes) > 1 else vocab_axes[0]

    def local_lookup(local_vd, ids):
        rows = local_vd.shape[0]
        start = jax.lax.axis_index(vocab_axes) * rows
        local_ids = ids - start
        inside = (local_ids >= 0) & (local_ids < rows)
        x = jnp.take(local_vd, jnp.where(inside, local_ids, 0), axis=0)
        return jax.lax.psum(jnp.where(inside[..., None], x, 0), vocab_axes)

    return jax.shard_map(local_lookup, in_specs=(P(vocab, None), P(batch, length)),
                         out_specs=P(batch, length, None))(table_vd, ids_bt)
