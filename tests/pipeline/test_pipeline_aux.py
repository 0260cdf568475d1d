"""Auxiliary outputs and layer groups through the pipeline executors (pipeline/chunk.py, lockstep.py,
staggered.py, eval.py), against one device.

`toy_groups` (tests/aux_models.py) with 8 layers: a stem of 4 (run with the embedding on the first
stage) and 4 pipelined toy-aux layers, both groups returning aux with a `loss_` term; `toy_aux` (one
group) once. Every schedule of tests/pipeline/test_pipeline.py computes one device's loss, gradients,
parameters after 3 steps (layout_check.py's tolerances, unchanged) and aux (each micro-batch's
forward counted once, summed per stage into its rows, one psum); with dropout (the stem's and the
chunks' keys by global layer), packed documents (the loss terms' weight), a float16-style loss
scale (the loss terms' cotangent) and in pipelined evaluation. Groups a pipeline cannot run are
refused before compiling.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from aux_models import (TOY_AUX, TOY_GROUPS, ToyGroups, assert_aux_close, check_layout_with_aux, reference,
                        register_toy_families)
from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import params as params_lib
from jaxfrontier.pipeline import chunk
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib
from layout_check import LOSS_RTOL, assert_trees_close, batches, make_config

LAYERS, BATCH = 8, 24


@pytest.fixture(scope='module', autouse=True)
def toy_families():
    with register_toy_families():
        yield


@pytest.fixture(scope='module')
def references():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = reference(make_config(family=family, layers=LAYERS, global_batch=BATCH))
        return cache[family]

    return get


def pipeline_config(schedule, p, m, other, virtual=1, family=TOY_GROUPS.name, **kw):
    return make_config(family=family, layers=LAYERS, global_batch=BATCH, pipeline=p, schedule=schedule,
                       virtual=virtual, accum=m, **({other: 2} if other else {}), **kw)


# (schedule, P, M, V, other axis, family): each executor, P = 2 and 4, a stem of 4 layers before
# 1 to 2 pipelined layers per chunk.
FAST = [('1f1b', 2, 3, 1, 'tensor', TOY_GROUPS.name)]
SLOW = [('1f1b', 4, 4, 1, 'fsdp', TOY_GROUPS.name), ('1f1b_lockstep', 2, 3, 1, 'fsdp', TOY_GROUPS.name),
        ('gpipe', 2, 2, 1, 'tensor', TOY_GROUPS.name), ('interleaved', 2, 2, 2, 'fsdp', TOY_GROUPS.name),
        ('interleaved', 2, 4, 2, 'tensor', TOY_AUX.name)]


@pytest.mark.parametrize('schedule,p,m,virtual,other,family', FAST)
def test_pipeline_with_aux_matches_single_device(schedule, p, m, virtual, other, family, references):
    check_layout_with_aux(pipeline_config(schedule, p, m, other, virtual, family), references(family))


@pytest.mark.slow
@pytest.mark.parametrize('schedule,p,m,virtual,other,family', SLOW)
def test_pipeline_with_aux_matches_single_device_slow(schedule, p, m, virtual, other, family, references):
    check_layout_with_aux(pipeline_config(schedule, p, m, other, virtual, family), references(family))


@pytest.mark.slow
@pytest.mark.parametrize('kw', [dict(data=2, tensor=2, zero1=True),  # the data-local map (reduced once)
                                dict(context=2, tensor=2, remat='full')])
def test_pipeline_with_aux_composes_with_data_and_context(kw, references):
    c = pipeline_config('1f1b', 2, 3 if 'data' in kw else 2, None, **kw)
    check_layout_with_aux(c, references(TOY_GROUPS.name))


# --------------------------------------------------------------------------- step 0 only


def loss_aux_grads(c, scales=(None,)):
    """Step 0's (loss, aux, grads) of `c` at the initial parameters, per loss scale (one program for
    every scale that is not None: the scale is an argument)."""
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    batch = jax.device_put(batches(c.train.global_batch)[0], NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    fn = jax.jit(step_lib.make_loss_aux_and_grads(c, layout))
    out = []
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        for scale in scales:
            args = () if scale is None else (jnp.float32(scale),)
            loss, aux, grads = jax.device_get(fn(state['params'], batch, 0, *args))
            out.append((float(loss), aux, params_lib.merge_virtual(grads)))
    return out


def assert_step0_close(result, ref):
    (loss, aux, grads), (ref_loss, ref_aux, ref_grads) = result, ref
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'grad')
    assert_aux_close(aux, ref_aux)


@pytest.mark.slow
def test_pipeline_dropout_with_groups_matches_non_pipelined():
    """Dropout keys by global layer: the stem's layers on the first stage and the chunks' after them
    draw one device's masks (loss, gradients, aux of step 0; layout_check.py's tolerances)."""
    flat = make_config(family=TOY_GROUPS.name, layers=LAYERS, global_batch=BATCH, accum=2, dropout_rate=0.1)
    piped = pipeline_config('1f1b', 2, 2, 'tensor', dropout_rate=0.1)
    assert_step0_close(loss_aux_grads(piped)[0], loss_aux_grads(flat)[0])


@pytest.mark.slow
def test_pipeline_packed_documents_weigh_loss_terms_as_one_device():
    """Packed documents: the step scales gradients by count_scale, so the loss terms enter divided by
    it (aux_weight) in every executor; the batch's most frequent token ends documents."""
    configs = [make_config(family=TOY_GROUPS.name, layers=LAYERS, global_batch=BATCH, accum=2),
               pipeline_config('1f1b', 2, 2, 'tensor'), pipeline_config('gpipe', 2, 2, 'fsdp')]
    eot = int(np.bincount(batches(BATCH)[0][:, :-1].ravel()).argmax())
    for c in configs:
        c.data.update(pack_documents=True, eot_id=eot)
    ref = loss_aux_grads(configs[0])[0]
    for c in configs[1:]:
        assert_step0_close(loss_aux_grads(c)[0], ref)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', ['1f1b', 'gpipe'])
