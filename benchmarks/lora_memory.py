"""LoRA's memory per device against full fine-tuning, Llama 8B on Frontier's layout: planner and XLA.

  python benchmarks/lora_memory.py                      # rank 16 on q,k,v,o,gate,up,down; ~minutes of XLA:CPU
  python benchmarks/lora_memory.py --rank=16 --targets=q,k,v,o --out=/tmp/lora_memory.json

configs/llama.py:size=8b,layout=frontier (data 8 x fsdp 8, ZeRO-1, micro-batch 1 x 8, remat save_dots), fine-tuned
whole and with adapters. For each: the plan (bf16, MI250X GCD), and an fp32 copy compiled on 64 simulated CPU
devices (plan/compile_check.py: XLA:CPU upcasts 16-bit work, so agreement is stated in fp32) with XLA's memory
per device beside the plan of the same copy. docs/post_training.md quotes the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))

import llama  # noqa: E402  pylint: disable=wrong-import-position,import-error
from jaxfrontier.plan import compile_check, planner  # noqa: E402  pylint: disable=wrong-import-position

GIB = 2**30


def measure(rank: int, targets: str, compile_copy: bool) -> dict:
    """The plan (bf16) and, with `compile_copy`, XLA's and the planner's memory of the fp32 copy."""
    c = llama.get_config('size=8b,layout=frontier')
    if rank:
        c.lora.update(rank=rank, alpha=2.0 * rank, targets=targets)
    out = {'plan_bf16': dict(planner.plan(c, 'mi250x').memory.items())}
    if compile_copy:
        copy = compile_check.cpu_copy(c)
        copy.model.dtype = 'float32'
        result = compile_check.run_in_subprocess(copy, timeout_s=3600)
        out['cpu_copy'] = {'mesh': dict(copy.mesh), 'compile_s': result.compile_s, 'xla': result.memory,
                           'plan_fp32': dict(planner.plan(copy, 'mi250x').memory.items())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--rank', type=int, default=16)
    p.add_argument('--targets', default='q,k,v,o,gate,up,down')
    p.add_argument('--no-compile', dest='compile', action='store_false')
    p.add_argument('--only', choices=['full', 'lora'], default=None)
    p.add_argument('--out', default=os.path.join(ROOT, 'benchmarks', 'results', 'lora_memory.json'))
    a = p.parse_args()
    kinds = {'full': 0, 'lora': a.rank}
    results = {k: measure(r, a.targets, a.compile) for k, r in kinds.items() if a.only in (None, k)}
    for kind, r in results.items():
        line = f'{kind:5s} plan bf16 {sum(r["plan_bf16"].values()) / GIB:6.2f} GiB per GCD'
        if 'cpu_copy' in r:
            x = r['cpu_copy']
            line += (f'; fp32 copy: XLA {x["xla"]["total"] / GIB:6.2f} GiB (temporaries '
                     f'{x["xla"]["temporaries"] / GIB:.2f}), plan {sum(x["plan_fp32"].values()) / GIB:6.2f} GiB, '
                     f'compiled in {x["compile_s"]:.0f} s')
        print(line, flush=True)
    with open(a.out, 'w', encoding='utf-8') as f:
        json.dump({'rank': a.rank, 'targets': a.targets, 'results': results}, f, indent=1)


if __name__ == '__main__':
    main()
