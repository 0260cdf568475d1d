"""jaxfrontier against its peers on one machine: the same shapes, parameters, optimizer and precision.

  python benchmarks/peers.py --rounds 5 --out benchmarks/results/peers.json        # the CPU table
  python benchmarks/peers.py --sizes small --rounds 3 --steps 3                     # a quicker look
  python benchmarks/peers.py --sizes gpt1.3b,llama1b,llama8b_4l --peers jf,torch_compile   # a GPU

Peers (benchmarks/peer_workers.py): jaxfrontier's GPT and Llama (`jf`), a plain jitted JAX GPT
(`jax`), PyTorch eager (`torch_eager`) and under torch.compile (`torch_compile`): benchmarks/
torch_gpt.py's GPT, or transformers' `LlamaForCausalLM`. Shapes (`--sizes`): `small`, the 6 x 384
shape of docs/PERFORMANCE.md (sequence 256, batch 8), and `100m`, GPT-2 small's 12 x 768 at
sequence 1024 (batch 1); the Llama of each has grouped-query attention and the SwiGLU width that
gives it the GPT's parameter count; the GPU sizes are listed in peer_workers.SHAPES.

How it measures: for each size and family, one worker process per peer builds and compiles its
step and runs warm-up steps (one process tree, all alive, one measuring at a time). Then, in each
of `--rounds` rounds, every peer runs `--steps` timed steps, the order rotated by one each round
so no peer always follows the same one. A peer's figure is the median over rounds of its round's
median step. Beside each round: the load average and the share of the machine's CPU that other
processes used while it ran (/proc/stat), and the peer's own CPU seconds per step. Ratios are
of medians: tokens/s of the row over tokens/s of each peer. `--variant label=peer:key=value,...`
adds a row of a peer with config overrides (jaxfrontier: `model.attention=reference`; the plain JAX
GPT: its Config fields), environment variables of that worker (an upper-case name: e.g.
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`) or `XLA_FLAGS=...` (last: its value may hold commas and
spaces), for comparisons inside one run.

FLOP convention (benchmarks/harness.py): model FLOPs are each family's Megatron-convention count
(f = 3, causal attention counted full, padded vocabulary; Llama by Megatron-LM's GQA/SwiGLU count),
MFU = model FLOPs / (step time x peak), the peak on the CPU an fp32 1024^3 matmul: the largest of the
jaxfrontier workers' start-up measurement and each one's `peak` after the last round (one
start-up measurement alone read half the machine in one run); on a GPU the device table's bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO)

import peer_workers  # noqa: E402  (no JAX or torch at import)

PEERS = ('jf', 'jax', 'torch_eager', 'torch_compile')


class Worker:
    """One peer in its own process (`python peers.py --worker ...`), driven over its stdin/stdout."""

    def __init__(self, label: str, peer: str, size: str, family: str, overrides: tuple[str, ...],
                 env: dict[str, str], warmup: int):
        self.label, self.peer = label, peer
        cmd = [sys.executable, os.path.abspath(__file__), '--worker', peer, '--size', size, '--family', family,
               '--warmup', str(warmup), *[f'--override={o}' for o in overrides]]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                                     env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f'{self.label}: the worker exited ({code}) before answering; its stderr is above')
        return json.loads(line)

    def measure(self, steps: int) -> dict:
        self.proc.stdin.write(f'steps {steps}\n')
        self.proc.stdin.flush()
        return self._read()

    def peak(self) -> float:
        """The CPU's fp32 matmul FLOP/s measured again by this (JAX) worker, its threads warm."""
        self.proc.stdin.write('peak\n')
        self.proc.stdin.flush()
        return self._read()['peak_flops']

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write('quit\n')
            self.proc.stdin.close()
            self.proc.wait(timeout=120)


def worker_env(variables: dict[str, str]) -> dict[str, str]:
    """The environment of a worker: this one's, the repository importable, and the row's variables."""
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ['PYTHONPATH'] if 'PYTHONPATH' in os.environ
                                              else ''))
    return {**env, **variables}


def rows_for(size: str, family: str, peers: list[str], variants: list[str]) -> list[tuple]:
    """(label, peer, overrides, environment variables) of every row of one size and family."""
    rows = [(p, p, (), {}) for p in peers if not (p == 'jax' and family != 'gpt')]
    for spec in variants:
        label, rest = spec.split('=', 1)
        peer, _, settings = rest.partition(':')
        settings, _, xla_flags = settings.partition('XLA_FLAGS=')  # last: its value may hold commas
        variables, overrides = {}, []
        for item in filter(None, settings.split(',')):  # NAME=value: the worker's environment; else an override
            if re.fullmatch(r'[A-Z][A-Z0-9_]*', item.split('=', 1)[0]):
                name, value = item.split('=', 1)
                variables[name] = value
            else:
                overrides.append(item)
        overrides = tuple(overrides)
        if xla_flags:
            variables['XLA_FLAGS'] = xla_flags
        if peer == 'jax' and family != 'gpt':
            continue
        rows.append((label, peer, overrides, variables))
    return rows


