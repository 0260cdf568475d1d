"""The implementations benchmarks/peers.py compares, each built in a worker process of its own.

A worker builds one implementation of one shape, compiles it, runs warm-up steps, then answers
the parent on stdin/stdout: `steps N` times N steps (each blocked on its loss) and replies one
JSON line with the step times, this process's CPU seconds and the CPU seconds the rest of the
machine used meanwhile (/proc/stat), so that a round taken while other jobs ran can be told
apart; `peak` (jaxfrontier workers on the CPU) times the fp32 1024^3 matmul of the MFU's peak again, best
of `PEAK_CALLS`, now that the worker's threads are warm. Only one worker measures at a time; the
others wait on their stdin.

Peers (all on one shape, fp32 on the CPU, bf16 compute with fp32 parameters on a GPU, AdamW
lr 6e-4, betas 0.9/0.95, weight decay 0.1, global-norm clipping 1.0, tied embeddings):
  jf             jaxfrontier's real train step (benchmarks/harness.py), GPT or Llama
  jax            a plain jitted JAX GPT (benchmarks/baseline_jax_gpt.py), GPT only
  torch_eager    PyTorch: benchmarks/torch_gpt.py's GPT, or transformers' LlamaForCausalLM (sdpa)
  torch_compile  the same under torch.compile (inductor)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmark shape: a GPT and a Llama of (nearly) equal parameter count."""
    layers: int
    d_model: int
    heads: int
    kv_heads: int  # the Llama's (grouped-query attention, head dim d / heads)
    seq_len: int
    vocab: int
    batch: int
    dtype: str = 'float32'  # compute dtype; parameters stay fp32
    llama_mlp: int = 0  # the Llama's SwiGLU width; 0: searched for the GPT's parameter count
    llama_only: bool = False  # a Llama-shaped size with no GPT twin
    # jaxfrontier's recomputation: none of the matmuls on any size, as the torch peers (whose compiled
    # partitioner recomputes element-wise work). On the CPU sizes save_dots_attention, which keeps every
    # matmul's and attention's output and recomputes the element-wise ops: 1.14x (Llama) and 1.23x (GPT)
    # remat=none's step at the small shape (docs/PERFORMANCE.md). The GPU sizes keep none: with cuDNN
    # attention (auto in bf16) the policy would run the kernel's forward again (its statistics are JAX's).
    remat: str = 'save_dots_attention'


SHAPES = {
    # The CPU benchmark shape of docs/PERFORMANCE.md (compare_baseline.py, compare_llama.py).
    'small': Shape(layers=6, d_model=384, heads=6, kv_heads=2, seq_len=256, vocab=512, batch=8),
    # GPT-2 small (124M with its 50,257-token vocabulary) at sequence 1024, one sequence per step.
    '100m': Shape(layers=12, d_model=768, heads=12, kv_heads=4, seq_len=1024, vocab=50257, batch=1),
    # GPU sizes (benchmarks/gpu_session.sh): configs/gpt.py's 1.3b; Llama 3.2 1B; four Llama 3 8B layers.
    'gpt1.3b': Shape(layers=24, d_model=2048, heads=16, kv_heads=16, seq_len=2048, vocab=50257, batch=8,
                     dtype='bfloat16', remat='none'),
    'llama1b': Shape(layers=16, d_model=2048, heads=32, kv_heads=8, seq_len=2048, vocab=128256, batch=8,
                     dtype='bfloat16', llama_mlp=8192, llama_only=True, remat='none'),
    'llama8b_4l': Shape(layers=4, d_model=4096, heads=32, kv_heads=8, seq_len=2048, vocab=128256, batch=4,
                        dtype='bfloat16', llama_mlp=14336, llama_only=True, remat='none'),
}


def jf_config(shape: Shape, family: str, overrides: tuple[str, ...] = ()):
    """jaxfrontier's config of `shape` for `family` (one device, synthetic data), with `key=value` overrides."""
    from jaxfrontier import config as config_lib  # no JAX
    c = config_lib.base_config()
    c.model.update(family=family, num_layers=shape.layers, d_model=shape.d_model, num_heads=shape.heads,
                   seq_len=shape.seq_len, vocab_size=shape.vocab, vocab_multiple=128, dtype=shape.dtype,
                   remat=shape.remat, tied_embeddings=True)
    if family == 'llama':
        c.model.update(num_kv_heads=shape.kv_heads, mlp_dim=shape.llama_mlp or _equal_parameter_width(shape),
                       rope_theta=10000.0)
    c.train.update(global_batch=shape.batch, micro_batch=shape.batch, accum_steps=1)
    c.data.kind = 'synthetic'
    for item in overrides:
        key, value = item.split('=', 1)
        section, field = key.split('.', 1)
        old = c[section][field]
        c[section][field] = type(old)(value) if not isinstance(old, bool) else value.lower() in ('1', 'true')
    return c


