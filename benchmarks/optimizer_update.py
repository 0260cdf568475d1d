"""What the optimizer update costs: alone against PyTorch's, and inside the train step.

  JAX_PLATFORMS=cpu python benchmarks/optimizer_update.py [--rounds 3] [--reps 8]

compare_baseline.py's shape (6 layers, width 384, vocabulary 512, sequence 256, batch 8, fp32,
one device; 10.9 M parameters). Each round times, back to back:
  update     jaxfrontier's optimizer (training/optimizer.make_optimizer: global-norm clipping 1.0,
             AdamW) and `optax.apply_updates`, jitted, on the model's parameter tree;
  torch      `clip_grad_norm_` and `torch.optim.AdamW` (foreach, PyTorch's CPU default) on the
             same tensors, when torch is importable (`pip install torch`; not a dependency);
  grads      the train step's loss and gradients alone (training/step.py make_loss_and_grads, jitted);
  step       the whole train step (training/step.py compile_steps): step - grads is what the update, the
             norms and the metrics add inside the step.
Medians in ms, one JSON line per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import baseline_jax_gpt  # noqa: E402
import compare_baseline  # noqa: E402
from jaxfrontier import config as config_lib  # noqa: E402
from jaxfrontier import mesh as mesh_lib  # noqa: E402
from jaxfrontier.training import step as step_lib  # noqa: E402
from jaxfrontier.training import state as ts  # noqa: E402


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def torch_update(params, grads):
    """`() -> None`: PyTorch's clip + AdamW step on copies of `params` with gradients `grads`."""
    try:
        import torch  # pylint: disable=g-import-not-at-top
    except ImportError:
        return None
    tensors = [torch.nn.Parameter(torch.tensor(np.asarray(p))) for p in jax.tree.leaves(params)]
    for t, g in zip(tensors, jax.tree.leaves(grads)):
        t.grad = torch.tensor(np.asarray(g))
    opt = torch.optim.AdamW(tensors, lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step():
        torch.nn.utils.clip_grad_norm_(tensors, 1.0)
        opt.step()
    step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--reps', type=int, default=8)
    args = parser.parse_args()
    c = compare_baseline.jaxfrontier_config(baseline_jax_gpt.Config())
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    train_step, _, _ = step_lib.compile_steps(c, layout)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, c.model.vocab_size, (c.train.global_batch, c.model.seq_len + 1), np.int32))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        grads_fn = jax.jit(step_lib.make_loss_and_grads(c, layout))
        params = jax.tree.map(jnp.copy, state['params'])  # the step donates `state`
        _, grads = grads_fn(params, tokens, state['step'])
        tx = layout.tx
        update = jax.jit(lambda p, o, g: (lambda u, o2: (optax.apply_updates(p, u), o2))(*tx.update(g, o, p)))
        opt_state = tx.init(params)
        torch_step = torch_update(params, grads)
        current = {'state': state}

        def step():
            current['state'], metrics = train_step(current['state'], tokens)
            return metrics
        for _ in range(2):
            step()
        for r in range(args.rounds):
            row = {'round': r, 'params': int(sum(p.size for p in jax.tree.leaves(params))),
                   'update_ms': median_ms(lambda: update(params, opt_state, grads), args.reps),
                   'torch_update_ms': median_ms(torch_step, args.reps) if torch_step else None,
                   'grads_ms': median_ms(lambda: grads_fn(current['state']['params'], tokens, current['state']['step']), args.reps),
                   'step_ms': median_ms(step, args.reps)}
            row['step_minus_grads_ms'] = row['step_ms'] - row['grads_ms']
            print(json.dumps(row), flush=True)


if __name__ == '__main__':
    main()