def run_group(size: str, family: str, rows: list[tuple], rounds: int, steps: int, warmup: int) -> dict:
    """Starts one worker per row, then `rounds` rotated rounds of `steps` steps each."""
    workers = []
    try:
        for label, peer, overrides, variables in rows:  # one compile at a time: they would share the cores
            t0 = time.perf_counter()
            workers.append(Worker(label, peer, size, family, overrides, worker_env(variables), warmup))
            print(f'# {size} {family} {label}: ready in {time.perf_counter() - t0:.0f} s '
                  f'({workers[-1].info.get("params", 0):,} parameters)', file=sys.stderr, flush=True)
        results = {w.label: [] for w in workers}
        for r in range(rounds):
            order = workers[r % len(workers):] + workers[:r % len(workers)]
            for w in order:
                res = w.measure(steps)
                results[w.label].append(res)
                print(f'# round {r} {size} {family} {w.label}: {res["median_s"]:.3f} s/step, '
                      f'others {res["others_cpu_share"]:.2f} of the CPU, load {res["loadavg"]:.1f}',
                      file=sys.stderr, flush=True)
        for w in workers:  # the MFU's CPU peak measured again, after the rounds (summarise keeps the largest)
            if w.peer == 'jf' and str(w.info.get('peak_source', '')).startswith('measured'):  # the CPU's
                w.info['peak_flops_end'] = w.peak()
        return {w.label: {'peer': w.peer, 'info': w.info, 'rounds': results[w.label]} for w in workers}
    finally:
        for w in workers:
            w.close()


def summarise(size: str, family: str, group: dict) -> list[dict]:
    """A row per peer: median step, tokens/s, MFU, load, and its tokens/s over every other row's."""
    from jaxfrontier import config as config_lib  # no JAX
    shape = peer_workers.SHAPES[size]
    c = peer_workers.jf_config(shape, family)
    model_flops, _ = config_lib.flops_per_step(c)
    tokens = shape.batch * shape.seq_len
    peak = next((g['info']['peak_flops'] for g in group.values() if 'peak_flops' in g['info']), float('nan'))
    remeasured = [g['info']['peak_flops_end'] for g in group.values() if 'peak_flops_end' in g['info']]
    if remeasured and peak == peak:  # a CPU's: the largest measurement (a GPU's table peak has none)
        peak = max([peak, *remeasured])
    rows = []
    for label, g in group.items():
        step_s = statistics.median(r['median_s'] for r in g['rounds'])
        rows.append({'size': size, 'family': family, 'label': label, 'peer': g['peer'], 'step_s': step_s,
                     'tokens_per_s': tokens / step_s, 'mfu': model_flops / step_s / peak,
                     'params': g['info'].get('params'), 'compile_s': g['info'].get('compile_s'),
                     'cpu_s_per_step': statistics.median(r['cpu_s_per_step'] for r in g['rounds']),
                     'others_cpu_share': statistics.median(r['others_cpu_share'] for r in g['rounds']),
                     'loadavg': statistics.median(r['loadavg'] for r in g['rounds']),
                     'rounds_s': [r['median_s'] for r in g['rounds']], 'loss': g['rounds'][-1]['loss'],
                     'info': g['info']})
    for row in rows:
        row['over'] = {o['label']: row['tokens_per_s'] / o['tokens_per_s'] for o in rows if o is not row}
    return rows


def print_table(rows: list[dict]) -> None:
    """The Markdown table docs/PERFORMANCE.md takes: a row per peer, its ratio to each peer of its group."""
    labels = list(dict.fromkeys(r['label'] for r in rows))
    head = ['size', 'family', 'peer', 'params', 'step s', 'tokens/s', 'MFU', 'others CPU', 'load',
            *[f'x {lab}' for lab in labels]]
    print('| ' + ' | '.join(head) + ' |')
    print('|' + '---|' * len(head))
    for r in rows:
        ratios = [f'{r["over"][lab]:.2f}' if lab in r['over'] else ('1.00' if lab == r['label'] else '')
                  for lab in labels]
        print(f'| {r["size"]} | {r["family"]} | {r["label"]} | {r["params"] or 0:,} | {r["step_s"]:.3f} | '
              f'{r["tokens_per_s"]:,.0f} | {r["mfu"]:.3f} | {r["others_cpu_share"]:.2f} | {r["loadavg"]:.1f} | '
              + ' | '.join(ratios) + ' |')


