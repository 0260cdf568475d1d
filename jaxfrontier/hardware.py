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

The time model's other free parameters are fields too (`TIME_FIELDS`): how GEMM efficiency
falls for small matmuls, how much communication overlaps compute, fixed costs per step and
per layer, how much of the pipeline bubble is idle time, what keeping residuals for the
backward costs beyond their traffic, and whether simulated devices share the host's cores.
Their defaults are the planner's fixed rules; `python -m jaxfrontier.calibrate` fits them
(and the bandwidths, latencies and efficiency) to measured step times and writes a
description as JSON, which `get('path.json')` loads wherever a hardware name is taken.

This is the one device table: the trainer's MFU (`device_peak_flops`) and the planner read
the same entries, matched to a JAX device by `match_kind`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxfrontier import errors

GIB = 2**30
LEVELS = ('package', 'node', 'network')


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device kind and the machine around it. All rates are per device."""

    name: str
    description: str
    peak_bf16_flops: float  # dense matrix peak, FLOP/s
    peak_fp32_flops: float  # dense fp32 (non-TF32) matrix peak, FLOP/s (XLA may use TF32 for fp32 dots on NVIDIA)
    memory_bytes: int
    memory_bytes_per_s: float  # HBM bandwidth
    matmul_efficiency: float  # achieved share of the peak for large GEMMs
    devices_per_package: int
    devices_per_node: int
    link_bytes_per_s: dict[str, float]  # level -> bandwidth per direction
    link_latency_s: dict[str, float]  # level -> latency of one collective step
    # The time model's parameters beyond the table (defaults: the planner's fixed rules).
    gemm_half_flops: float = 0.0  # efficiency x w / (w + this); w = one layer's matmul FLOPs per device and micro-batch
    overlap: float = 1.0  # share of the hideable communication that compute hides (1: the overlap rules)
    step_overhead_s: float = 0.0  # fixed cost per optimizer step (dispatch, host work)
    layer_overhead_s: float = 0.0  # fixed cost per layer per micro-batch on a stage (kernel launches)
    bubble_scale: float = 1.0  # share of the pipeline bubble that is idle time
    # Extra passes over memory per byte a layer keeps from its forward for its backward: kept
    # residuals leave the caches (they matter on a CPU, where recomputing can beat stashing).
    stash_passes: float = 0.0
    shared_host_devices: int = 0  # > 0: the peak is of this many devices sharing one host's cores (CPU)
    calibration: dict = dataclasses.field(default_factory=dict)  # how a calibrated description was fitted

    def peak_flops(self, dtype: str) -> float:
        """Dense matrix peak for a compute dtype ('bfloat16', 'float16' or 'float32')."""
        return self.peak_fp32_flops if dtype == 'float32' else self.peak_bf16_flops

    def compute_flops(self, dtype: str, num_devices: int) -> float:
        """Peak of one device of a job of `num_devices`: simulated devices share the host's cores."""
        peak = self.peak_flops(dtype)
        if self.shared_host_devices > 0:
            peak *= self.shared_host_devices / max(num_devices, 1)
        return peak

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

# Substrings of jax `device_kind` -> table entry, with variants the substring must not match
# (an H100 PCIe or NVL is not the SXM part). First match wins: longer names before prefixes.
_KINDS = (('MI250X', (), 'mi250x'), ('MI300X', (), 'mi300x'), ('A100', (), 'a100'),
          ('H100', ('PCIe', 'NVL'), 'h100'), ('H200', (), 'h200'))
NAMES = tuple(HARDWARE) + ('local',)
TIME_FIELDS = ('matmul_efficiency', 'memory_bytes_per_s', 'link_bytes_per_s', 'link_latency_s', 'gemm_half_flops',
               'overlap', 'step_overhead_s', 'layer_overhead_s', 'bubble_scale', 'stash_passes',
               'shared_host_devices')


