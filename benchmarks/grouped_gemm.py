"""One device's grouped GEMM of moe_1t's experts (`jax.lax.ragged_dot`) beside a dense matmul of the same FLOPs.

  python benchmarks/grouped_gemm.py            # one GPU, under a minute (gpu_check.py's `grouped_gemm` row)
  python benchmarks/grouped_gemm.py --smoke    # a tiny shape on the CPU: checks the plumbing, not the machine

configs/moe.py's moe_1t (d 7168, expert width f 2048, 384 experts, top k 8) at expert parallelism 32, the
layout docs/models.md plans for it: a device holds 12 experts, and its n = 4096 tokens' k n = 32,768
assignments (the even share; bf16) reach its experts sorted by expert. A single GPU cannot run EP, so this
times that device's share alone, the forward's two shapes of the layer (model/layers/moe.py,
linear.project_grouped):

  gate/up  x [m, d] by w [12, d, f] (each of w_gate and w_up)
  down     h [m, f] by w [12, f, d]

for three routings: `even` (the m rows split evenly over the 12 experts), `skewed` (one expert 4x the even
share, the rest even) and `padded` (even, in a buffer of 2 m rows as the ragged dispatch's receive buffer at
moe_dispatch_buffer 2: rows past the groups' total come out 0 and do no useful work). FLOPs = 2 x (rows in
groups) x d x f per matmul, the useful rows only; the dense row is x [m, d] by w [d, f] (and [m, f] by
[f, d]), the same FLOPs. TFLOP/s is the median over --trials of --reps back-to-back calls, after warm-up;
`vs_dense` is the grouped GEMM's TFLOP/s over the dense one's and `of_peak` over the device's table peak
(jaxfrontier.hardware). Each routing's first and last non-empty expert are checked against a dense fp32 product of
their rows (`rel_err`, the max error over the max magnitude).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FULL = {'d': 7168, 'f': 2048, 'experts': 384, 'top_k': 8, 'ep': 32, 'tokens': 4096}
SMOKE = {'d': 96, 'f': 32, 'experts': 32, 'top_k': 2, 'ep': 4, 'tokens': 64}  # 8 local experts, 128 rows
HOT = 4.0  # the skewed routing's busiest expert, over the even share


def group_sizes(rows: int, groups: int, case: str) -> list[int]:
    """Rows per local expert, summing to `rows`: even (the remainder on the first groups) or skewed."""
    if case == 'skewed':
        hot = min(rows, round(HOT * rows / groups))
        rest = group_sizes(rows - hot, groups - 1, 'even')
        return [hot] + rest
    base, extra = divmod(rows, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


def _time(f, args, reps: int, trials: int) -> float:
    """Median seconds per call of `f(*args)` over `trials` runs of `reps` queued calls (blocked at the end)."""
    import jax  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(f(*args))  # compile
    jax.block_until_ready(f(*args))  # warm-up
    per_call = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / reps)
    return statistics.median(per_call)


def _check(y_md, x_md, w_gio, sizes: list[int]) -> float:
    """Max error of the first and last non-empty group's rows against an fp32 product, over the reference's max."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    errs, top = [], 0.0
    filled = [g for g, size in enumerate(sizes) if size]
    for g in (filled[0], filled[-1]):
        lo = sum(sizes[:g])
        ref = jnp.dot(x_md[lo:lo + sizes[g]].astype(jnp.float32), w_gio[g].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)  # no TF32 on GPUs
        errs.append(float(jnp.max(jnp.abs(y_md[lo:lo + sizes[g]].astype(jnp.float32) - ref))))
        top = max(top, float(jnp.max(jnp.abs(ref))))
    return max(errs) / top if top else 0.0


