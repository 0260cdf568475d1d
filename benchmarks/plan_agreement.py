"""The planner's memory estimate against XLA's compiled memory analysis, as a Markdown table.

  python benchmarks/plan_agreement.py

Small layouts of every kind (the ones tests/plan/test_planner.py holds to 10 % / 20 %) on
simulated CPU devices, then the 175B and 1T paper layouts' fp32 copies with data
parallelism reduced to fit 2048 devices (docs/planner.md, "How well it agrees with XLA").
Each compile runs in its own process with the device count it needs.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, 'tests'), os.path.join(ROOT, 'tests', 'plan'), os.path.join(ROOT, 'configs')]

from jaxfrontier.plan import compile_check  # noqa: E402  pylint: disable=wrong-import-position
from jaxfrontier.plan import planner
from test_planner import make_config, paper_config  # noqa: E402  pylint: disable=wrong-import-position

LAYOUTS = [
    ('1 device, L2 d64 s64, no remat', dict()),
    ('1 device, L2 d128 s128', dict(seq=128, d=128, batch=8)),
    ('data 2 × fsdp 2 × tensor 2, 2 micro-batches (reduced once)', dict(data=2, fsdp=2, tensor=2, accum=2, d=128)),
    ('fsdp 4, L4 d128 s128, full remat', dict(fsdp=4, layers=4, d=128, seq=128, remat='full')),
    ('data 4 ZeRO-1, save_dots', dict(data=4, zero1=True, layers=4, d=128, seq=128, remat='save_dots')),
    ('tensor 4 × data 2, 2 micro-batches (reduced once)', dict(layers=2, d=192, seq=32, batch=32, tensor=4, data=2,
                                                                accum=2)),
    ('fsdp 8, save_dots_no_batch', dict(layers=4, d=128, heads=8, fsdp=8, remat='save_dots_no_batch')),
    ('PP 2 × data 2 × tensor 2, 1F1B (staggered), M 4', dict(pipeline=2, data=2, tensor=2, accum=4, layers=4)),
    ('PP 2 × tensor 4, 1F1B (staggered), M 4, s128', dict(pipeline=2, tensor=4, accum=4, layers=4, d=128, seq=128,
                                                         batch=8)),
    ('PP 2 × tensor 4, 1F1B lockstep, M 4, s128', dict(pipeline=2, tensor=4, accum=4, layers=4, d=128, seq=128, batch=8,
                                                      schedule='1f1b_lockstep')),
    ('PP 4 × tensor 2, interleaved V 2, M 4', dict(pipeline=4, tensor=2, accum=4, layers=8, d=128, batch=8,
                                                  schedule='interleaved', virtual=2)),
    ('PP 2 × fsdp 2, GPipe, M 2', dict(pipeline=2, fsdp=2, accum=2, layers=4, d=128, batch=8, schedule='gpipe')),
    ('PP 2 × data 2, ZeRO-1, L4 d256, 1F1B (staggered), full remat', dict(pipeline=2, data=2, zero1=True, accum=4,
                                                                         layers=4, d=256, batch=8, remat='full')),
]


def row(name, c):
    result = compile_check.run_in_subprocess(c)
    plan = planner.plan(c)
    xla_mb, plan_mb = result.memory['total'] / 2**20, plan.memory.total_bytes / 2**20
    print(f'| {name} | {xla_mb:,.2f} | {plan_mb:,.2f} | '
          f'{compile_check.within(plan.memory.total_bytes, result.memory["total"]):+.1%} |', flush=True)


def main():
    print('| layout (fp32; L layers, d, seq; batch) | XLA MB | plan MB | |\n|---|---|---|---|')
    for name, kw in LAYOUTS:
        row(name, make_config(**kw))
    for name in ('175b', '1t'):
        c = paper_config(name)
        c.model.dtype = 'float32'
        copy = compile_check.cpu_copy(c)
        row(f'{name} paper layout, fp32 ({copy.mesh.pipeline * copy.mesh.data * copy.mesh.fsdp * copy.mesh.tensor} '
            'devices)', copy)


if __name__ == '__main__':
    main()
