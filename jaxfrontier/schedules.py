"""Pipeline schedules as static tick tables (pure NumPy; no JAX).

The model's layers are cut into C = P x V chunks; chunk c runs on pipeline stage c mod P
(virtual stage c // P), so with V > 1 each stage holds V chunks, assigned round-robin. A unit
of work is (micro-batch m, chunk c). Time advances in ticks; in one tick every stage may do
one forward unit (F) and one backward unit (B), then passes the forward output to the next
stage and the input gradient to the previous one (a ring `ppermute`). A backward unit
recomputes each layer's forward from that layer's stashed input (per-layer full
recomputation, as Megatron does with pipelines), and the last chunk's forward is folded into
its backward, where the loss is computed.

Schedules (the tick of each unit; everything else follows):
  gpipe        F(m, p) at m + p; all backwards after the last forward.
  1f1b         F(m, p) at m + p and B(m, p) at m + 2P - 2 - p: after a warm-up of P - 1
               ticks every stage does one forward and one backward per tick, so a stage
               holds at most 2(P - p) - 1 micro-batches' stashes (independent of M), where
               GPipe holds M.
  interleaved  1f1b over V chunks per stage, micro-batches in groups of P (Megatron's
               order), so the warm-up and drain are made of chunk-sized ticks.

`build` checks every dependency (a unit runs strictly after the unit it needs, one tick for
the ring transfer) and at most one F and one B per stage per tick, then assigns buffer slots
for stashed inputs and received gradients by interval colouring.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxfrontier.config import PIPELINE_SCHEDULES as SCHEDULES

# Forward kinds: nothing, first chunk (embeds the tokens), a middle chunk (stashed input).
F_NONE, F_FIRST, F_MID = 0, 1, 2
# Backward kinds: nothing; first chunk; middle; last chunk (fused forward + head + loss);
# the only chunk (C == 1: embed, layers, head and loss in one).
B_NONE, B_FIRST, B_MID, B_LAST, B_ONLY = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Static tick tables of a pipeline schedule, indexed [tick, stage, field].

    f_table fields: kind, micro-batch, virtual stage, input slot.
    b_table fields: kind, micro-batch, virtual stage, input slot, gradient slot.
    recv_f / recv_b fields: valid, slot (where this stage stores what it receives at the end
    of the tick from the previous / next stage).
    """

    name: str
    num_stages: int
    num_micro: int
    virtual: int
    f_table: np.ndarray
    b_table: np.ndarray
    recv_f: np.ndarray
    recv_b: np.ndarray
    act_slots: int
    grad_slots: int

    @property
    def num_ticks(self) -> int:
        return self.f_table.shape[0]

    @property
    def bubble(self) -> float:
        """Theoretical bubble fraction (P - 1) / (V M + P - 1) of the step time."""
        p, m, v = self.num_stages, self.num_micro, self.virtual
        return (p - 1) / (v * m + p - 1)

    def max_stashed_inputs(self) -> int:
        return self.act_slots


