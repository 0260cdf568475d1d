"""Every parallel layout computes what one device computes, to fp32 rounding.

Layouts: data 8; fsdp 8; tensor 8; data 2 x fsdp 2 x tensor 2; ZeRO-1 with data 4 x tensor 2,
each with and without gradient accumulation. The comparison, its tolerances and why they are
what they are (Adam's eps, the key bias) are in layout_check.py; each layout compiles only its
train step (layout_once.py), the one-device reference both programs.
"""

import jax
import pytest

from jaxfrontier.plan import compile_check
from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.training import state as ts
from layout_check import check_against_reference, make_config, run_layout
from layout_once import run_layout_once


@pytest.fixture(scope='module')
def reference():
    return run_layout(make_config())


LAYOUTS = {
    'data8': dict(data=8),
    'fsdp8': dict(fsdp=8),
    'tensor8': dict(tensor=8),
    'd2f2t2': dict(data=2, fsdp=2, tensor=2),
    'zero1_d4t2': dict(data=4, tensor=2, zero1=True),
}


# The fast subset runs the layout that mixes data, fsdp and tensor; the rest (ZeRO-1 among them) run
# with -m slow.
FAST = [('d2f2t2', 1)]
SLOW = [(name, accum) for name in LAYOUTS for accum in (1, 2) if (name, accum) not in FAST]


@pytest.mark.parametrize('name,accum', FAST)
def test_layout_matches_single_device(name, accum, reference):
    check_against_reference(run_layout_once(make_config(accum=accum, **LAYOUTS[name])), reference)


@pytest.mark.slow
@pytest.mark.parametrize('name,accum', SLOW)
def test_layout_matches_single_device_slow(name, accum, reference):
    check_against_reference(run_layout_once(make_config(accum=accum, **LAYOUTS[name])), reference)


@pytest.mark.slow
def test_gpu_default_unrolled_remat_full_matches_single_device(reference):
    """The GPUs' default stack (every layer unrolled) with remat=full, whose layers are custom VJPs
    (stack.recompute_after_cotangent), on data 2 x fsdp 2 x tensor 2 with accumulation: the data-local
    map, FSDP's gathers and the tensor split inside the recomputation."""
    c = make_config(accum=2, remat='full', **LAYOUTS['d2f2t2'])
    c.model.scan_unroll = c.model.num_layers
    check_against_reference(run_layout_once(c), reference)


def test_zero1_shards_optimizer_state_not_params():
    c = make_config(data=4, tensor=2, zero1=True)
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices())
    layout = ts.make_placement(c, mesh)
    w_in = layout.param_shardings['blocks']['mlp']['w_in'].spec
    mu = layout.state_shardings['opt_state'][1][0].mu['blocks']['mlp']['w_in'].spec
    assert 'data' not in str(w_in) and 'tensor' in str(w_in)
    assert 'data' in str(mu) and 'tensor' in str(mu)


@pytest.mark.slow
def test_padded_zero1_matches_single_device():
    """ZeRO-1 over data 3: no dimension of d_model 64, 8 heads or vocabulary 256 divides by 3,
    so the optimizer state is padded (layout_lib.zero1_layout); the run is still exact."""
    reference = run_layout(make_config(global_batch=24))
    check_against_reference(run_layout_once(make_config(data=3, tensor=2, zero1=True, accum=2, global_batch=24)),
                            reference)


def _data_reduction_bytes(accum, pipeline=1):
    mesh = dict(data=4, tensor=2, zero1=True) if pipeline == 1 else dict(pipeline=pipeline, data=2, tensor=2)
    c = make_config(accum=accum, global_batch=32, **mesh)
    compiled = compile_check.compile_on_cpu(c)
    return sum(x.total_bytes for x in compile_check.collectives(c, compiled)
               if 'data' in x.axes and x.kind in ('all-reduce', 'reduce-scatter'))


@pytest.mark.slow  # two compiles; a property of the program's bytes, not of its numbers
def test_gradients_cross_data_once_per_step():
    """Accumulation sums each replica's gradients locally: the bytes reduced over `data` per step
    do not grow with the number of micro-batches (jaxfrontier/training/reduction.py)."""
    two, eight = _data_reduction_bytes(2), _data_reduction_bytes(8)
    assert two > 0 and abs(eight / two - 1) < 0.02, (two, eight)


@pytest.mark.slow
def test_pipelined_gradients_cross_data_once_per_step():
    """The same through the pipeline's tick loop: one map manual over `pipeline` and `data`
    (pipeline.make_pipeline_grads), which jax 0.11 compiles, as it does not two nested ones."""
    two, eight = _data_reduction_bytes(2, pipeline=2), _data_reduction_bytes(8, pipeline=2)
    assert two > 0 and abs(eight / two - 1) < 0.02, (two, eight)
