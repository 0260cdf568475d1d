"""Pipeline schedules side by side: step time, executed/useful FLOPs, memory, bubble.

  python benchmarks/pipeline.py [--quick] > pipeline.jsonl

For each schedule (staggered `1f1b` and `1f1b_lockstep` side by side), P in {2, 4} and M in {P, 4P, 16P} on 8 simulated CPU devices (tensor =
8 / P), a GPT of 8 layers x 128 wide, sequence 64, micro-batch 1: JSON lines, then a table.
executed/useful = matmul FLOPs the step executes (jaxpr count, bubbles and recomputation
included, see jaxfrontier/plan/flop_count.py) / those of the same step without pipeline and
without recomputation. temp = XLA's temporary memory per device of the compiled step;
max_stashed_inputs = the most micro-batches whose stage input a stage holds at once.
"""

import json
import os
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import harness  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier.plan import flop_count  # noqa: E402
from jaxfrontier import layout as layout_lib
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier import pipeline  # noqa: E402
from jaxfrontier.training import step as step_lib  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402


def bench_config(schedule, p, m, remat='full'):
    c = config_lib.base_config()
    c.model.update(num_layers=8, d_model=128, num_heads=8, seq_len=64, vocab_size=256, vocab_multiple=32,
                   dtype='float32', remat=remat, attention='xla')
    c.mesh.update(pipeline=p, tensor=8 // p)
    c.pipeline.update(schedule=schedule, virtual_stages=2 if schedule == 'interleaved' else 1)
    c.train.update(global_batch=m, micro_batch=1, accum_steps=m)
    return c


def step_flops(c):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layout.abstract_state)
    batch = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32)
    weights = pipeline.build_schedule(layout_lib.Layout.from_config(c)).flop_weights if c.mesh.pipeline > 1 else None
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        return flop_count.executed_dot_flops(step_lib.make_train_step(c, layout), state, batch, branch_weights=weights)


def main():
    quick = '--quick' in sys.argv
    rows = []
    for schedule in ('gpipe', '1f1b', '1f1b_lockstep', 'interleaved'):
        for p in (2, 4):
            for m in ((p, 4 * p) if quick else (p, 4 * p, 16 * p)):
                c = bench_config(schedule, p, m)
                useful = step_flops(bench_config(schedule, 1, m, remat='none'))
                row = {'schedule': schedule, 'P': p, 'M': m, 'V': c.pipeline.virtual_stages,
                       'bubble': pipeline.build_schedule(layout_lib.Layout.from_config(c)).bubble,
                       'max_stashed_inputs': pipeline.build_schedule(layout_lib.Layout.from_config(c)).max_stashed_inputs(),
                       'executed_over_useful': step_flops(c) / useful}
                row.update(harness.time_train_step(c, steps=3, warmup=1))
                rows.append(row)
                print(json.dumps(row), flush=True)
    harness.print_table(rows, ['schedule', 'P', 'M', 'V', 'median_step_s', 'executed_over_useful',
                               'temp_gib_per_device', 'max_stashed_inputs', 'bubble', 'compile_s'])


if __name__ == '__main__':
    main()
