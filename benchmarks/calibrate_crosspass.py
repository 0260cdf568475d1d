"""How well the calibrated time model ranks the CPU sweep's layouts, held out and across passes.

  python benchmarks/calibrate_crosspass.py                      # the time model as it is (~15 s)
  python benchmarks/calibrate_crosspass.py --variant=all        # and each tried alternative (~2 min)
  python benchmarks/calibrate_crosspass.py --xla_bytes           # XLA's byte count of the stash (~6 min)

The same 24-layout sweep (benchmarks/calibrate.py) was measured twice, 3 h apart:
calibrate_cpu_sweep.jsonl (pass 1) and calibrate_cpu_sweep_pass2.jsonl (pass 2). Prints, for
pass 1, pass 2 and both (as repeats), the leave-one-out median |error| of the step time and the
Spearman rank correlation of held-out predicted vs measured throughput; then the check against
fitting noise: fit on one pass, rank the other pass's layouts (Spearman of predicted vs that
pass's measured throughput); and the noise ceiling, how alike the two passes rank the layouts.

`--variant` swaps one term of the time model (patched here, nothing in jaxfrontier/ changes) for
an alternative tried on this sweep; docs/planner.md, "On this machine", has the table:

  current          the stash charge: `stash_passes` x the residuals a layer keeps, per micro-batch
  sharded_stash    ... only the tensor-sharded residuals (heads, MLP hidden), not the replicated stream
  sharded_traffic  no replicated residual in the stash charge nor in the 4-5 element-wise passes
  per_step_stash   the stash charged once per step (buffers reused by the micro-batch scan)
  footprint        instead: activations + temporaries once per step (first touch of fresh memory)
  host_cache       instead: one layer's stash of all 8 devices beyond the host's 32 MiB L3
  l2_arrays        only residual arrays of >= 512 KiB (a core's L2) per device: smaller ones stay cached
  host_overlap     element-wise traffic of some devices hidden behind others' matmuls (max, not sum)
  stash_xla        `stash_passes` fixed at 9.4, what XLA:CPU's cost analysis counts, not fitted

`--xla_bytes` compiles each pass-1 layout on 8 simulated CPU devices and compares XLA's
`bytes accessed` (cost analysis; a loop's body counts once, so layer fwd + bwd of one
micro-batch plus the rest) of remat none and full with the bytes a layer stashes per device
(`ComputeWork.stash_bytes`): the extra bytes per stashed byte without a pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.plan import activations
from jaxfrontier.plan import calibrate as fit_lib
from jaxfrontier.plan import estimate
from jaxfrontier.plan import measured

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results')
PASSES = {'pass 1': [os.path.join(RESULTS, 'calibrate_cpu_sweep.jsonl')],
          'pass 2': [os.path.join(RESULTS, 'calibrate_cpu_sweep_pass2.jsonl')]}
PASSES['both'] = PASSES['pass 1'] + PASSES['pass 2']
VARIANTS = ('current', 'sharded_stash', 'sharded_traffic', 'per_step_stash', 'footprint', 'host_cache',
            'l2_arrays', 'host_overlap', 'stash_xla')
HOST_L3, CORE_L2 = 32 * 2**20, 512 * 2**10  # this project's host (lscpu)
XLA_STASH_PASSES = 9.4  # (bytes accessed, remat none - full) / stashed bytes per layer: 9.1-9.7 at tensor 1, 2, 4
_ORIG = (estimate.compute_work, estimate.compute_s, estimate.update_s, fit_lib.candidates)


def _replicated_share(shape, layout, remat: str, attention: str) -> tuple[float, float]:
    """(tensor-sharded, replicated) residual bytes of one layer for one micro-batch."""
    sig = activations.for_shape(shape, remat, attention)
    # pylint: disable-next=protected-access
    act, weight = estimate._act_sizes(shape, layout, False), estimate._act_sizes(shape, layout, True)
    out = [0.0, 0.0]
    for r in sig.block:
        out[not set(r.dims) & {'h', 'f', 'v'}] += r.local_bytes(weight if r.is_weight else act)
    return out[0], out[1]


def use_variant(name: str) -> None:
    """Patches estimate (and the candidates) to the variant's term."""
    compute_work, compute_s, update_s, candidates = _ORIG
    estimate.compute_work, estimate.compute_s, estimate.update_s, fit_lib.candidates = _ORIG

    def work(shape, layout, hw, fl):
        w = compute_work(shape, layout, hw, fl)
        attention, remat = estimate.attention_for(shape, hw), estimate.effective_remat(layout)
        sharded, replicated = _replicated_share(shape, layout, remat, attention)
        layers = shape.num_layers / layout.pipeline
        if name in ('sharded_stash', 'sharded_traffic'):
            w = dataclasses.replace(w, stash_bytes=layers * sharded)
        if name == 'sharded_traffic':
            passes = 4 + (1 if remat != 'none' else 0)
            w = dataclasses.replace(w, memory_bytes=w.memory_bytes - passes * layers
                                    * _replicated_share(shape, layout, 'none', attention)[1])
        if name == 'per_step_stash':
            w = dataclasses.replace(w, stash_bytes=w.stash_bytes / layout.accum_steps)
        if name == 'host_cache':
            host = (sharded + replicated) * layout.num_devices
            w = dataclasses.replace(w, stash_bytes=layers * max(0.0, host - HOST_L3) / layout.num_devices)
        if name == 'l2_arrays':
            sig = activations.for_shape(shape, remat, attention)
            act = estimate._act_sizes(shape, layout, False)  # pylint: disable=protected-access
            big = sum(r.local_bytes(act) for r in sig.block if r.local_bytes(act) >= CORE_L2)
            w = dataclasses.replace(w, stash_bytes=layers * big)
        if name == 'footprint':
            w = dataclasses.replace(w, stash_bytes=0.0)
        return w

    def overlapped_s(w, hw):
        peak = hw.compute_flops(w.dtype, w.num_devices) * estimate.gemm_efficiency(hw, w.layer_flops)
        matmul_s = w.matmul_flops / peak
        return (max(matmul_s, w.memory_bytes / hw.memory_bytes_per_s) + hw.stash_passes * w.stash_bytes
                / hw.memory_bytes_per_s + hw.layer_overhead_s * w.layers)

    estimate.compute_work = work
    if name == 'footprint':
        estimate.update_s = lambda mem, hw: update_s(mem, hw) + hw.stash_passes * (
            mem.activations_bytes + mem.temporaries_bytes) / hw.memory_bytes_per_s
    if name == 'host_overlap':
        estimate.compute_s = overlapped_s
    if name == 'stash_xla':
        fit_lib.candidates = lambda ms, hw: [p for p in candidates(ms, hw) if p.name != 'stash_passes']


