"""The expected compile time of a layout: a base plus a cost per compiled copy of the layer.

XLA compiles every copy of the layer a program holds, so a stack's compile time grows with
`model.stack.layer_bodies`, not with its depth: one copy for the rolled scan
(`model.scan_unroll=1`, the CPU default), k plus the remainder for a scan over groups of k, every
layer when unrolled (k >= layers; `0` = auto unrolls on GPUs). A pipelined layout scans each
chunk whatever `scan_unroll` says (pipeline/chunk.py), so it compiles one copy.

The relation compile_s = base_s + per_body_s x bodies + per_body2_s x bodies^2 is measured by
benchmarks/compile_layers.py on XLA:CPU (train and eval steps, one device, width 64,
remat=full); `CPU_FIT` holds its fit. It is not a line: 1 / 16 / 32 / 64 unrolled copies took
4 / 24 / 72 / 300 s, so past about 16 copies the compiler's passes that grow with the square of
the program dominate, and doubling an unrolled stack roughly quadruples its compile. No GPU compile has been measured against depth yet, so on
a GPU the seconds are the CPU's rate, labelled so; the ratio to the rolled stack (`vs_rolled`)
is the number to compare layouts by.
"""

from __future__ import annotations

import dataclasses

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.model import stack


@dataclasses.dataclass(frozen=True)
class CompileFit:
    """compile_s = base_s + per_body_s x bodies + per_body2_s x bodies^2, and where the numbers come from."""

    base_s: float
    per_body_s: float
    source: str
    per_body2_s: float = 0.0

    def seconds(self, bodies: int) -> float:
        return self.base_s + self.per_body_s * bodies + self.per_body2_s * bodies ** 2


# `benchmarks/compile_layers.py` (layers 8 / 16 / 32 / 64 x rolled, groups of 4 and 8, unrolled; 15 rows)
# on the 2-core machine, quiet, 2026-12-02: wall-clock compile seconds fitted to their relative error,
# worst residual 18 % (benchmarks/results/compile_layers.jsonl).
CPU_FIT = CompileFit(base_s=3.47, per_body_s=0.626, per_body2_s=0.0519,
                     source='benchmarks/compile_layers.py: XLA:CPU, one device, width 64, remat=full, layers 8-64')


# Past this many copies of the layer the report names the middle ground: a scan over groups of
# GROUP layers. On XLA:CPU at 64 layers it compiles in 11 s against 300 s unrolled, and its step took
# 226 ms against 710 ms unrolled and 177 ms rolled (benchmarks/results/compile_layers.jsonl); what it
# costs a GPU step against the unrolled stack has not been measured (docs/PERFORMANCE.md).
GROUP = 8
SUGGEST_ABOVE = 2 * GROUP


@dataclasses.dataclass(frozen=True)
class CompileTime:
    """What a layout's train and eval steps compile: copies of the layer and the expected seconds."""

    scan_unroll: int  # resolved for the hardware (0 = auto: every layer on GPUs, 1 on the CPU)
    num_layers: int
    pipelined: bool
    bodies: int
    seconds: float
    vs_rolled: float  # seconds / the same layout's with the rolled stack
    platform: str
    grouped_s: float | None = None  # the seconds of a scan over groups of GROUP layers, where it compiles less


    def line(self) -> str:
        if self.pipelined:
            how = 'pipeline chunks scan their layers whatever model.scan_unroll says'
        elif self.scan_unroll <= 1:
            how = 'rolled scan'
        elif self.scan_unroll >= self.num_layers:
            how = 'every layer unrolled'
        else:
            how = f'a scan over groups of {self.scan_unroll} layers'
        guess = '' if self.platform == 'cpu' else ', CPU-calibrated'
        setting = '' if self.pipelined else f', model.scan_unroll {self.scan_unroll}'
        hint = ('' if self.grouped_s is None else
                f'; model.scan_unroll={GROUP} (a scan over groups of {GROUP}) would take about {self.grouped_s:.0f} s')
        return (f'compile   {self.bodies} cop{"y" if self.bodies == 1 else "ies"} of the layer ({how}{setting}): '
                f'about {self.seconds:.0f} s{guess}; {self.vs_rolled:.1f}x the rolled stack{hint}')


def platform(hw: hw_lib.Hardware) -> str:
    """The JAX platform a hardware description stands for ('local' on the CPU shares its cores)."""
    return 'cpu' if hw.shared_host_devices > 0 else 'gpu'


def bodies(num_layers: int, scan_unroll: int, pipeline: int) -> int:
    """Copies of the layer the train step compiles for a resolved `scan_unroll`."""
    return 1 if pipeline > 1 else stack.layer_bodies(num_layers, scan_unroll)


def estimate(num_layers: int, scan_unroll: int, pipeline: int, hw: hw_lib.Hardware,
             fit: CompileFit = CPU_FIT) -> CompileTime:
    """The expected compile time of a stack of `num_layers` (model.scan_unroll as configured, 0 = auto)."""
    where = platform(hw)
    unroll = config_lib.resolve_scan_unroll(scan_unroll, num_layers, where)
    n = bodies(num_layers, unroll, pipeline)
    seconds = fit.seconds(n)
    grouped = bodies(num_layers, GROUP, pipeline)
    grouped_s = fit.seconds(grouped) if n > SUGGEST_ABOVE and grouped < n else None
    return CompileTime(unroll, num_layers, pipeline > 1, n, seconds, seconds / fit.seconds(1), where, grouped_s)
