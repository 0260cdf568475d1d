"""Test-only models whose layers return auxiliary outputs, and the layout checks that compare them.

`toy_aux`: GPT whose blocks return, besides their output y [N, d], a toy aux (model/auxiliary.py):
  mean_y       each layer's mean activation (reported only),
  bucket_mean  its mean over four equal slices of d, a small vector like a mixture-of-experts
               layer's [E] expert fractions (reported only),
  loss_sq      COEF x mean(y^2), a term of the training objective (differentiated).
COEF is 1: the term's gradient is about 1e-2 of the cross-entropy's, some 500 times the layout
tests' relative tolerance, so a term dropped, counted twice or seeded wrongly fails.
`toy_groups`: two layer groups (model/decoder.py) of different block kinds, `stem_blocks` (half
the layers: GPT's blocks returning mean_y and loss_stem = COEF x mean(|y|^2) / 2) then `blocks`
(toy-aux blocks): `mean_y` spans both groups' rows, the other entries one group's; the groups'
dropout indices; a pipeline's stem (the first group runs with the embedding on the first stage).

`register_toy_families` is the one place that registers them (`families.register`, for the duration).
"""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import families
from jaxfrontier.model import gpt, stack
from jaxfrontier.model import params as params_lib
from jaxfrontier.families import ParamSpec
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import LOSS_RTOL, TREE_ATOL, TREE_RTOL, batches, check_against_reference, without_key_bias
from layout_once import run_once

COEF, BUCKETS = 1.0, 4