def _unit_ticks(name: str, p_size: int, m_size: int, v_size: int) -> tuple[dict, dict]:
    """(forward tick, backward tick) of every unit (m, c) for the named schedule."""
    fwd, bwd = {}, {}
    c_last = p_size * v_size - 1
    if name in ('1f1b', 'interleaved'):
        k_f = k_b = 0
        for g in range(-(-m_size // p_size)):
            group = [m for m in range(g * p_size, (g + 1) * p_size) if m < m_size]
            for v in range(v_size):
                for m in group:
                    for p in range(p_size):
                        fwd[m, v * p_size + p] = k_f + p
                    k_f += 1
            for v in reversed(range(v_size)):
                for m in group:
                    for p in range(p_size):
                        bwd[m, v * p_size + p] = k_b + v_size * p_size - 1 + (p_size - 1 - p)
                    k_b += 1
    elif name == 'gpipe':
        start_b = m_size + p_size - 2
        for m in range(m_size):
            for p in range(p_size):
                fwd[m, p] = m + p
                bwd[m, p] = start_b + m + (p_size - 1 - p)
    else:
        raise ValueError(f'unknown pipeline schedule {name!r}; use one of {SCHEDULES}')
    for m in range(m_size):
        del fwd[m, c_last]  # folded into the last chunk's backward
    return fwd, bwd


def _check(fwd: dict, bwd: dict, p_size: int, m_size: int, c_size: int) -> None:
    for m in range(m_size):
        for c in range(c_size):
            if 0 < c < c_size - 1:
                assert fwd[m, c] > fwd[m, c - 1], ('forward order', m, c)
            if c == c_size - 1 and c > 0:
                assert bwd[m, c] > fwd[m, c - 1], ('last chunk input', m, c)
            if c < c_size - 1:
                assert bwd[m, c] > bwd[m, c + 1], ('backward order', m, c)
                assert bwd[m, c] >= fwd[m, c], ('backward before forward', m, c)
    for table in (fwd, bwd):
        seen = set()
        for (m, c), t in table.items():
            key = (t, c % p_size)
            assert key not in seen, ('two units in one tick', m, c, t)
            seen.add(key)


def _colour(intervals: list[tuple[int, int, tuple]]) -> tuple[dict, int]:
    """Greedy interval colouring: a slot stored at the end of tick s and read during tick e
    is free again for a store at the end of tick e."""
    free_at: list[int] = []  # slot -> tick from whose end it may be stored again
    slot_of = {}
    for start, end, key in sorted(intervals):
        for slot, t in enumerate(free_at):
            if t <= start:
                break
        else:
            slot = len(free_at)
            free_at.append(0)
        free_at[slot] = end
        slot_of[key] = slot
    return slot_of, max(1, len(free_at))


def build(name: str, num_stages: int, num_micro: int, virtual: int = 1) -> Schedule:
    """Builds and checks the tick tables of a schedule."""
    p_size, m_size, v_size = num_stages, num_micro, virtual
    if name != 'interleaved' and v_size != 1:
        raise ValueError(f'schedule {name!r} has one chunk per stage; virtual stages need interleaved')
    c_size = p_size * v_size
    fwd, bwd = _unit_ticks(name, p_size, m_size, v_size)
    _check(fwd, bwd, p_size, m_size, c_size)
    n_ticks = max(bwd.values()) + 1

    # Stashed layer inputs of unit (m, c): for c > 0 the chunk input arrives at the end of
    # F(m, c-1); chunk 0 writes its stash during F(m, 0) (so it needs a slot free before that
    # tick). B(m, c) reads it. A single chunk (C == 1) computes everything in its backward.
    act_iv = [(fwd[m, c - 1] if c else fwd[m, 0] - 1, bwd[m, c], (m, c))
              for m in range(m_size) for c in range(c_size) if c_size > 1]
    # Input gradients of chunks c < C-1: received at the end of B(m, c+1), read by B(m, c).
    grad_iv = [(bwd[m, c + 1], bwd[m, c], (m, c)) for m in range(m_size) for c in range(c_size - 1)]
    act_slot, act_n = {}, 1
    grad_slot, grad_n = {}, 1
    for p in range(p_size):
        slots, n = _colour([iv for iv in act_iv if iv[2][1] % p_size == p])
        act_slot.update(slots)
        act_n = max(act_n, n)
        slots, n = _colour([iv for iv in grad_iv if iv[2][1] % p_size == p])
        grad_slot.update(slots)
        grad_n = max(grad_n, n)

    f_table = np.zeros((n_ticks, p_size, 4), np.int32)
    b_table = np.zeros((n_ticks, p_size, 5), np.int32)
    recv_f = np.zeros((n_ticks, p_size, 2), np.int32)
    recv_b = np.zeros((n_ticks, p_size, 2), np.int32)
    for (m, c), t in fwd.items():
        p, v = c % p_size, c // p_size
        f_table[t, p] = (F_FIRST if c == 0 else F_MID, m, v, act_slot.get((m, c), 0))
        recv_f[t, (c + 1) % p_size] = (1, act_slot[m, c + 1])
    for (m, c), t in bwd.items():
        p, v = c % p_size, c // p_size
        kind = B_ONLY if c_size == 1 else B_FIRST if c == 0 else B_LAST if c == c_size - 1 else B_MID
        b_table[t, p] = (kind, m, v, act_slot.get((m, c), 0), grad_slot.get((m, c), 0))
        if c > 0:
            recv_b[t, (c - 1) % p_size] = (1, grad_slot[m, c - 1])
    return Schedule(name, p_size, m_size, v_size, f_table, b_table, recv_f, recv_b, act_n, grad_n)


def layer_order(num_layers: int, num_stages: int, virtual: int) -> np.ndarray:
    """Storage position -> model layer, so that stage p's contiguous slice holds its chunks.

    Stage p stores chunks p, P + p, 2P + p, ... (each num_layers / (P V) layers) in that
    order. The identity when V == 1.
    """
    per_chunk = num_layers // (num_stages * virtual)
    order = [(v * num_stages + p) * per_chunk + j
             for p in range(num_stages) for v in range(virtual) for j in range(per_chunk)]
    return np.asarray(order, np.int32)
