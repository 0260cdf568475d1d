"""Layers' auxiliary outputs (model/auxiliary.py) and layer groups (model/decoder.py), unpipelined.

The test-only families of tests/aux_models.py: `toy_groups` (two groups of different block kinds,
each returning a toy aux with a `loss_` term) and `toy_aux` (one group). The layer runner's
objective, gradients and aux equal a layer-by-layer loop's under every runner form (rolled scan,
grouped scan, unrolled custom VJP; remat policies; dropout keys by global layer), and every
unpipelined layout of tests/test_parallel.py (and context's) computes one device's loss,
gradients, parameters after 3 steps (layout_check.py's tolerances, unchanged) and aux.
Aux tolerance: loss terms at the loss's rtol 2e-6; reported entries at the trees' 2e-5 / 2e-6.
Measured worst over the matrix (and the pipelined one): aux 1.9e-9 absolute (values ~1e-4 to 1e-3),
gradients 4.6e-8, parameters after 3 steps 3.7e-7, loss 1.7e-7 relative.
The pipelined layouts are tests/pipeline/test_pipeline_aux.py.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from aux_models import TOY_AUX, TOY_GROUPS, check_layout_with_aux, reference, register_toy_families
from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import families
from jaxfrontier.model import auxiliary, decode
from jaxfrontier.model import packing as packing_lib
from jaxfrontier.model import params as params_lib
from jaxfrontier.model.context import TokenOrder
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import SEQ, assert_trees_close, batches, make_config

RTOL, ATOL = 1e-5, 1e-6  # tests/model/test_model.py's: reduction order only


@pytest.fixture(scope='module', autouse=True)
def toy_families():
    with register_toy_families():
        yield


# --------------------------------------------------------------------------- the runner, one device


def tiny_model(remat='none', unroll=1, dropout=0.1, layers=6):
    """toy_groups with 3 + 3 layers (a group of 3: unroll 2 leaves a remainder), its params, a batch."""
    c = make_config(family=TOY_GROUPS.name, layers=layers, remat=remat, dropout_rate=dropout)
    shape = dataclasses.replace(config_lib.model_shape(c), scan_unroll=unroll)
    return params_lib.ModelDef.create(shape), _params(layers), jnp.asarray(batches(16, 1)[0][:4])


@functools.lru_cache(maxsize=None)
def _params(layers):
    shape = config_lib.model_shape(make_config(family=TOY_GROUPS.name, layers=layers))
    return jax.device_get(jax.jit(params_lib.init_params, static_argnums=0)(shape, jax.random.key(0)))


def layer_by_layer(model, tokens, key):
    """(objective, (cross-entropy, aux)) by calling each group's blocks one at a time (no runner)."""
    x, rows, index = model.embed(tokens[:, :-1], key), {}, 0
    for name in model.GROUPS:
        graphdef, stacked = nnx.split(getattr(model, name))
        for i in range(jax.tree.leaves(stacked)[0].shape[0]):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
            x, aux = layer(x, SEQ, jax.random.fold_in(key, index))
            index += 1
            for k, v in aux.items():
                rows.setdefault(k, []).append(v)
    ce = model.head_loss(x, tokens[:, 1:])
    aux = {k: jnp.stack(v) for k, v in rows.items()}
    return ce + sum(jnp.sum(v) for k, v in aux.items() if k.startswith('loss_')), (ce, aux)


def runner(model, tokens, key):
    ce, aux = model.loss_and_aux(tokens[:, :-1], tokens[:, 1:], key)
    return auxiliary.objective(ce, aux), (ce, aux)


@functools.lru_cache(maxsize=None)
def _by_layer():
    model_def, params, tokens = tiny_model()
    key = jax.random.key(3)
    grad = jax.value_and_grad(lambda p: layer_by_layer(model_def.bind(p), tokens, key), has_aux=True)
    ce_grad = jax.grad(lambda p: layer_by_layer(model_def.bind(p), tokens, key)[1][0])
    return jax.device_get(jax.jit(lambda p: (grad(p), ce_grad(p)))(params))  # one compile


