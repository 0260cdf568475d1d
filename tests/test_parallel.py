"""Every parallel layout computes what one device computes, to fp32 rounding.

For each layout (data 8; fsdp 8; tensor 8; data 2 x fsdp 2 x tensor 2; ZeRO-1 with data 4 x
tensor 2), with and without gradient accumulation: the loss and gradients of the first step,
and the parameters after 3 optimizer steps, equal a single-device run on the same global
batch. Tolerances (fp32 compute, fp32 params): loss rtol 2e-6; gradients and parameters
atol 2e-6 + rtol 2e-5 elementwise. Adam's update lr * g / (|g| + eps) turns a rounding
difference delta of a small gradient into a parameter difference of up to lr * delta / eps per
step, so the test uses lr 1e-3 and eps 1e-6 (amplification <= 1e3; with eps 1e-8 a 1e-10
rounding difference in a 1e-7 gradient already moves a weight by ~2e-6). They allow
reduction-order differences only: a
wrong shard, a missing all-reduce or a mis-ordered micro-batch is off by orders of magnitude.

One exception, by mathematics rather than tolerance: the key bias. softmax(q.(k + b)) does not
depend on b (it adds the same q.b to every score of a row), so its true gradient is exactly 0
and every layout computes only rounding noise (~1e-9) there, which Adam divides by
sqrt(v) + eps and turns into arbitrary O(lr) updates. The test asserts that this gradient is
~0 in every layout and compares the parameters without that slice.
"""

import jax
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier import train_state as ts
from layout_check import check_against_reference, make_config, run_layout


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


# The fast subset runs the two layouts that mix every axis; the rest run with -m slow.
FAST = [('d2f2t2', 1), ('zero1_d4t2', 2)]
SLOW = [(name, accum) for name in LAYOUTS for accum in (1, 2) if (name, accum) not in FAST]


@pytest.mark.parametrize('name,accum', FAST)
def test_layout_matches_single_device(name, accum, reference):
    check_against_reference(run_layout(make_config(accum=accum, **LAYOUTS[name])), reference)


@pytest.mark.slow
@pytest.mark.parametrize('name,accum', SLOW)
def test_layout_matches_single_device_slow(name, accum, reference):
    check_against_reference(run_layout(make_config(accum=accum, **LAYOUTS[name])), reference)


def test_zero1_shards_optimizer_state_not_params():
    c = make_config(data=4, tensor=2, zero1=True)
    mesh = mesh_lib.make_mesh(config_lib.mesh_shape(c), jax.devices())
    layout = ts.make_layout(c, mesh)
    w_in = layout.param_shardings['blocks']['mlp']['w_in'].spec
    mu = layout.state_shardings['opt_state'][1][0].mu['blocks']['mlp']['w_in'].spec
    assert 'data' not in str(w_in) and 'tensor' in str(w_in)
    assert 'data' in str(mu) and 'tensor' in str(mu)
