"""Tests of jaxfrontier.run.observe.metrics: FLOP formula, device peaks, perf arithmetic, writer, NaN guard."""

import dataclasses
import glob
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import flops as flops_lib
from jaxfrontier import hardware
from jaxfrontier.run.observe import metrics

import processes

# GPT-3 175B as trained by Megatron-LM: B = 1536 sequences, s = 2048, l = 96, h = 12288,
# V = 51200 (GPT-2's 50257 padded).
B, S, L, H, V = 1536, 2048, 96, 12288, 51200


def _matmul_flops_forward(b, s, l, h, v):
    """Forward matmul FLOPs counted term by term (2 FLOPs per multiply-add)."""
    qkv = 2 * b * s * h * 3 * h
    scores = 2 * b * s * s * h  # causal counted as full
    attend = 2 * b * s * s * h
    out_proj = 2 * b * s * h * h
    mlp = 2 * b * s * h * 4 * h * 2
    logits = 2 * b * s * h * v
    return l * (qkv + scores + attend + out_proj + mlp), logits


def test_megatron_flops_175b_matches_expanded_terms():
    blocks, logits = _matmul_flops_forward(B, S, L, H, V)
    # Megatron-LM's count with recomputation: blocks run 4 times (fwd, recomputed fwd,
    # backward = 2 fwd), the logits layer 3 times: 96 B s l h^2 + 16 B s^2 l h + 6 B s h V.
    expected = 4 * blocks + 3 * logits
    assert expected == 96 * B * S * L * H**2 + 16 * B * S**2 * L * H + 6 * B * S * H * V
    assert expected == 4_510_970_753_323_106_304  # ~4.51 EFLOP per step, computed by hand
    got = flops_lib.megatron_flops_per_step(B, S, L, H, V, recompute=True)
    assert got == pytest.approx(expected, rel=1e-12)


def test_megatron_flops_without_recompute_and_model_flops():
    blocks, logits = _matmul_flops_forward(B, S, L, H, V)
    # f = 3 multiplies the whole formula, so the logits term becomes 3/4 of 3 passes.
    expected = 3 * blocks + 3 * logits * 3 / 4
    no_remat = flops_lib.megatron_flops_per_step(B, S, L, H, V, recompute=False)
    assert no_remat == pytest.approx(expected, rel=1e-12)
    assert flops_lib.model_flops_per_step(B, S, L, H, V) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize('shape', [(1536, 2048, 96, 12288, 51200), (3, 7, 5, 11, 13)])
def test_recompute_ratio_is_four_thirds(shape):
    f4 = flops_lib.megatron_flops_per_step(*shape, recompute=True)
    f3 = flops_lib.megatron_flops_per_step(*shape, recompute=False)
    assert f4 / f3 == pytest.approx(4 / 3, rel=1e-12)


def test_flops_per_step_from_config_uses_padded_vocab_and_remat():
    c = config_lib.base_config()
    c.model.num_layers, c.model.d_model, c.model.seq_len = 3, 40, 24
    c.model.vocab_size, c.mesh.tensor, c.train.global_batch = 50257, 2, 6
    assert config_lib.padded_vocab(c) == 50432  # multiple of 128 * 2
    c.model.remat = 'full'
    model, hw = config_lib.flops_per_step(c)
    assert model == pytest.approx(flops_lib.model_flops_per_step(6, 24, 3, 40, 50432), rel=1e-12)
    assert hw == pytest.approx(flops_lib.megatron_flops_per_step(6, 24, 3, 40, 50432, True), rel=1e-12)
    c.model.remat = 'none'
    model_none, hw_none = config_lib.flops_per_step(c)
    assert model_none == model and hw_none == pytest.approx(model, rel=1e-12)


def test_perf_metrics_arithmetic():
    out = metrics.perf_metrics(step_time_s=2.0, tokens_per_step=8192, n_devices=4,
                               model_flops=3.2e15, megatron_hw_flops=4.0e15, peak_flops=1e15)
    assert set(out) == {
        'perf/step_time_s', 'perf/tokens_per_s', 'perf/tokens_per_s_per_device',
        'perf/model_tflops_per_device', 'perf/mfu', 'perf/megatron_hw_tflops_per_device'}
    assert out['perf/step_time_s'] == 2.0
    assert out['perf/tokens_per_s'] == pytest.approx(4096.0)
    assert out['perf/tokens_per_s_per_device'] == pytest.approx(1024.0)
    assert out['perf/model_tflops_per_device'] == pytest.approx(400.0)  # 3.2e15 / 8 / 1e12
    assert out['perf/mfu'] == pytest.approx(0.4)
    assert out['perf/megatron_hw_tflops_per_device'] == pytest.approx(500.0)


