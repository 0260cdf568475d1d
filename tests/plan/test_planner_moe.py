"""The planner on mixture-of-experts models (plan/moe.py, configs/moe.py).

Exact: total and active parameters of the published shapes against their model cards; the two FLOP
conventions by hand; the expert axis's traffic in closed form, the expert weights neither gathered nor
reduced over `expert`; the search turning the expert axis and the dispatch. Against XLA (slow): the compiled
collectives over `expert` equal the plan's bytes for gather (expert 4) and all_to_all (expert 2, 4, 8);
the ragged dispatch lowered for cuda and rocm holds ragged_all_to_all with the plan's rows (fast: lowering
only); `--mode=verify` certifies an expert-parallel layout against one device.
"""

import importlib.util
import os
import re

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.families import moe as families_moe
from jaxfrontier.plan import compile_check
from jaxfrontier.plan import moe as plan_moe
from jaxfrontier.plan import planner
from jaxfrontier.plan import search as search_lib
from jaxfrontier.plan import shrink as shrink_lib
from jaxfrontier.plan import verify

import processes

_spec = importlib.util.spec_from_file_location('config_moe', os.path.join(processes.REPO, 'configs', 'moe.py'))
moe_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_configs)

# Model cards: (total, active) parameters, in billions, as published (rounded as published).
PUBLISHED = {'mixtral_8x7b': (46.7, 12.9), 'qwen3_30b_a3b': (30.5, 3.3), 'qwen3_235b_a22b': (235.0, 22.0)}


def tiny(arg='', **fields):
    c = moe_configs.get_config('size=tiny' + (',' + arg if arg else ''))
    c.model.update(**fields)
    config_lib.validate(c, config_lib.num_devices(c))
    return c


@pytest.mark.parametrize('size', sorted(PUBLISHED))
def test_published_total_and_active_parameters(size):
    x = plan_moe.config_summary(moe_configs.get_config(f'size={size}'))
    total, active = PUBLISHED[size]
    assert abs(x.total_params / 1e9 - total) <= 0.006 * total, x.total_params
    assert abs(x.active_params / 1e9 - active) <= 0.03 * active, x.active_params


def test_1t_shape_is_a_trillion_with_35b_active():
    x = plan_moe.config_summary(moe_configs.get_config('size=moe_1t'))
    assert 1.0e12 < x.total_params < 1.05e12 and 33e9 < x.active_params < 36e9, x


def test_flop_conventions_by_hand():
    """Mixtral 8x7B: MaxText's 6 x active matmul parameters + causal attention equals its closed form;
    Megatron-LM's MoE term is its dense formula at the active width k x F; the plan's model FLOPs are the
    dense model's at that width plus the router (full attention, as the XLA kernel computes it)."""
    c = moe_configs.get_config('size=mixtral_8x7b')
    x, shape = plan_moe.config_summary(c), config_lib.model_shape(c)
    L, d, s, v, kv, F = 32, 4096, 4096, 32000, 8 * 128, 14336
    attn = 2 * d * d + 2 * d * kv
    active = L * (attn + 2 * F * 3 * d + d * 8) + d * v  # layers (router included) + head
    assert x.maxtext_flops_per_token == pytest.approx(6 * active + 6 * s * d * L)
    dense = moe_configs.get_config('size=mixtral_8x7b')
    dense.model.update(moe_experts=0, mlp_dim=2 * F)
    assert x.megatron_flops_per_token == pytest.approx(plan_moe.megatron_flops_per_token(config_lib.model_shape(dense)))
    tokens = c.train.global_batch * shape.seq_len
    router = 3 * 2 * L * d * 8
    assert planner.plan(c).flops.model / tokens == pytest.approx(planner.plan(dense).flops.model / tokens + router)


