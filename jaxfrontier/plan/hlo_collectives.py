"""Collectives of a compiled XLA program: kind, mesh axes, bytes and how often each runs.

`collectives(hlo_text, mesh_shape)` reads the optimised HLO text of an SPMD program
(`compiled.as_text()`) and returns one `Collective` per collective instruction, with the
mesh axes its device groups span (from the replica groups, whatever their printed form),
its payload in bytes per device, and its execution count per program run (instructions in a
while loop body run once per iteration; XLA prints the trip count of scan loops).

Payload convention (per device, per execution), used by the planner as well:
  all-reduce          the reduced buffer
  all-gather          the gathered (output) buffer
  reduce-scatter      the input buffer (output x group size)
  collective-permute  the sent buffer
  all-to-all          the buffer

This module only parses text: it needs no devices and does not import JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence

import numpy as np

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')

DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4,
               'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16}

_ARRAY_RE = re.compile(r'\b([a-z]+[0-9]*)\[([0-9,]*)\]')
_COMPUTATION_RE = re.compile(r'^(?:ENTRY\s+)?%([^\s(]+)\s*\(')
_INSTRUCTION_RE = re.compile(r'^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$')
_CALLEE_RE = re.compile(r'\b(body|calls|to_apply|true_computation|false_computation)=%([^\s,)}]+)')
_BRANCHES_RE = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    name: str
    kind: str  # one of KINDS
    axes: tuple[str, ...]  # mesh axes its groups span, outermost first; () for a no-op group
    group_size: int
    payload_bytes: int  # per device and execution, see the module docstring
    count: float  # executions per program run (averaged over devices inside weighted branches)

    @property
    def total_bytes(self) -> float:
        return self.payload_bytes * self.count


def array_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape (an array or a tuple of arrays), e.g. '(f32[2,3]{1,0}, bf16[4])'."""
    total = 0
    for dtype, dims in _ARRAY_RE.findall(shape_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[] and friends
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
    return total


def _split_shape(rest: str) -> tuple[str, str]:
    """'(a, b) op(...)' or 'f32[2]{0} op(...)' -> (shape text, text after the shape)."""
    if rest.startswith('('):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == '('
            depth -= ch == ')'
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    shape, _, tail = rest.partition(' ')
    return shape, tail


def _tuple_elements(shape: str) -> list[str]:
    """Top-level elements of a tuple shape '(a, (b, c), d)' -> ['a', '(b, c)', 'd']."""
    if not shape.startswith('('):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        depth += ch in '([{'
        depth -= ch in ')]}'
        if (ch == ',' and depth == 1) or (depth == 0 and i == len(shape) - 1):
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts


def _parse_iota(text: str) -> np.ndarray:
    """'[4,2]<=[2,2,2]T(2,1,0)' -> the [4, 2] array of device ids; '[2,2]T(1,0)' -> [2, 2]."""
    m = re.fullmatch(r'(?:\[([0-9,]+)\]<=)?\[([0-9,]+)\](?:T\(([0-9,]+)\))?', text)
    if not m:
        raise ValueError(f'unrecognised iota device list {text!r}')
    dims = [int(x) for x in m.group(2).split(',')]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(',')])
    return ids.reshape([int(x) for x in m.group(1).split(',')]) if m.group(1) else ids


def replica_groups(attrs: str, n_devices: int) -> list[list[int]]:
    """Device groups of a collective from its attribute text (every form XLA prints)."""
    if 'source_target_pairs=' in attrs:
        pairs = re.search(r'source_target_pairs=\{(.*?)\}\}', attrs + '}')
        return [[int(a), int(b)] for a, b in re.findall(r'\{(\d+),(\d+)\}', pairs.group(1) + '}')]
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*(?:\([^)]*\))?)\))? \{([^}]*)\}", attrs)
    if m:  # named-mesh form: mesh['a'=2,'b'=4], device_ids=(iota) {'a'}
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = (_parse_iota(m.group(2)).reshape(sizes) if m.group(2)
               else np.arange(math.prod(sizes)).reshape(sizes))
        varying = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        fixed = [i for i in range(len(names)) if i not in varying]
        return ids.transpose(fixed + varying).reshape(-1, math.prod(sizes[i] for i in varying)).tolist()
    m = re.search(r'replica_groups=(\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)', attrs)
    if m:
        return _parse_iota(m.group(1)).tolist()
    m = re.search(r'replica_groups=\{((?:\{[0-9,]*\},?)*)\}', attrs)
    if m:
        groups = [[int(x) for x in g.split(',') if x] for g in re.findall(r'\{([0-9,]*)\}', m.group(1))]
        return groups or [list(range(n_devices))]
    raise ValueError(f'no replica groups in {attrs[:200]!r}')


