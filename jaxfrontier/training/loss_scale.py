"""Dynamic loss scaling for float16 compute (`model.dtype='float16'`, `optim.loss_scale='dynamic'`).

float16 has 5 exponent bits: activation gradients below ~6e-8 flush to zero, so a small
model's backward pass underflows unless the loss (the seed of the backward pass) is scaled
up. The scale is jmp's `DynamicLossScale` rule: double it after `period` finite steps, halve
it on a step whose gradients overflow, and skip that step's update (parameters and optimizer
state are kept; the step counter and the data position still advance).

The state is a plain dict of scalars in the train state, `state['loss_scale']`, so Orbax saves
and restores it like every other array: `{'scale': f32, 'good_steps': i32, 'skipped_steps': i32}`.
bfloat16 and float32 runs have no such entry and their step is unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jmp
import ml_collections

LossScaleState = dict[str, jax.Array]


def enabled(c: ml_collections.ConfigDict) -> bool:
    """Loss scaling applies to float16 compute only (bfloat16 has float32's exponent range)."""
    return c.model.dtype == 'float16' and c.optim.loss_scale == 'dynamic'


def abstract_state() -> dict[str, jax.ShapeDtypeStruct]:
    return {'scale': jax.ShapeDtypeStruct((), jnp.float32), 'good_steps': jax.ShapeDtypeStruct((), jnp.int32),
            'skipped_steps': jax.ShapeDtypeStruct((), jnp.int32)}


def init_state(c: ml_collections.ConfigDict) -> LossScaleState:
    return {'scale': jnp.asarray(c.optim.loss_scale_init, jnp.float32), 'good_steps': jnp.zeros((), jnp.int32),
            'skipped_steps': jnp.zeros((), jnp.int32)}


def _as_jmp(c: ml_collections.ConfigDict, s: LossScaleState) -> jmp.DynamicLossScale:
    return jmp.DynamicLossScale(s['scale'], s['good_steps'], period=c.optim.loss_scale_period)


def unscale(c: ml_collections.ConfigDict, s: LossScaleState, grads: Any) -> Any:
    """Gradients of the scaled loss -> gradients of the loss (in their own fp32)."""
    return _as_jmp(c, s).unscale(grads)


def finish_step(c: ml_collections.ConfigDict, s: LossScaleState, grads: Any, new: Any, old: Any
                ) -> tuple[Any, LossScaleState, dict[str, jax.Array]]:
    """Keeps `new` (the updated params/optimizer state) only if `grads` are finite; the next scale.

    Returns:
      (new or old, the next loss-scale state, metrics train/loss_scale and train/skipped_steps).
    """
    finite = jmp.all_finite(grads)
    kept = jmp.select_tree(finite, new, old)
    adjusted = _as_jmp(c, s).adjust(finite)
    nxt = {'scale': adjusted.loss_scale, 'good_steps': adjusted.counter.astype(jnp.int32),
           'skipped_steps': s['skipped_steps'] + (1 - finite.astype(jnp.int32))}
    # The scale this step used, and the skipped steps including this one.
    return kept, nxt, {'train/loss_scale': s['scale'], 'train/skipped_steps': nxt['skipped_steps'],
                       'train/step_skipped': 1 - finite.astype(jnp.int32)}
