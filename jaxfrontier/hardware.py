"""Hardware descriptions for the planner: peak FLOP/s, memory and link bandwidths by level.

One `Hardware` per kind of device (one JAX device: a GCD of an MI250X, a whole GPU
elsewhere). Links come in three levels, from fastest to slowest:

  package  devices in one package (the two GCDs of an MI250X); absent elsewhere
  node     devices in one node (Infinity Fabric / xGMI, NVLink + NVSwitch)
  network  devices in different nodes (Slingshot, InfiniBand)

Bandwidths are per device and per direction, as a ring collective sees them when every
device of a node communicates at once: the network figure is the node's injection bandwidth
divided by its devices. Sources: FRONTIER.md for Frontier; vendor data sheets elsewhere.
`matmul_efficiency` is the share of the dense peak a large bf16 GEMM reaches in practice
(Frontier: measured 125 of 191.5 TFLOP/s); the planner's roofline uses it.

The dense peaks agree with `metrics.device_peak_flops` (a test holds them together).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import numpy as np

GIB = 2**30
LEVELS = ('package', 'node', 'network')


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind and the machine around it. All rates are per device."""

    name: str
    description: str
    peak_bf16_flops: float  # dense matrix peak, FLOP/s
    peak_fp32_flops: float  # dense fp32 (non-TF32) matrix peak, FLOP/s
    memory_bytes: int
    memory_bytes_per_s: float  # HBM bandwidth
    matmul_efficiency: float  # achieved share of the peak for large GEMMs
    devices_per_package: int
    devices_per_node: int
    link_bytes_per_s: dict[str, float]  # level -> bandwidth per direction
    link_latency_s: dict[str, float]  # level -> latency of one collective step

    def peak_flops(self, dtype: str) -> float:
        """Dense matrix peak for a compute dtype ('bfloat16', 'float16' or 'float32')."""
        return self.peak_fp32_flops if dtype == 'float32' else self.peak_bf16_flops

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


_LATENCY_S = {'package': 5e-6, 'node': 10e-6, 'network': 20e-6}

HARDWARE = {
    'mi250x': Hardware(
        'mi250x', 'AMD MI250X, one GCD (OLCF Frontier: 4 MI250X = 8 GCDs per node, 4 x 25 GB/s Slingshot-11)',
        peak_bf16_flops=191.5e12, peak_fp32_flops=47.9e12, memory_bytes=64 * GIB, memory_bytes_per_s=1.6e12,
        matmul_efficiency=125.0 / 191.5, devices_per_package=2, devices_per_node=8,
        link_bytes_per_s={'package': 200e9, 'node': 50e9, 'network': 100e9 / 8}, link_latency_s=_LATENCY_S),
    'mi300x': Hardware(
        'mi300x', 'AMD MI300X (8 per node, Infinity Fabric mesh, 8 x 400 Gb/s NICs)',
        peak_bf16_flops=1307.4e12, peak_fp32_flops=163.4e12, memory_bytes=192 * 10**9, memory_bytes_per_s=5.3e12,
        matmul_efficiency=0.55, devices_per_package=1, devices_per_node=8,
        link_bytes_per_s={'package': 300e9, 'node': 300e9, 'network': 50e9}, link_latency_s=_LATENCY_S),
    'a100': Hardware(
        'a100', 'NVIDIA A100 SXM 80 GB (8 per node, NVLink 3 + NVSwitch, 8 x 200 Gb/s HDR)',
        peak_bf16_flops=312e12, peak_fp32_flops=19.5e12, memory_bytes=80 * GIB, memory_bytes_per_s=2.039e12,
        matmul_efficiency=0.8, devices_per_package=1, devices_per_node=8,
        link_bytes_per_s={'package': 300e9, 'node': 300e9, 'network': 25e9}, link_latency_s=_LATENCY_S),
    'h100': Hardware(
        'h100', 'NVIDIA H100 SXM 80 GB (8 per node, NVLink 4 + NVSwitch, 8 x 400 Gb/s NDR)',
        peak_bf16_flops=989.4e12, peak_fp32_flops=66.9e12, memory_bytes=80 * GIB, memory_bytes_per_s=3.35e12,
        matmul_efficiency=0.75, devices_per_package=1, devices_per_node=8,
        link_bytes_per_s={'package': 450e9, 'node': 450e9, 'network': 50e9}, link_latency_s=_LATENCY_S),
    'h200': Hardware(
        'h200', 'NVIDIA H200 SXM 141 GB (8 per node, NVLink 4 + NVSwitch, 8 x 400 Gb/s NDR)',
        peak_bf16_flops=989.4e12, peak_fp32_flops=66.9e12, memory_bytes=143771 * 2**20, memory_bytes_per_s=4.8e12,
        matmul_efficiency=0.8, devices_per_package=1, devices_per_node=8,
        link_bytes_per_s={'package': 450e9, 'node': 450e9, 'network': 50e9}, link_latency_s=_LATENCY_S),
}