def main() -> None:
    ap = peer_workers.Parser(description=__doc__.split('\n')[0])
    ap.add_argument('--sizes', default='small,100m')
    ap.add_argument('--families', default='gpt,llama')
    ap.add_argument('--peers', default=','.join(PEERS))
    ap.add_argument('--variant', action='append', default=[], help='label=peer:key=value,... (see above)')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--steps', type=int, default=0, help='timed steps per peer per round (0: 5 small, 2 larger)')
    ap.add_argument('--warmup', type=int, default=2)
    ap.add_argument('--out', default='')
    # a worker (started by the parent)
    ap.add_argument('--worker', default='', help=argparse.SUPPRESS)
    ap.add_argument('--size', default='', help=argparse.SUPPRESS)
    ap.add_argument('--family', default='gpt', help=argparse.SUPPRESS)
    ap.add_argument('--override', action='append', default=[], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        peer_workers.serve(args.worker, args.size, args.family, tuple(args.override), args.warmup)
        return
    check_args(args)  # every mistake one line before the first worker starts
    t0 = time.perf_counter()
    started = time.strftime('%Y-%m-%d %H:%M:%S')
    rows = []
    for size in args.sizes.split(','):
        shape = peer_workers.SHAPES[size]
        steps = args.steps or (5 if shape.seq_len * shape.batch <= 2048 else 2)
        for family in args.families.split(','):
            if shape.llama_only and family != 'llama':
                continue
            group = run_group(size, family, rows_for(size, family, args.peers.split(','), args.variant),
                              args.rounds, steps, args.warmup)
            rows += summarise(size, family, group)
            write(args.out, started, t0, rows)  # after every group: a run cut short keeps what it measured
    print_table(rows)
    print(f'{len(rows)} rows in {(time.perf_counter() - t0) / 60:.1f} min')


def check_args(args: argparse.Namespace) -> None:
    """Sizes, families, peers and variants known, counts in range, --out writable: else one line, exit 2."""
    sizes, families = args.sizes.split(','), args.families.split(',')
    peer_workers.check_names('--sizes', sizes, peer_workers.SHAPES)
    peer_workers.check_names('--families', families, peer_workers.FAMILIES)
    peer_workers.check_names('--peers', args.peers.split(','), PEERS)
    peer_workers.check_at_least('--rounds', args.rounds, 1)
    peer_workers.check_at_least('--steps', args.steps, 0, ' (0: 5 on the small sizes, 2 on larger ones)')
    peer_workers.check_at_least('--warmup', args.warmup, 0)
    labels = set(args.peers.split(','))
    for spec in args.variant:
        label, _, rest = spec.partition('=')
        peer = rest.partition(':')[0]
        if not label or not rest:
            peer_workers.fail(f'--variant={spec}: not label=peer:key=value,... Fix: e.g. '
                              '--variant=ref=jf:model.attention=reference')
        if peer not in PEERS:
            peer_workers.fail(f'--variant={spec}: unknown peer {peer!r}. Fix: one of {", ".join(PEERS)}')
        if label in labels:
            peer_workers.fail(f'--variant={spec}: the label {label!r} names another row already. Fix: a new label')
        labels.add(label)
    pairs = [(s, f) for s in sizes for f in families if not (peer_workers.SHAPES[s].llama_only and f != 'llama')]
    if not pairs:
        peer_workers.fail(f'--sizes={args.sizes} --families={args.families}: nothing to run (those sizes are '
                          'Llama-only). Fix: add --families=llama')
    for size, family in pairs:
        for label, peer, overrides, _ in rows_for(size, family, args.peers.split(','), args.variant):
            peer_workers.check_overrides(f'--variant {label} ({size} {family})', peer, size, family, overrides)
    peer_workers.check_out('--out', args.out)


def write(out: str, started: str, t0: float, rows: list[dict]) -> None:
    """The JSON of the rows so far (`--out`; nothing without it)."""
    if not out:
        return
    result = {'started': started, 'wall_s': time.perf_counter() - t0, 'argv': sys.argv[1:], 'cpus': os.cpu_count(),
              'loadavg_end': os.getloadavg(), 'rows': rows}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + '.tmp', 'w') as f:
        json.dump(result, f, indent=1)
    os.replace(out + '.tmp', out)


if __name__ == '__main__':
    main()
