"""`jax.lax.ragged_all_to_all` on the GPUs, and its exact stand-in where XLA has none (XLA:CPU).

XLA:CPU's thunk emitter has no ragged-all-to-all (jax 0.10: "HLO opcode ragged-all-to-all is not
supported by XLA:CPU ThunkEmitter"); NVIDIA (NCCL) and AMD (RCCL) GPUs have it. `ragged_all_to_all` picks
per platform when the program is lowered (`jax.lax.platform_dependent`): the collective itself on cuda
and rocm, `stand_in` on the CPU, so the MoE dispatch around it (model/layers/moe_parallel.py), the layout
tests and `--mode=verify` run the same code on every platform, and a program lowered for cuda or rocm
from a CPU machine (`lowering_platforms`) holds the real op.

The stand-in has the op's semantics exactly (the arguments as jax.lax.ragged_all_to_all documents them:
slice i of the caller's `operand`, rows input_offsets[i] .. + send_sizes[i], goes to device
i // (N / axis size) and lands there at output_offsets[i]; rows of `output` no slice covers keep their
value), built from collectives the CPU has: every device all-gathers the operands and the offsets and
copies the slices addressed to it. It moves every device's whole operand (the planner counts the real
op's bytes, plan/moe.py), and it is differentiable through all-gather and gather (the real op's
transpose is a ragged-all-to-all the other way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PLATFORMS_WITH_OP = ('cuda', 'rocm')


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, axis_name: str) -> jax.Array:
    """jax.lax.ragged_all_to_all over `axis_name` (inside a map manual over it): the op on GPUs, the
    stand-in elsewhere; the same result on every platform."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    def real(*a):
        return jax.lax.ragged_all_to_all(*a, axis_name=axis_name)

    def emulated(*a):
        return stand_in(*a, axis_name=axis_name)

    return jax.lax.platform_dependent(*args, cpu=emulated, cuda=real, rocm=real, default=emulated)


def stand_in(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
             output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """ragged_all_to_all's result from all-gathers (the module docstring). `recv_sizes` is implied by the
    senders' sizes (the op requires them to agree) and not read."""
    del recv_sizes
    size = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    per_device = input_offsets.shape[0] // size
    operands = jax.lax.all_gather(operand, axis_name)  # [D, M, ...]
    in_off, sizes, out_off = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    # The slices addressed to this device: slot j of sender s for j in [me*per_device, (me+1)*per_device).
    mine = me * per_device + jnp.arange(per_device)
    src_s, starts, lens, dst = (a[:, mine].reshape(-1) for a in
                                (jnp.broadcast_to(jnp.arange(size)[:, None], in_off.shape), in_off, sizes, out_off))
    rows = output.shape[0]
    # Each output row's slice: the slices do not overlap, so the nearest start at or before the row names
    # it (a running maximum of the starts scattered to their rows); empty slices scatter nowhere.
    slot = jnp.arange(src_s.shape[0], dtype=jnp.int32)
    where_r = jnp.where(lens > 0, dst, rows)
    start_r = jax.lax.cummax(jnp.full((rows,), -1, jnp.int32).at[where_r].max(where_r.astype(jnp.int32),
                                                                               mode='drop'))
    slot_r = jnp.zeros((rows,), jnp.int32).at[where_r].set(slot, mode='drop')[jnp.maximum(start_r, 0)]
    row = jnp.arange(rows, dtype=jnp.int32)
    covered = (start_r >= 0) & (row < start_r + lens[slot_r])
    source_row = jnp.clip(starts[slot_r] + row - start_r, 0, operand.shape[0] - 1)
    received = operands[src_s[slot_r], source_row]
    mask = covered.reshape((rows,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, received.astype(output.dtype), output)