# Substrings of jax `device_kind` -> table entry ('this machine' on an accelerator).
_KIND_NAMES = (('MI250X', 'mi250x'), ('MI300X', 'mi300x'), ('A100', 'a100'), ('H100', 'h100'), ('H200', 'h200'))
NAMES = tuple(HARDWARE) + ('local',)


def get(name: str) -> Hardware:
    """The hardware called `name` (one of NAMES); 'local' describes this machine's devices."""
    if name == 'local':
        return local()
    if name not in HARDWARE:
        raise KeyError(f'unknown hardware {name!r}; use one of {NAMES}')
    return HARDWARE[name]


def local() -> Hardware:
    """This machine's first JAX device: a table entry for a known GPU, else measured (CPU).

    A CPU device's peak is measured with `metrics.measure_cpu_matmul_peak` (seconds); its
    memory is the host's physical memory shared by the simulated CPU devices; links between
    CPU devices are memory copies, taken as 10 GB/s (a stated guess, not a measurement).
    """
    import jax  # pylint: disable=g-import-not-at-top

    from jaxfrontier import metrics  # pylint: disable=g-import-not-at-top

    device = jax.devices()[0]
    for sub, name in _KIND_NAMES:
        if sub in str(device.device_kind):
            base = HARDWARE[name]
            stats = memory_stats(device)
            memory = int(stats.get('bytes_limit', base.memory_bytes))
            return dataclasses.replace(base, name='local', memory_bytes=memory,
                                       description=f'this machine: {device.device_kind} ({base.description})')
    n = len(jax.devices())
    total = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    bandwidth = 10e9
    return Hardware(
        'local', f'this machine: {n} {device.platform} device(s), {os.cpu_count()} cores, '
        f'{total / GIB:.0f} GiB shared',
        peak_bf16_flops=metrics.measure_cpu_matmul_peak('bfloat16'),
        peak_fp32_flops=metrics.measure_cpu_matmul_peak('float32'),
        memory_bytes=total // n, memory_bytes_per_s=bandwidth, matmul_efficiency=1.0,
        devices_per_package=1, devices_per_node=n,
        link_bytes_per_s={level: bandwidth for level in LEVELS}, link_latency_s=_LATENCY_S)


def memory_stats(device: Any) -> dict[str, Any]:
    """The device allocator's statistics ({} where the platform keeps none, e.g. the CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
        return {}


def axis_level(mesh_shape: dict[str, int], axes: tuple[str, ...], hw: Hardware) -> str:
    """The slowest link level a collective over `axes` of the mesh crosses.

    Devices are numbered row-major over the mesh axes (outermost first), as `mesh.make_mesh`
    lays them out; a group crosses the package (node) level if its members do not all share
    one package (node). Returns 'local' for a group of one device.
    """
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if math.prod(mesh_shape[a] for a in axes) <= 1:
        return 'local'
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    inside = [names.index(a) for a in axes]
    outside = [i for i in range(len(names)) if i not in inside]
    groups = ids.transpose(outside + inside).reshape(-1, math.prod(sizes[i] for i in inside))
    for level, size in (('package', hw.devices_per_package), ('node', hw.devices_per_node)):
        if np.all(groups // size == (groups[:, :1] // size)):
            return level
    return 'network'


def link_bytes_per_s(hw: Hardware, level: str) -> float:
    """Per-device bandwidth of a level; 'local' (no communication) is infinite."""
    return math.inf if level == 'local' else hw.link_bytes_per_s[level]