def throughput(ms: list[measured.Measurement], seconds: np.ndarray) -> np.ndarray:
    return np.array([m.tokens for m in ms]) / seconds


def evaluate(variant: str, prior: hw_lib.Hardware) -> None:
    use_variant(variant)
    if variant == 'stash_xla':
        prior = dataclasses.replace(prior, stash_passes=XLA_STASH_PASSES)
    data = {name: measured.load(paths, prior) for name, paths in PASSES.items()}
    print(f'{variant}:\n  {"data":<8s} {"LOO error":>10s} {"LOO Spearman":>13s} {"fit Spearman":>13s}')
    for name, ms in data.items():
        _, report = fit_lib.calibrate(ms, prior)
        print(f'  {name:<8s} {report["holdout_median_abs_rel_error"]:>10.1%} {report["spearman_holdout"]:>13.2f} '
              f'{report["spearman_fit"]:>13.2f}   ' +
              ', '.join(f'{k} {v["value"]:.3g}' for k, v in report['fitted'].items()))
    one, two = data['pass 1'], data['pass 2']
    assert [m.work.layout for m in one] == [m.work.layout for m in two], 'the passes list the layouts alike'
    for a, b in (('pass 1', 'pass 2'), ('pass 2', 'pass 1')):
        hw = fit_lib.fit(data[a], prior).hardware
        ms = data[b]
        rho = fit_lib.spearman(throughput(ms, fit_lib.predict(ms, hw)),
                               throughput(ms, np.array([m.measured_s for m in ms])))
        print(f'  cross-pass: fit on {a}, rank {b}: Spearman {rho:.2f}')
    if variant == 'current':
        ceiling = fit_lib.spearman(throughput(one, np.array([m.measured_s for m in one])),
                                   throughput(two, np.array([m.measured_s for m in two])))
        print(f'  noise ceiling: pass 1 vs pass 2 measured throughput (median step times), Spearman {ceiling:.2f}')


def xla_bytes(prior: hw_lib.Hardware) -> None:
    """XLA's extra bytes accessed without remat, per byte the planner says a layer stashes (pipeline 1)."""
    from jaxfrontier.plan import compile_check  # pylint: disable=g-import-not-at-top

    with open(PASSES['pass 1'][0], encoding='utf-8') as f:
        records = [json.loads(line) for line in f]
    ms = measured.load(PASSES['pass 1'], prior)
    accessed = {}
    for record, m in zip(records, ms):
        if m.work.layout.pipeline == 1:
            config = measured._with_defaults(record['config'])  # pylint: disable=protected-access
            cost = compile_check.compile_on_cpu(config).cost_analysis()
            accessed[m.work.layout] = ((cost[0] if isinstance(cost, list) else cost)['bytes accessed'],
                                       m.work.compute.stash_bytes / m.work.compute.layers)
    for layout, (none_bytes, none_stash) in accessed.items():
        if layout.remat == 'none':
            full_bytes, full_stash = accessed[dataclasses.replace(layout, remat='full')]
            print(f'  {layout.describe()}: bytes accessed {none_bytes / 1e6:.0f} MB (none) - {full_bytes / 1e6:.0f} MB '
                  f'(full) = {(none_bytes - full_bytes) / (none_stash - full_stash):.1f} x the stash difference '
                  f'{(none_stash - full_stash) / 1e6:.2f} MB per layer')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--variant', default='current', choices=VARIANTS + ('all',))
    parser.add_argument('--xla_bytes', action='store_true', help='compile the layouts and compare XLA\'s byte count')
    args = parser.parse_args()
    prior = hw_lib.load(os.path.join(RESULTS, 'calibrate_cpu_prior.json'))
    if args.xla_bytes:
        config_lib.set_cpu_device_count(8)  # before JAX starts
        xla_bytes(prior)
        return
    for variant in VARIANTS if args.variant == 'all' else (args.variant,):
        evaluate(variant, prior)


if __name__ == '__main__':
    main()