class ToyAuxBlock(gpt.Block):
    """GPT's block returning the toy aux of its output (the module docstring)."""

    def __call__(self, x_nd, seq, key, cache=None, positions_bt=None):
        out = super().__call__(x_nd, seq, key, cache, positions_bt)
        if cache is not None:  # decoding: the extended cache, no aux
            return out
        y_nd, _ = out
        return y_nd, self.aux(y_nd.astype(jnp.float32))

    def aux(self, y):
        n, d = y.shape
        return {'mean_y': jnp.mean(y), 'bucket_mean': jnp.mean(y.reshape(n, BUCKETS, d // BUCKETS), axis=(0, 2)),
                'loss_sq': COEF * jnp.mean(jnp.square(y))}


class ToyStemBlock(ToyAuxBlock):
    """The first group's kind: another aux (one name shared with ToyAuxBlock's, one of its own)."""

    def aux(self, y):
        return {'mean_y': jnp.mean(y), 'loss_stem': COEF * jnp.mean(jnp.square(y)) / 2}


class ToyAux(gpt.GPT):
    """GPT with toy-aux blocks (one layer group)."""

    def __init__(self, s, *, rngs: nnx.Rngs):
        super().__init__(s, rngs=rngs)
        self.blocks = stack.create(lambda r: ToyAuxBlock(s, rngs=r), s.num_layers, rngs)


def stem_layers(s) -> int:
    return s.num_layers // 2


class ToyGroups(gpt.GPT):
    """Two layer groups: toy stem blocks (half the layers), then toy-aux blocks."""

    GROUPS = ('stem_blocks', 'blocks')

    def __init__(self, s, *, rngs: nnx.Rngs):
        super().__init__(s, rngs=rngs)
        self.stem_blocks = stack.create(lambda r: ToyStemBlock(s, rngs=r), stem_layers(s), rngs,
                                        axis_name=stack.STEM_LAYERS)
        self.blocks = stack.create(lambda r: ToyAuxBlock(s, rngs=r), s.num_layers - stem_layers(s), rngs)


def groups_param_specs(s) -> tuple[ParamSpec, ...]:
    """GPT's table with the layers split into the two groups (paths under each group's key)."""
    out = []
    for p in families.get('gpt').param_specs(s):
        if not p.is_block:
            out.append(p)
            continue
        out.append(ParamSpec(p.path, (s.num_layers - stem_layers(s), *p.shape[1:]), p.names))
        out.append(ParamSpec('stem_' + p.path, (stem_layers(s), *p.shape[1:]), (stack.STEM_LAYERS, *p.names[1:])))
    return tuple(sorted(out, key=lambda p: p.path))


TOY_AUX = dataclasses.replace(families.get('gpt'), name='toy_aux', module=f'{__name__}:ToyAux')
TOY_GROUPS = dataclasses.replace(families.get('gpt'), name='toy_groups', module=f'{__name__}:ToyGroups',
                                 param_specs=groups_param_specs)


@contextlib.contextmanager
def register_toy_families():
    """The toy families registered for the duration (`families.register`)."""
    for family in (TOY_AUX, TOY_GROUPS):
        families.register(family)
    try:
        yield
    finally:
        for family in (TOY_AUX, TOY_GROUPS):
            families.unregister(family.name)


# --------------------------------------------------------------------------- layout checks with aux


def _mesh_and_placement(c):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    return mesh, ts.make_placement(c, mesh)


def _aux_of(metrics) -> dict[str, np.ndarray]:
    """`{name: [L, ...]}` of a train step's metrics (`aux/<name>/layers`)."""
    return {k[len('aux/'):-len('/layers')]: np.asarray(v) for k, v in metrics.items()
            if k.startswith('aux/') and k.endswith('/layers')}


def reference(c):
    """One device's (loss, grads, params after 3 steps) as layout_check.run_layout, and step 0's aux
    from `make_loss_aux_and_grads` (its own program, not the train step's), on the same global batches
    as every layout: a MoE model's micro-batches are the same rows in every layout
    (step.split_micro_batches, strided), so nothing is reordered for the reference."""
    mesh, layout = _mesh_and_placement(c)
    state = ts.init_train_state(c, layout)
    sharding = NamedSharding(mesh, mesh_lib.batch_spec(layout.rules))
    data = [jax.device_put(b, sharding)
            for b in batches(c.train.global_batch)]
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, aux, grads = jax.device_get(jax.jit(step_lib.make_loss_aux_and_grads(c, layout))(
            state['params'], data[0], 0))
        step = jax.jit(step_lib.make_train_step(c, layout), donate_argnums=0)
        for batch in data:
            state, _ = step(state, batch)
    params = params_lib.merge_virtual(jax.device_get(state['params']))
    return (float(loss), params_lib.merge_virtual(grads), params), {k: np.asarray(v) for k, v in aux.items()}


def run_with_aux(c):
    """A layout's (loss, grads, params after 3 steps) from its train step alone (layout_once.py's
    read-back), step 0's aux `{name: [L, ...]}` and metrics."""
    result, metrics = run_once(c)
    return result, _aux_of(metrics), metrics


# Aux entries of a layout's communication, not of the model: one device has none to compare with.
LAYOUT_ONLY = ('moe_dispatch_fallback',)


def model_aux(aux):
    """`aux` without the layout's own entries (LAYOUT_ONLY)."""
    return {name: value for name, value in aux.items() if name not in LAYOUT_ONLY}


def assert_aux_close(aux, ref_aux, what=''):
    """Every aux entry as one device's: the layers' values (loss terms at the loss's rtol); the layout's own
    entries (LAYOUT_ONLY) are left out."""
    aux = model_aux(aux)
    assert sorted(aux) == sorted(ref_aux), (sorted(aux), sorted(ref_aux))
    for name in ref_aux:
        assert aux[name].shape == ref_aux[name].shape, (name, aux[name].shape, ref_aux[name].shape)
        if name.startswith('loss_'):
            np.testing.assert_allclose(aux[name], ref_aux[name], rtol=LOSS_RTOL, err_msg=f'{what} aux {name}')
        else:
            np.testing.assert_allclose(aux[name], ref_aux[name], rtol=TREE_RTOL, atol=TREE_ATOL,
                                       err_msg=f'{what} aux {name}')


def check_layout_with_aux(c, ref):
    """`c`'s train step against one device's: loss, grads, params (layout_check's tolerances) and aux.
    Returns (and prints, for `pytest -s`) the worst differences: loss (relative), gradients,
    parameters after 3 steps and aux (absolute)."""
    (result, aux, metrics), (ref_result, ref_aux) = run_with_aux(c), ref
    check_against_reference(result, ref_result)
    assert_aux_close(aux, ref_aux, 'step 0')
    for name, v in ref_aux.items():  # the scalar metric: the mean over the layers
        np.testing.assert_allclose(metrics[f'aux/{name}'], v.mean(axis=0), rtol=TREE_RTOL, atol=TREE_ATOL)
    worst = lambda a, b: max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))  # noqa: E731
                             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    fallback = aux.get('moe_dispatch_fallback')
    aux = model_aux(aux)
    diffs = {'loss_rel': abs(result[0] - ref_result[0]) / abs(ref_result[0]), 'grad': worst(result[1], ref_result[1]),
             'param': worst(without_key_bias(result[2]), without_key_bias(ref_result[2])), 'aux': worst(aux, ref_aux)}
    if fallback is not None:  # how often the dispatch's exact fallback ran (layers' mean at step 0)
        diffs['dispatch_fallback'] = float(np.mean(fallback))
    print(f'\nworst differences vs one device: {", ".join(f"{k} {v:.2e}" for k, v in diffs.items())}')
    return diffs
