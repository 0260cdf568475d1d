"""The fast checkpoint tier against the persistent one: blocking time, GiB/s, and steps lost per failure.

  python benchmarks/checkpoint_tiers.py [--quick] [--large] [--fast_dir=/dev/shm/jf_fast] [--dir=/tmp/jf_tiers]
      [--step_s=10] [--every_steps=1000] [--fast_every_steps=100] [--mtbf_h=4] > checkpoint_tiers.jsonl

The state is benchmarks/checkpoint.py's (GPT parameters + two Adam moments, fp32, drawn at random
as a trained state's are, fsdp 8 over 8 simulated CPU devices): 0.26 GiB (2 layers x 512), or
1.22 GiB with --large. --quick: one timed save per tier (checks the script). Two directories of
this machine stand for the two tiers: --fast_dir (default /dev/shm: memory, as the NVMe's page
cache would absorb a few hundred MB) and --dir (the persistent tier; on Frontier Lustre).

Measured, after one warm-up save of each tier, median of 3 (JSON lines, then a table):

  blocked_s   how long `save()` holds the training loop. Persistent (manager.Checkpointer, async):
              Orbax's device-to-host copy and bookkeeping. Fast (checkpoint/fast/tiers.py): this
              process's shards copied to host memory (and, with several processes, the peer
              exchange dispatched: one process here, so no peer copy is sent or written)
  total_s     until the step is committed (Orbax's rename; the fast tier's manifest, fsynced)
  gib_per_s   state GiB / total_s

Steps lost per failure (computed, not measured: a failure is not reproduced here). A failure at a
uniformly random moment loses the steps since the newest committed checkpoint: on average half a
save interval, plus the steps run while the newest save was still being written (its commit
latency, total_s / step_s, rounded up to whole steps, while it is shorter than the interval):

  lost(K, total_s) = K / 2 + ceil(total_s / step_s)      steps, for saves every K steps

without the fast tier K = --every_steps and total_s the persistent tier's; with it K =
--fast_every_steps and the fast tier's (one lost node: its shards come back from its peer; two
adjacent lost nodes fall back to the persistent tier). The saves' own cost per step is
blocked_s / K; the time lost per --mtbf_h hours of the job is failures x lost steps x step_s plus
the saves' blocking time, and Young/Daly's interval sqrt(2 x blocked_s x MTBF) / step_s is printed
for each tier. Use --step_s from a real run (metrics.jsonl's perf/step_time_s); the lead times this
on a quiet machine, as every benchmark.
"""

import json
import math
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checkpoint as bench  # noqa: E402  (sets the 8 simulated CPU devices before JAX starts)
import harness  # noqa: E402
import jax  # noqa: E402
from jaxfrontier.checkpoint import manager as ckpt_lib  # noqa: E402
from jaxfrontier.checkpoint.fast import tiers  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402


def _arg(name: str, default: str) -> str:
    return next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith(f'--{name}=')), default)


def time_tier(save, wait, state, repeats: int) -> dict[str, float]:
    """Warm-up save, then `repeats` timed ones: medians of (blocked_s, total_s)."""
    times = []
    for step in range(1, repeats + 2):
        metrics = jax.block_until_ready(bench.step_metrics(state))
        start = time.perf_counter()
        blocked = save(step, state, metrics)
        wait()
        total = time.perf_counter() - start
        if step > 1:
            times.append((blocked(start), total))
    return {'blocked_s': statistics.median(t[0] for t in times), 'total_s': statistics.median(t[1] for t in times)}


def steps_lost(every: int, total_s: float, step_s: float) -> float:
    """Mean steps lost by a failure at a random moment with saves every `every` steps (module docstring)."""
    return every / 2 + math.ceil(total_s / step_s)


def main():
    quick, large = '--quick' in sys.argv, '--large' in sys.argv
    fast_dir, root = _arg('fast_dir', '/dev/shm/jf_fast_bench'), _arg('dir', '/tmp/jf_tiers_bench')
    step_s, mtbf_h = float(_arg('step_s', '10')), float(_arg('mtbf_h', '4'))
    every, fast_every = int(_arg('every_steps', '1000')), int(_arg('fast_every_steps', '100'))
    repeats = 1 if quick else 3
    for d in (fast_dir, root):
        shutil.rmtree(d, ignore_errors=True)
    c = bench.bench_config(quick=not large)
    c.checkpoint.update(fast_dir=fast_dir, fast_every_steps=1, fast_keep=2, keep=2)
    layout = bench.layout_for(c)
    state = bench.trained_like(ts.init_train_state(c, layout))
    arrays, gib = ckpt_lib.describe_arrays(state)
    common = {'state_gib': gib, 'arrays': arrays, 'devices': jax.device_count(), 'platform': jax.devices()[0].platform}
    rows = []

    persistent = ckpt_lib.Checkpointer(c, root)

    def persistent_save(step, s, metrics):
        persistent.save(step, s, force=True, metrics=metrics)
        end = time.perf_counter()
        return lambda start: end - start

    rows.append({'tier': 'persistent', 'dir': root, **time_tier(persistent_save, persistent.wait, state, repeats)})
    persistent.close()

    fast = tiers.FastTier(c.checkpoint, layout.mesh)

    def fast_save(step, s, metrics):
        fast.save(step, s, metrics)
        return lambda start: fast.last_blocking_s

    rows.append({'tier': 'fast', 'dir': fast_dir, **time_tier(fast_save, fast.wait, state, repeats)})
    fast.close()

    failures = 3600 * 24 / (mtbf_h * 3600)  # per day of the job
    for row, k in zip(rows, (every, fast_every)):
        row.update(common, gib_per_s=gib / row['total_s'], every_steps=k, step_s=step_s,
                   steps_lost_per_failure=steps_lost(k, row['total_s'], step_s),
                   save_overhead=row['blocked_s'] / (k * step_s),
                   hours_lost_per_day=(failures * steps_lost(k, row['total_s'], step_s) * step_s
                                       + 24 * 3600 * row['blocked_s'] / (k * step_s)) / 3600,
                   young_daly_every_steps=math.sqrt(2 * max(row['blocked_s'], 1e-6) * mtbf_h * 3600) / step_s)
        print(json.dumps(row), flush=True)
    harness.print_table(rows, ['tier', 'state_gib', 'blocked_s', 'total_s', 'gib_per_s', 'every_steps',
                               'steps_lost_per_failure', 'save_overhead', 'hours_lost_per_day',
                               'young_daly_every_steps'])
    for d in (fast_dir, root):
        shutil.rmtree(d, ignore_errors=True)


if __name__ == '__main__':
    main()