def group_axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the members of the groups differ (mesh ids are row-major)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying: set[int] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [members, axes]
        varying.update(int(i) for i in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(names[i] for i in sorted(varying))


def _computations(hlo_text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION_RE.match(line)
        if m and line.rstrip().endswith('{'):
            current = m.group(1)
            comps[current] = []
        elif line.startswith('}'):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _entry_name(hlo_text: str) -> str:
    m = re.search(r'^ENTRY\s+%([^\s(]+)', hlo_text, re.M)
    if not m:
        raise ValueError('no ENTRY computation in the HLO text')
    return m.group(1)


BranchWeights = Callable[[int], Sequence[float]]  # number of branches -> weight of each


def execution_counts(hlo_text: str, branch_weights: BranchWeights | None = None) -> dict[str, float]:
    """How many times each computation runs per program run.

    A while body runs its trip count times (NaN where XLA knows none: a loop whose bound is
    data, as in blockwise attention's causal block loops); a conditional's branches run
    `branch_weights(n)` times per execution (n = number of branches), or once each when no
    weights are given (an upper bound: every branch as if taken).
    """
    comps = _computations(hlo_text)
    callers: dict[str, list[tuple[str, float]]] = {name: [] for name in comps}
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP_RE.search(line)
            callees = [(kind, callee, 1.0) for kind, callee in _CALLEE_RE.findall(line)]
            for branch in _BRANCHES_RE.findall(line):
                names = [c.strip().lstrip('%') for c in branch.split(',') if c.strip()]
                weights = branch_weights(len(names)) if branch_weights else [1.0] * len(names)
                callees += [('branch', c, w) for c, w in zip(names, weights)]
            for kind, callee, weight in callees:
                if kind == 'to_apply' and ' call(' not in line:
                    continue  # reduction computations hold no collectives
                if kind == 'body':
                    weight = int(trip.group(1)) if trip else math.nan
                if callee in callers:
                    callers[callee].append((name, weight))
    entry = _entry_name(hlo_text)
    counts: dict[str, float] = {}

    def count(name: str) -> float:  # memoised over the acyclic call graph
        if name not in counts:
            counts[name] = 1.0 if name == entry else sum(count(c) * times for c, times in callers[name])
        return counts[name]

    for name in comps:
        count(name)
    return counts


def collectives(hlo_text: str, mesh_shape: dict[str, int],
                branch_weights: BranchWeights | None = None) -> list[Collective]:
    """Every collective of an optimised SPMD HLO module, with axes, payload and count."""
    n_devices = math.prod(mesh_shape.values())
    counts = execution_counts(hlo_text, branch_weights)
    out = []
    for comp, lines in _computations(hlo_text).items():
        for line in lines:
            m = _INSTRUCTION_RE.match(line)
            if not m:
                continue
            shape, tail = _split_shape(m.group(2))
            opcode = tail.partition('(')[0]
            kind = opcode.removesuffix('-start')
            if kind not in KINDS or counts.get(comp, 0) == 0:
                continue
            if math.isnan(counts[comp]):
                raise ValueError(f'a collective inside a while loop without a known trip count: {line.strip()[:160]}')
            groups = replica_groups(tail, n_devices)
            size = max(len(g) for g in groups)
            payload = array_bytes(shape)
            if opcode.endswith('-start') and kind in ('all-gather', 'collective-permute'):
                payload = array_bytes(_tuple_elements(shape)[1])  # (operands, results, ...)
            if kind == 'reduce-scatter':
                payload *= size
            axes = group_axes(groups, mesh_shape) if size > 1 or kind == 'collective-permute' else ()
            out.append(Collective(m.group(1), kind, axes, size, payload, counts[comp]))
    return out


def in_branches(hlo_text: str, kinds: Sequence[str] = ('collective-permute',)) -> list[str]:
    """Collectives of `kinds` inside a conditional's branches, or in what they call: '<computation>: <line>' each.

    XLA:CPU's collective-permute waits for every device of the process, not only the pairs it
    names, so one that only some devices reach deadlocks the rest: a pipeline stage's `lax.switch`
    branch must hold none (the pipeline's own exchanges run after the switch, outside it). Other
    collectives meet within their replica groups, whose devices take the same branch.
    """
    comps = _computations(hlo_text)

    def callees(lines: list[str]) -> list[str]:
        out = [callee for line in lines for _, callee in _CALLEE_RE.findall(line)]
        return out + [c.strip().lstrip('%') for line in lines for branch in _BRANCHES_RE.findall(line)
                      for c in branch.split(',') if c.strip()]

    todo = [c.strip().lstrip('%') for lines in comps.values() for line in lines
            for branch in _BRANCHES_RE.findall(line) for c in branch.split(',') if c.strip()]
    todo += [c for lines in comps.values() for line in lines
             for kind, c in _CALLEE_RE.findall(line) if kind in ('true_computation', 'false_computation')]
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached or name not in comps:
            continue
        reached.add(name)
        todo += callees(comps[name])
    found = []
    for name in sorted(reached):
        for line in comps[name]:
            m = _INSTRUCTION_RE.match(line)
            if m and _split_shape(m.group(2))[1].partition('(')[0].removesuffix('-start') in kinds:
                found.append(f'{name}: {line.strip()[:240]}')
    return found


def bytes_by_axis(items: Sequence[Collective], min_bytes: int = 0) -> dict[tuple[str, tuple[str, ...]], float]:
    """Total payload bytes per (kind, axes), skipping collectives under `min_bytes` each."""
    totals: dict[tuple[str, tuple[str, ...]], float] = {}
    for c in items:
        if c.axes and c.payload_bytes >= min_bytes:
            key = (c.kind, c.axes)
            totals[key] = totals.get(key, 0) + c.total_bytes
    return totals
