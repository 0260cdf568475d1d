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
  gpipe          F(m, p) at m + p; all backwards after the last forward.
  1f1b_lockstep  F(m, p) at m + p and B(m, p) at m + 2P - 2 - p: after a warm-up of P - 1
                 ticks every stage does one forward and one backward per tick, so a stage
                 holds at most 2(P - p) - 1 micro-batches' stashes (independent of M), where
                 GPipe holds M. A hop costs a whole tick in both directions.
  interleaved    1f1b over V chunks per stage, micro-batches in groups of P (Megatron's
                 order), so the warm-up and drain are made of chunk-sized ticks.
  1f1b           staggered (`Staggered`, below; executor pipeline/staggered.py): half-slots in
                 which neighbouring stages alternate between forward and backward work, so a
                 hop costs half a slot and stage p holds at most P - p chunk inputs, as
                 asynchronous 1F1B does.

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

    def flop_weights(self, occurrence: int, n_branches: int) -> list[float]:
        """flop_count weights of the tick loop's switches, forward then backward.

        Weight of branch b = (stages x ticks running b) / ticks, since the tick scan already
        multiplies its body by the number of ticks; the total is summed over all stages.
        """
        kinds = (self.f_table, self.b_table)[occurrence % 2][..., 0]
        return [float(np.sum(kinds == b)) / self.num_ticks for b in range(n_branches)]

    def hlo_weights(self, n_branches: int) -> list[float]:
        """hlo_collectives weights by branch count (forward 3, backward 5): share of (tick, stage) slots."""
        kinds = {3: self.f_table, 5: self.b_table}[n_branches][..., 0]
        return [float(np.mean(kinds == b)) for b in range(n_branches)]


def _unit_ticks(name: str, p_size: int, m_size: int, v_size: int) -> tuple[dict, dict]:
    """(forward tick, backward tick) of every unit (m, c) for the named schedule."""
    fwd, bwd = {}, {}
    c_last = p_size * v_size - 1
    if name in ('1f1b_lockstep', 'interleaved'):
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


def _colour(intervals: list[tuple[int, int, tuple]], p_size: int) -> tuple[dict, int]:
    """Greedy interval colouring on each stage (unit (m, c) on stage c mod P): a slot stored at
    the end of tick s and read during tick e is free again for a store at the end of tick e.
    Returns (slot of each unit, the most slots a stage needs)."""
    slot_of, most = {}, 1
    for p in range(p_size):
        free_at: list[int] = []  # slot -> tick from whose end it may be stored again
        for start, end, key in sorted(iv for iv in intervals if iv[2][1] % p_size == p):
            for slot, t in enumerate(free_at):
                if t <= start:
                    break
            else:
                slot = len(free_at)
                free_at.append(0)
            free_at[slot] = end
            slot_of[key] = slot
        most = max(most, len(free_at))
    return slot_of, most


def build(name: str, num_stages: int, num_micro: int, virtual: int = 1) -> Schedule | Staggered:
    """Builds and checks the tables of a schedule: half-slot tables for `1f1b` (staggered,
    pipeline/staggered.py), tick tables for the lockstep executor's (pipeline/lockstep.py)."""
    if name == '1f1b':
        if virtual != 1:
            raise ValueError(f'schedule {name!r} has one chunk per stage; virtual stages need interleaved')
        return staggered_1f1b(num_stages, num_micro)
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
    act_slot, act_n = _colour(act_iv, p_size)
    grad_slot, grad_n = _colour(grad_iv, p_size)

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


# --------------------------------------------------------------------------- staggered 1F1B
# A kinds: what a stage does in its A half-slot (a forward, a recomputation, or both).
A_NONE, A_F_FIRST, A_F_MID, A_R, A_R_LAST, A_F_FIRST_R, A_F_MID_R = range(7)
# B kinds: the backward of the chunk from the residuals its A half-slot left.
BS_NONE, BS_FIRST, BS_MID, BS_LAST = range(4)