def match_kind(device_kind: str) -> Hardware | None:
    """The table entry of a JAX `device_kind` string, or None for a kind the table lacks."""
    for sub, excluded, name in _KINDS:
        if sub in device_kind and not any(x in device_kind for x in excluded):
            return HARDWARE[name]
    return None


def get(name: str) -> Hardware:
    """The hardware called `name` (one of NAMES), or a description in a JSON file (`load`).

    'local' describes this machine's devices.

    Raises:
      UserError: an unknown name, or a file that is missing or not a description.
    """
    if name.endswith('.json') or os.sep in name:
        return load(name)
    if name == 'local':
        return local()
    if name not in HARDWARE:
        raise errors.UserError(f'--hardware={name}: unknown hardware. Fix: use one of {", ".join(NAMES)}, or a '
                               'description file path.json (python -m jaxfrontier.calibrate writes one)')
    return HARDWARE[name]


def to_json(hw: Hardware) -> dict[str, Any]:
    """A description as plain JSON-able data (every field; `load` reads it back)."""
    return dataclasses.asdict(hw)


def save(hw: Hardware, path: str) -> None:
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(to_json(hw), f, indent=1)
        f.write('\n')


def _check_fields(path: str, data: Any) -> None:
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    if not isinstance(data, dict):
        raise errors.UserError(f'--hardware={path}: not a hardware description (a JSON object of {", ".join(fields)})'
                               '. Fix: give a file written by python -m jaxfrontier.calibrate')
    unknown = sorted(set(data) - set(fields) - {'base'})
    if unknown:
        raise errors.UserError(f'--hardware={path}: unknown field(s) {", ".join(unknown)}. Fix: use the fields of '
                               f'hardware.Hardware ({", ".join(fields)}), and "base" to start from a built-in entry')
    for key in ('link_bytes_per_s', 'link_latency_s'):
        if key in data and (not isinstance(data[key], dict) or set(data[key]) != set(LEVELS)):
            raise errors.UserError(f'--hardware={path}: {key} must give each level {", ".join(LEVELS)}. Fix: add '
                                   'the missing levels')


def load(path: str) -> Hardware:
    """A description from JSON: every field, or "base" (a built-in name) and the fields that differ."""
    try:
        with open(path, encoding='utf-8') as f:
            data = json.load(f)
    except OSError as e:
        raise errors.UserError(f'--hardware={path}: {e.strerror}. Fix: give an existing description file, or '
                               f'one of {", ".join(NAMES)}') from None
    except ValueError as e:
        raise errors.UserError(f'--hardware={path}: not JSON ({e}). Fix: give a file written by python -m '
                               'jaxfrontier.calibrate') from None
    _check_fields(path, data)
    base = data.pop('base', None)
    try:
        return dataclasses.replace(get(str(base)), **data) if base is not None else Hardware(**data)
    except TypeError as e:
        raise errors.UserError(f'--hardware={path}: {e}. Fix: give every field of hardware.Hardware, or "base"'
                               ) from None


CPU_NODE_DEVICES = 4096  # simulated CPU devices of one process are all one node


def local() -> Hardware:
    """This machine's first JAX device: a table entry for a known GPU, else measured (CPU).

    A CPU device's peak is measured with `measure_cpu_matmul_peak` (seconds); its
    memory is the host's physical memory shared by the simulated CPU devices; links between
    CPU devices are memory copies, taken as 10 GB/s (a stated guess, not a measurement).
    """
    import jax  # pylint: disable=g-import-not-at-top  (the planner's tables need no JAX)

    device = jax.devices()[0]
    base = match_kind(str(device.device_kind))
    if base is not None:
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
        peak_bf16_flops=measure_cpu_matmul_peak('bfloat16'),
        peak_fp32_flops=measure_cpu_matmul_peak('float32'),
        memory_bytes=total // n, memory_bytes_per_s=bandwidth, matmul_efficiency=1.0,
        devices_per_package=1, devices_per_node=max(n, CPU_NODE_DEVICES),
        link_bytes_per_s={level: bandwidth for level in LEVELS}, link_latency_s=_LATENCY_S, shared_host_devices=n)


