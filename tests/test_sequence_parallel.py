"""Megatron sequence parallelism along `tensor` (`sharding.sequence_parallel`).

With it the flat residual stream [B*T, d] (model/layers.ACT_ND, logical `stream`) is split
over the tensor-parallel group between the matmuls, and gathered where attention and the MLP
need every token. Held here:
  - the rules: `stream` follows `tokens`' axes, plus the heads' axes with SP; 'auto' is
    off (config.sequence_parallel says why) and a wrong setting is a one-line ConfigError;
  - equivalence with one device (tensor 2, tensor 2 x fsdp 2, tensor 2 x pipeline 2; GPT and
    Llama) with SP on; SP off is the default the layout tests (test_parallel, test_pipeline) run;
  - the compiled program: with SP the activations are gathered over tensor (all-gathers of a
    [tokens, d] shard appear) and the temporary memory per device falls.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model.layers import ACT_ND
from jaxfrontier.plan import hlo_collectives
from jaxfrontier.training import state as ts
from jaxfrontier.training import step as step_lib

import layout_check
from layout_check import LLAMA, assert_trees_close, check_against_reference, make_config, run_layout
from layout_once import run_layout_once


def _sp(c, setting):
    c.sharding.sequence_parallel = setting
    config_lib.validate(c, config_lib.num_devices(c))
    return c


def test_rules_split_the_stream_over_tensor_only_with_sp():
    rules = lambda c: dict(config_lib.sharding_rules(c))  # noqa: E731
    c = make_config(data=2, fsdp=2, tensor=2)
    tokens = rules(c)['tokens']  # the context axis and the batch's axes (model/context.py's order)
    assert set(tokens) == {'data', 'fsdp', 'context'}
    assert rules(c)['stream'] == tokens  # 'auto' is off
    assert rules(_sp(c, 'true'))['stream'] == (*tokens, 'tensor')
    assert rules(_sp(c, 'true'))['tokens'] == tokens  # inside attention and the MLP: whole over tensor
    assert rules(_sp(c, 'false'))['stream'] == tokens
    assert rules(_sp(make_config(data=8), 'true'))['stream'] == tokens  # no tensor axis: nothing to split
    spec = mesh_lib.logical_to_spec(ACT_ND, config_lib.sharding_rules(_sp(c, 'true')))
    assert spec == jax.sharding.PartitionSpec((*tokens, 'tensor'), None)


def test_unknown_setting_is_a_config_error():
    c = make_config(tensor=2)
    c.sharding.sequence_parallel = 'yes'
    with pytest.raises(ConfigError, match='sharding.sequence_parallel'):
        config_lib.validate(c, config_lib.num_devices(c))


# --------------------------------------------------------------------------- one device


@pytest.fixture(scope='module')
def references():
    """Single-device (loss, grads, params after 3 steps) per family, computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run_layout(make_config(**(LLAMA if family == 'llama' else {})))
        return cache[family]
    return get


LAYOUTS = {'tensor2': dict(tensor=2), 'tensor2_fsdp2': dict(tensor=2, fsdp=2),
           'tensor2_pipeline2': dict(tensor=2, pipeline=2, accum=2)}


@pytest.mark.slow
@pytest.mark.parametrize('family', ['gpt', 'llama'])
@pytest.mark.parametrize('layout', LAYOUTS)
def test_sequence_parallel_matches_one_device(references, family, layout):
    """Loss and gradients of step 0; with tensor 2 alone also the parameters after 3 optimizer
    steps (the fsdp and pipeline layouts' updates are the layout tests' own: SP changes only the
    activations' placement, which step 0's gradients already cover)."""
    c = _sp(make_config(**LAYOUTS[layout], **(LLAMA if family == 'llama' else {})), 'true')
    assert layout_check.GLOBAL_BATCH * layout_check.SEQ % 8 == 0  # every token split is even
    if layout == 'tensor2':
        check_against_reference(run_layout_once(c), references(family))
        return
    loss, grads, _ = run_layout(c, steps=False)
    ref_loss, ref_grads, _ = references(family)
    np.testing.assert_allclose(loss, ref_loss, rtol=layout_check.LOSS_RTOL)
    assert_trees_close(grads, ref_grads, 'grad')


# --------------------------------------------------------------------------- the compiled program


def _compiled(setting, tensor):
    """The compiled loss-and-gradients program of a GPT on tensor `tensor` (full remat)."""
    c = make_config(tensor=tensor, remat='full', layers=2, global_batch=2)
    c.model.update(seq_len=256, d_model=128)
    _sp(c, setting)
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices()[:tensor])
    layout = ts.make_placement(c, mesh)
    state = ts.init_train_state(c, layout)
    batch = jax.ShapeDtypeStruct((2, 257), np.int32, sharding=NamedSharding(mesh, mesh_lib.batch_spec(layout.rules)))
    with jax.set_mesh(mesh), mesh_lib.use_rules(layout.rules):
        compiled = jax.jit(step_lib.make_loss_and_grads(c, layout)).lower(state['params'], batch, 0).compile()
    collectives = hlo_collectives.collectives(compiled.as_text(), config_lib.mesh_shape(c))
    return compiled.memory_analysis().temp_size_in_bytes, collectives


@pytest.mark.slow
def test_sequence_parallel_gathers_the_stream_and_saves_memory():
    tokens_d_shard = 2 * 256 * 128 * 4 // 4  # one tensor rank's [tokens / 4, d] in fp32
    temp_off, off = _compiled('false', 4)
    temp_on, on = _compiled('true', 4)
    gathers = lambda cs: [c for c in cs if c.kind == 'all-gather' and c.axes == ('tensor',)  # noqa: E731
                          and c.payload_bytes == 4 * tokens_d_shard]
    assert not gathers(off), 'without SP the stream is whole on every tensor rank: nothing to gather'
    # Forward: before attention and the MLP in each of 2 layers, and before the head; the
    # backward gathers again where it needs the stream whole.
    assert sum(c.count for c in gathers(on)) >= 5
    assert temp_on < 0.9 * temp_off, (temp_on, temp_off)
