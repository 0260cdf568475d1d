"""One train step of a peers.py shape, taken apart: what XLA:CPU compiled and where the time goes.

  JAX_PLATFORMS=cpu python benchmarks/profile_step.py --size small --family llama          # jaxfrontier
  JAX_PLATFORMS=cpu python benchmarks/profile_step.py --size small --family llama --torch  # torch.compile
  ... --override model.scan_unroll=6   (jaxfrontier config overrides, as peers.py's --variant)

jaxfrontier's side prints two things. The compiled program's statistics, read from its optimized
HLO text (deterministic: the machine's load does not change them): fusions by kind (a dot in a
`kCustom` fusion runs in the library its backend config names: YNNPACK `__ynn_fusion`, XNNPACK
`__xnn_fusion`; elsewhere XLA's own Eigen call), while
loops (the rolled layer scan), transposes and copies by the bytes they move. Then a
`jax.profiler` trace of `--steps` steps, its device events summed by HLO name: the share of the
step each op takes (shares within one process survive a loaded machine far better than times).
With `--torch`, torch.profiler's table of the compiled PyTorch step (its CPU ops and inductor's
generated kernels) on the same shape. `--out` writes the JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import peer_workers  # noqa: E402

_DTYPE_BYTES = {'f32': 4, 'bf16': 2, 'f16': 2, 's32': 4, 'u32': 4, 'pred': 1, 's8': 1, 'u8': 1, 'f64': 8}
_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\][^ ]* (\w[\w\-]*)\(')


def hlo_stats(hlo_text: str) -> dict:
    """Counts of the optimized HLO's instructions that decide XLA:CPU's speed (see the module doc)."""
    ops = collections.Counter()
    fusion_kinds = collections.Counter()
    moved = collections.Counter()  # bytes written by transposes and copies
    custom = collections.Counter()
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        _, dtype, dims, op = m.groups()
        ops[op] += 1
        if op == 'fusion':
            kind = re.search(r'"kind":"(\w+)"', line) or re.search(r'kind=(\w+)', line)
            fusion_kinds[kind.group(1) if kind else '?'] += 1
        if op == 'custom-call':
            target = re.search(r'custom_call_target="([^"]+)"', line)
            custom[target.group(1) if target else '?'] += 1
        if op in ('transpose', 'copy'):
            n = 1
            for d in dims.split(','):
                n *= int(d) if d else 1
            moved[op] += n * _DTYPE_BYTES.get(dtype, 4)
    return {'while_loops': len(re.findall(r' while\(', hlo_text)), 'ops': dict(ops.most_common()), 'fusion_kinds': dict(fusion_kinds), 'custom_calls': dict(custom),
            'transpose_copy_mib': {k: v / 2**20 for k, v in moved.items()},
            'computations': hlo_text.count('\n%') + hlo_text.count('\nENTRY')}


def trace_ops(step, steps: int, logdir: str) -> list[tuple[str, float, int]]:
    """(name, share of the traced time, count) of the XLA:CPU ops of `steps` steps, largest first."""
    import jax
    from jax._src.lib import _profile_data  # pylint: disable=g-import-not-at-top
    jax.profiler.start_trace(logdir)
    for _ in range(steps):
        step()
    jax.profiler.stop_trace()
    path = glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True)[0]
    data = _profile_data.ProfileData.from_file(path)
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:  # XLA:CPU's thunks are events on its client's and Eigen's thread lines
        for line in plane.lines:
            if not line.name.startswith('tf_XLA'):
                continue
            for ev in line.events:
                if ev.name.startswith(('ThreadpoolListener', 'end: ', 'ThunkExecutor')):  # markers, not ops
                    continue
                total[ev.name] += ev.duration_ns
                count[ev.name] += 1
    # a while loop's event spans its body's: shares are of the ops outside loops plus the bodies' ops
    whole = sum(t for n, t in total.items() if not n.startswith('while')) or 1
    return [(name, t / whole, count[name]) for name, t in total.most_common()]


def profile_jf(size: str, family: str, overrides: tuple[str, ...], steps: int) -> dict:
    import harness
    c = peer_workers.jf_config(peer_workers.SHAPES[size], family, overrides)
    run = harness.build_train_step(c)
    stats = hlo_stats(run.compiled.as_text())
    for _ in range(2):
        run.step()
    with tempfile.TemporaryDirectory() as d:
        ops = trace_ops(run.step, steps, d)
    return {'attention': run.attention, 'scan_unroll': run.scan_unroll, 'hlo': stats,
            'top_ops': [{'op': n, 'share': s, 'count': k} for n, s, k in ops[:40]]}


def profile_torch(size: str, family: str, steps: int) -> dict:
    import torch
    import torch_gpt
    c = peer_workers.jf_config(peer_workers.SHAPES[size], family)
    step, _ = torch_gpt.make_step(c, model=torch_gpt.hf_llama(c) if family == 'llama' else None)
    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table = prof.key_averages()
    whole = sum(e.self_cpu_time_total for e in table) or 1
    rows = sorted(table, key=lambda e: -e.self_cpu_time_total)
    return {'top_ops': [{'op': e.key, 'share': e.self_cpu_time_total / whole, 'count': e.count} for e in rows[:40]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--size', default='small', choices=list(peer_workers.SHAPES))
    ap.add_argument('--family', default='gpt')
    ap.add_argument('--override', action='append', default=[])
    ap.add_argument('--steps', type=int, default=3)
    ap.add_argument('--torch', action='store_true')
    ap.add_argument('--out', default='')
    args = ap.parse_args()
    res = (profile_torch(args.size, args.family, args.steps) if args.torch
           else profile_jf(args.size, args.family, tuple(args.override), args.steps))
    for k, v in res.items():
        if k != 'top_ops':
            print(f'{k}: {json.dumps(v)}')
    print(f'{"share":>6} {"count":>6}  op')
    for r in res['top_ops'][:25]:
        print(f'{r["share"]:6.3f} {r["count"]:6d}  {r["op"][:110]}')
    if args.out:
        with open(args.out, 'w') as f:
            json.dump({'args': vars(args), **res}, f, indent=1)


if __name__ == '__main__':
    main()