def measure(smoke: bool = False, reps: int = 0, trials: int = 5) -> dict:
    """The grouped GEMM's and the dense matmul's rows at moe_1t's shape (smoke: SMOKE's), on device 0."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jaxfrontier import hardware  # pylint: disable=g-import-not-at-top
    s = SMOKE if smoke else FULL
    reps = reps or (3 if smoke else 20)
    groups, m = s['experts'] // s['ep'], s['top_k'] * s['tokens']
    d, f = s['d'], s['f']
    peak, source = hardware.device_peak_flops(jax.devices()[0], 'bfloat16')
    keys = jax.random.split(jax.random.key(0), 4)
    x_md = jax.random.normal(keys[0], (2 * m, d), jnp.bfloat16)  # the padded case's buffer; the others its first m
    h_mf = jax.random.normal(keys[1], (2 * m, f), jnp.bfloat16)
    w = {'gate/up': jax.random.normal(keys[2], (groups, d, f), jnp.bfloat16) / d ** 0.5,
         'down': jax.random.normal(keys[3], (groups, f, d), jnp.bfloat16) / f ** 0.5}
    inputs = {'gate/up': x_md, 'down': h_mf}
    grouped = jax.jit(lambda a, b, sizes: jax.lax.ragged_dot(a, b, sizes))
    dense = jax.jit(lambda a, b: a @ b)
    rows = []
    for proj in ('gate/up', 'down'):
        a_full, w_gio = inputs[proj], w[proj]
        k_in, k_out = w_gio.shape[1:]
        flops = 2 * m * k_in * k_out
        t = _time(dense, (a_full[:m], w_gio[0]), reps, trials)
        dense_tflops = flops / t / 1e12
        rows.append({'case': 'dense', 'projection': proj, 'shape': f'[{m},{k_in}]x[{k_in},{k_out}]', 'rows': m,
                     'flops': flops, 'ms': t * 1e3, 'tflops': dense_tflops, 'vs_dense': 1.0,
                     'of_peak': flops / t / peak})
        for case in ('even', 'skewed', 'padded'):
            sizes = group_sizes(m, groups, 'even' if case == 'padded' else case)
            a = a_full if case == 'padded' else a_full[:m]
            sizes_g = jnp.asarray(sizes, jnp.int32)
            t = _time(grouped, (a, w_gio, sizes_g), reps, trials)
            rows.append({'case': case, 'projection': proj,
                         'shape': f'[{a.shape[0]},{k_in}]x[{groups},{k_in},{k_out}]', 'rows': a.shape[0],
                         'group_sizes': sizes, 'flops': flops, 'ms': t * 1e3, 'tflops': flops / t / 1e12,
                         'vs_dense': flops / t / 1e12 / dense_tflops, 'of_peak': flops / t / peak,
                         'rel_err': _check(grouped(a, w_gio, sizes_g), a, w_gio, sizes)})
    return {'shape': s, 'local_experts': groups, 'assignments': m, 'dtype': 'bfloat16', 'smoke': smoke,
            'device': str(jax.devices()[0].device_kind), 'platform': jax.devices()[0].platform,
            'peak_tflops': peak / 1e12, 'peak_source': source, 'reps': reps, 'trials': trials,
            'flop_convention': '2 x rows in groups x d x f per matmul (useful rows only)', 'rows': rows}


def _f(value, digits: int, general: bool = False) -> str:
    return '' if value is None else f'{value:.{digits}g}' if general else f'{value:.{digits}f}'


def markdown(record: dict) -> str:
    """The grouped-GEMM table docs/PERFORMANCE.md takes."""
    if 'rows' not in record:
        return f"Grouped GEMM (ragged_dot): {record.get('skipped') or record.get('error', 'no result')}"
    s = record['shape']
    what = 'the --smoke shape (plumbing only)' if record['smoke'] else "moe_1t's experts"
    lines = [f"Grouped GEMM (jax.lax.ragged_dot, {record['dtype']}): {what} at EP {s['ep']}, "
             f"{record['local_experts']} local experts of d {s['d']} x f {s['f']}, {record['assignments']} rows "
             f"(k {s['top_k']} x n {s['tokens']}); FLOPs 2 m d f per matmul (rows in groups); "
             f"peak {_f(record['peak_tflops'], 3, True)} TFLOP/s ({record['peak_source']})", '',
             '| projection | case | shape | ms | TFLOP/s | vs dense | of peak | rel err |', '|---|---|---|---|---|---|---|---|']
    for r in record['rows']:
        lines.append(f"| {r['projection']} | {r['case']} | {r['shape']} | {_f(r['ms'], 3)} | {_f(r['tflops'], 3, True)} | "
                     f"{_f(r['vs_dense'], 2)} | {_f(r['of_peak'], 2)} | {_f(r.get('rel_err'), 4)} |")
    return '\n'.join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--smoke', action='store_true', help='a tiny shape (the CPU): the plumbing, not the machine')
    parser.add_argument('--reps', type=int, default=0, help='calls per timed trial (default 20; smoke 3)')
    parser.add_argument('--trials', type=int, default=5, help='timed trials; their median is reported')
    parser.add_argument('--out', default='', help='where the JSON record goes (none by default)')
    args = parser.parse_args(argv)
    sys.path.insert(0, REPO)
    record = measure(args.smoke, args.reps, args.trials)
    if args.out:
        with open(args.out, 'w', encoding='utf-8') as f:
            json.dump(record, f, indent=1)
    print(markdown(record))
    return 0


if __name__ == '__main__':
    sys.exit(main())
