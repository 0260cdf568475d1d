"""The planner with context parallelism and sequence parallelism (issue 24, item 4).

Exact: ring attention's traffic per step against the count written out by hand (per layer the
positions gathered, c - 1 hops of a k/v chunk [B, T/c, H/TP, K] forward, again when recomputed,
c - 1 of k/v and c of fp32 dk/dv backward) and the link level the context axis lands on; SP's reduce-scatter + all-gather in
place of the all-reduce, same payload; activations per device falling with context and the
stream's share with SP; the search enumerating both.
The ring's bytes equal model/ring.ring_send_bytes, which tests/model/test_ring.py holds against
the compiled ring's collective-permutes. Against XLA (slow): the memory of a context layout
within the planner's tolerance (test_planner.MEMORY_TOL), with the context attention attend
calls today (all-gathered k/v; ring attention is not wired in at attend's call site yet).
"""

import dataclasses

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.plan import comm, compile_check, estimate, planner
from jaxfrontier.plan import search as plan_search
from jaxfrontier.training import step as step_lib

from test_planner import MEMORY_TOL, make_config

LLAMA = dict(family='llama', num_kv_heads=2, mlp_dim=96)


def _llama_shape(seq=64, layers=3):
    c = make_config(layers=layers, d=64, heads=4, seq=seq, **LLAMA)
    return config_lib.model_shape(c)


def _traffic(shape, layout, hw='mi250x'):
    hardware = hw_lib.get(hw)
    specs = estimate.param_specs(shape)
    rules = config_lib.resolve_rules(config_lib.DEFAULT_RULES, shape, layout.mesh_shape)
    return {(t.what, t.kind): t for t in comm.traffic(shape, layout, rules, specs, hardware)}


@pytest.mark.parametrize('remat,forward_passes', [('full', 2), ('none', 1)])
def test_ring_traffic_is_c_minus_1_chunks_per_layer(remat, forward_passes):
    shape = _llama_shape(seq=64, layers=3)  # 4 query heads of 16 (2 k/v heads, repeated at the call site)
    layout = layout_lib.Layout(context=4, tensor=2, micro_batch=2, accum_steps=3, remat=remat)
    items = _traffic(shape, layout)
    # One chunk of k or v: 2 rows x 64/4 tokens x (4 heads / tensor 2) x 16 head dim, fp32 here.
    chunk_bytes = 2 * 16 * 2 * 16 * 4
    calls = 3 * 3  # micro-batches x layers
    forward = items[('ring attention: k/v chunks', 'collective-permute')]
    assert forward.axes == ('context',) and forward.group == 4
    assert forward.count == calls * forward_passes * 3  # c - 1 hops per call
    assert forward.payload_bytes == forward.count * 2 * chunk_bytes  # k and v
    backward = items[('ring attention backward: k/v chunks', 'collective-permute')]
    assert (backward.count, backward.payload_bytes) == (calls * 3, calls * 3 * 2 * chunk_bytes)
    home = items[('ring attention backward: dk/dv home', 'collective-permute')]
    assert (home.count, home.payload_bytes) == (calls * 4, calls * 4 * 2 * chunk_bytes)  # fp32, c hops
    ids = items[('ring attention: positions', 'all-gather')]
    assert ids.payload_bytes == calls * forward_passes * 2 * 64 * 4
    assert not any(what.startswith('ring') for what, _ in _traffic(shape, dataclasses.replace(layout, context=1)))


@pytest.mark.parametrize('context,tensor,dtype', [(2, 1, 'float32'), (4, 2, 'bfloat16')])
def test_ring_traffic_is_what_ring_attention_sends(context, tensor, dtype):
    """The planner's count per call equals model/ring.ring_send_bytes, which tests/model/test_ring.py
    holds against the collective-permutes of the compiled ring (the HLO check, one step removed)."""
    ring = pytest.importorskip('jaxfrontier.model.attention.ring')
    shape = dataclasses.replace(_llama_shape(seq=64, layers=1), dtype=dtype)
    layout = layout_lib.Layout(context=context, tensor=tensor, micro_batch=2, remat='none')
    planned = sum(t.payload_bytes for (what, _), t in _traffic(shape, layout).items() if what.startswith('ring'))
    sent = ring.ring_send_bytes(batch=2, seq_len=64, heads=4 // tensor, head_dim=16,
                                itemsize=4 if dtype == 'float32' else 2, context=context, segments=False)
    assert planned == sent['forward'] + sent['backward']


