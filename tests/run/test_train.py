"""The default run learns, and the training loop writes what it promises."""

import json
import logging
import os

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier.run import loop
from ml_collections import config_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Byte-unigram entropy of the built-in corpus (CPython 3.11's stdlib sources): 3.25 nats.
UNIGRAM_ENTROPY_NATS = 3.25
EVAL_LOSS_BOUND = 2.6


def tiny(steps):
    c = config_flags.config_flags._LoadConfigModule('tiny', os.path.join(REPO, 'configs', 'tiny.py')).get_config()
    c.train.update(steps=steps, eval_every=0, log_every=20, progress=False)
    return c


@pytest.mark.slow  # 80 steps of configs/tiny.py: ~50 s
def test_tiny_config_learns_below_unigram_entropy(tmp_path, caplog):
    """A shortened configs/tiny.py (data 2 x fsdp 2 x tensor 2) beats the byte-unigram model; every
    stage's log line is attributed to the module that wrote it."""
    with caplog.at_level(logging.INFO):
        record = loop.train_and_evaluate(tiny(80), str(tmp_path))
    by_module = {}
    for r in caplog.records:
        if r.name.startswith('jaxfrontier'):
            by_module.setdefault(r.getMessage().split(':')[0], set()).add(r.name)
    for stage in ('mesh', 'data', 'state', 'compile', 'start-up', 'checkpoint', 'done'):
        assert by_module.get(stage) == {'jaxfrontier.run.loop'}, (stage, by_module)
    assert record['eval/loss'] < EVAL_LOSS_BOUND < UNIGRAM_ENTROPY_NATS, record
    lines = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in lines] == [20, 40, 60, 80]
    assert lines[0]['train/loss'] > lines[-1]['train/loss']
    for key in ('train/loss', 'train/grad_norm', 'train/param_norm', 'train/lr', 'perf/tokens_per_s',
                'perf/tokens_per_s_per_device', 'perf/model_tflops_per_device', 'perf/mfu',
                'perf/megatron_hw_tflops_per_device', 'perf/step_time_s'):
        assert key in lines[-1], key
    assert 'eval/loss' in lines[-1] and 'eval/loss' not in lines[0]
    # Each start-up phase timed once, with the first row.
    assert {k for k in lines[0] if k.startswith('startup/')} == {
        'startup/lock_and_mesh_s', 'startup/data_s', 'startup/init_s', 'startup/compile_s'}
    assert not any(k.startswith('startup/') for k in lines[1])
    assert os.listdir(tmp_path / 'tensorboard')
    assert json.loads((tmp_path / 'config.json').read_text())['train']['steps'] == 80


@pytest.mark.slow  # ~25 s
def test_nan_loss_stops_with_a_clear_message(tmp_path):
    c = tiny(30)
    c.optim.update(lr=1e6, min_lr=0.0, warmup_steps=0, clip_norm=1e12)
    with pytest.raises(errors.NonFiniteLossError, match='at step'):
        loop.train_and_evaluate(c, str(tmp_path))


def test_accumulation_is_validated():
    c = tiny(10)
    c.train.accum_steps = 3
    with pytest.raises(errors.ConfigError, match='train.global_batch = 16'):
        config_lib.validate(c, 8)


@pytest.mark.slow
def test_pipelined_training_runs_end_to_end(tmp_path):
    """train_and_evaluate with pipeline 2 x data 2 x tensor 2 (1F1B, M = 4) learns and logs its bubble."""
    c = tiny(30)
    c.mesh.update(pipeline=2, data=2, fsdp=1, tensor=2)
    c.train.update(global_batch=16, micro_batch=2, accum_steps=4, log_every=10)
    record = loop.train_and_evaluate(c, str(tmp_path))
    assert record['pipeline/bubble'] == pytest.approx(1 / 5)
    assert record['eval/loss'] < UNIGRAM_ENTROPY_NATS, record


def test_the_last_step_is_always_reported(tmp_path):
    """A run stopped between logged steps (SIGTERM) still writes its last step: the `done:` line and
    metrics.jsonl end at the step its final checkpoint holds (they had said 150 while step 160 was committed)."""
    from jaxfrontier.run.observe import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.run.observe import report  # pylint: disable=g-import-not-at-top
    c = tiny(10)
    c.train.log_every = 4
    writer = metrics_lib.MetricsWriter(str(tmp_path), c.train.steps, enabled=True, progress=False, initial_step=0)
    reporter = report.Reporter(c.train, writer, 8, seq_len=c.model.seq_len, dtype=c.model.dtype,
                               flops=config_lib.flops_per_step(c))
    for step in (1, 2, 3):
        reporter.report(step, {'train/loss': 1.0}, None, last=step == 3)
    writer.close()
    rows = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rows] == [3] and reporter.last_record['step'] == 3
