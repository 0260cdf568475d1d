"""Peak host memory of the Hugging Face export and import for 4 vs 16 layers of the same width.

  PYTHONPATH=$PWD python benchmarks/export_memory.py [--family=gpt|llama] [--width=512] [--layers=4,16]

For each depth: a checkpoint of a model of that family and depth (random fp32 parameters,
vocabulary 256, seq_len 128; llama: 8 heads, 2 kv heads, its MLP rule) is written with the
trainer's Checkpointer (params only: the export reads nothing else); then, each in a fresh
process, `checkpoint.hf.export_hf` (one layer's slice at a time), the older
`checkpoint.safetensors.export_params` (one whole stacked [L, ...] tensor at a time), and
`checkpoint.hf.load_hf` of the exported directory onto one CPU device (one layer at a time).
Reported: the process's peak RSS (VmHWM) at the end minus the same after imports, in MiB, and
the size of the largest stacked tensor for scale; the import's figure includes the model it
built (on the CPU the device memory is the host's), so `import_overhead_mib` subtracts that.
JSON lines to benchmarks/results/export_memory[_llama].jsonl.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

CHILD = r'''
import json, os, sys
os.environ['JAX_PLATFORMS'] = 'cpu'
import jax
from jaxfrontier import config as config_lib, mesh as mesh_lib
from jaxfrontier.checkpoint import target
from jaxfrontier.checkpoint.interop import hf
from jaxfrontier.checkpoint.interop import safetensors
def status_mib(key):  # VmHWM is this process's own peak (ru_maxrss would carry the parent's over exec)
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key)) / 1024
base = status_mib('VmHWM')
kind, source, out, model = sys.argv[1:5]
extra = {}
if kind == 'hf':
    hf.export_hf(source, out)
elif kind == 'safetensors':
    safetensors.export_params(source, out)
else:  # import the directory `source` into the model `model` on one device
    c = config_lib.base_config()
    c.model.update(json.loads(model))
    params = hf.load_hf(source, c, target.param_placement(c, mesh_lib.mesh_from_config(c)).target())
    jax.block_until_ready(params)
    extra['params_mib'] = sum(x.nbytes for x in jax.tree.leaves(params)) / 2**20
peak = status_mib('VmHWM')
print(json.dumps({'base_mib': base, 'peak_mib': peak, 'export_mib': peak - base, **extra}))
'''


def model_fields(family: str, layers: int, width: int) -> dict:
    fields = dict(family=family, num_layers=layers, d_model=width, num_heads=width // 64, seq_len=128,
                  vocab_size=256, dtype='float32')
    if family == 'llama':
        fields.update(num_kv_heads=2, tied_embeddings=False)
    return fields


def write_checkpoint(workdir: str, fields: dict) -> int:
    """A params-only checkpoint of the model `fields`; returns the largest stacked tensor's bytes."""
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.model.params import init_params  # pylint: disable=g-import-not-at-top
    from jaxfrontier.checkpoint import manager as ckpt_lib  # pylint: disable=g-import-not-at-top

    c = config_lib.base_config()
    c.model.update(fields)
    c.checkpoint.async_save = False
    params = jax.jit(lambda k: init_params(config_lib.model_shape(c), k))(jax.random.key(0))
    ckpt = ckpt_lib.Checkpointer(c, workdir)
    ckpt.save(1, {'step': jnp.ones((), jnp.int32), 'params': params, 'opt_state': jnp.zeros((), jnp.float32)},
              force=True)
    ckpt.close()
    return max(x.nbytes for x in jax.tree.leaves(params['blocks']))


def measure(kind: str, source: str, out: str, fields: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, '-c', CHILD, kind, source, out, json.dumps(fields)], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--family', default='gpt', choices=('gpt', 'llama'))
    p.add_argument('--width', type=int, default=512)
    p.add_argument('--layers', default='4,16')
    p.add_argument('--dir', default='/tmp/jf_export_mem')
    a = p.parse_args()
    rows = []
    for layers in [int(x) for x in a.layers.split(',')]:
        root = os.path.join(a.dir, f'L{layers}')
        shutil.rmtree(root, ignore_errors=True)
        fields = model_fields(a.family, layers, a.width)
        stacked = write_checkpoint(os.path.join(root, 'run'), fields)
        run, hf_dir = os.path.join(root, 'run'), os.path.join(root, 'hf')
        for kind, source, out in (('hf', run, hf_dir), ('safetensors', run, os.path.join(root, 'p.safetensors')),
                                  ('hf_import', hf_dir, '')):
            row = {'family': a.family, 'layers': layers, 'width': a.width, 'export': kind,
                   'largest_stacked_mib': stacked / 2**20, **measure(kind, source, out, fields)}
            if 'params_mib' in row:
                row['import_overhead_mib'] = row['export_mib'] - row['params_mib']
            rows.append(row)
            print(json.dumps(row), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.join(os.path.dirname(__file__), 'results'), exist_ok=True)
    name = 'export_memory.jsonl' if a.family == 'gpt' else f'export_memory_{a.family}.jsonl'
    with open(os.path.join(os.path.dirname(__file__), 'results', name), 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in rows)
    print(f'{"layers":>6} {"export":>12} {"stacked MiB":>12} {"peak - base MiB":>16} {"- the model MiB":>16}')
    for r in rows:
        print(f'{r["layers"]:>6} {r["export"]:>12} {r["largest_stacked_mib"]:>12.1f} {r["export_mib"]:>16.1f} '
              f'{r.get("import_overhead_mib", float("nan")):>16.1f}')


if __name__ == '__main__':
    main()
