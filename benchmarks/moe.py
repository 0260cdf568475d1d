"""Mixture of experts: each dispatch at expert-parallel sizes; bytes over `expert`, step time, compiled memory.

  python benchmarks/moe.py                          # 2.5 min on 2 cores; writes benchmarks/results/moe_dispatch.json
  python benchmarks/moe.py --eps=2 --dispatches=gather,ragged --steps=1 --warmup=0 --out=/tmp/moe.json   # quick
  python benchmarks/moe.py --dispatches=auto --eps=1,2,4,8 --modes=dropless,capacity \
      --out=benchmarks/results/moe.json             # the earlier sweep: dropless vs capacity at the auto dispatch

configs/moe.py's `tiny` model (8 experts of width 64, top 2, 2 MoE layers, d 128, fp32) on 8 simulated CPU
devices: expert EP x data 8 / EP at a global batch of 16 sequences of 64 tokens, for each `model.moe_dispatch`
(gather, all_to_all, ragged: model/layers/moe_dispatch.py; `auto` is the config's own choice) and each mode
(dropless, or capacity factor 1.25; --chunks sets model.moe_chunks of the sent dispatches). EP 1 has no
dispatch: one row, `local`. Each row compiles the train step once and reports, side by side:

  dispatch_B_hlo   the compiled step's collectives over `expert` alone that move tokens (all-gather,
                   reduce-scatter, all-to-all), per device and step (plan/compile_check.collectives with
                   its branch_weights: the sent dispatch's overflow fallback to gather, a `lax.cond`
                   branch, counts 0, as the plan charges the sent path)
  dispatch_B_plan  the planner's bytes for the same (planner.plan(c).transfers over `expert` alone, the
                   same kinds and ragged-all-to-all; plan/moe.py expert_traffic)
  expert_B_hlo/plan  every collective whose axes include `expert`: the above, the dispatch's overflow
                   check (a pmax of one pred) and the dense parameters' gradient all-reduce over
                   (data, expert), or (expert) at data 1
  step_s           median CPU step time of --steps steps after --warmup (compilation excluded)

On the CPU `ragged` runs the exact all-gather stand-in (model/layers/ragged.py: XLA:CPU has no
ragged-all-to-all), so its compiled bytes and its step time are the stand-in's, an all-gather of every
device's sorted assignments (EP k n rows) and their transposes, growing with EP; the planner's ragged bytes
are the GPU op's (what the busiest device receives: DROPLESS_IMBALANCE x k n rows a collective, flat in EP).
The JSON rows hold each side's bytes by (kind, axes).

benchmarks/results/moe_dispatch.json (the default run, AMD EPYC, 2 cores at load average 3.3-4.0): the
compiled dispatch bytes equal the plan's for gather (1.06 / 2.12 / 4.24 MB at EP 2 / 4 / 8: EP n rows)
and all_to_all (2.10 MB at every EP: EP buffers of 2 k n / EP rows); ragged's stand-in moves 3.0x
gather's (3.1 / 6.3 / 12.6 MB) where the plan charges the GPU op 1.31 MB at every EP. The expert bytes
differ by the plan's separate embedding-gradient all-reduce, which XLA merges into the other one: 131 kB
above the compiled count at every EP (an untied embedding's gradient reduced once, not twice:
comm._param_traffic, a dense-model matter). Step times 0.08-0.19 s, within the shared host's noise.

Simulated devices share the host's cores, so step time measures the dispatch's overheads (the collectives,
the buffers, the sorts), not a speed-up; state the machine's load beside any timing (`loadavg` in each row)
and the host (`lscpu`). FLOPs (tokens/s only here): benchmarks/harness.py.
benchmarks/results/moe.json holds the earlier sweep (load average 1-7 on 2 shared cores): the temporaries
grow with EP dropless (the EP k n-row buffers, and XLA:CPU's per-group ragged_dot expansion,
docs/planner.md) and shrink with a capacity ((E / EP) C rows); step times are noise-dominated at this size.
"""

import json
import os
import statistics
import sys
import time

from absl import app, flags

from jaxfrontier import config as config_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'configs'))
import moe as moe_configs  # noqa: E402  (configs/moe.py)

DISPATCHES = ('auto', 'gather', 'all_to_all', 'ragged')
_DISPATCHES = flags.DEFINE_list('dispatches', ['gather', 'all_to_all', 'ragged'],
                                f'model.moe_dispatch values, of {DISPATCHES} (auto: the config\'s choice).')
_EPS = flags.DEFINE_list('eps', ['2', '4', '8'], 'Expert-parallel sizes (data takes the other devices).')
_MODES = flags.DEFINE_list('modes', ['dropless'], 'dropless and/or capacity (factor 1.25).')
_CHUNKS = flags.DEFINE_integer('chunks', 1, 'model.moe_chunks of the all_to_all and ragged rows (1: one dispatch a layer).')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices of every run.')
_STEPS = flags.DEFINE_integer('steps', 3, 'Timed steps after warm-up.')
_WARMUP = flags.DEFINE_integer('warmup', 1, 'Untimed steps after compilation.')
_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'benchmarks', 'results', 'moe_dispatch.json'),
                           'Where the rows go.')

MOVES_TOKENS = ('all-gather', 'reduce-scatter', 'all-to-all', 'ragged-all-to-all')
BYTES = ('dispatch_B_hlo', 'dispatch_B_plan', 'expert_B_hlo', 'expert_B_plan')
COLUMNS = ['dispatch', 'expert', 'data', 'mode', *(b.replace('_B_', '_kB_') for b in BYTES), 'median_step_s',
           'tokens_per_s_per_device', 'temp_gib_per_device', 'loadavg']


