"""Refuse a run that cannot fit, before its first step (docs/checkpoints.md, "When a run cannot go on").

XLA's memory analysis of the compiled train step gives the bytes one device needs
(arguments + outputs + temporaries - the donated arguments the outputs reuse; the figure
`compile:` logs as memory/peak_gib_per_device). It is compared with what a device has: the
allocator's limit on an accelerator (`memory_stats()['bytes_limit']`), and on the CPU the
host's available RAM (MemAvailable, or the cgroup's remaining limit) shared by the simulated
devices of this process. A step that needs more would be killed by the kernel's out-of-memory
killer after thrashing the machine, or die in the allocator with a traceback; both become one
line: the figure, the largest parts, and the fixes. `--config.train.ignore_memory_check=True` goes ahead anyway.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import ml_collections

from jaxfrontier import hardware
from jaxfrontier.checkpoint.format import FROZEN
from jaxfrontier.errors import UserError
from jaxfrontier.training import step as step_lib

GIB = 2**30

FIXES = ('get layouts of this model that fit with `python -m jaxfrontier.main --config=... --mode=plan --search '
         '--hardware=local` (or the --hardware you run on); or lower train.micro_batch (raising train.accum_steps), '
         "set model.remat='full', shard more (mesh.fsdp, mesh.tensor, sharding.zero1=True); or go ahead anyway "
         'with --config.train.ignore_memory_check=True')


def state_parts(abstract_state: Any, shardings: Any) -> dict[str, int]:
    """Bytes per device of the parameters, the optimizer state and LoRA's frozen base (from their shardings)."""
    def per_device(tree, tree_shardings) -> int:
        sizes = jax.tree.map(lambda a, s: math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize, tree, tree_shardings)
        return sum(jax.tree.leaves(sizes))
    parts = {'parameters': per_device(abstract_state['params'], shardings['params']),
             'optimizer state': per_device(abstract_state['opt_state'], shardings['opt_state'])}
    if FROZEN in abstract_state:  # LoRA: the trained parameters are the adapters; the base rides along frozen
        parts['frozen base (LoRA)'] = per_device(abstract_state[FROZEN], shardings[FROZEN])
    return parts


def needed_parts(compiled: Any, abstract_state: Any, shardings: Any) -> tuple[int, dict[str, int]] | None:
    """(bytes per device the compiled step needs, its parts, largest first); None without an analysis."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    parts = {'temporaries (activations, gradients, workspace)': mem.temp_size_in_bytes,
             **state_parts(abstract_state, shardings),
             'outputs not reusing the donated state': max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0)}
    return total, dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def _describe(parts: dict[str, int]) -> str:
    return ', '.join(f'{name} {size / GIB:.2f} GiB' for name, size in list(parts.items())[:3])


def summary(compiled: Any) -> dict[str, float]:
    """The compiled step's `memory/peak_gib_per_device` and `memory/temp_gib_per_device` ({} without an analysis)."""
    mem = step_lib.memory_bytes(compiled)
    if not mem:
        return {}
    return {'memory/peak_gib_per_device': mem['total'] / GIB, 'memory/temp_gib_per_device': mem['temporaries'] / GIB}


def measured_peak(devices: Sequence[Any]) -> dict[str, float]:
    """`memory/measured_peak_gib_per_device`: the allocator's peak over `devices` (accelerators; {} on the CPU)."""
    peaks = [p for p in (hardware.memory_stats(d).get('peak_bytes_in_use') for d in devices) if p is not None]
    return {'memory/measured_peak_gib_per_device': max(peaks) / GIB} if peaks else {}


def check_fits(compiled: Any, t: ml_collections.ConfigDict, abstract_state: Any, shardings: Any,
               devices: Sequence[Any] | None = None) -> None:
    """Raises UserError when the compiled step needs more memory per device than a device has.

    `t`: the run's `train` section (`ignore_memory_check` goes ahead anyway)."""
    if t.ignore_memory_check:
        return
    found = needed_parts(compiled, abstract_state, shardings)
    if found is None:
        return
    need, parts = found
    capacity, source = hardware.device_capacity(jax.local_devices() if devices is None else devices)
    if need > capacity:
        raise UserError(f'the compiled train step needs {need / GIB:.2f} GiB per device but a device has '
                        f'{capacity / GIB:.2f} GiB ({source}); largest parts: {_describe(parts)}. Fix: {FIXES}')


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation failure of the runtime (XlaRuntimeError RESOURCE_EXHAUSTED)."""
    return isinstance(e, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' in str(e)


def out_of_memory_error(e: BaseException) -> UserError:
    """The one-line UserError for an allocation failure."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    capacity, source = hardware.device_capacity(jax.local_devices())
    return UserError(f'out of device memory: {first[:300]} (a device has {capacity / GIB:.2f} GiB: {source}). '
                     f'Fix: {FIXES}')
