"""The training loop's evaluation: the eval loss overall and, for several files, per file.

The validation source is one split or file (a TokenSource) or several (a BlendSource: the tail
splits of a training blend, or the files of a `data.val_path` blend). Each file is evaluated on
its own `train.eval_batches` full batches (windows k = batch * B + row of its epoch-0
permutation, the same every evaluation), so its loss is that file's, not a mix's; the overall
`eval/loss` weighs the files' losses by the blend's weights. With one file whose windows number
`eval_batches * global_batch` every window is read once, and the loss equals `--mode=eval` of
that file.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfrontier.data import loader as data_lib
from jaxfrontier.data import sampling
from jaxfrontier.model import packing as packing_lib


_counted_share = jax.jit(packing_lib.counted_share, static_argnums=1)


def _mean_loss(eval_step, params, source, batch_sharding, eval_batches: int, global_batch: int,
               packing: packing_lib.Packing | None) -> jax.Array:
    """Mean loss over `eval_batches` fixed batches of one source (dispatched async).

    With packed documents or a loss mask each batch's loss is a mean over its counted predictions,
    and batches count different numbers: they are weighed by their counted share
    (model/packing.py), so the result is the mean over every counted prediction, not a mean of means.
    """
    batches = [data_lib.make_global_batch(source, i, batch_sharding, global_batch) for i in range(eval_batches)]
    losses = jnp.stack([eval_step(params, batch) for batch in batches])
    if packing is None or not packing.uncounted:
        return jnp.mean(losses)
    shares = jnp.stack([_counted_share(batch, packing) for batch in batches])
    return jnp.sum(losses * shares) / jnp.maximum(jnp.sum(shares), 1e-30)


def evaluate(eval_step, params, source: Any, batch_sharding, *, eval_batches: int, global_batch: int,
             packing: packing_lib.Packing | None) -> dict[str, jax.Array]:
    """`{'eval/loss': overall}`, plus `eval/loss/<file>` per file of a blend; device arrays, not fetched.

    Args:
      eval_step: (params, batch) -> the batch's mean loss (training/step.py's, compiled).
      params: the parameters to evaluate.
      source: the validation source (data/loader.py's `make_datasets`).
      batch_sharding: the sharding of a global batch.
      eval_batches: batches per file (`train.eval_batches`).
      global_batch: rows per batch (`train.global_batch`).
      packing: the run's document packing (`model.packing.from_config`), None without.
    """
    fields = (batch_sharding, eval_batches, global_batch, packing)
    if not isinstance(source, sampling.BlendSource):
        return {'eval/loss': _mean_loss(eval_step, params, source, *fields)}
    per_file = {f'eval/loss/{name}': _mean_loss(eval_step, params, s, *fields)
                for name, s in zip(source.names, source.sources)}
    total = sum(source.weights)
    overall = sum(w / total * loss for w, loss in zip(source.weights, per_file.values()))
    return {'eval/loss': overall, **per_file}


def eval_line(step: int, scalars: dict[str, float]) -> str:
    """The log line of one evaluation: `eval: step 200: loss 3.2100 (web 3.1000, code 3.4000)`."""
    per_file = [f'{k[len("eval/loss/"):]} {v:.4f}' for k, v in scalars.items() if k.startswith('eval/loss/')]
    return (f'eval: step {step}: loss {scalars["eval/loss"]:.4f}'
            + (f' ({", ".join(per_file)})' if per_file else ''))