def config(ep: int, mode: str, dispatch: str = 'auto'):
    c = moe_configs.get_config(f'size=tiny,expert={ep},data={_DEVICES.value // ep}')
    c.model.moe_dropless = mode == 'dropless'
    c.model.moe_dispatch = dispatch
    if _CHUNKS.value != 1 and dispatch in ('all_to_all', 'ragged'):
        c.model.moe_chunks = _CHUNKS.value
    c.mesh.cpu_devices = _DEVICES.value
    return c


def runs() -> list[tuple[int, str, str]]:
    """(EP, mode, dispatch) of every row; EP 1 once per mode (no dispatch: every one is the local one)."""
    bad = [d for d in _DISPATCHES.value if d not in DISPATCHES]
    if bad:
        raise app.UsageError(f'--dispatches: {bad} unknown; use some of {DISPATCHES}')
    out = []
    for ep in (int(x) for x in _EPS.value):
        for mode in _MODES.value:
            out += [(ep, mode, 'auto')] if ep == 1 else [(ep, mode, d) for d in _DISPATCHES.value]
    return out


def by_kind(items) -> dict[str, float]:
    """Bytes per device and step by 'kind axes' of (kind, axes, bytes) whose axes include `expert`."""
    out = {}
    for kind, axes, n in items:
        if 'expert' in axes:
            key = f"{kind} {','.join(axes)}"
            out[key] = out.get(key, 0.0) + n
    return out


def dispatch_bytes(kinds: dict[str, float]) -> float:
    """The token-moving collectives over `expert` alone (MOVES_TOKENS) of a by_kind dict."""
    return sum(n for key, n in kinds.items() if key.split()[0] in MOVES_TOKENS and key.split()[1] == 'expert')


def expert_bytes(c, compiled) -> dict:
    """The compiled step's and the plan's collective bytes over `expert` (module docstring)."""
    from jaxfrontier.plan import compile_check, planner  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
    hlo = by_kind((x.kind, x.axes, x.total_bytes) for x in compile_check.collectives(c, compiled))
    plan = by_kind((t.kind, t.axes, t.payload_bytes) for t in planner.plan(c).transfers)
    return {'dispatch_B_hlo': dispatch_bytes(hlo), 'dispatch_B_plan': dispatch_bytes(plan),
            'expert_B_hlo': sum(hlo.values()), 'expert_B_plan': sum(plan.values()),
            'hlo_bytes_by_kind': hlo, 'plan_bytes_by_kind': plan}


def measure(c, steps: int, warmup: int) -> dict:
    """One compile of `c`'s train step: the median of `steps` timed steps after `warmup`, its memory and the
    bytes over `expert` of that same compiled program."""
    import harness  # pylint: disable=g-import-not-at-top  (imports JAX, after XLA_FLAGS is final)
    from jaxfrontier.families import moe as families_moe  # pylint: disable=g-import-not-at-top
    from jaxfrontier.training import step as step_lib  # pylint: disable=g-import-not-at-top
    run = harness.build_train_step(c)
    times, loss = [], float('nan')
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = run.step()  # blocks on the loss
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    n = config_lib.num_devices(c)
    mem = step_lib.memory_bytes(run.compiled)
    ep = c.mesh.expert
    s = families_moe.shape_of(c.model, c.model.mlp_dim)
    with open('/proc/loadavg', encoding='utf-8') as f:
        load = float(f.read().split()[0])
    return {'dispatch': 'local' if ep == 1 else families_moe.resolve_dispatch(s, ep), 'asked': c.model.moe_dispatch,
            'chunks': c.model.get('moe_chunks', 1), 'expert': ep, 'data': c.mesh.data, 'mode': 'dropless' if c.model.moe_dropless else 'capacity',
            'devices': n, 'compile_s': run.compile_s, 'median_step_s': step_s, 'step_times_s': times, 'loss': loss,
            'tokens_per_s_per_device': c.train.global_batch * c.model.seq_len / (step_s * n),
            'temp_gib_per_device': mem.get('temporaries', float('nan')) / 2**30,
            'peak_gib_per_device': mem.get('total', float('nan')) / 2**30,
            **expert_bytes(c, run.compiled), 'loadavg': load}


def main(argv):
    del argv
    todo = runs()
    config_lib.set_cpu_device_count(_DEVICES.value)
    import harness  # pylint: disable=g-import-not-at-top  (imports JAX, after XLA_FLAGS is final)
    rows = []
    for ep, mode, dispatch in todo:
        rows.append(measure(config(ep, mode, dispatch), _STEPS.value, _WARMUP.value))
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith('by_kind')}), flush=True)
    print()
    in_kb = [{**r, **{b.replace('_B_', '_kB_'): f'{r[b] / 1e3:.1f}' for b in BYTES}} for r in rows]
    harness.print_table(in_kb, COLUMNS)
    print('\nkB per device and step. On the CPU `ragged` runs the all-gather stand-in '
          '(model/layers/ragged.py): its _hlo bytes and step time are the stand-in\'s; its _plan bytes are the '
          'GPU op\'s (ragged-all-to-all). Simulated devices share the host\'s cores (loadavg beside each row).')
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, 'w', encoding='utf-8') as f:
        json.dump(rows, f, indent=1)


if __name__ == '__main__':
    app.run(main)