@pytest.mark.parametrize('remat,unroll', [
    ('full', 6),  # unrolled: recompute_after_cotangent's custom VJP
    pytest.param('full', 1, marks=pytest.mark.slow),  # rolled scan, jax.checkpoint
    pytest.param('none', 1, marks=pytest.mark.slow),
    pytest.param('save_dots', 2, marks=pytest.mark.slow),  # grouped scan of 2, remainder 1
])
def test_runner_matches_layer_by_layer(remat, unroll):
    """The runner's objective, cross-entropy, aux and gradients (the loss terms' included, through
    every group and the dropout keys of the global layer index) are a plain loop's."""
    model_def, params, tokens = tiny_model(remat, unroll)
    key = jax.random.key(3)
    fn = jax.jit(jax.value_and_grad(lambda p: runner(model_def.bind(p), tokens, key), has_aux=True))
    (objective, (ce, aux)), grads = jax.device_get(fn(params))
    ((ref_objective, (ref_ce, ref_aux)), ref_grads), ce_grads = _by_layer()
    np.testing.assert_allclose(objective, ref_objective, rtol=RTOL)
    np.testing.assert_allclose(ce, ref_ce, rtol=RTOL)
    assert sorted(aux) == ['bucket_mean', 'loss_sq', 'loss_stem', 'mean_y']
    assert aux['mean_y'].shape == (6,) and aux['bucket_mean'].shape == (3, 4) and aux['loss_stem'].shape == (3,)
    for k in ref_aux:
        np.testing.assert_allclose(aux[k], ref_aux[k], rtol=RTOL, atol=ATOL, err_msg=k)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL), grads, ref_grads)
    # The loss terms move the gradients far past the tolerance: a term dropped or counted twice fails.
    moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ref_grads, ce_grads)))
    assert moved > 100 * ATOL, moved


def test_reported_entries_carry_no_gradient():
    """Only `loss_` entries are differentiated: a function of the reported ones has zero gradient."""
    model_def, params, tokens = tiny_model(dropout=0.0)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(model_def.bind(p).loss_and_aux(tokens[:, :-1], tokens[:, 1:])[1]
                                                ['mean_y'])))(params)
    assert all(float(np.max(np.abs(g))) == 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_packed_documents_leave_the_loss_terms_unscaled():
    """Packed documents: the cross-entropy becomes a mean over the counted predictions (the step
    multiplies by count_scale), the loss terms do not (aux_weight): the step's gradients are those
    of count_scale x the weighted cross-entropy + the terms. The batch's most frequent token ends
    documents, so count_scale is not 1."""
    c = make_config(family=TOY_GROUPS.name, layers=LAYERS)
    tokens = batches(16, 1)[0]
    c.data.update(pack_documents=True, eot_id=int(np.bincount(tokens[:, :-1].ravel()).argmax()))
    packing = packing_lib.from_config(c)
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:1])
    layout = ts.make_placement(c, mesh)
    params = _params(LAYERS)
    order = TokenOrder(SEQ, packing=packing)

    def direct(p):
        ce, aux = order.loss_and_aux(layout.model_def.bind(p), tokens)
        return packing_lib.count_scale(tokens, packing) * ce + auxiliary.loss_terms(aux)

    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        _, _, grads = jax.device_get(jax.jit(step_lib.make_loss_aux_and_grads(c, layout))(params, tokens, 0))
        ref_grads = jax.device_get(jax.jit(jax.grad(direct))(params))
    assert float(packing_lib.count_scale(tokens, packing)) > 1.001
    assert_trees_close(grads, ref_grads, 'grad')


