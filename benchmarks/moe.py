"""Mixture of experts: dropless vs capacity, expert-parallel sizes; tokens/s and compiled memory per device.

  python benchmarks/moe.py                          # writes benchmarks/results/moe.json
  python benchmarks/moe.py --eps=1,2 --modes=dropless --steps=1 --warmup=0 --out=/tmp/moe.json   # quick

configs/moe.py's `tiny` model (8 experts of width 64, top 2, 2 MoE layers, d 128, fp32) on 8 simulated CPU
devices: expert EP x data 8 / EP at a global batch of 16 sequences of 64 tokens, each EP dropless and with
capacity factor 1.25. Beside the measured step: XLA's temporary and total memory per device, the compiled
collectives' bytes over `expert` (plan/hlo_collectives.py) and the planner's count of them
(plan/moe.py). Simulated devices share the host's cores, so step time measures the dispatch's overheads
(the all-gather / reduce-scatter and the EP k n-row buffers, model/layers/moe_parallel.py), not a
speed-up; state the machine's load beside any timing (`loadavg` in each row). FLOPs: benchmarks/harness.py.

The bytes over `expert` alone include the dense parameters' gradient reductions where data is 1 (expert 8):
there the plan's separate embedding-gradient all-reduce, which XLA merges into the other one, makes the
plan 131 kB (2.6 %) above the compiled count (an untied embedding's gradient reduced once, not twice:
comm._param_traffic, a dense-model matter). Elsewhere the two are equal, capacity mode included.

benchmarks/results/moe.json (load average 1-7 on 2 shared cores, in each row): the temporaries grow with EP
dropless (the EP k n-row buffers, and XLA:CPU's per-group ragged_dot expansion, docs/planner.md) and shrink
with a capacity ((E / EP) C rows); step times are noise-dominated at this size.
"""

import json
import os
import sys

from absl import app, flags

from jaxfrontier import config as config_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import moe as moe_configs  # noqa: E402  (configs/moe.py)

_EPS = flags.DEFINE_list('eps', ['1', '2', '4', '8'], 'Expert-parallel sizes (data takes the other devices).')
_MODES = flags.DEFINE_list('modes', ['dropless', 'capacity'], 'dropless and/or capacity (factor 1.25).')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices of every run.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps after warm-up.')
_WARMUP = flags.DEFINE_integer('warmup', 1, 'Untimed steps after compilation.')
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'benchmarks', 'results', 'moe.json'), 'Where the rows go.')


def config(ep: int, mode: str):
    c = moe_configs.get_config(f'size=tiny,expert={ep},data={_DEVICES.value // ep}')
    c.model.moe_dropless = mode == 'dropless'
    c.mesh.cpu_devices = _DEVICES.value
    return c


def expert_bytes(c) -> tuple[float, float]:
    """(compiled, planned) collective bytes per device and step over `expert`."""
    from jaxfrontier.plan import compile_check, planner  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
    compiled = compile_check.compile_on_cpu(c)
    hlo = sum(x.total_bytes for x in compile_check.collectives(c, compiled) if x.axes == ('expert',))
    plan = sum(t.payload_bytes for t in planner.plan(c).transfers if t.axes == ('expert',))
    return hlo, plan


def main(argv):
    del argv
    config_lib.set_cpu_device_count(_DEVICES.value)
    import harness  # pylint: disable=g-import-not-at-top  (imports JAX, after XLA_FLAGS is final)
    rows = []
    for ep in (int(x) for x in _EPS.value):
        for mode in _MODES.value:
            c = config(ep, mode)
            result = harness.time_train_step(c, steps=_STEPS.value, warmup=_WARMUP.value)
            hlo, plan = expert_bytes(c)
            with open('/proc/loadavg', encoding='utf-8') as f:
                load = f.read().split()[0]
            rows.append({'expert': ep, 'data': _DEVICES.value // ep, 'mode': mode, **result,
                         'expert_bytes_compiled': hlo, 'expert_bytes_planned': plan, 'loadavg': float(load)})
            print(json.dumps(rows[-1]))
    harness.print_table(rows, ['expert', 'mode', 'median_step_s', 'perf/tokens_per_s_per_device',
                               'temp_gib_per_device', 'peak_gib_per_device', 'expert_bytes_compiled',
                               'expert_bytes_planned', 'loadavg'])
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)


if __name__ == '__main__':
    app.run(main)
