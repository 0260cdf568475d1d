"""Refuse a training run that cannot fit, before anything is allocated (the memory preflight of --mode=train).

`run/observe/memory_check.py` compares the compiled step's memory analysis with the device's,
which comes after the state is built and the step compiled: a model far too big for the host
(configs/gpt.py:size=1.3b on a 24 GiB machine) had filled most of the memory by then. The
planner knows the bytes per device of the parameters, gradients, optimizer state, activations
and working set of a layout by arithmetic (plan/estimate.py), in about a second and without a
device array. `check(config)` compares its total with what one device has (hardware.device_capacity's
figure: the allocator's `bytes_limit` on an accelerator, the host's available RAM shared by
the simulated devices on the CPU) and refuses with one line: the bytes needed, the bytes
available, the largest parts, and a layout of the same devices that fits (the planner's search),
as --config overrides. `--config.train.ignore_memory_check=True` goes ahead anyway, as for the
compiled check.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import ml_collections
from absl import logging

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import UserError
from jaxfrontier.plan import planner
from jaxfrontier.plan import search as search_lib

GIB = hw_lib.GIB


def local_hardware(devices: Sequence[Any], capacity: int) -> hw_lib.Hardware:
    """This machine's device description with `capacity` bytes per device, without measuring anything.

    A known GPU keeps its table entry (its peaks rank the layouts); a CPU or unknown device takes
    the MI250X entry's rates (only the ranking of layouts that fit uses them) with every
    simulated device on one node.
    """
    known = hw_lib.match_kind(str(devices[0].device_kind)) if devices else None
    if known is not None:
        return dataclasses.replace(known, name='local', memory_bytes=capacity)
    n = max(len(devices), 1)
    return dataclasses.replace(hw_lib.get('mi250x'), name='local', memory_bytes=capacity,
                               description=f'this machine: {n} {devices[0].platform if devices else "cpu"} device(s)',
                               devices_per_package=1, devices_per_node=max(n, hw_lib.CPU_NODE_DEVICES))


def overrides(layout: layout_lib.Layout) -> str:
    """The --config overrides that select `layout` (an optional mesh axis only where it is not 1)."""
    out = [f'--config.{a.field}={getattr(layout, a.name)}' for a in axes_lib.AXES
           if not a.optional or getattr(layout, a.name) > 1]
    out += [f'--config.train.micro_batch={layout.micro_batch}', f'--config.train.accum_steps={layout.accum_steps}']
    if layout.pipeline == 1:
        out.append(f'--config.model.remat={layout.remat}')
    else:
        out.append(f'--config.pipeline.schedule={layout.schedule}')
        if layout.schedule == 'interleaved':
            out.append(f'--config.pipeline.virtual_stages={layout.virtual_stages}')
    out.append(f'--config.sharding.zero1={layout.zero1}')
    if layout.tensor > 1:
        out.append(f'--config.sharding.sequence_parallel={"true" if layout.sequence_parallel else "false"}')
    return ' '.join(out)


def suggestion(c: ml_collections.ConfigDict, hw: hw_lib.Hardware, num_devices: int) -> str:
    """A layout of `num_devices` devices that fits, as --config overrides, or that none does (the fix of a
    refusal here and of --mode=plan's `does not fit:` line)."""
    plans, planned, _ = search_lib.search(c, hw, num_devices, top=1)
    if plans:
        best = plans[0]
        return (f'a layout of these {num_devices} devices that fits ({best.memory.total_bytes / GIB:.1f} GiB per '
                f'device, the planner\'s estimate): {overrides(best.layout)}')
    return (f'none of the {planned} layouts of {num_devices} devices the planner tried fits; run on devices with '
            'more memory (or more of them: --mode=plan --search --search_devices=N), or train a smaller model')


def check(c: ml_collections.ConfigDict, devices: Sequence[Any] | None = None, *, validated: bool = False) -> None:
    """Raises UserError when the planner's bytes per device exceed what a device has.

    Args:
      c: a training config.
      devices: this process's devices (default: jax.local_devices()).
      validated: `c` passed `config.validate` already (main's run/validation.validate_run, before JAX
        started), so the planner does not check it again; otherwise it does (ConfigError).
    """
    if c.train.ignore_memory_check:
        return
    if devices is None and config_lib.num_devices(c) != jax.device_count():
        return  # the trainer's mesh reports a device-count mismatch, the more basic mistake
    devices = list(jax.local_devices() if devices is None else devices)
    capacity, source = hw_lib.device_capacity(devices)
    hw = local_hardware(devices, capacity)
    try:
        p = planner.plan(c, hw, validated=validated)
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as e:
        if isinstance(e, UserError):
            raise
        # The planner models no such layout: the compiled step's check (run/observe/memory_check.py) still runs.
        logging.warning('memory preflight skipped: the planner cannot estimate this config (%s: %s)',
                        type(e).__name__, e)
        return
    need = p.memory.total_bytes
    if need <= capacity:
        return
    parts = sorted(p.memory.items(), key=lambda kv: -kv[1])[:3]
    described = ', '.join(f'{name} {size / GIB:.2f} GiB' for name, size in parts)
    raise UserError(
        f'by the planner\'s estimate this layout needs {need / GIB:.2f} GiB per device but a device has '
        f'{capacity / GIB:.2f} GiB ({source}): {need:,.0f} bytes needed, {capacity:,} available ({p.memory.stage}; '
        f'largest parts: {described}); refused before allocating anything. Fix: '
        f'{suggestion(c, hw, config_lib.num_devices(c))}; or go ahead anyway with '
        '--config.train.ignore_memory_check=True')
