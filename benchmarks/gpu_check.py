"""One command for the first minutes on a GPU: what the machine is, and how fast we train on it.

  python benchmarks/gpu_check.py [--out=gpu_check.json] [--budget_s=420]   # one GPU, < 8 minutes
  python benchmarks/gpu_check.py --quick                                   # CPU-sized, every part

Records (JSON to --out, then the Markdown table docs/PERFORMANCE.md takes, on stdout):
  environment  devices, Python, jax / jaxlib / GPU plugin versions, XLA_FLAGS
  matmul       measured bf16 matmul TFLOP/s (8192^3; --quick: 512^3) against the table's peak
  grouped_gemm jax.lax.ragged_dot at moe_1t's expert shape, one device's share at EP 32 (12 experts,
               32,768 rows; even, skewed and padded routings) beside a dense matmul of the same FLOPs
               (benchmarks/grouped_gemm.py; --quick: its --smoke shape)
  steps        125m, 350m, 1.3b (configs/gpt.py) at sequence 2048 for each attention
               (auto, xla, cudnn, blockwise) and remat policy (none, full, save_dots,
               save_dots_attention: the CPU's fastest, docs/PERFORMANCE.md): step time,
               tokens/s, MFU (Megatron's f = 3 FLOPs, benchmarks/harness.py); the micro-batch
               the planner says fills memory (halved once on an out-of-memory); the allocator's
               peak beside XLA's estimate and the planner's. An implementation the config does
               not know (blockwise before it lands) or the platform cannot run (cuDNN off
               NVIDIA) is listed as skipped with the reason.
  torch        the same GPT in PyTorch (pre-LN, tied embeddings, SDPA, fused AdamW, bf16
               autocast) under torch.compile, when torch is importable (benchmarks/torch_gpt.py)
  layout       tests/layout_check.py's single-device reference comparison for data parallelism
               over the devices present (one device: nothing to compare)
  checkpoint   save / restore GiB/s of benchmarks/checkpoint.py's state through Checkpointer

On a GPU every measurement runs in its own subprocess (an out-of-memory or a crash costs one
row, and the allocator's peak is that row's own); rows run in priority order and those left
when --budget_s is spent are listed as skipped. --quick runs everything in this process on 8
simulated CPU devices with a 2-layer model (sequence 64) and three step rows, so the script
cannot rot before a GPU arrives (tests/test_gpu_check.py). There a step runs on one of the 8
simulated devices while the CPU peak is divided among all 8, so quick MFU and the matmul's
fraction of peak read about 8x too high: quick numbers check the plumbing, not the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib import metadata

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = 'GPU_CHECK_RESULT '
SIZES = ('125m', '350m', '1.3b')
ATTENTIONS = ('auto', 'xla', 'cudnn', 'blockwise')
REMATS = ('none', 'full', 'save_dots', 'save_dots_attention')
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'jax-cuda12-plugin', 'jax-cuda12-pjrt',
            'jax-cuda13-plugin', 'jax-cuda13-pjrt', 'jax-rocm7-plugin', 'jax-rocm7-pjrt', 'torch')


def step_config(size: str, attention: str, remat: str, micro_batch: int, quick: bool):
    """configs/gpt.py's model at sequence 2048 (quick: 2 layers x 64, sequence 64) on one device."""
    sys.path.insert(0, REPO)
    from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
    gpt = config_flags.config_flags._LoadConfigModule('gpt', os.path.join(REPO, 'configs', 'gpt.py'))  # noqa: SLF001
    c = gpt.get_config(f'size={size},micro_batch={micro_batch}')
    c.model.update(attention=attention, remat=remat)
    if quick:
        c.model.update(num_layers=2, d_model=64, num_heads=2, seq_len=64, vocab_size=512)
    return c


def skip_reason(size: str, attention: str, remat: str, platform: str, kind: str, quick: bool) -> str | None:
    """Why a row cannot run here (config validation, platform), or None."""
    from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top  (no JAX)
    from jaxfrontier.errors import ConfigError  # pylint: disable=g-import-not-at-top
    try:
        config_lib.validate(step_config(size, attention, remat, 1, quick))
    except ConfigError as e:
        return str(e)
    if attention == 'cudnn' and 'nvidia' not in kind.lower() and platform not in ('cuda', 'gpu'):
        return f'cuDNN attention needs an NVIDIA GPU (this is {platform}: {kind})'
    return None


