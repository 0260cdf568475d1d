"""A warning when a mixture-of-experts layer's expert receives no token for a while (host side).

Reads the rows the metrics writer writes (`aux/moe_load/layers` [L, E]: each expert's fraction of the
step's assignments, model/layers/moe.py) and says once per expert and stretch, on process 0, when an
expert's load stayed 0 for `train.moe_empty_warn_steps` steps (counted between logged rows, every
train.log_every steps). A dead expert wastes its parameters; the balancing loss or the router bias
(docs/models.md "Mixture of experts") is what revives it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KEY = 'aux/moe_load/layers'


class EmptyExperts:
    """`observe(step, row) -> warning lines` (see the module docstring); off where `steps` is 0."""

    def __init__(self, steps: int):
        self.steps = int(steps)
        self.since: dict[tuple[int, int], int] = {}  # (layer, expert) -> first step of its empty stretch
        self.warned: set[tuple[int, int]] = set()

    def observe(self, step: int, row: Mapping[str, Any]) -> list[str]:
        loads = row.get(KEY)
        if not self.steps or loads is None:
            return []
        lines = []
        for layer, per_expert in enumerate(loads):
            for expert, load in enumerate(per_expert):
                key = (layer, expert)
                if load is None or load > 0:
                    self.since.pop(key, None)
                    self.warned.discard(key)
                    continue
                first = self.since.setdefault(key, step)
                if step - first + 1 >= self.steps and key not in self.warned:
                    self.warned.add(key)
                    lines.append(f'warning: MoE layer {layer} expert {expert} received no token for {step - first + 1} '
                                 f'steps (since step {first}); raise model.moe_lb_coef or use the router bias')
        return lines