def test_loss_scale_seeds_the_loss_terms(schedule):
    """float16's loss scale multiplies the loss terms' cotangent too: gradients at scale 8 are 8 x
    those at scale 1 (exactly: powers of two), in both executors."""
    (_, _, one), (_, _, eight) = loss_aux_grads(pipeline_config(schedule, 2, 2, 'tensor'), scales=(1.0, 8.0))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a * 8, b), one, eight)


# --------------------------------------------------------------------------- evaluation


def eval_loss_and_aux(c, params, tokens):
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:config_lib.num_devices(c)])
    layout = ts.make_placement(c, mesh)
    virtual = c.pipeline.virtual_stages if c.mesh.pipeline > 1 else 1
    params = jax.device_put(params_lib.split_virtual(params, virtual), layout.param_shardings)
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        loss, aux = jax.device_get(jax.jit(step_lib.make_eval_loss_and_aux(c, layout))(params, tokens))
    return float(loss), aux


@pytest.mark.slow
@pytest.mark.parametrize('schedule,p,m,virtual', [('1f1b', 2, 3, 1), ('interleaved', 2, 4, 2)])
def test_pipelined_eval_aux_matches_flat(schedule, p, m, virtual):
    """The forward-only wave's loss and aux (its own units) are the unpipelined eval step's."""
    tokens = batches(BATCH)[0]
    flat = make_config(family=TOY_GROUPS.name, layers=LAYERS, global_batch=BATCH, accum=m)
    shape = config_lib.model_shape(flat)
    params = jax.device_get(jax.jit(params_lib.init_params, static_argnums=0)(shape, jax.random.key(0)))
    ref_loss, ref_aux = eval_loss_and_aux(flat, params, tokens)
    loss, aux = eval_loss_and_aux(pipeline_config(schedule, p, m, 'tensor', virtual), params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_aux_close(aux, ref_aux, 'eval')


# --------------------------------------------------------------------------- refusals


class ToyTail(ToyGroups):
    """The toy's groups in the other order: a group after the pipelined one."""

    GROUPS = ('blocks', 'stem_blocks')


def test_groups_a_pipeline_cannot_run_are_refused_before_compiling():
    """A pipelined group whose layers do not split into P x V chunks, or a group after it: one line
    naming mesh.pipeline and a layout that works, from building the step (nothing compiled)."""
    c = make_config(family=TOY_GROUPS.name, layers=6, global_batch=BATCH, pipeline=2, accum=2)  # 3 + 3 layers
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:2])
    layout = ts.make_placement(c, mesh)
    with pytest.raises(ConfigError, match=r"mesh.pipeline = 2.*'blocks' holds 3 layers \(of 6\).*mesh.pipeline to "
                                          r"one of \[3\]"):
        step_lib.make_train_step(c, layout)
    with pytest.raises(ConfigError, match='mesh.pipeline'):
        step_lib.make_eval_step(c, layout)
    tail = params_lib.ModelDef(*nnx.split(nnx.eval_shape(lambda: ToyTail(config_lib.model_shape(c),
                                                                          rngs=nnx.Rngs(0)))))
    with pytest.raises(ConfigError, match=r"do not end with the pipelined group 'blocks'.*mesh.pipeline=1"):
        chunk.check_groups(tail, 2, 1)
    chunk.check_groups(layout.model_def, 3, 1)  # 3 layers in 3 chunks: accepted
