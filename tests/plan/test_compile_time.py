"""The planner's compile time of a layout (plan/compile_time.py): copies of the layer, without a clock.

The seconds come from a fitted line (benchmarks/compile_layers.py); what is held here is
the count it is applied to: `model.stack.layer_bodies` (the count tests/model/test_model.py
holds to the compiled program), the resolution of scan_unroll=0 per platform, pipelines, and
the line `--mode=plan` prints.
"""

import dataclasses
import json

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import hardware as hw_lib
from jaxfrontier.model import stack
from jaxfrontier.plan import compile_time
from jaxfrontier.plan import report

FIT = compile_time.CompileFit(base_s=11.0, per_body_s=3.0, source='test')
GPU = hw_lib.get('mi250x')
CPU = dataclasses.replace(GPU, name='cpu', shared_host_devices=8)  # what hardware.local() gives on a CPU


@pytest.mark.parametrize('layers,unroll,bodies', [
    (8, 1, 1), (8, 0, 1),  # rolled (0: the pipeline chunks' "always scan")
    (8, 4, 4), (96, 8, 8),  # groups that divide the layers
    (8, 3, 5), (7, 2, 3),  # k in the loop + the remainder unrolled after it (jax's _scan_impl)
    (8, 8, 8), (5, 9, 5),  # every layer: a plain loop
])
def test_layer_bodies(layers, unroll, bodies):
    assert stack.layer_bodies(layers, unroll) == bodies


def test_auto_unroll_is_every_layer_on_gpus_and_rolled_on_the_cpu():
    gpu = compile_time.estimate(96, 0, 1, GPU, FIT)
    assert (gpu.platform, gpu.scan_unroll, gpu.bodies) == ('gpu', 96, 96)
    assert gpu.seconds == 11.0 + 3.0 * 96 and gpu.vs_rolled == pytest.approx((11.0 + 288.0) / 14.0)
    cpu = compile_time.estimate(96, 0, 1, CPU, FIT)
    assert (cpu.platform, cpu.scan_unroll, cpu.bodies, cpu.vs_rolled) == ('cpu', 1, 1, 1.0)


def test_quadratic_term_and_the_grouped_hint_for_deep_unrolled_stacks():
    fit = dataclasses.replace(FIT, per_body2_s=0.5)
    deep = compile_time.estimate(64, 0, 1, GPU, fit)  # 64 copies: the hint names groups of 8
    assert deep.seconds == 11.0 + 3.0 * 64 + 0.5 * 64 ** 2
    assert deep.grouped_s == 11.0 + 3.0 * 8 + 0.5 * 8 ** 2
    assert f'model.scan_unroll=8 (a scan over groups of 8) would take about {deep.grouped_s:.0f} s' in deep.line()
    shallow = compile_time.estimate(16, 0, 1, GPU, fit)  # 16 copies: no hint
    assert shallow.grouped_s is None and 'would take' not in shallow.line()
    assert compile_time.estimate(64, 0, 4, GPU, fit).grouped_s is None  # pipelined: one copy already


def test_grouped_scan_and_pipelines():
    grouped = compile_time.estimate(96, 8, 1, GPU, FIT)  # an explicit value wins on every platform
    assert (grouped.scan_unroll, grouped.bodies, grouped.seconds) == (8, 8, 11.0 + 24.0)
    assert 'a scan over groups of 8 layers' in grouped.line() and 'CPU-calibrated' in grouped.line()
    piped = compile_time.estimate(96, 0, 4, GPU, FIT)  # pipeline chunks scan whatever scan_unroll says
    assert piped.bodies == 1 and 'pipeline' in piped.line()


def test_plan_mode_reports_the_compile_time(tmp_path):
    c = config_lib.base_config()
    c.model.update(num_layers=12, d_model=64, num_heads=4, seq_len=64, vocab_size=256, scan_unroll=4)
    c.train.update(global_batch=8, micro_batch=8)
    out = tmp_path / 'plan.json'
    text = report.report(c, hardware='h100', check='none', json_path=str(out))
    line = next(ln for ln in text.splitlines() if ln.startswith('compile '))
    assert '4 copies of the layer (a scan over groups of 4 layers, model.scan_unroll 4)' in line, line
    record = json.loads(out.read_text())['compile_time']
    assert (record['bodies'], record['scan_unroll'], record['platform']) == (4, 4, 'gpu')
    assert record['seconds'] == pytest.approx(compile_time.CPU_FIT.seconds(4))