def test_perf_metrics_unknown_peak_gives_nan_mfu():
    out = metrics.perf_metrics(1.0, 100, 1, 1e12, 1e12, math.nan)
    assert math.isnan(out['perf/mfu'])
    assert out['perf/model_tflops_per_device'] == pytest.approx(1.0)


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


@pytest.mark.parametrize('kind, dtype, peak', [
    ('AMD Instinct MI250X', 'bfloat16', 191.5e12),
    ('AMD Instinct MI250X', 'float16', 191.5e12),
    ('AMD Instinct MI250X', 'float32', 47.9e12),
    ('AMD Instinct MI300X', 'bfloat16', 1307.4e12),
    ('AMD Instinct MI300X', 'float32', 163.4e12),
    ('NVIDIA A100-SXM4-80GB', 'bfloat16', 312e12),
    ('NVIDIA A100-SXM4-80GB', 'float32', 19.5e12),
    ('NVIDIA H100 80GB HBM3', 'bfloat16', 989.4e12),
    ('NVIDIA H100 80GB HBM3', 'float32', 66.9e12),
    ('NVIDIA H200', 'bfloat16', 989.4e12),
    ('NVIDIA H200', 'float16', 989.4e12),
])
def test_device_peak_table(kind, dtype, peak):
    got, source = hardware.device_peak_flops(FakeDevice('gpu', kind), dtype)
    assert got == peak
    assert 'table' in source


@pytest.mark.parametrize('kind', ['NVIDIA GeForce RTX 4090', 'NVIDIA H100 PCIe', 'TPU v5 lite'])
def test_unknown_device_kind_is_nan(kind):
    got, source = hardware.device_peak_flops(FakeDevice('gpu', kind), 'bfloat16')
    assert math.isnan(got)
    assert source.startswith('unknown device kind')


def test_unknown_dtype_raises():
    with pytest.raises(ValueError, match='int8'):
        hardware.device_peak_flops(FakeDevice('gpu', 'NVIDIA H200'), 'int8')


def test_cpu_peak_is_measured_positive_and_cached():
    peak = hardware.measure_cpu_matmul_peak('float32')
    assert math.isfinite(peak) and peak > 0
    assert hardware.measure_cpu_matmul_peak('float32') == peak  # cached, not re-measured
    got, source = hardware.device_peak_flops(jax.devices('cpu')[0], 'float32')
    assert got == peak
    assert 'measured' in source and f'{len(jax.local_devices(backend="cpu"))} CPU devices' in source


def test_metrics_writer_writes_jsonl_and_tensorboard(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), total_steps=3, enabled=True, progress=False)
    writer.write(1, {'train/loss': 2.5, 'perf/tokens_per_s': 100, 'perf/mfu': math.nan})
    writer.advance(1)
    writer.write(2, {'train/loss': jax.numpy.float32(2.25)})
    writer.advance(2)
    writer.log_line('a line')
    writer.close()
    writer.close()  # idempotent

    lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f'non-strict JSON {c}'))
            for line in lines]
    assert rows == [
        {'step': 1, 'train/loss': 2.5, 'perf/tokens_per_s': 100.0, 'perf/mfu': None},
        {'step': 2, 'train/loss': 2.25},
    ]
    events = glob.glob(os.path.join(tmp_path, 'tensorboard', 'events.out.tfevents.*'))
    assert events and os.path.getsize(events[0]) > 0