# --------------------------------------------------------------------------- parts (run with JAX)


def part_environment(spec, quick):
    import jax  # pylint: disable=g-import-not-at-top
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    d = jax.devices()[0]
    return {'platform': d.platform, 'device_kind': str(d.device_kind), 'devices': jax.device_count(),
            'python': sys.version.split()[0], 'versions': versions, 'xla_flags': os.environ.get('XLA_FLAGS', ''),
            'backend_version': getattr(jax.extend.backend.get_backend(), 'platform_version', '')
            if hasattr(jax, 'extend') else ''}


def part_matmul(spec, quick):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jaxfrontier import hardware  # pylint: disable=g-import-not-at-top
    n, reps = (512, 5) if quick else (8192, 20)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    start = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - start) / reps
    peak, source = hardware.device_peak_flops(jax.devices()[0], 'bfloat16')
    tflops = 2 * n ** 3 / seconds / 1e12
    return {'n': n, 'tflops': tflops, 'peak_tflops': peak / 1e12, 'fraction_of_peak': tflops * 1e12 / peak,
            'peak_source': source}


def part_grouped_gemm(spec, quick):
    import grouped_gemm  # pylint: disable=g-import-not-at-top  (benchmarks/grouped_gemm.py)
    return grouped_gemm.measure(smoke=quick)


def part_step(spec, quick):
    import jax  # pylint: disable=g-import-not-at-top
    import harness  # pylint: disable=g-import-not-at-top
    from jaxfrontier import hardware  # pylint: disable=g-import-not-at-top
    from jaxfrontier.plan import planner  # pylint: disable=g-import-not-at-top
    c = step_config(spec['size'], spec['attention'], spec['remat'], spec['micro_batch'], quick)
    plan = planner.plan(c, hardware.local())
    result = harness.time_train_step(c, steps=2 if quick else 5, warmup=1 if quick else 2)
    peak = hardware.memory_stats(jax.devices()[0]).get('peak_bytes_in_use')
    return {**spec, 'step_s': result['median_step_s'], 'tokens_per_s': result['perf/tokens_per_s'],
            'mfu': result['perf/mfu'], 'compile_s': result['compile_s'], 'loss': result['loss'],
            'xla_peak_gib': result['peak_gib_per_device'], 'planner_gib': plan.memory.total_bytes / 2**30,
            'allocator_peak_gib': None if peak is None else peak / 2**30}


def choose_micro_batch(size: str, attention: str, remat: str, quick: bool) -> int:
    """The largest power-of-two micro-batch (<= 64) the planner says fits one device here."""
    if quick:
        return 2
    from jaxfrontier import hardware  # pylint: disable=g-import-not-at-top
    from jaxfrontier.plan import planner  # pylint: disable=g-import-not-at-top
    hw, best = hardware.local(), 1
    for b in (1, 2, 4, 8, 16, 32, 64):
        if planner.plan(step_config(size, attention, remat, b, quick), hw).fits:
            best = b
    return best


def part_plan(spec, quick):
    return {'micro_batch': choose_micro_batch(spec['size'], spec['attention'], spec['remat'], quick)}


def part_torch(spec, quick):
    try:
        import torch_gpt  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        return {**spec, 'skipped': f'torch not importable ({e})'}
    c = step_config(spec['size'], 'auto', 'none', spec['micro_batch'], quick)
    return {**spec, **torch_gpt.time_step(c, steps=2 if quick else 5, warmup=1 if quick else 2)}


def part_layout(spec, quick):
    import jax  # pylint: disable=g-import-not-at-top
    n = jax.device_count()
    if n < 2:
        return {'devices': n, 'checked': [], 'note': 'one device: no layout to compare'}
    sys.path.insert(0, os.path.join(REPO, 'tests'))
    import layout_check  # pylint: disable=g-import-not-at-top
    data = 2 if quick else n
    reference = layout_check.run_layout(layout_check.make_config())
    layout_check.check_against_reference(layout_check.run_layout(layout_check.make_config(data=data)), reference)
    return {'devices': n, 'checked': [f'data {data} == 1 device (loss, grads, params after 3 steps)'], 'ok': True}