def test_groups_keep_one_group_models_and_extend_the_table():
    """The planner's table (family.param_specs) sees each group under its key, as eval_shape does;
    one-group models keep `params['blocks']` alone."""
    c = make_config(family=TOY_GROUPS.name, layers=6)
    shape = config_lib.model_shape(c)
    model_def = params_lib.ModelDef.create(shape)
    assert model_def.groups == ('stem_blocks', 'blocks') and model_def.group_sizes() == {'stem_blocks': 3,
                                                                                            'blocks': 3}
    flat = lambda tree, **kw: {'/'.join(k.key for k in path): leaf for path, leaf in  # noqa: E731
                               jax.tree_util.tree_flatten_with_path(tree, **kw)[0]}
    abstract = flat(model_def.abstract_params())
    logical = flat(model_def.logical_specs(), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    specs = families.get(TOY_GROUPS.name).param_specs(shape)
    assert sorted(p.path for p in specs) == sorted(abstract)
    for p in specs:
        assert p.shape == abstract[p.path].shape and p.names == tuple(logical[p.path]), p.path
    assert {p.names[0] for p in specs if p.path.startswith('stem_blocks/')} == {'stem_layers'}
    one = params_lib.ModelDef.create(config_lib.model_shape(make_config(family=TOY_AUX.name)))
    assert one.groups == ('blocks',) and 'stem_blocks' not in one.abstract_params()


def test_decoding_runs_every_group():
    """KV-cached decoding (model/decode.py) scans each group over its rows of the cache: a prefill's
    last logits are the full forward's; the blocks' aux is dropped there."""
    model_def, params, tokens = tiny_model(dropout=0.0)
    prompt = tokens[:, :-1]

    def both(p):
        model = model_def.bind(p)
        logits, _ = decode.prefill(model, prompt, jnp.full((prompt.shape[0],), SEQ), decode.init_cache(
            model.shape, prompt.shape[0]))
        return logits, model(prompt)[:, -1]

    logits, full = jax.device_get(jax.jit(both)(params))
    np.testing.assert_allclose(logits, full, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- unpipelined layouts

LAYERS = 4  # toy_groups: 2 + 2


@pytest.fixture(scope='module')
def references():
    """One device's results per family (computed on first use)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = reference(make_config(family=family, layers=LAYERS))
        return cache[family]

    return get


LAYOUTS = {  # tests/test_parallel.py's, and context's
    'data8': dict(data=8),
    'fsdp8': dict(fsdp=8),
    'tensor8': dict(tensor=8),
    'd2f2t2': dict(data=2, fsdp=2, tensor=2),
    'zero1_d4t2': dict(data=4, tensor=2, zero1=True),
}
FAST = [('d2f2t2', 1, TOY_GROUPS.name)]
SLOW = [(name, accum, TOY_GROUPS.name) for name in LAYOUTS for accum in (1, 2)
        if (name, accum, TOY_GROUPS.name) not in FAST] + [
    ('d2f2t2', 2, TOY_AUX.name), ('c2', 1, TOY_GROUPS.name), ('c2f2t2_dots', 2, TOY_GROUPS.name),
    ('unrolled_full_d2f2t2', 2, TOY_GROUPS.name)]
LAYOUTS.update({'c2': dict(context=2), 'c2f2t2_dots': dict(context=2, fsdp=2, tensor=2, remat='save_dots'),
                'unrolled_full_d2f2t2': dict(data=2, fsdp=2, tensor=2, remat='full')})


def _check(name, accum, family, references):
    c = make_config(family=family, layers=LAYERS, accum=accum, **LAYOUTS[name])
    if name.startswith('unrolled'):
        c.model.scan_unroll = LAYERS
    check_layout_with_aux(c, references(family))


@pytest.mark.parametrize('name,accum,family', FAST)
def test_layout_with_aux_matches_single_device(name, accum, family, references):
    _check(name, accum, family, references)


@pytest.mark.slow
@pytest.mark.parametrize('name,accum,family', SLOW)
def test_layout_with_aux_matches_single_device_slow(name, accum, family, references):
    _check(name, accum, family, references)