def memory_stats(device: Any) -> dict[str, Any]:
    """The device allocator's statistics ({} where the platform keeps none, e.g. the CPU)."""
    try:
        return device.memory_stats() or {}
    except Exception:  # pylint: disable=broad-except
        return {}


def host_memory_bytes() -> int:
    """RAM available to this process now: MemAvailable, or the cgroup's remaining limit if lower.

    Not the total: on a shared node the other processes' memory is not ours (a step that fit
    the total but not the available RAM was killed by the kernel in testing).
    """
    available = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_AVPHYS_PAGES')
    with contextlib.suppress(OSError, KeyError, ValueError), open('/proc/meminfo') as f:
        available = int(dict(line.split(':', 1) for line in f)['MemAvailable'].split()[0]) * 1024
    for limit_path, usage_path in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                                   ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                                    '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
        try:
            with open(limit_path) as f, open(usage_path) as g:
                limit, usage = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():
            available = min(available, int(limit) - int(usage))
    return available


def device_capacity(devices: Sequence[Any]) -> tuple[int, str]:
    """(bytes one device may use, where the figure comes from) for this process's devices."""
    limits = [memory_stats(d).get('bytes_limit') for d in devices]
    if devices and all(limits):
        return min(limits), f'the {devices[0].platform} allocator limit (memory_stats bytes_limit)'
    host = host_memory_bytes()
    n = max(len(devices), 1)
    return host // n, (f'{host / GIB:.1f} GiB of available host RAM shared by {n} simulated '
                       f'{devices[0].platform} devices')


def _groups(mesh_shape: dict[str, int], axes: tuple[str, ...]) -> np.ndarray:
    """The device ids of each collective group over `axes` [groups, members] (row-major over the mesh axes,
    outermost first, as `mesh.make_mesh` lays them out)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    inside = [names.index(a) for a in axes]
    outside = [i for i in range(len(names)) if i not in inside]
    return ids.transpose(outside + inside).reshape(-1, math.prod(sizes[i] for i in inside))


def axis_level(mesh_shape: dict[str, int], axes: tuple[str, ...], hw: Hardware) -> str:
    """The slowest link level a collective over `axes` of the mesh crosses.

    Devices are numbered row-major over the mesh axes (outermost first), as `mesh.make_mesh`
    lays them out; a group crosses the package (node) level if its members do not all share
    one package (node). Returns 'local' for a group of one device.
    """
    if math.prod(mesh_shape[a] for a in axes) <= 1:
        return 'local'
    groups = _groups(mesh_shape, axes)
    for level, size in (('package', hw.devices_per_package), ('node', hw.devices_per_node)):
        if np.all(groups // size == (groups[:, :1] // size)):
            return level
    return 'network'


def peer_shares(mesh_shape: dict[str, int], axes: tuple[str, ...], hw: Hardware) -> dict[str, float]:
    """For an all-to-all over `axes`: the share of a device's peers (the group's other members) at each link
    level, 'package' (the same package), 'node' (the same node, another package) and 'network', averaged
    over the groups (devices numbered as in `axis_level`). What an even all-to-all sends a peer crosses
    that peer's level; the shares sum to 1 (empty for a group of one)."""
    group = math.prod(mesh_shape[a] for a in axes)
    if group <= 1:
        return {}
    groups = _groups(mesh_shape, axes)
    package = groups[:, :, None] // hw.devices_per_package == groups[:, None, :] // hw.devices_per_package
    node = groups[:, :, None] // hw.devices_per_node == groups[:, None, :] // hw.devices_per_node
    pairs = groups.shape[0] * group * (group - 1)
    same_package = (package.sum() - groups.shape[0] * group) / pairs  # less each device with itself
    same_node = (node & ~package).sum() / pairs
    return {'package': float(same_package), 'node': float(same_node), 'network': float(1 - same_package - same_node)}


