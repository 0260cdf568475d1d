"""Mixture-of-experts layouts equal one device (model/layers/moe_parallel.py; docs/models.md).

Loss, gradients and parameters after 3 steps (layout_check.py's tolerances) and step 0's aux entries
(loads, dropped fraction, entropy, balancing and z losses) of each layout against one device run on the
same global batches. The balancing loss and the capacity drops are per-micro-batch and not linear in its
rows; a MoE model's micro-batch a is global rows a, a + A, ... in every layout and on one device
(step.split_micro_batches, strided), so accumulation keeps them layout-invariant.

Skewed routing: the sigmoid router's bias starts at 3 for expert 0 (its scores lie in (0, 1)), so every
token chooses expert 0 (half of all assignments go to one device under expert parallelism), and the bias
moves every step (moe_bias_rate). Fast: expert x data with accumulation (~14 s); the rest slow.
"""

import jax
import pytest

import aux_models
from jaxfrontier.training import state as ts
from layout_check import LLAMA, make_config

MOE = dict(LLAMA, moe_experts=4, moe_top_k=2, moe_mlp_dim=32, moe_z_coef=0.001)
SKEWED = dict(MOE, moe_router='sigmoid', moe_router_bias=True, moe_bias_rate=0.01, moe_experts=8)
CAPACITY = dict(MOE, moe_dropless=False, moe_capacity_factor=0.75)
FIRST_DENSE = dict(MOE, moe_first_dense=1, moe_shared_experts=1)
MODELS = {'moe': MOE, 'skewed': SKEWED, 'capacity': CAPACITY, 'first_dense': FIRST_DENSE}
# A dispatch forced on a model (model/layers/moe_dispatch.py): 'MODEL/DISPATCH' has roomy buffers that never
# overflow (moe_dispatch_buffer >= EP), 'MODEL/DISPATCH/tight' tight ones that overflow under skewed routing and
# take the exact fallback, 'MODEL/DISPATCH/chunksN' a device's tokens in N chunks (model.moe_chunks).


def model_fields(name: str) -> dict:
    """'MODEL[/DISPATCH[/tight|/chunksN]]': tight, a buffer of the even share (the fallback runs); else 8x."""
    base, *dispatch = name.split('/')
    if not dispatch:
        return MODELS[base]
    option = dispatch[1] if dispatch[1:] else ''
    return dict(MODELS[base], moe_dispatch=dispatch[0], moe_dispatch_buffer=1.0 if option == 'tight' else 8.0,
                moe_chunks=int(option.removeprefix('chunks')) if option.startswith('chunks') else 1)


@pytest.fixture
def skewed_init(monkeypatch):
    """Every layout's (and the reference's) initial router bias: 3 on expert 0 (the module docstring)."""
    init = ts.init_train_state

    def skewed(c, layout):
        state = init(c, layout)
        mlp = state['params']['blocks']['mlp']
        if 'router_bias' in mlp:
            mlp['router_bias'] = jax.device_put(mlp['router_bias'].at[..., 0].set(3.0), mlp['router_bias'].sharding)
        return state

    monkeypatch.setattr(ts, 'init_train_state', skewed)


_REFERENCES = {}


def check(model: str, accum: int = 1, layers: int = 2, **mesh):
    base = model.split('/')[0]  # one device has no dispatch: the same reference for every dispatch
    key = (base, accum, layers)
    if key not in _REFERENCES:  # one device on the same global batches: shared by every layout
        _REFERENCES[key] = aux_models.reference(make_config(accum=accum, layers=layers, **MODELS[base]))
    return aux_models.check_layout_with_aux(make_config(accum=accum, layers=layers, **mesh, **model_fields(model)),
                                            _REFERENCES[key])


@pytest.mark.slow
def test_expert_parallel_equals_one_device(skewed_init):
    check('skewed', expert=2)


@pytest.mark.slow  # ~20-40 s of compiles: the fast tier keeps the layer's dense-reference checks (test_moe.py)
def test_expert_x_data_with_accumulation_equals_one_device(skewed_init):
    """The once-per-step reduction (training/reduction.data_local): a replica's balancing-loss gradient
    from its own tokens' probabilities, the loads counted over every replica."""
    check('moe', accum=2, expert=2, data=2)


LAYOUTS = [
    ('moe', 1, dict(expert=4)), ('skewed', 1, dict(expert=8)), ('moe', 1, dict(expert=2, fsdp=2)),
    ('moe', 1, dict(expert=2, tensor=2)), ('moe', 1, dict(expert=2, context=2)),
    ('moe', 1, dict(expert=2, data=2, zero1=True)), ('moe', 1, dict(expert=2, fsdp=2, tensor=2)),
    ('moe', 2, dict(expert=2, pipeline=2)), ('moe', 2, dict(expert=2, pipeline=2, schedule='gpipe')),
    ('skewed', 2, dict(expert=4, pipeline=2)), ('skewed', 2, dict(expert=2, fsdp=2, context=2)),
    ('capacity', 1, dict(expert=2)), ('capacity', 2, dict(expert=2, data=2)),
    ('capacity', 1, dict(expert=2, context=2)), ('first_dense', 1, dict(expert=2)),
    ('first_dense', 2, dict(expert=2, pipeline=2, layers=3)),
]


@pytest.mark.slow
@pytest.mark.parametrize('model,accum,mesh', LAYOUTS, ids=lambda x: str(x))
def test_layout_matrix_equals_one_device(skewed_init, model, accum, mesh):
    mesh = dict(mesh)
    layers = mesh.pop('layers', 2)
    check(model, accum=accum, layers=layers, **mesh)


# Each dispatch on the axes it meets (roomy buffers), and the exact fallback (tight buffers, skewed routing).
DISPATCH_LAYOUTS = [
    ('moe/all_to_all', 1, dict(expert=4)), ('moe/ragged/chunks2', 2, dict(expert=2, data=2)),
    ('moe/ragged', 2, dict(expert=2, pipeline=2)), ('capacity/all_to_all/chunks4', 1, dict(expert=2, context=2)),
    ('skewed/ragged/tight', 1, dict(expert=4)),
]


@pytest.mark.slow
@pytest.mark.parametrize('model,accum,mesh', DISPATCH_LAYOUTS, ids=lambda x: str(x))
def test_dispatch_equals_one_device(skewed_init, model, accum, mesh):
    diffs = check(model, accum=accum, **mesh)
    assert diffs['dispatch_fallback'] == (1.0 if model.endswith('tight') else 0.0), diffs
