"""Every parallel layout computes what one device computes, to fp32 rounding.

Layouts: data 8; fsdp 8; tensor 8; data 2 x fsdp 2 x tensor 2; ZeRO-1 with data 4 x tensor 2,
each with and without gradient accumulation. The comparison, its tolerances and why they are
what they are (Adam's eps, the key bias) are in layout_check.py.
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