def part_checkpoint(spec, quick):
    import tempfile  # pylint: disable=g-import-not-at-top
    import jax  # pylint: disable=g-import-not-at-top
    platforms = os.environ.get('JAX_PLATFORMS')
    import checkpoint as bench  # pylint: disable=g-import-not-at-top  (benchmarks/checkpoint.py)
    if platforms is None:  # benchmarks/checkpoint.py defaults JAX_PLATFORMS to cpu for its own runs
        os.environ.pop('JAX_PLATFORMS', None)
    from jaxfrontier.checkpoint import manager as ckpt_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.training import state as ts  # pylint: disable=g-import-not-at-top
    c = bench.bench_config(quick, data=1, fsdp=jax.device_count())
    if quick:  # 2 layers x 128, vocabulary 4096: a few MiB, the same code path
        c.model.update(d_model=128, num_heads=4, vocab_size=4096)
    state = ts.init_train_state(c, bench.layout_for(c))
    _, gib = ckpt_lib.describe_arrays(state)
    with tempfile.TemporaryDirectory(prefix='gpu_check_ckpt_') as root:
        save = bench.time_saves(c, state, root, gib)
        del state
        restore = bench.time_restores(c, root, gib)
    return {'state_gib': gib, 'save_gib_per_s': save['gib_per_s'], 'save_blocked_s': save['blocked_s'],
            'restore_gib_per_s': restore['gib_per_s']}


PARTS = {'environment': part_environment, 'matmul': part_matmul, 'grouped_gemm': part_grouped_gemm, 'plan': part_plan,
         'step': part_step, 'torch': part_torch, 'layout': part_layout, 'checkpoint': part_checkpoint}


# --------------------------------------------------------------------------- the runner


class Runner:
    """Runs parts in this process (--quick) or one subprocess each (GPU), within a time budget."""

    def __init__(self, quick: bool, budget_s: float):
        self.quick, self.deadline = quick, time.monotonic() + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, part: str, spec: dict | None = None, timeout_s: float = 300) -> dict:
        spec = dict(spec or {})
        if self.left() < 10:
            return {**spec, 'skipped': 'time budget spent (--budget_s)'}
        start = time.monotonic()
        try:
            out = PARTS[part](spec, True) if self.quick else self._subprocess(part, spec, min(timeout_s, self.left()))
        except Exception as e:  # noqa: BLE001  (a failed row is a result, not the end of the check)
            out = {**spec, 'error': f'{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ""}'}
        out['wall_s'] = round(time.monotonic() - start, 1)
        print(f'[gpu_check] {part} {json.dumps(spec)} -> {json.dumps(out)}', file=sys.stderr, flush=True)
        return out

    def _subprocess(self, part: str, spec: dict, timeout_s: float) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), f'--part={part}', f'--spec={json.dumps(spec)}']
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep))
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {**spec, 'error': f'timed out after {timeout_s:.0f} s'}
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-3:]
        oom = 'RESOURCE_EXHAUSTED' in proc.stderr or 'out of memory' in proc.stderr.lower()
        return {**spec, 'error': ('out of memory: ' if oom else f'exit {proc.returncode}: ') + ' | '.join(tail)[-500:]}


def step_rows(runner: Runner, env: dict) -> list[dict]:
    """Every (size, attention, remat), the default (auto, full) of each size first, with torch rows."""
    combos = [(s, a, r) for s in SIZES for a in ATTENTIONS for r in REMATS]
    first = [(s, 'auto', 'full') for s in SIZES] + [(s, 'auto', 'none') for s in SIZES]
    order = first + [x for x in combos if x not in first]
    sizes = ('125m',) if runner.quick else SIZES  # quick: one (shrunk) size is every part's check
    rows = []
    for size, attention, remat in order:
        if size not in sizes:
            continue
        spec = {'size': size, 'attention': attention, 'remat': remat}
        reason = skip_reason(size, attention, remat, env.get('platform', ''), env.get('device_kind', ''),
                             runner.quick)
        if reason:
            rows.append({**spec, 'skipped': reason})
            continue
        if runner.quick and (attention, remat) not in (('auto', 'full'), ('auto', 'none'), ('xla', 'none')):
            rows.append({**spec, 'skipped': '--quick runs three rows'})
            continue
        chosen = runner.run('plan', spec, timeout_s=120)
        if 'micro_batch' not in chosen:
            rows.append(chosen)
            continue
        spec['micro_batch'] = chosen['micro_batch']
        row = runner.run('step', spec)
        if 'out of memory' in row.get('error', '') and spec['micro_batch'] > 1:
            spec['micro_batch'] //= 2
            row = {**runner.run('step', spec), 'halved_after_oom': True}
        rows.append(row)
        if (attention, remat) == ('auto', 'none'):  # the PyTorch row beside ours, same micro-batch
            rows.append({**runner.run('torch', {'size': size, 'micro_batch': spec['micro_batch']}), 'impl': 'torch'})
    return rows