def test_layer_arrays_go_to_jsonl_as_lists_and_not_to_tensorboard_or_sinks(tmp_path):
    """The layers' aux (model/auxiliary.py: `aux/<name>/layers`, [L] or [L, E]) arrives from the step
    as arrays: host_values turns them into lists, the JSON row keeps them (non-finite as null),
    TensorBoard and the sinks get the scalars only."""
    class Sink:
        rows = []

        def write(self, step, values, replayed):
            self.rows.append(dict(values))

    fetched = {'train/loss': np.float32(2.5), 'aux/loss_z': np.float32(0.5),
               'aux/loss_z/layers': np.array([0.25, 0.75], np.float32),
               'aux/counts/layers': np.array([[0.5, 0.5], [1.0, np.inf]], np.float32)}
    values = metrics.host_values(fetched)
    assert values == {'train/loss': 2.5, 'aux/loss_z': 0.5, 'aux/loss_z/layers': [0.25, 0.75],
                      'aux/counts/layers': [[0.5, 0.5], [1.0, math.inf]]}
    writer = metrics.MetricsWriter(str(tmp_path), total_steps=3, enabled=True, progress=False, sinks=(Sink(),))
    writer.write(1, values)
    writer.close()
    row = json.loads((tmp_path / 'metrics.jsonl').read_text(),
                     parse_constant=lambda c: pytest.fail(f'non-strict JSON {c}'))
    assert row == {'step': 1, 'train/loss': 2.5, 'aux/loss_z': 0.5, 'aux/loss_z/layers': [0.25, 0.75],
                   'aux/counts/layers': [[0.5, 0.5], [1.0, None]]}
    assert Sink.rows == [{'train/loss': 2.5, 'aux/loss_z': 0.5}]


def test_disabled_writer_writes_nothing(tmp_path):
    workdir = tmp_path / 'run'
    writer = metrics.MetricsWriter(str(workdir), total_steps=3, enabled=False, progress=True)
    writer.write(1, {'train/loss': 1.0})
    writer.advance(1)
    writer.log_line('nothing')
    writer.close()
    assert not workdir.exists()


@pytest.mark.parametrize('bad', [math.nan, math.inf, -math.inf])
def test_check_finite_raises_with_hints(bad):
    with pytest.raises(errors.NonFiniteLossError) as info:
        metrics.check_finite(17, jax.numpy.float32(bad))
    message = str(info.value)
    assert 'step 17' in message and str(bad) in message
    assert 'optim.lr' in message and 'data' in message and 'float32' in message


def test_check_finite_passes_finite_loss():
    metrics.check_finite(3, 2.0)
    metrics.check_finite(3, jax.numpy.float32(0.0))


def test_a_batch_log_gets_one_plain_line_per_logged_step(tmp_path, capsys):
    """Not a terminal (a Slurm log): one readable line per written row, no carriage returns (issue 25)."""
    writer = metrics.MetricsWriter(str(tmp_path), total_steps=100, enabled=True, progress=True, terminal=False)
    writer.write(10, {'train/loss': 3.25, 'train/lr': 1e-3, 'train/grad_norm': 0.5, 'perf/tokens_per_s': 12345.0,
                      'perf/mfu': 0.41, 'perf/step_time_s': 2.0})
    writer.write(20, {'train/loss': 3.0, 'eval/loss': 3.5})
    writer.close()
    err = capsys.readouterr().err
    assert '\r' not in err
    assert err.splitlines() == [
        'step 10/100, loss 3.2500, lr 0.001, grad norm 0.5, tokens/s 12,345, MFU 0.410, ETA 0:03:00',
        'step 20/100, loss 3.0000, eval loss 3.5000']


def test_a_terminal_gets_the_bar_and_no_lines(tmp_path, capsys):
    writer = metrics.MetricsWriter(str(tmp_path), total_steps=3, enabled=True, progress=True, terminal=True)
    writer.write(1, {'train/loss': 3.0})
    writer.close()
    assert 'step 1/3' not in capsys.readouterr().err


def test_the_writer_does_not_import_torch_and_leaves_it_importable(tmp_path):
    """tensorboardX imports torch (1.3-1.8 s of a run's start where torch is installed) only for type hints:
    the writer loads it without torch, writes its events, and torch imports normally after."""
    pytest.importorskip('torch')
    code = ('import glob, sys\n'
            'from jaxfrontier.run.observe import metrics\n'
            f'w = metrics.MetricsWriter({str(tmp_path)!r}, 2, enabled=True, progress=False)\n'
            'w.write(1, {"train/loss": 2.5}); w.close()\n'
            'assert "torch" not in sys.modules, "torch imported"\n'
            f'assert glob.glob({str(tmp_path / "tensorboard" / "events.*")!r})\n'
            'import torch\n'
            'assert torch.ones(2).sum().item() == 2.0\n')
    proc = subprocess.run([sys.executable, '-c', code], env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