def parameter_count(c) -> int:
    """Parameters of config `c`'s model by its family's table (no JAX)."""
    from jaxfrontier import config as config_lib
    from jaxfrontier import families
    shape = config_lib.model_shape(c)
    return sum(p.size for p in families.get(shape.family).param_specs(shape))


def _equal_parameter_width(shape: Shape) -> int:
    """The SwiGLU width whose Llama has the GPT's parameter count most nearly (searched)."""
    target = parameter_count(jf_config(shape, 'gpt'))
    lo, hi = 8, 8 * shape.d_model  # the count grows with the width: bisect, then take the nearer neighbour
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if parameter_count(_with_mlp(shape, mid)) <= target else (lo, mid)
    return min((lo, hi), key=lambda f: abs(parameter_count(_with_mlp(shape, f)) - target))


def _with_mlp(shape: Shape, width: int):
    return jf_config(dataclasses.replace(shape, llama_mlp=width), 'llama')


# --------------------------------------------------------------------------- builders: () -> step


def build_jf(shape: Shape, family: str, overrides: tuple[str, ...]):
    """jaxfrontier's compiled train step; returns (step() -> loss, info)."""
    import harness
    c = jf_config(shape, family, overrides)
    run = harness.build_train_step(c)
    return run.step, {'params': run.params, 'compile_s': run.compile_s, 'peak_flops': run.peak_flops,
                      'peak_source': run.peak_source, 'attention': run.attention, 'scan_unroll': run.scan_unroll}


def build_jax(shape: Shape, family: str, overrides: tuple[str, ...]):
    """The plain jitted JAX GPT of baseline_jax_gpt.py on the padded vocabulary."""
    if family != 'gpt':
        raise ValueError('the plain JAX baseline is a GPT')
    import jax
    import numpy as np
    import baseline_jax_gpt as base
    from jaxfrontier import config as config_lib
    cfg = base.Config(layers=shape.layers, d_model=shape.d_model, heads=shape.heads, seq_len=shape.seq_len,
                      vocab=config_lib.padded_vocab(jf_config(shape, 'gpt')), batch=shape.batch, dtype=shape.dtype,
                      **dict(o.split('=', 1) for o in overrides))
    t0 = time.perf_counter()
    train_step, params, opt_state, tokens = base.make_state(cfg)
    state = {'params': params, 'opt': opt_state}

    def step():
        state['params'], state['opt'], loss = train_step(state['params'], state['opt'], tokens)
        return float(loss)

    step()  # compiles
    n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(state['params']))
    return step, {'params': n, 'compile_s': time.perf_counter() - t0}


def build_torch(shape: Shape, family: str, overrides: tuple[str, ...], compiled: bool):
    """PyTorch's step (torch_gpt.make_step) of the GPT or of transformers' Llama, eager or compiled."""
    import torch_gpt
    c = jf_config(shape, family)
    model = torch_gpt.hf_llama(c) if family == 'llama' else None
    t0 = time.perf_counter()
    step, info = torch_gpt.make_step(c, model=model, compiled=compiled)
    step()  # compiles (torch.compile) or warms the allocator
    return step, {**info, 'compile_s': time.perf_counter() - t0}


BUILDERS = {
    'jf': build_jf,
    'jax': build_jax,
    'torch_eager': lambda s, f, o: build_torch(s, f, o, compiled=False),
    'torch_compile': lambda s, f, o: build_torch(s, f, o, compiled=True),
}


# --------------------------------------------------------------------------- the worker's loop


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat's first line)."""
    with open('/proc/stat') as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(step, steps: int) -> dict:
    """Times `steps` calls of `step`; this process's CPU seconds and the other processes' CPU share."""
    busy0, total0 = _busy_jiffies()
    cpu0, wall0 = _own_cpu_s(), time.perf_counter()
    times, loss = [], float('nan')
    for _ in range(steps):
        t = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - wall0, _own_cpu_s() - cpu0
    busy1, total1 = _busy_jiffies()
    ncpu = os.cpu_count() or 1
    machine_busy_s = (busy1 - busy0) / max(total1 - total0, 1) * wall * ncpu  # CPU seconds of every process
    return {'times_s': times, 'median_s': statistics.median(times), 'cpu_s_per_step': cpu / steps,
            'others_cpu_share': max(machine_busy_s - cpu, 0.0) / (wall * ncpu), 'loadavg': os.getloadavg()[0],
            'loss': loss}


PEAK_CALLS = 20