def test_context_lands_between_tensor_and_fsdp_links():
    shape = _llama_shape()
    ring = ('ring attention: k/v chunks', 'collective-permute')
    # Frontier: 2 GCDs per package, 8 per node. tensor 2 fills a package, so context 4 spans a node.
    assert _traffic(shape, layout_lib.Layout(context=4, tensor=2, fsdp=4))[ring].level == 'node'
    assert _traffic(shape, layout_lib.Layout(context=2))[ring].level == 'package'
    assert _traffic(shape, layout_lib.Layout(context=8, tensor=2))[ring].level == 'network'


def test_sequence_parallel_swaps_each_all_reduce_for_reduce_scatter_and_all_gather():
    shape = _llama_shape()
    layout = layout_lib.Layout(tensor=2, micro_batch=2, accum_steps=2)
    off = _traffic(shape, layout)
    on = _traffic(shape, dataclasses.replace(layout, sequence_parallel=True))
    all_reduce = off[('activations (Megatron f/g)', 'all-reduce')]
    for kind in ('reduce-scatter', 'all-gather'):
        x = on[('activations (Megatron SP g/g-bar)', kind)]
        assert (x.payload_bytes, x.count) == (all_reduce.payload_bytes, all_reduce.count)
    assert ('activations (Megatron f/g)', 'all-reduce') not in on
    hw = hw_lib.get('mi250x')
    wire = lambda t: comm.wire_time_s(t.kind, t.payload_bytes, 0, t.group, t.level, hw)  # noqa: E731
    sp = sum(wire(on[('activations (Megatron SP g/g-bar)', k)]) for k in ('reduce-scatter', 'all-gather'))
    assert sp == pytest.approx(wire(all_reduce))  # the same bytes on the wire


def test_activations_per_device_fall_with_context_and_sp():
    shape = dataclasses.replace(_llama_shape(seq=256), attention='blockwise')
    base = layout_lib.Layout(tensor=2, micro_batch=2, remat='none')
    per_layer = lambda lay: estimate.layer_bytes(shape, lay, 'none', 'blockwise')[0]  # noqa: E731
    assert per_layer(dataclasses.replace(base, context=4)) == pytest.approx(per_layer(base) / 4, rel=0.02)
    with_sp = per_layer(dataclasses.replace(base, sequence_parallel=True))
    assert per_layer(base) / 2 < with_sp < per_layer(base)  # the stream's share halves, the rest stays


def test_search_enumerates_context_and_sequence_parallel():
    c = make_config(layers=4, d=64, heads=4, seq=64, batch=8)
    layouts = plan_search.candidate_layouts(c, 8, hw_lib.get('mi250x'))
    assert {lay.context for lay in layouts} == {1, 2, 4, 8}  # 64 tokens: 2 x 8 balanced chunks divide it
    assert any(lay.sequence_parallel for lay in layouts) and not any(
        lay.sequence_parallel for lay in layouts if lay.tensor == 1)
    for lay in layouts[::97]:
        config_lib.validate(lay.apply(c), 8)


@pytest.mark.slow
@pytest.mark.parametrize('layout', [dict(context=2, seq=128, d=128, batch=4),
                                    dict(context=2, tensor=2, seq=128, d=128, batch=4, sp=True)], ids=str)
def test_context_memory_agrees_with_xla(layout):
    layout = dict(layout)
    context, sp = layout.pop('context'), layout.pop('sp', False)
    c = make_config(**layout)
    c.mesh.context = context
    c.sharding.sequence_parallel = 'true' if sp else 'false'
    config_lib.validate(c, config_lib.num_devices(c))
    measured = step_lib.memory_bytes(compile_check.compile_on_cpu(c))['total']
    plan = planner.plan(c)
    rel = compile_check.within(plan.memory.total_bytes, measured)
    assert abs(rel) <= MEMORY_TOL[False], f'memory: plan {plan.memory.total_bytes} vs XLA {measured} ({rel:+.1%})'