def test_expert_traffic_in_closed_form():
    """expert 2 x data 2, micro-batch 4 of 64 tokens, fp32, 2 MoE layers: each layer gathers x [2n, d] and the
    routing (ids, gates) and reduce-scatters the fp32 output; the backward the other way. The expert weights
    are not gathered over `expert` and their gradients are summed over `data` only."""
    p = planner.plan(tiny('expert=2,data=2'))
    by = {}
    for t in p.transfers:
        by[(t.kind, t.axes)] = by.get((t.kind, t.axes), 0) + t.payload_bytes
    rows, d, k, layers = 2 * 4 * 64, 128, 2, 2
    assert by[('all-gather', ('expert',))] == layers * (rows * d * 4 + rows * k * 8 + rows * d * 4)
    assert by[('reduce-scatter', ('expert',))] == layers * (rows * d * 4 * 2 + rows * k * 4)
    experts_bytes = layers * 3 * (8 // 2) * d * 64 * 4  # this device's 4 experts, fp32
    assert by[('all-reduce', ('data',))] == experts_bytes
    assert not [t for t in p.transfers if t.what.startswith('FSDP') and 'expert' in t.axes]


def test_search_turns_the_expert_axis():
    c = tiny()
    eps = {lay.expert for lay in search_lib.candidate_layouts(c, 8, hw_lib.get('mi250x'))}
    assert eps == {1, 2, 4, 8}
    dense = moe_configs.get_config('size=tiny')
    dense.model.moe_experts = 0
    assert {lay.expert for lay in search_lib.candidate_layouts(dense, 8, hw_lib.get('mi250x'))} == {1}


@pytest.mark.parametrize('size', sorted(moe_configs.FRONTIER))
def test_frontier_layouts_fit(size):
    """configs/moe.py's Frontier layouts (docs/models.md's table) fit a GCD."""
    p = planner.plan(moe_configs.get_config(f'size={size},layout=frontier'), 'mi250x')
    assert p.fits, (size, p.memory.total_bytes / hw_lib.GIB)
    assert 0 < p.time.mfu < 1
    assert 'mixture of experts' in planner.format_plan(p)


@pytest.mark.slow  # one compile on 8 simulated devices each
@pytest.mark.parametrize('arg, dispatch, remat, dropless, chunks', [
    ('expert=4,data=2', 'gather', 'none', False, 1), ('expert=2,tensor=2,data=2', 'all_to_all', 'full', True, 1),
    ('expert=4,data=2', 'all_to_all', 'none', False, 2), ('expert=8', 'all_to_all', 'none', False, 1)])
def test_compiled_expert_collectives_equal_the_plan(arg, dispatch, remat, dropless, chunks):
    """The expert axis's collectives in the compiled HLO carry exactly the plan's bytes, per dispatch: gather's
    all-gathers and reduce-scatters (recomputed under full remat; with a capacity, the drop decisions' gathers
    too), all_to_all's per-peer buffers each way, per chunk (the exact gather fallback's branch not taken); the expert
    weights' gradient all-reduce over `data`; the all-reduces over `tensor` (the experts' partial sums over
    the routed buffer) too, but for the router statistics' few bytes."""
    c = tiny(arg, remat=remat, moe_dropless=dropless, moe_dispatch=dispatch, moe_chunks=chunks)
    compiled = compile_check.compile_on_cpu(c)
    plan, in_hlo, planned = planner.plan(c), {}, {}
    for x in compile_check.collectives(c, compiled):
        in_hlo[(x.kind, x.axes)] = in_hlo.get((x.kind, x.axes), 0) + x.total_bytes
    for t in plan.transfers:
        planned[(t.kind, t.axes)] = planned.get((t.kind, t.axes), 0) + t.payload_bytes
    assert (dispatch == 'all_to_all') == (('all-to-all', ('expert',)) in in_hlo)
    for key in [('all-gather', ('expert',)), ('reduce-scatter', ('expert',)), ('all-to-all', ('expert',)),
                ('all-reduce', ('data',)), ('all-gather', ('data',))]:
        assert in_hlo.get(key, 0) == planned.get(key, 0), (key, in_hlo.get(key), planned.get(key))
    key = ('all-reduce', ('tensor',))
    assert abs(in_hlo.get(key, 0) - planned.get(key, 0)) <= 0.001 * in_hlo.get(key, 1), (in_hlo.get(key), planned.get(key))


@pytest.mark.slow  # two small runs on simulated devices
def test_verify_certifies_an_expert_parallel_layout():
    c = tiny('expert=2,data=2')
    cert = verify.certificate('moe', shrink_lib.shrink(c, max_devices=8))
    assert cert['passed'], verify.summary(cert)
    assert cert['kept']['mesh']['expert'] == 2


def test_sweep_space_takes_the_expert_axis():
    """The throughput sweep (sweep/space.py) sweeps `expert` like any mesh axis: data takes the devices left."""
    from jaxfrontier.sweep import space as space_lib  # pylint: disable=g-import-not-at-top
    space = space_lib.parse_space(['expert=2,4'])
    points = space_lib.grid(space)
    meshes = [space_lib.point_config(tiny('data=8'), p, 8, ['expert'])[0].mesh for p in points]
    assert [(m.expert, m.data) for m in meshes] == [(2, 4), (4, 2)]


@pytest.mark.parametrize('platform, remat, chunks', [('cuda', 'none', 1), ('rocm', 'none', 1), ('cuda', 'full', 1),
                                                     ('rocm', 'full', 2)])
def test_ragged_dispatch_lowers_for_gpus_with_the_planned_buffers(platform, remat, chunks):
    """The train step with `ragged` dispatch lowered for cuda and rocm from this CPU machine holds
    ragged_all_to_all (XLA:CPU has none; the CPU runs the stand-in): per MoE layer body and chunk
    (model.moe_chunks) 2 forward (tokens out, outputs back; again under full remat) and 2 backward, each
    sending a chunk's k n / c assignments (the plan's even rows) into the receive buffer of
    families/moe.send_buffer_rows rows and back."""
    c = tiny('expert=4,data=2', remat=remat, moe_dispatch='ragged', moe_chunks=chunks)
    text = compile_check.lower_abstract(c, platform).as_text()
    ops = re.findall(r'custom_call @ragged_all_to_all\(.*? : \((tensor<[^>]*>), (tensor<[^>]*>),', text)
    shape = config_lib.model_shape(c)
    moe = shape.moe
    n = c.model.seq_len * c.train.micro_batch // chunks
    even = f'tensor<{moe.top_k * n}x{shape.d_model}xf32>'
    buffer = f'tensor<{families_moe.send_buffer_rows(moe, "ragged", 4, n)}x{shape.d_model}xf32>'
    assert sorted(ops) == sorted([(even, buffer), (buffer, even)] * chunks * (3 if remat == 'full' else 2)), ops
    rows = plan_moe.imbalance(shape, layout_lib.Layout.from_config(c)) * moe.top_k * n
    sent = {t.what: t.payload_bytes / t.count for t in planner.plan(c).transfers if t.kind == 'ragged-all-to-all'}
    assert sent and all(v == rows * shape.d_model * 4 for v in sent.values()), sent