def cpu_matmul_peak(calls: int = PEAK_CALLS) -> float:
    """hardware.measure_cpu_matmul_peak's measurement (best of five at start-up, cached) taken again at the
    end of a run, best of `calls`. One start-up measurement read 1.07e11 FLOP/s in one run and 2.1e11 in
    another on the same machine (a 2x gap: one core against two), so the parent keeps the largest of the
    jaxfrontier workers' measurements."""
    from jaxfrontier import hardware
    return hardware.time_cpu_matmul_peak('float32', calls)


def serve(peer: str, size: str, family: str, overrides: tuple[str, ...], warmup: int) -> None:
    """Builds the peer, reports `ready`, then answers `steps N` lines until `quit` or end of input."""
    out = os.fdopen(os.dup(1), 'w')  # the parent's pipe, private to this loop
    os.dup2(2, 1)  # whatever else writes to stdout (libraries, compile subprocesses) goes to stderr
    sys.stdout = sys.stderr
    shape = SHAPES[size]
    step, info = BUILDERS[peer](shape, family, overrides)
    for _ in range(warmup):
        step()
    out.write(json.dumps({'ready': True, **info}) + '\n')
    out.flush()
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == 'quit':
            break
        reply = {'peak_flops': cpu_matmul_peak()} if cmd[0] == 'peak' else measure(step, int(cmd[1]))
        out.write(json.dumps(reply) + '\n')
        out.flush()


# --------------------------------------------------------------------------- the command lines' checks

FAMILIES = ('gpt', 'llama')  # what every peer builds (torch_gpt.py's GPT, transformers' Llama)


def fail(message: str) -> None:
    """One line on stderr, exit 2: a mistake in the command, found before any worker starts."""
    print(f'error: {" ".join(message.split())}', file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, a value that is no integer) are one `error:` line, exit 2."""

    def error(self, message: str) -> None:
        fail(f'{self.prog}: {message}. Fix: see --help')


def check_names(flag: str, names: list[str], known) -> None:
    bad = [n for n in names if n not in known]
    if bad or not names:
        fail(f'{flag}={",".join(names)}: unknown {", ".join(map(repr, bad)) or "(none named)"}. Fix: name some of '
             f'{", ".join(known)}, comma-separated')


def check_at_least(flag: str, value: int, least: int, meaning: str = '') -> None:
    if value < least:
        fail(f'{flag}={value}: must be at least {least}{meaning}. Fix: pass {flag}=N with N >= {least}')


def check_out(flag: str, path: str) -> None:
    """`path` can be written (its directory made): tried now with a probe file, not after hours of measuring."""
    if not path:
        return
    if os.path.isdir(path):
        fail(f'{flag}={path} is a directory. Fix: name a file, e.g. {flag}={os.path.join(path, "result.json")}')
    probe = path + '.tmp'
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(probe, 'w'):
            pass
        os.remove(probe)
    except OSError as e:
        fail(f'{flag}={path} cannot be written ({e.strerror or e}). Fix: name a file in a writable directory')


def _baseline_fields() -> set[str]:
    """baseline_jax_gpt.Config's fields, read from its source (importing it imports JAX)."""
    with open(os.path.join(HERE, 'baseline_jax_gpt.py')) as f:
        tree = ast.parse(f.read())
    config = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == 'Config')
    return {n.target.id for n in config.body if isinstance(n, ast.AnnAssign)}


def check_overrides(where: str, peer: str, size: str, family: str, overrides: tuple[str, ...]) -> None:
    """A row's overrides name fields of its peer and values they take (jaxfrontier's: `config.validate`)."""
    if peer.startswith('torch') and overrides:
        fail(f'{where}: the {peer} peer takes no config overrides ({", ".join(overrides)}); they set jaxfrontier\'s '
             'config (peer jf) or the plain JAX GPT\'s (peer jax). Fix: drop them')
    if peer == 'jax':
        bad = [o for o in overrides if o.split('=', 1)[0] not in _baseline_fields() or '=' not in o]
        if bad:
            fail(f'{where}: {", ".join(bad)} sets no field of baseline_jax_gpt.Config. Fix: use key=value with a key '
                 f'of {", ".join(sorted(_baseline_fields()))}')
    if peer != 'jf':
        return
    from jaxfrontier import config as config_lib  # no JAX
    from jaxfrontier.errors import UserError
    try:
        config_lib.validate(jf_config(SHAPES[size], family, overrides))
    except UserError as e:
        fail(f'{where}: {e}')
    except (KeyError, AttributeError, ValueError, TypeError) as e:
        fail(f'{where}: {", ".join(overrides)} is not section.field=value of a field jaxfrontier\'s config has '
             f'({type(e).__name__}: {e}). Fix: e.g. model.attention=reference')