def _f(value, digits=3) -> str:
    return '' if value is None else f'{value:.{digits}f}' if isinstance(value, float) else str(value)


def markdown(record: dict) -> str:
    env, mm = record['environment'], record['matmul']
    lines = [f"Device: {env.get('devices')} x {env.get('device_kind')} ({env.get('platform')}); "
             f"jax {env.get('versions', {}).get('jax')}, jaxlib {env.get('versions', {}).get('jaxlib')}; "
             f"bf16 matmul {_f(mm.get('tflops'), 1)} TFLOP/s ({_f(mm.get('fraction_of_peak'), 2)} of peak)", '',
             '| size | impl | attention | remat | micro-batch | step s | tokens/s | MFU | alloc peak GiB '
             '| XLA GiB | planner GiB | note |', '|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in record['steps']:
        note = r.get('skipped') or r.get('error') or ('halved after OOM' if r.get('halved_after_oom') else '')
        lines.append(f"| {r.get('size')} | {r.get('impl', 'jaxfrontier')} | {r.get('attention', '')} | "
                     f"{r.get('remat', '')} | {_f(r.get('micro_batch'))} | {_f(r.get('step_s'))} | "
                     f"{_f(r.get('tokens_per_s'), 0)} | {_f(r.get('mfu'))} | {_f(r.get('allocator_peak_gib'), 1)} | "
                     f"{_f(r.get('xla_peak_gib'), 1)} | {_f(r.get('planner_gib'), 1)} | {note[:120]} |")
    ck, lay = record['checkpoint'], record['layout']
    lines += ['', f"Checkpoint ({_f(ck.get('state_gib'), 2)} GiB): save {_f(ck.get('save_gib_per_s'), 2)} GiB/s, "
                  f"restore {_f(ck.get('restore_gib_per_s'), 2)} GiB/s. Layout: "
                  f"{lay.get('note') or lay.get('error') or '; '.join(lay.get('checked', []))}."]
    if 'grouped_gemm' in record:
        import grouped_gemm  # pylint: disable=g-import-not-at-top  (benchmarks/grouped_gemm.py)
        lines += ['', grouped_gemm.markdown(record['grouped_gemm'])]
    return '\n'.join(lines)


def check(quick: bool, budget_s: float) -> dict:
    runner = Runner(quick, budget_s)
    record = {'quick': quick, 'started': time.strftime('%Y-%m-%dT%H:%M:%S')}
    record['environment'] = env = runner.run('environment', timeout_s=120)
    record['matmul'] = runner.run('matmul', timeout_s=120)
    # Layout, checkpoint and the grouped GEMM are cheap: measured before the step rows can spend the budget.
    record['layout'] = runner.run('layout', timeout_s=180)
    record['checkpoint'] = runner.run('checkpoint', timeout_s=180)
    record['grouped_gemm'] = runner.run('grouped_gemm', timeout_s=120)
    record['steps'] = step_rows(runner, env)
    record['wall_s'] = round(budget_s - runner.left(), 1)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true', help='CPU-sized run of every part (8 simulated devices)')
    parser.add_argument('--out', default='gpu_check.json', help='where the JSON record goes')
    parser.add_argument('--budget_s', type=float, default=420.0, help='stop starting new rows after this')
    parser.add_argument('--part', help=argparse.SUPPRESS)
    parser.add_argument('--spec', default='{}', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path[:0] = [HERE, REPO]
    if args.part:  # one measurement in its own process (the GPU path)
        print(MARK + json.dumps(PARTS[args.part](json.loads(args.spec), False)), flush=True)
        return 0
    if args.quick:
        os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
        os.environ['JAX_PLATFORMS'] = 'cpu'
    record = check(args.quick, args.budget_s)
    with open(args.out, 'w') as f:
        json.dump(record, f, indent=1)
    print(markdown(record))
    print(f'\n(JSON: {args.out}; {record["wall_s"]} s)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
