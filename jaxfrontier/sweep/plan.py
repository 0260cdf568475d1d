"""The planner's verdict on a trial before it runs: predicted memory per device, fit, tokens/s.

`predictor(hardware_name, cpu)` returns `predict(config, devices) -> dict` for `Study.predict`.
It imports JAX (the planner traces the model's saved activations), so the sweep's parent
restricts itself to the CPU first (`sweep.main`): it must not hold a GPU its trials need.
`--hardware=local` on simulated CPU devices describes this host, whose memory the simulated
devices share (as does a description calibrated from it); on GPUs, name the device (h100,
mi250x, ..., or a calibrated path.json) so the parent needs no GPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import ml_collections

from jaxfrontier import hardware as hw_lib
from jaxfrontier.errors import UserError


def predictor(hardware: str, cpu: bool) -> Callable[[ml_collections.ConfigDict, int], dict[str, Any]]:
    """`predict(config, devices)`: the planner's memory, fit and tokens/s for one trial config."""
    if hardware == 'local' and not cpu:
        raise UserError(
            '--hardware=local: the trials run on GPUs, and the sweep process must not take one to look. Fix: '
            f'name the device with --hardware (one of {", ".join(hw_lib.HARDWARE)}), or pass --noplan_filter')
    from jaxfrontier.plan import planner  # pylint: disable=g-import-not-at-top  (imports JAX)

    hw = hw_lib.get(hardware)
    host_bytes = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')

    def predict(c: ml_collections.ConfigDict, devices: int) -> dict[str, Any]:
        device = dataclasses.replace(hw, memory_bytes=host_bytes // devices) if hw.shared_host_devices else hw
        p = planner.plan(c, device)
        return {'hardware': hardware, 'fits': bool(p.fits), 'memory_gib': p.memory.total_bytes / hw_lib.GIB,
                'usable_gib': p.usable_bytes / hw_lib.GIB, 'tokens_per_s': p.time.tokens_per_s}

    return predict
