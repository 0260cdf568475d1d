"""layout_check.run_layout's three results from one compiled program: the train step.

`run_layout(c)` compiles two programs per layout: `loss_and_grads` for step 0's loss and
gradients, then the train step (which contains the same loss and gradients) for the three
optimizer steps. On XLA:CPU the compiles are most of a layout test's time, and the first one
is redundant: the train step already computes step 0's loss and gradients, and its state and
metrics after step 0 hold them exactly enough to read them back:

- the loss is the step's `train/loss` metric (the same `loss_and_grads` value);
- the gradients are in the first moment. AdamW's (and Lion's) moment starts at 0, so after
  one update it is (1 - decay) x the gradient the optimizer saw, and that gradient is the
  step's gradient clipped to `optim.clip_norm` by its global norm, which the step reports
  as `train/grad_norm`. Undoing both is two fp32 roundings (a relative 1e-7), against the
  comparison's rtol 2e-5 and atol 2e-6 (layout_check.py): what is compared is the gradient
  itself, not its clipped direction, so a gradient off by a constant factor still fails.
  A parameter no optimizer updates (model/params.py `OUTSIDE_GRADIENT`: the MoE router's bias)
  has no moment; its gradient is exactly 0 (stopped), which the read-back gives it.

These are the gradients the train step applies (not a separate program's), so the check is
the same as run_layout's, on the program that trains. The one-device references stay
run_layout's own `loss_and_grads`: every comparison then also holds this read-back against
the direct gradients. Only for optimizers with such a moment (adamw, lion) and without loss
scaling or spike skipping (which may drop step 0's update): anything else is refused.
"""

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from optax.transforms import MaskedNode

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.model import params as params_lib
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts
from layout_check import batches

# optim.name -> (its first-moment state, the config field with the moment's decay)
MOMENTS = {'adamw': (optax.ScaleByAdamState, 'b1'), 'lion': (optax.ScaleByLionState, 'b2')}


def _first_moment(opt_state, kind):
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(s, kind)]
    assert len(found) == 1, f'expected one {kind.__name__} in the optimizer state, found {len(found)}'
    return found[0].mu


def step0_gradients(c, mu, grad_norm: float, params):
    """The step-0 gradient behind the first moment `mu` after one update (module docstring).

    `mu` may be ZeRO-1-padded (layout_lib.zero1_layout): the padding is cut to `params`' shapes.
    """
    decay = c.optim[MOMENTS[c.optim.name][1]]
    unclip = grad_norm / c.optim.clip_norm if grad_norm >= c.optim.clip_norm else 1.0

    def gradient(m, p):
        if isinstance(m, MaskedNode):  # a parameter no optimizer updates (params.OUTSIDE_GRADIENT): no gradient
            return np.zeros(p.shape, np.float64)
        return np.asarray(m, np.float64)[tuple(slice(0, n) for n in p.shape)] / (1.0 - decay) * unclip

    return jax.tree.map(gradient, mu, params, is_leaf=lambda x: isinstance(x, MaskedNode))


def run_layout_once(c, inspect=None):
    """(loss, grads) of step 0 and params after 3 steps, as numpy, like run_layout(c), from the
    train step alone (one compile instead of two).

    `inspect`: called with the loop's compiled train step (`step.jit_train_step`: explicit shardings,
    donated state), which then runs instead of a plain `jax.jit` of the step (e.g. to read its HLO).
    """
    return run_once(c, inspect)[0]


def run_once(c, inspect=None):
    """`run_layout_once(c, inspect)`'s result, and step 0's metrics (fetched: numpy)."""
    if c.optim.name not in MOMENTS:
        raise ValueError(f'optim.name {c.optim.name!r} keeps no first moment to read gradients from')
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    # No loss scale or spike state: either may skip step 0's update (then use run_layout). LoRA's frozen
    # base rides along (its `params` are the adapters).
    assert set(state) - {ts.FROZEN} == {'step', 'params', 'opt_state'}, sorted(state)
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    data = [jax.device_put(b, sharding) for b in batches(c.train.global_batch)]
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        if inspect is None:
            step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
        else:
            jitted, abstract_state, abstract_batch = step_lib.jit_train_step(c, layout)
            step = jitted.lower(abstract_state, abstract_batch).compile()
            inspect(step)
        state, metrics = step(state, data[0])
        metrics = jax.device_get(metrics)
        loss, grad_norm = metrics['train/loss'], metrics['train/grad_norm']
        mu = jax.device_get(_first_moment(state['opt_state'], MOMENTS[c.optim.name][0]))
        grads = step0_gradients(c, mu, float(grad_norm), state['params'])
        for batch in data[1:]:
            state, _ = step(state, batch)
    # Interleaved pipelines store blocks as [V, L / V, ...]; compare in model order [L, ...].
    result = (float(loss), params_lib.merge_virtual(grads), params_lib.merge_virtual(jax.device_get(state['params'])))
    return result, metrics
