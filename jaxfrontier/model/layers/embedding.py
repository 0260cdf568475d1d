"""Embedding lookups: vocabulary-parallel, or rows gathered locally (the head's matmul is linear.py's)."""

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
    replicate the table or the ids. Without vocabulary axes: `lookup_rows`.
    """
    vocab_axes = mesh_lib.active_axes('vocab')
    if not vocab_axes:
        return lookup_rows(table_vd, ids_bt)
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


def lookup_rows(table_rd: jax.Array, ids_bt: jax.Array) -> jax.Array:
    """Rows of a table not split over its rows (an embedding without vocabulary axes):
    [R, d], [B, T] -> [B, T, d].

    Each device gathers its own tokens' rows from a copy of the table whole on it (as the
    vocabulary-parallel lookup holds its vocabulary range whole), and the gradient is one
    all-reduce (the transpose of the map's replicated input) over the axes that split the tokens.
    Left to XLA's partitioner inside a pipeline stage (a map manual over `pipeline` only), the
    gather with tokens over fsdp x context failed in one of two ways, by shapes: at some the
    scatter-add of its gradient moved shards to d over fsdp with a collective-permute inside the
    first stage's `lax.switch` branch, which deadlocked the stages (XLA:CPU's collective-permute
    waits for every device of the process); at others (--mode=verify's shrunk model) partitioning
    the gather aborted the process (spmd_partitioner_util.cc:497). Where no axis splits the tokens:
    a plain gather.
    """
    batch = mesh_lib.active_axes('batch') or None
    length = mesh_lib.active_axes('length') or None
    if batch is None and length is None:
        return jnp.take(table_rd, ids_bt, axis=0)
    return jax.shard_map(lambda local_rd, local_bt: jnp.take(local_rd, local_bt, axis=0),
                         in_specs=(P(), P(batch, length)), out_specs=P(batch, length, None))(table_rd, ids_bt)
