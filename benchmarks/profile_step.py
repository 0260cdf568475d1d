"""One train step of a peers.py shape, taken apart: what XLA:CPU compiled and where the time goes.

  JAX_PLATFORMS=cpu python benchmarks/profile_step.py --size small --family llama          # jaxfrontier
  JAX_PLATFORMS=cpu python benchmarks/profile_step.py --size small --family llama --torch  # torch.compile
  JAX_PLATFORMS=cpu python benchmarks/profile_step.py --size small --family llama --torch --eager
  ... --override model.scan_unroll=6   (jaxfrontier config overrides, as peers.py's --variant)

jaxfrontier's side prints two things. The compiled program's statistics, read from its optimized
HLO text (deterministic: the machine's load does not change them): fusions by kind (a dot in a
`kCustom` fusion runs in the library its backend config names: YNNPACK `__ynn_fusion`, XNNPACK
`__xnn_fusion`; elsewhere XLA's own Eigen call), while
loops (the rolled layer scan), transposes and copies by the bytes they move. Then a
`jax.profiler` trace of `--steps` steps, its device events summed by HLO name: the share of the
step each op takes (shares within one process survive a loaded machine far better than times).
With `--torch`, torch.profiler's table of the compiled PyTorch step (its CPU ops and inductor's
generated kernels) on the same shape. Both sides also time `--steps` untraced steps and apportion
that median step to the categories by their shares (`by_category_s`: seconds per step, the one
figure comparable between the two sides). `--out` writes the JSON.
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
import time

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


_COMP = re.compile(r'^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\s*$')


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """Instruction name -> category of the optimized HLO, with its while-loop depth in the name.

    Categories: `dot (YNNPACK)` (a fusion calling YNNPACK/XNNPACK), `dot (XLA Eigen)` (a dot left
    to XLA's own runtime), `buffer fill (broadcast)` (a fused constant broadcast: at the top level, the
    zero-fill of a scan's stacked outputs), `loop fusion` (XLA's own other
    element-wise kLoop/kInput fusions), `copy`, `transpose`, `other`; the suffix ` @depth N` says how
    many while bodies enclose it (0: the step's top level; 1: the rolled layer scan's body or an
    attention block loop at top level; 2: an attention block loop inside the layer scan)."""
    comp_of, body_of = {}, {}  # instruction -> its computation; while body -> the while's computation
    kind, comp = {}, ''
    for line in hlo_text.splitlines():
        c = _COMP.match(line)
        if c and not line.startswith(' '):  # a computation's header (instructions are indented)
            comp = c.group(1)
            continue
        m = _INSTR.match(line) or re.match(r'^\s*(?:ROOT )?%?([\w.\-]+) = \(.*?\) (\w[\w\-]*)\(', line)
        if not m:
            continue
        name, op = m.group(1), m.groups()[-1]
        comp_of[name] = comp
        if op == 'while':
            body = re.search(r'body=%?([\w.\-]+)', line)
            if body:
                body_of[body.group(1)] = comp
        if op == 'fusion' and re.search(r'__(?:ynn|xnn)_fusion|kind=kCustom', line):
            kind[name] = 'dot (YNNPACK)'
        elif op in ('dot', 'convolution') or (op == 'custom-call' and 'matmul' in line.lower()):
            kind[name] = 'dot (XLA Eigen)'
        elif op == 'fusion' and name.startswith('wrapped_broadcast'):  # a constant broadcast: a buffer's fill
            kind[name] = 'buffer fill (broadcast)'
        elif op == 'fusion':
            kind[name] = 'loop fusion'
        elif op in ('copy', 'transpose', 'while'):
            kind[name] = op
        else:
            kind[name] = 'other'

    def depth(c: str) -> int:
        d = 0
        while c in body_of and d < 8:
            c, d = body_of[c], d + 1
        return d
    return {n: f'{k} @depth {depth(comp_of[n])}' for n, k in kind.items()}


def by_category(ops: list[tuple[str, float, int]], categories: dict[str, str]) -> dict[str, float]:
    """Shares of the traced time summed by `hlo_categories`' category (`unmatched`: an event name
    that is no instruction of the program, e.g. a runtime marker)."""
    out = collections.Counter()
    for name, share, _ in ops:
        if not name.startswith('while'):
            out[categories.get(name, 'unmatched')] += share
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _median_step_s(step, steps: int) -> float:
    """Median wall time of `steps` untraced steps (each step returns a host value, so it has finished)."""
    times = []
    for _ in range(max(steps, 1)):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _seconds(shares: dict[str, float], step_s: float) -> dict[str, float]:
    """Each category's share of the traced op time apportioned to the untraced step's wall time: seconds
    per step comparable across the two sides (ops that overlap on the threads share the wall time)."""
    return {k: round(v * step_s, 4) for k, v in shares.items()}


def profile_jf(size: str, family: str, overrides: tuple[str, ...], steps: int) -> dict:
    import harness
    c = peer_workers.jf_config(peer_workers.SHAPES[size], family, overrides)
    run = harness.build_train_step(c)
    hlo_text = run.compiled.as_text()
    stats = hlo_stats(hlo_text)
    for _ in range(2):
        run.step()
    step_s = _median_step_s(run.step, steps)
    with tempfile.TemporaryDirectory() as d:
        ops = trace_ops(run.step, steps, d)
    shares = by_category(ops, hlo_categories(hlo_text))
    return {'attention': run.attention, 'scan_unroll': run.scan_unroll, 'hlo': stats, 'step_s': step_s,
            'by_category': shares, 'by_category_s': _seconds(shares, step_s),
            'top_ops': [{'op': n, 'share': s, 'count': k} for n, s, k in ops[:40]]}


_TORCH_CATEGORIES = (  # (category, substrings of an op's key), first match wins
    ('optimizer (AdamW, clipping)', ('adam', '_foreach', 'clip_grad', 'vector_norm', 'optimizer')),
    ('attention (sdpa)', ('scaled_dot_product', 'flash_attention', '_efficient_attention')),
    ('matmul (mm/bmm/addmm/linear)', ('aten::mm', 'aten::bmm', 'aten::addmm', 'aten::matmul', 'aten::linear',
                                     'extern_kernels.mm', 'extern_kernels.bmm', 'extern_kernels.addmm')),
    ('copies (copy_/clone/contiguous/cat)', ('copy_', 'clone', 'contiguous', 'aten::cat', 'aten::to', '_to_copy')),
    ('inductor fused kernels', ('cpp_fused', 'triton_', 'graph_', 'kernel')),
    ('compiled-region and autograd overhead', ('torch-compiled region', 'compiledfunction', 'autograd',
                                              'dynamo', 'aotdispatch')),
)


def torch_category(key: str) -> str:
    low = key.lower()
    for cat, subs in _TORCH_CATEGORIES:
        if any(s.lower() in low for s in subs):
            return cat
    return 'other (element-wise, embedding, loss, ...)'


def profile_torch(size: str, family: str, steps: int, compiled: bool = True) -> dict:
    import torch
    import torch_gpt
    c = peer_workers.jf_config(peer_workers.SHAPES[size], family)
    step, _ = torch_gpt.make_step(c, model=torch_gpt.hf_llama(c) if family == 'llama' else None, compiled=compiled)
    for _ in range(3):
        step()
    step_s = _median_step_s(step, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    table = prof.key_averages()
    whole = sum(e.self_cpu_time_total for e in table) or 1
    rows = sorted(table, key=lambda e: -e.self_cpu_time_total)
    cats = collections.Counter()
    for e in table:
        cats[torch_category(e.key)] += e.self_cpu_time_total / whole
    # AdamW's per-tensor ops (mul_, lerp_, addcmul_, sqrt) share names with the model's: its share is
    # read from torch's own `Optimizer.step#AdamW.step` range (inclusive time) instead
    opt_share = sum(e.cpu_time_total for e in table if e.key.startswith('Optimizer.step')) / whole
    shares = dict(cats.most_common())
    return {'compiled': compiled, 'step_s': step_s, 'by_category': shares, 'by_category_s': _seconds(shares, step_s),
            'optimizer_step_inclusive': opt_share,
            'top_ops': [{'op': e.key, 'share': e.self_cpu_time_total / whole, 'count': e.count} for e in rows[:40]]}


def check_args(args: argparse.Namespace) -> None:
    """A known size and family, overrides jaxfrontier's config takes, --steps >= 1, --out writable."""
    peer_workers.check_names('--size', [args.size], peer_workers.SHAPES)
    peer_workers.check_names('--family', [args.family], peer_workers.FAMILIES)
    peer_workers.check_at_least('--steps', args.steps, 1, ' (the steps timed, then traced)')
    if args.eager and not args.torch:
        peer_workers.fail('--eager: profiles PyTorch eager, with --torch only. Fix: add --torch, or drop --eager')
    peer = ('torch_eager' if args.eager else 'torch_compile') if args.torch else 'jf'
    peer_workers.check_overrides('--override', peer, args.size, args.family, tuple(args.override))
    peer_workers.check_out('--out', args.out)


def main() -> None:
    ap = peer_workers.Parser(description=__doc__.split('\n')[0])
    ap.add_argument('--size', default='small', help=f'one of {", ".join(peer_workers.SHAPES)}')
    ap.add_argument('--family', default='gpt')
    ap.add_argument('--override', action='append', default=[])
    ap.add_argument('--steps', type=int, default=3)
    ap.add_argument('--torch', action='store_true')
    ap.add_argument('--eager', action='store_true', help='with --torch: PyTorch eager, not torch.compile')
    ap.add_argument('--out', default='')
    args = ap.parse_args()
    check_args(args)  # every mistake one line before anything compiles
    res = (profile_torch(args.size, args.family, args.steps, not args.eager) if args.torch
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
