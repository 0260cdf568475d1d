"""Loss, gradient and parameter digests of eight layouts, to show a refactor changes no number.

  cd OLD_TREE && PYTHONPATH=$PWD python /path/to/benchmarks/layout_digests.py > before.txt
  cd NEW_TREE && PYTHONPATH=$PWD python benchmarks/layout_digests.py > after.txt && diff before.txt after.txt

Each line: the first step's loss (repr), a SHA-256 prefix of the first step's gradients and of
the parameters after 3 steps (tests/layout_check.py's runs: data/fsdp/tensor, ZeRO-1, staggered
and lockstep 1F1B, interleaved, remat, dropout inside pipelines). Bitwise, not within a tolerance.
"""
import os, sys, hashlib
os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'
sys.path.insert(0, os.path.join(os.getcwd(), 'tests'))
import jax, numpy as np
import layout_check as lc
def digest(tree):
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.asarray(x, np.float32).tobytes())
    return h.hexdigest()[:16]
cases = {
  'd2f2t2 accum2': dict(data=2, fsdp=2, tensor=2, accum=2),
  'zero1 d4 t2': dict(data=4, tensor=2, zero1=True),
  'pp2 1f1b d2 t2 M4 L4': dict(pipeline=2, data=2, tensor=2, accum=4, layers=4),
  'pp2 1f1b_lockstep t2 M4 L4': dict(pipeline=2, tensor=2, accum=4, layers=4, schedule='1f1b_lockstep'),
  'pp2 interleaved v2 M2 L4 fsdp2': dict(pipeline=2, fsdp=2, accum=2, layers=4, schedule='interleaved', virtual=2),
  'pp2 1f1b remat full t2 M4 L4': dict(pipeline=2, tensor=2, accum=4, layers=4, remat='full'),
  'dropout pp2 1f1b M2 L4': dict(pipeline=2, accum=2, layers=4),
  'dropout pp2 lockstep M2 L4': dict(pipeline=2, accum=2, layers=4, schedule='1f1b_lockstep'),
}
for name, kw in cases.items():
    c = lc.make_config(**kw)
    if name.startswith('dropout'):
        c.model.dropout_rate = 0.1
    loss, grads, params = lc.run_layout(c)
    print(f'{name}: loss {loss!r} grads {digest(grads)} params {digest(params)}', flush=True)