def link_bytes_per_s(hw: Hardware, level: str) -> float:
    """Per-device bandwidth of a level; 'local' (no communication) is infinite."""
    return math.inf if level == 'local' else hw.link_bytes_per_s[level]


# --------------------------------------------------------------------------- peaks of JAX devices

_PEAK_DTYPES = {'bfloat16': 'bf16', 'float16': 'bf16', 'float32': 'fp32'}
_CPU_MATMUL_N = 1024


def _peak_dtype(dtype: str) -> str:
    name = getattr(dtype, 'name', str(dtype))
    if name not in _PEAK_DTYPES:
        raise ValueError(f'no peak FLOP/s for dtype {dtype!r}; use one of {sorted(_PEAK_DTYPES)}')
    return name


@functools.cache
def measure_cpu_matmul_peak(dtype: str = 'float32') -> float:
    """Measures matmul FLOP/s of one CPU JAX device; cached per dtype for the process.

    `time_cpu_matmul_peak` with its best of five.

    Args:
      dtype: 'float32', 'bfloat16' or 'float16'; the matmul runs in this dtype.

    Returns:
      FLOP/s per CPU device (> 0).
    """
    return time_cpu_matmul_peak(dtype)


def time_cpu_matmul_peak(dtype: str = 'float32', calls: int = 5) -> float:
    """Matmul FLOP/s of one CPU JAX device, measured now (not cached).

    Times a jitted n x n matmul (n = 1024) on the first CPU device (one warm-up, best of `calls`)
    and divides by the number of CPU devices in this process, because simulated CPU devices
    share the same cores.
    """
    import jax  # pylint: disable=g-import-not-at-top  (this module is read before JAX starts)
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    name = _peak_dtype(dtype)
    devices = jax.local_devices(backend='cpu')
    n = _CPU_MATMUL_N
    key_a, key_b = jax.random.split(jax.random.key(0))
    a_nn = jax.device_put(jax.random.normal(key_a, (n, n), dtype=name), devices[0])
    b_nn = jax.device_put(jax.random.normal(key_b, (n, n), dtype=name), devices[0])
    matmul = jax.jit(lambda x, y: jnp.einsum('ij,jk->ik', x, y))
    matmul(a_nn, b_nn).block_until_ready()  # compile and warm up
    best = math.inf
    for _ in range(calls):
        start = time.perf_counter()
        matmul(a_nn, b_nn).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / len(devices)


def device_peak_flops(device: Any, dtype: str) -> tuple[float, str]:
    """Dense matrix peak FLOP/s of one JAX device for a compute dtype.

    Accelerators are looked up by substring of `device.device_kind` in a table of published
    dense peaks (float16 uses the bf16 entry). CPU devices are measured once per process with
    `measure_cpu_matmul_peak`. Unknown kinds give NaN, so MFU shows as NaN rather than wrong.

    Args:
      device: a `jax.Device` (anything with `.platform` and `.device_kind`).
      dtype: 'float32', 'bfloat16' or 'float16'.

    Returns:
      (peak FLOP/s, a description of where the number came from).
    """
    name = _peak_dtype(dtype)
    if device.platform == 'cpu':
        import jax  # pylint: disable=g-import-not-at-top

        n_cpu = len(jax.local_devices(backend='cpu'))
        return (measure_cpu_matmul_peak(name),
                f'measured: jitted {_CPU_MATMUL_N}x{_CPU_MATMUL_N} {name} matmul on one CPU '
                f'device, divided by {n_cpu} CPU devices')
    kind = str(device.device_kind)
    column = _PEAK_DTYPES[name]
    hw = match_kind(kind)
    if hw is not None:
        return hw.peak_flops(name), f'table: {hw.description} dense {column} matrix peak (device_kind {kind!r})'
    return math.nan, f'unknown device kind {kind!r} (platform {device.platform}): MFU is NaN'


# --------------------------------------------------------------------------- throughput
