"""The planner: exact counts, and estimates that agree with XLA's compiled programs.

Exact (equality): the parameter table against `eval_shape` of the model; FLOPs against the
closed forms, Megatron's formula in `metrics` and the matmuls of the traced train step
(`flop_count`); the activation residuals against JAX's `saved_residuals`; pipeline slots and
ticks against `schedules.build`.

Agreement with XLA:CPU (8 simulated devices, fp32 compute: XLA:CPU upcasts 16-bit work, so
bf16 programs are not what a GPU runs). Stated in docs/planner.md and held here:
  memory per device (arguments + outputs + temporaries - aliased): within 10 % without a
  pipeline and within 20 % with one (MEMORY_TOL);
  communication: payload bytes per device per step for each (collective family, mesh axes),
  collectives of >= 4 KiB, within 10 % (COMM_TOL) where XLA moves more than 1 % of the
  step's bytes; families are reductions (all-reduce, reduce-scatter: XLA:CPU emits
  all-reduce + slice where GPUs get reduce-scatter), gathers and permutes. Known exception,
  left out here and quantified in docs/planner.md: with full remat *and* tensor x fsdp, XLA
  re-gathers some weights for the recomputation (+25 % FSDP gather bytes).
The slow part compiles more layouts and the 175B layout itself (fp32, 128 CPU devices).
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals
from jax.sharding import AxisType

from jaxfrontier.plan import compile_check
from jaxfrontier import config as config_lib
from jaxfrontier.plan import flop_count
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.plan import hlo_collectives
from jaxfrontier import flops as flops_lib
from jaxfrontier import pipeline
from jaxfrontier.model.attention import blockwise
from jaxfrontier.plan import estimate
from jaxfrontier.plan import search as plan_search
from jaxfrontier.plan import planner
from jaxfrontier.pipeline import schedules
from jaxfrontier.training import step as step_lib
from jaxfrontier.training import state as ts
from jaxfrontier.model import params as params_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, 'configs'))

MEMORY_TOL = {False: 0.10, True: 0.20}  # keyed by "has a pipeline"
COMM_TOL, COMM_MIN_BYTES, COMM_MIN_SHARE = 0.10, 4096, 0.01


def make_config(pipeline=1, data=1, fsdp=1, tensor=1, accum=1, zero1=False, remat='none', layers=2, d=64,
                heads=4, seq=64, batch=16, vocab=256, tied=True, schedule='1f1b', virtual=1, dtype='float32',
                attention='xla', **model):
    """A small validated config of this layout; `model` sets further model.* fields (test_planner_llama)."""
    c = config_lib.base_config()
    c.model.update(num_layers=layers, d_model=d, num_heads=heads, seq_len=seq, vocab_size=vocab, vocab_multiple=32,
                   dtype=dtype, remat=remat, attention=attention, tied_embeddings=tied, **model)
    c.mesh.update(pipeline=pipeline, data=data, fsdp=fsdp, tensor=tensor)
    c.pipeline.update(schedule=schedule, virtual_stages=virtual)
    c.train.update(global_batch=batch, micro_batch=batch // (data * fsdp * accum), accum_steps=accum)
    c.sharding.zero1 = zero1
    config_lib.validate(c, config_lib.num_devices(c))
    return c


def paper_config(name):
    import importlib  # pylint: disable=import-outside-toplevel
    return importlib.import_module(name).get_config()


# --------------------------------------------------------------------------- exact counts


@pytest.mark.parametrize('tied,virtual', [(True, 1), (False, 1), (True, 2)])
def test_param_table_matches_eval_shape(tied, virtual):
    c = make_config(layers=4, d=48, heads=3, seq=20, vocab=97, tied=tied, pipeline=2 if virtual > 1 else 1,
                    schedule='interleaved' if virtual > 1 else '1f1b', virtual=virtual, accum=2, batch=4)
    mesh = jax.sharding.AbstractMesh((2, 1, 1, 1, 1), config_lib.axes.in_mesh({}), axis_types=(AxisType.Auto,) * 5)
    layout = ts.make_placement(c, mesh)
    abstract = jax.tree_util.tree_flatten_with_path(layout.abstract_state['params'])[0]
    logical = params_lib.split_virtual_specs(layout.model_def.logical_specs(), virtual)
    names = {jax.tree_util.keystr(p): tuple(s) for p, s in jax.tree_util.tree_flatten_with_path(
        logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]}
    specs = {p.path: p for p in estimate.param_specs(config_lib.model_shape(c), virtual)}
    assert len(specs) == len(abstract)
    for path, leaf in abstract:
        key = '/'.join(k.key for k in path)
        assert specs[key].shape == leaf.shape, key
        assert specs[key].names == names[jax.tree_util.keystr(path)], key
    assert estimate.count_params(tuple(specs.values())) == sum(leaf.size for _, leaf in abstract)


def test_paper_model_sizes():
    # FRONTIER.md: 22B ~ 22.1 B, 175B ~ 174.6 B, 1T ~ 1.008 T parameters.
    for name, expected in (('22b', 22.07e9), ('175b', 174.6e9), ('1t', 1.008e12)):
        n = planner.plan(paper_config(name)).num_params
        assert abs(n - expected) / expected < 2e-3, (name, n)


def test_flops_match_closed_forms_and_megatron():
    shape = config_lib.model_shape(paper_config('175b'))
    layout = layout_lib.Layout(pipeline=1, data=8, tensor=1, micro_batch=1, accum_steps=4, remat='full')
    fl = estimate.flops(shape, layout)
    b, s, l, h, v = layout.global_batch, shape.seq_len, shape.num_layers, shape.d_model, shape.vocab_size
    # Integers are exact; the planner's floats round at 1e-16.
    assert fl.model == pytest.approx(72 * b * s * l * h * h + 12 * b * s * s * l * h + 6 * b * s * h * v, rel=1e-15)
    # Megatron's f = 3 counts the logits at 4.5 B s h V instead of 6 (FRONTIER.md's formula).
    kw = dict(global_batch=b, seq_len=s, num_layers=l, d_model=h, vocab_size=v)
    assert fl.model == pytest.approx(flops_lib.model_flops_per_step(**kw) + 1.5 * b * s * h * v, rel=1e-15)
    assert fl.megatron_hw == flops_lib.megatron_flops_per_step(**kw, recompute=True)
    recompute = estimate.forward_flops(shape)[0] - 2 * s * h * shape.mlp_dim  # all but the MLP output matmul
    assert fl.hardware - fl.model == pytest.approx(b * l * recompute, rel=1e-15)


@pytest.mark.parametrize('remat,pipe', [('none', 1), ('full', 1), ('save_dots_no_batch', 1), ('none', 2), ('full', 2),
                                        ('save_dots', 2), ('save_dots_attention', 1)])
def test_hardware_flops_match_traced_train_step(remat, pipe):
    c = make_config(remat=remat, pipeline=pipe, accum=2 if pipe > 1 else 1, layers=4, d=32, seq=16, batch=4)
    mesh = jax.sharding.AbstractMesh((pipe, 1, 1, 1, 1), config_lib.axes.in_mesh({}), axis_types=(AxisType.Auto,) * 5)
    layout = ts.make_placement(c, mesh)
    weights = None
    if pipe > 1:
        weights = pipeline.build_schedule(layout_lib.Layout.from_config(c)).flop_weights
    loss_and_grads = step_lib.make_loss_and_grads(c, layout)
    tokens = jax.ShapeDtypeStruct((c.train.global_batch, c.model.seq_len + 1), jnp.int32)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = flop_count.executed_dot_flops(lambda p, t: loss_and_grads(p, t, 0), layout.abstract_state['params'],
                                               tokens, branch_weights=weights)
    planned = estimate.flops(config_lib.model_shape(c), layout_lib.Layout.from_config(c)).hardware
    assert traced == pytest.approx(planned, rel=1e-12)  # branch weights are fractions


@pytest.mark.parametrize('seq,bq,bkv', [(64, 64, 64), (256, 64, 64), (250, 64, 32), (100, 32, 48), (2048, 64, 64)])
def test_blockwise_visits_the_causal_blocks(seq, bq, bkv):
    """The planner's count of computed block pairs is the pairs holding any unmasked score."""
    t_pad_q, t_pad_kv = -(-seq // bq) * bq, -(-seq // bkv) * bkv
    brute = sum(1 for i in range(0, t_pad_q, bq) for j in range(0, t_pad_kv, bkv) if i + bq - 1 >= j)
    assert blockwise.visited_block_pairs(seq, bq, bkv) == brute


def test_blockwise_flops_are_the_causal_half():
    shape = config_lib.model_shape(paper_config('175b'))
    layout = layout_lib.Layout(pipeline=1, data=8, tensor=1, micro_batch=1, accum_steps=4, remat='none')
    full, block = estimate.flops(shape, layout, 'xla'), estimate.flops(shape, layout, 'blockwise')
    assert block.model == full.model  # MFU's convention counts every score
    share = estimate.blockwise_attention_share(shape)
    assert share == pytest.approx(0.5 + 0.5 * 64 / 2048)  # 32 blocks: 528 of 1024 pairs
    attention = 2 * 2 * shape.seq_len**2 * shape.d_model * layout.global_batch * shape.num_layers
    assert full.hardware - block.hardware == pytest.approx((3 - 3.5 * share) * attention, rel=1e-12)


def test_blockwise_working_set_is_linear_in_the_sequence():
    layout = layout_lib.Layout(pipeline=1, data=1, tensor=1, micro_batch=1, accum_steps=1, remat='none')
    sizes = {}
    for attention in ('xla', 'blockwise'):
        for seq in (2048, 8192):
            shape = config_lib.model_shape(make_config(seq=seq, attention=attention))
            sizes[attention, seq] = estimate.backward_working_bytes(shape, layout, attention)
    assert sizes['xla', 8192] / sizes['xla', 2048] > 12  # s^2 buffers
    assert 3.5 < sizes['blockwise', 8192] / sizes['blockwise', 2048] <= 4  # per token, plus one block pair


def test_residuals_match_saved_residuals():
    """The symbolic residuals, evaluated at another size, are exactly what JAX saves."""
    for remat, dtype, attention in (('none', 'float32', 'xla'), ('full', 'bfloat16', 'xla'),
                                    ('save_dots', 'bfloat16', 'xla'), ('save_dots_attention', 'float32', 'xla'),
                                    ('save_dots_attention', 'float32', 'blockwise')):
        c = make_config(layers=3, d=48, heads=3, seq=20, vocab=96, remat=remat, dtype=dtype, batch=3,
                        attention=attention)
        c.model.attention_block_q = c.model.attention_block_kv = 10  # blockwise's statistics are padded to whole blocks
        shape = config_lib.model_shape(c)
        model_def = params_lib.ModelDef.create(shape)
        tokens = jax.ShapeDtypeStruct((3, 20), jnp.int32)
        saved = saved_residuals(lambda p, t: model_def.bind(p).loss(t, t), model_def.abstract_params(), tokens)
        expected = sum(a.size * a.dtype.itemsize for a, why in saved if not why.startswith('from the argument'))
        layout = layout_lib.Layout.from_config(c)
        per_layer, head = estimate.layer_bytes(shape, layout, remat, attention)
        assert per_layer * 3 + head == expected, (remat, dtype, attention)


def test_pipeline_slots_match_schedules():
    for name in ('gpipe', '1f1b', '1f1b_lockstep', 'interleaved'):
        for p in (2, 3, 4, 8):
            for v in ((2, 3) if name == 'interleaved' else (1,)):
                for m in ((p, 2 * p, 5 * p) if name == 'interleaved' else (p, p + 1, 2 * p + 1, 5 * p)):
                    built = schedules.build(name, p, m, v)
                    slots = estimate.pipeline_slots(name, p, m, v)
                    assert (slots.act_slots, slots.grad_slots, slots.ticks) == (
                        built.act_slots, built.grad_slots, built.num_ticks), (name, p, m, v)
                    assert slots.bubble == pytest.approx(built.bubble)


def test_device_kinds_match_one_table_entry():
    """MFU (hardware.device_peak_flops) and the planner read the same entry for a device kind."""
    for name, kind in (('mi250x', 'AMD Instinct MI250X'), ('mi300x', 'AMD Instinct MI300X'),
                       ('a100', 'NVIDIA A100-SXM4-80GB'), ('h100', 'NVIDIA H100 80GB HBM3'), ('h200', 'NVIDIA H200')):
        assert hw_lib.match_kind(kind) is hw_lib.get(name), kind
    for kind in ('NVIDIA H100 PCIe', 'NVIDIA H100 NVL', 'NVIDIA GeForce RTX 4090', 'cpu'):
        assert hw_lib.match_kind(kind) is None, kind


def test_link_levels_of_the_1t_mesh():
    hw = hw_lib.get('mi250x')
    mesh = {'pipeline': 64, 'data': 6, 'fsdp': 1, 'tensor': 8}
    assert hw_lib.axis_level(mesh, ('tensor',), hw) == 'node'
    assert hw_lib.axis_level(mesh, ('data',), hw) == 'network'
    assert hw_lib.axis_level(mesh, ('pipeline',), hw) == 'network'
    assert hw_lib.axis_level({'pipeline': 4, 'data': 4, 'fsdp': 1, 'tensor': 2}, ('tensor',), hw) == 'package'
    assert hw_lib.axis_level({'pipeline': 1, 'data': 3, 'fsdp': 1, 'tensor': 3}, ('tensor',), hw) == 'network'


def test_hlo_parser_reads_every_replica_group_form():
    mesh = {'pipeline': 1, 'data': 2, 'fsdp': 2, 'tensor': 2}
    text = '''HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %ar = f32[8]{0} all-reduce(f32[8]{0} %x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %ag = f32[16]{0} all-gather(f32[8]{0} %x), replica_groups=mesh['a'=2,'b'=4], device_ids=([2,2,2]T(1,0,2)) {'a'}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2]{0} reduce-scatter(f32[8]{0} %x), replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  ROOT %cp = f32[8]{0} collective-permute(f32[8]{0} %x), source_target_pairs={{0,4},{4,0}}
}
'''
    found = {c.name: c for c in hlo_collectives.collectives(text, mesh)}
    assert (found['ar'].axes, found['ar'].count, found['ar'].payload_bytes) == (('tensor',), 3, 32)
    assert (found['ag'].axes, found['ag'].count, found['ag'].payload_bytes) == (('fsdp',), 3, 64)
    assert (found['rs'].axes, found['rs'].payload_bytes) == (('data', 'fsdp'), 32)  # output x group
    assert found['cp'].axes == ('data',)


# --------------------------------------------------------------------------- agreement with XLA


def _family(kind):
    return {'all-gather': 'gather', 'collective-permute': 'permute'}.get(kind, 'reduce')


def check_against_xla(c):
    """Compiles `c` on the CPU devices and holds memory and communication to the stated tolerances."""
    compiled = compile_check.compile_on_cpu(c)
    plan = planner.plan(c)
    measured = step_lib.memory_bytes(compiled)["total"]
    rel = compile_check.within(plan.memory.total_bytes, measured)
    assert abs(rel) <= MEMORY_TOL[c.mesh.pipeline > 1], f'memory: plan {plan.memory.total_bytes} vs XLA {measured}'
    estimated, in_hlo = {}, {}
    for t in plan.transfers:
        key = (_family(t.kind), t.axes)
        estimated[key] = estimated.get(key, 0.0) + t.payload_bytes
    mesh = config_lib.mesh_shape(c)
    items = [x for x in compile_check.collectives(c, compiled) if x.payload_bytes >= COMM_MIN_BYTES]
    for x in items:
        key = (_family(x.kind), x.axes)
        in_hlo[key] = in_hlo.get(key, 0.0) + x.total_bytes
    total = sum(in_hlo.values())
    for key, value in in_hlo.items():
        if value >= COMM_MIN_SHARE * total:
            assert abs(estimated.get(key, 0.0) - value) <= COMM_TOL * value, (key, estimated.get(key), value, mesh)
    return rel


FAST_LAYOUTS = [
    dict(data=2, fsdp=2, tensor=2, accum=2, d=128),
]
SLOW_LAYOUTS = [
    dict(pipeline=2, data=2, tensor=2, accum=4, layers=4),
    dict(),
    dict(seq=128, d=128, batch=8),
    dict(fsdp=4, layers=4, d=128, seq=128, remat='full'),
    dict(data=4, zero1=True, layers=4, d=128, seq=128, remat='save_dots'),
    dict(layers=2, d=192, seq=32, batch=32, tensor=4, data=2, accum=2),
    dict(layers=4, d=128, heads=8, fsdp=8, remat='save_dots_no_batch'),
    dict(pipeline=2, tensor=4, accum=4, layers=4, d=128, seq=128, batch=8),
    dict(pipeline=4, tensor=2, accum=4, layers=8, d=128, batch=8, schedule='interleaved', virtual=2),
    dict(seq=512, batch=4, attention='blockwise'),  # the s x s buffers of xla would dominate here
    dict(seq=512, batch=4, layers=4, remat='full', attention='blockwise'),
]


@pytest.mark.parametrize('layout', FAST_LAYOUTS, ids=str)
def test_estimates_agree_with_xla(layout):
    check_against_xla(make_config(**layout))


@pytest.mark.slow
@pytest.mark.parametrize('layout', SLOW_LAYOUTS, ids=str)
def test_estimates_agree_with_xla_slow(layout):
    check_against_xla(make_config(**layout))


# --------------------------------------------------------------------------- the paper's models


@pytest.mark.parametrize('name', ['175b', '1t'])
def test_paper_layouts_lower_on_full_size_abstract_mesh(name):
    c = paper_config(name)
    lowered = compile_check.lower_abstract(c)
    assert 'sdy.mesh' in lowered.as_text()[:20000] or 'mhlo.sharding' in lowered.as_text()[:200000]


def test_175b_plan_fits():
    p = planner.plan(paper_config('175b'))
    assert p.fits and p.memory.total_bytes < 64 * hw_lib.GIB
    assert p.time.bubble_fraction == pytest.approx(15 / (640 + 15))


def test_1t_plan_fits():
    """TP 8 x PP 64 x DP 6: fits only with ZeRO-1's padded optimizer state (no weight dimension
    divides by 6) and with gradients reduced once per step."""
    p = planner.plan(paper_config('1t'))
    assert p.fits, p.memory.total_bytes / hw_lib.GIB
    assert p.memory.optimizer_bytes < 3.0 * hw_lib.GIB  # Adam sharded 6 ways: 16.3 GiB replicated
    assert not [n for n in p.notes if 'once per micro-batch' in n]


@pytest.mark.parametrize('hardware', ['mi250x', 'mi300x', 'a100', 'h100', 'h200'])
def test_plans_on_every_hardware(hardware):
    p = planner.plan(paper_config('175b'), hardware)
    assert p.hardware.name == hardware and p.time.step_s > 0 and 0 < p.time.mfu < 1
    assert p.flops.hardware > p.flops.model  # a pipeline recomputes


def test_plan_cli_runs_in_seconds():
    out = subprocess.run([sys.executable, '-m', 'jaxfrontier.main', '--config=configs/1t.py', '--mode=plan',
                          '--plan_check=none'], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert '1,008,038,758,400 parameters' in out.stdout and 'communication per device per step' in out.stdout


def compiled_memory_error(name):
    """Relative error of the plan's memory for a paper model's fp32 CPU copy vs XLA's analysis."""
    c = paper_config(name)
    c.model.dtype = 'float32'
    copy = compile_check.cpu_copy(c)
    result = compile_check.run_in_subprocess(copy)
    return compile_check.within(planner.plan(copy).memory.total_bytes, result.memory['total'])


@pytest.mark.slow
def test_175b_compiled_memory_agrees():
    """The 175B layout itself (TP 4 x PP 16 x DP 2, 128 CPU devices), fp32 compute."""
    rel = compiled_memory_error('175b')
    assert abs(rel) <= MEMORY_TOL[True], rel


@pytest.mark.slow
def test_1t_compiled_memory_agrees():
    """The 1T layout with data 6 -> 3 (1,536 CPU devices), fp32 compute."""
    rel = compiled_memory_error('1t')
    assert abs(rel) <= MEMORY_TOL[True], rel


@pytest.mark.slow
@pytest.mark.parametrize('name,devices', [('175b', 1024), ('1t', 3072)])
def test_search_finds_layouts_that_fit(name, devices):
    c = paper_config(name)
    plans, planned, fitting = plan_search.search(c, 'mi250x', devices, top=5)
    assert plans and fitting <= planned
    speeds = [p.time.tokens_per_s for p in plans]
    assert speeds == sorted(speeds, reverse=True)
    for p in plans:
        assert p.fits and p.layout.num_devices == devices
        config_lib.validate(p.layout.apply(c), devices)
    assert np.isfinite(speeds[0])
