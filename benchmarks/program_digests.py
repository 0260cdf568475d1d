"""SHA-256 of the lowered train-step programs of thirteen layouts, to show a refactor changes no program.

  cd OLD_TREE && PYTHONPATH=$PWD python /path/to/benchmarks/program_digests.py > before.txt
  cd NEW_TREE && PYTHONPATH=$PWD python benchmarks/program_digests.py > after.txt && diff before.txt after.txt

The StableHLO text of `jit_train_step(...).lower(...)`, with source locations stripped, for the
benchmark shape of compare_baseline.py (one device) and four pipelined layouts on 8 simulated
devices (staggered 1F1B with ZeRO-1, interleaved V2, GPipe with fsdp and dropout, lockstep 1F1B), and
unpipelined GPT and Llama layouts (bf16 and remat policies, context with the blockwise kernel, Llama's
GQA, biases and RoPE scaling, Llama through three pipeline executors).
Identical programs compute identical numbers and run at identical speed; layout_digests.py checks
the numbers themselves. Works on trees from before the step/loop split (it falls back to
`training.loop.jit_train_step` and `state.make_layout`).
"""
import hashlib
import os
import re
import sys

os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.join(os.getcwd(), 'benchmarks'))

import jax  # noqa: E402

import baseline_jax_gpt  # noqa: E402
import compare_baseline  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402

try:
    from jaxfrontier.training import step as step_lib  # noqa: E402
    make = ts.make_placement
except ImportError:  # a tree from before the split
    from jaxfrontier.run import loop as step_lib  # noqa: E402
    make = ts.make_layout


LLAMA = dict(family='llama', num_kv_heads=2, qkv_bias=True, mlp_dim=96, rope_scaling='llama3',
             rope_original_max_len=16, tied_embeddings=False)


def pipelined(schedule, virtual=1, fsdp=1, data=2, dropout=0.0, zero1=False, **model):
    c = config_lib.base_config()
    c.model.update(num_layers=4, d_model=64, num_heads=4, seq_len=32, vocab_size=256, dtype='float32', remat='full',
                   dropout_rate=dropout, **model)
    c.mesh.update(pipeline=2, data=data, fsdp=fsdp, tensor=2)
    c.pipeline.update(schedule=schedule, virtual_stages=virtual)
    c.train.update(micro_batch=1, accum_steps=4, global_batch=4 * data * fsdp)
    c.sharding.zero1 = zero1
    return c


def flat(data=1, fsdp=1, tensor=1, context=1, accum=1, remat='full', dtype='float32', **model):
    """An unpipelined layout on up to 8 devices (bf16 and remat variants exercise the casts and the scan)."""
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256, dtype=dtype, remat=remat,
                   **model)
    c.mesh.update(data=data, fsdp=fsdp, tensor=tensor, context=context)
    c.train.update(micro_batch=2, accum_steps=accum, global_batch=2 * accum * data * fsdp)
    return c


CASES = {
    'compare_baseline shape, 1 device': lambda: compare_baseline.jaxfrontier_config(baseline_jax_gpt.Config()),
    'pp2 d2 t2 1f1b zero1': lambda: pipelined('1f1b', zero1=True),
    'pp2 d2 t2 interleaved v2': lambda: pipelined('interleaved', virtual=2),
    'pp2 f2 t2 gpipe dropout': lambda: pipelined('gpipe', fsdp=2, data=1, dropout=0.1),
    'pp2 d2 t2 1f1b_lockstep': lambda: pipelined('1f1b_lockstep'),
    'gpt d2 f2 t2 bf16 save_dots accum 2': lambda: flat(2, 2, 2, accum=2, dtype='bfloat16', remat='save_dots'),
    'gpt c2 f2 t2 blockwise': lambda: flat(1, 2, 2, context=2, attention='blockwise'),
    'llama 1 device bf16': lambda: flat(dtype='bfloat16', **LLAMA),
    'llama d2 f2 t2 accum 2': lambda: flat(2, 2, 2, accum=2, **LLAMA),
    'llama c2 f2 t2 blockwise': lambda: flat(1, 2, 2, context=2, attention='blockwise', **LLAMA),
    'llama pp2 d2 t2 1f1b': lambda: pipelined('1f1b', **LLAMA),
    'llama pp2 f2 t2 gpipe': lambda: pipelined('gpipe', fsdp=2, data=1, **LLAMA),
    'llama pp2 d2 t2 interleaved v2': lambda: pipelined('interleaved', virtual=2, **LLAMA),
}

for name, make_config in CASES.items():
    c = make_config()
    config_lib.validate(c, config_lib.num_devices(c))
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    placement = make(c, mesh)
    jitted, state, batch = step_lib.jit_train_step(c, placement)
    with jax.set_mesh(mesh), mesh_lib.use_rules(placement.rules):
        text = jitted.lower(state, batch).as_text()
    text = re.sub(r'loc\([^\n]*?\)\)?', '', text)  # source locations differ between trees
    text = re.sub(r'\s+', ' ', '\n'.join(line for line in text.splitlines() if not line.startswith('#loc')))
    print(f'{name}: {hashlib.sha256(text.encode()).hexdigest()[:16]} ({len(text):,} characters)', flush=True)