@dataclasses.dataclass(frozen=True)
class Staggered:
    """Half-slot tables of the staggered 1F1B executor (pipeline/staggered.py), one chunk per stage.

    Time runs in half-slots s. Stage p works on forwards in half-slots with s - p even (A) and
    on backwards when s - p is odd (B), so neighbouring stages are always in opposite phases
    and a message (an activation forward from an A stage, a gradient back from a B stage)
    sent at the end of one half-slot is used in the next: one half-slot per hop in both
    directions, as in asynchronous 1F1B. A half-slot costs two forward-equivalents on every
    busy stage: A = forward of micro-batch m (1) + recomputation, with residuals, of the
    micro-batch whose backward is next (1); B = that backward (2).

      F(m, p) = 2m + p          (p < P - 1; stashes the chunk input in slot m mod P)
      R(m, p) = 2m + 2P - 2 - p (recompute from the stash; p = P - 1: from the received
                                 activation, with head, loss and its gradient)
      B(m, p) = 2m + 2P - 1 - p

    A stage's stash lives from F to R: stage p holds at most P - p chunk inputs (P slots).
    Tables are indexed [half-slot, stage]: a (kind, forward m, recompute m, forward stash
    slot, recompute stash slot) and b (kind, m).
    """

    num_stages: int
    num_micro: int
    a_table: np.ndarray
    b_table: np.ndarray

    name = '1f1b'
    virtual = 1

    @property
    def num_half_slots(self) -> int:
        return self.a_table.shape[0]

    @property
    def num_ticks(self) -> int:
        """Steps of the executor's time (half-slots), for logs and cost models."""
        return self.num_half_slots

    @property
    def act_slots(self) -> int:
        return self.num_stages

    grad_slots = 1  # the one message buffer
    bubble = Schedule.bubble  # (P - 1) / (M + P - 1): V = 1

    def max_stashed_inputs(self) -> int:
        """Largest number of chunk inputs any stage holds at once (checked: at most P - p)."""
        worst = 0
        for p in range(self.num_stages - 1):
            live, best = set(), 0
            for s in range(self.num_half_slots):
                kind, m_f, m_r = self.a_table[s, p, :3]
                if kind in (A_R, A_F_FIRST_R, A_F_MID_R):
                    live.discard(int(m_r))
                if kind in (A_F_FIRST, A_F_MID, A_F_FIRST_R, A_F_MID_R):
                    live.add(int(m_f))
                best = max(best, len(live))
            worst = max(worst, best)
        return worst

    def flop_weights(self, occurrence: int, n_branches: int) -> list[float]:
        """flop_count weights of the loop body's switches, in trace order A0, B0, A1, B1 (half-slot
        parity 0 then 1): weight of branch b = (stages x half-slots of that parity running b) / iterations."""
        half, role = divmod(occurrence % 4, 2)
        kinds = (self.a_table, self.b_table)[role][half::2, :, 0]
        return [float(np.sum(kinds == b)) / (self.num_half_slots // 2) for b in range(n_branches)]

    def hlo_weights(self, n_branches: int) -> list[float]:
        """hlo_collectives weights by branch count (A: 7, B: 4): share of (half-slot, stage) pairs."""
        kinds = {7: self.a_table, 4: self.b_table}[n_branches][..., 0]
        return [float(np.mean(kinds == b)) for b in range(n_branches)]


def staggered_1f1b(num_stages: int, num_micro: int) -> Staggered:
    """Builds and checks the half-slot tables of staggered 1F1B (see `Staggered`)."""
    p_size, m_size = num_stages, num_micro
    n = 2 * m_size + 2 * p_size - 2  # the last backward, B(M - 1, 0), runs in half-slot n - 1
    a = np.zeros((n, p_size, 5), np.int32)
    b = np.zeros((n, p_size, 2), np.int32)
    last = p_size - 1
    for m in range(m_size):
        for p in range(p_size):
            s_b = 2 * m + 2 * p_size - 1 - p
            s_r = s_b - 1
            assert (s_r - p) % 2 == 0 and (s_b - p) % 2 == 1
            kind, m_f, m_r, slot_f, slot_r = a[s_r, p]
            assert kind in (A_NONE, A_F_FIRST, A_F_MID), ('two recomputations in a half-slot', m, p)
            if p == last:
                assert kind == A_NONE
                a[s_r, p] = (A_R_LAST, 0, m, 0, 0)
            else:
                a[s_r, p] = ({A_NONE: A_R, A_F_FIRST: A_F_FIRST_R, A_F_MID: A_F_MID_R}[kind], m_f, m,
                             slot_f, m % p_size)
            assert b[s_b, p, 0] == BS_NONE
            b[s_b, p] = (BS_FIRST if p == 0 else BS_LAST if p == last else BS_MID, m)
            if p < last:
                s_f = 2 * m + p
                kind, _, m_r, _, slot_r = a[s_f, p]
                assert kind in (A_NONE, A_R), ('two forwards in a half-slot', m, p)
                a[s_f, p] = ((A_F_FIRST if p == 0 else A_F_MID) if kind == A_NONE else
                             (A_F_FIRST_R if p == 0 else A_F_MID_R), m, m_r, m % p_size, slot_r)
    # Dependencies hold by construction: F(m, p) = F(m, p - 1) + 1 and B(m, p) = B(m, p + 1) + 1,
    # so a forward uses the activation, a backward the gradient, sent in the previous half-slot.
    sched = Staggered(p_size, m_size, a, b)
    assert sched.max_stashed_inputs() <= p_size
    return sched


def exchange_pairs(num_stages: int, half: int) -> list[tuple[int, int]]:
    """The one `ppermute` after a half-slot of parity `half`: A stages (p = half mod 2) send
    forward to p + 1, B stages back to p - 1; neighbours swap."""
    pairs = []
    for p in range(num_stages):
        to = p + 1 if (p - half) % 2 == 0 else p - 1
        if 0 <= to < num_stages:
            pairs.append((p, to))
    return pairs


# --------------------------------------------------------------------------- forward only (evaluation)
E_NONE, E_FIRST, E_MID, E_LAST = range(4)


@dataclasses.dataclass(frozen=True)
class ForwardOnly:
    """Tick tables of a forward-only pipeline pass (evaluation: no backward, no stash).

    e_table [tick, stage]: (kind, micro-batch, virtual stage, input slot); recv [tick, stage]:
    (valid, slot) for the activation arriving at the end of the tick from the previous stage.
    """

    num_stages: int
    num_micro: int
    virtual: int
    e_table: np.ndarray
    recv: np.ndarray
    slots: int

    @property
    def num_ticks(self) -> int:
        return self.e_table.shape[0]

    def flop_weights(self, occurrence: int, n_branches: int) -> list[float]:
        """flop_count weights of the forward-only loop's one switch."""
        kinds = self.e_table[..., 0]
        return [float(np.sum(kinds == b)) / self.num_ticks for b in range(n_branches)]


def forward_only(num_stages: int, num_micro: int, virtual: int = 1) -> ForwardOnly:
    """Greedy list schedule of the M x C chunk forwards (C = P V; chunk c on stage c mod P):
    each tick, every stage runs its ready unit of the earliest micro-batch. V = 1 gives the
    GPipe wave, unit (m, c) at tick m + c."""
    p_size, m_size, c_size = num_stages, num_micro, num_stages * virtual
    done: dict[tuple[int, int], int] = {}
    t = 0
    while len(done) < m_size * c_size:
        for q in range(p_size):
            ready = [(m, c) for m in range(m_size) for c in range(q, c_size, p_size)
                     if (m, c) not in done and (c == 0 or done.get((m, c - 1), t) < t)]
            if ready:
                done[min(ready)] = t
        t += 1
    slot_of, n_slots = _colour([(done[m, c - 1], done[m, c], (m, c)) for m in range(m_size) for c in range(1, c_size)],
                               p_size)
    e_table = np.zeros((t, p_size, 4), np.int32)
    recv = np.zeros((t, p_size, 2), np.int32)
    for (m, c), tick in done.items():
        kind = E_FIRST if c == 0 else E_LAST if c == c_size - 1 else E_MID
        e_table[tick, c % p_size] = (kind, m, c // p_size, slot_of.get((m, c), 0))
        if c < c_size - 1:
            recv[tick, (c + 1) % p_size] = (1, slot_of[m, c + 1])
    return ForwardOnly(p_size, m_size, virtual, e_table, recv, n_slots)
