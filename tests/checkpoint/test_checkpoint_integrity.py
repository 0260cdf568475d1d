"""Damaged checkpoints and bad input fail before training, with the step directory named and the fix.
"""

import os
import shutil

import pytest

from jaxfrontier import errors
from jaxfrontier.checkpoint import manager as ckpt_lib
from jaxfrontier import config as config_lib
from jaxfrontier.run import loop

from checkpoint_common import (  # noqa: F401  (fixtures are used by name)
    REPO, make_config, layout_for, target_of, no_init, _largest_file, vocab300, main)
from processes import error_line

# A failed Orbax read (the corruption tests) leaves reads and TensorStore callbacks aimed at the
# loop Orbax has closed; checkpoint/manager.py's unraisable hook drops exactly those (test_disk_full).


# --------------------------------------------------------------------------- bad input


CORRUPTIONS = {
    'truncated_data': lambda step: os.truncate(_largest_file(f'{step}/state'), 100),
    'missing_data': lambda step: os.remove(_largest_file(f'{step}/state')),
    'missing_state_metadata': lambda step: os.remove(f'{step}/state/_METADATA'),
    'missing_manifest': lambda step: os.remove(f'{step}/state/manifest.ocdbt'),
    'missing_meta': lambda step: os.remove(f'{step}/meta/metadata'),
    'garbage_meta': lambda step: open(f'{step}/meta/metadata', 'w').write('{"format": 1'),
    'unlisted_step_dir': lambda step: shutil.rmtree(f'{step}/state') or os.remove(f'{step}/_CHECKPOINT_METADATA'),
}


@pytest.mark.parametrize('kind', CORRUPTIONS)
def test_corrupted_checkpoint_fails_clearly(vocab300, tmp_path, kind):
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    CORRUPTIONS[kind](str(tmp_path / 'checkpoints' / '0'))
    with pytest.raises(errors.UserError, match=r'checkpoints/0.*Fix:'):
        checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
        checkpointer.restore_or_init(target_of(layout_for(c)), no_init)


def test_incomplete_checkpoint_is_never_restored(vocab300, tmp_path):
    """A step left in Orbax's temporary directory by a crash is ignored and removed."""
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    partial = tmp_path / 'checkpoints' / '5.orbax-checkpoint-tmp-1700000000000000'
    shutil.copytree(f'{workdir}/checkpoints/0', partial)
    os.remove(_largest_file(partial / 'state'))
    checkpointer = ckpt_lib.Checkpointer(c, str(tmp_path))
    state, origin = checkpointer.restore_or_init(target_of(layout_for(c)), no_init)
    assert int(state['step']) == 0 and 'restored step 0' in origin
    assert not partial.exists()


def test_unwritable_workdir_fails_before_training(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('x')
    with pytest.raises(errors.UserError, match='cannot be written'):
        loop.train_and_evaluate(make_config(), str(blocker / 'run'))
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'checkpoints').write_text('not a directory')
    with pytest.raises(errors.UserError, match='checkpoint directory .* cannot be written'):
        loop.train_and_evaluate(make_config(), str(tmp_path / 'run'))
    assert not (tmp_path / 'run' / 'metrics.jsonl').exists()


def test_config_validation():
    c = make_config()
    config_lib.validate(c, 8)
    for field, value in [('every_steps', -1), ('keep', 0), ('keep_period', -2), ('preemption_sync_every', 0),
                         ('preemption_signals', ('SIGTERM', 'SIGNOPE')), ('preemption_signals', ('SIGKILL',))]:
        bad = make_config()
        bad.checkpoint[field] = value
        with pytest.raises(errors.ConfigError, match=f'checkpoint.{field}'):
            config_lib.validate(bad, 8)


# --------------------------------------------------------------------------- checksums


def flip_bytes(path, count=64):
    """Inverts `count` bytes in the middle of a file."""
    with open(path, 'r+b') as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(count)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def test_flipped_bytes_fail_the_checksum(vocab300, tmp_path):
    """64 flipped bytes in the largest data file: the restore refuses, naming the step and the fix."""
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    flip_bytes(_largest_file(tmp_path / 'checkpoints' / '0' / 'state'))
    with pytest.raises(errors.CheckpointError, match=r'checkpoints/0 fails its checksum .*Fix: move '):
        ckpt_lib.Checkpointer(c, str(tmp_path)).restore_or_init(target_of(layout_for(c)), no_init)


def test_missing_state_metadata_is_corruption(vocab300, tmp_path):
    workdir, c = vocab300
    shutil.copytree(f'{workdir}/checkpoints', tmp_path / 'checkpoints')
    os.remove(tmp_path / 'checkpoints' / '0' / 'state' / '_METADATA')
    with pytest.raises(errors.CheckpointError, match=r'checkpoints/0 is corrupted: state/_METADATA') as error:
        ckpt_lib.Checkpointer(c, str(tmp_path)).restore_or_init(target_of(layout_for(c)), no_init)
    assert 'different model' not in str(error.value)


# --------------------------------------------------------------------------- command line (slow)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """configs/tiny.py (tiny overrides), 2 steps, a checkpoint after each."""
    workdir = str(tmp_path_factory.mktemp('trained') / 'run')
    proc = main(workdir, '--config.train.steps=2', '--config.checkpoint.every_steps=1')
    assert proc.returncode == 0, proc.stderr[-3000:]
    return workdir


def copy_of(trained, tmp_path):
    shutil.copytree(trained, tmp_path / 'run')
    return str(tmp_path / 'run')


@pytest.mark.slow
def test_flipped_bytes_refuse_the_resume(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    flip_bytes(_largest_file(f'{workdir}/checkpoints/2/state'))
    proc = main(workdir, '--config.train.steps=4')
    line = error_line(proc)
    assert f'checkpoint {workdir}/checkpoints/2 fails its checksum' in line, line
    assert '--config.checkpoint.restore_step=1' in line and f'move {workdir}/checkpoints/2 away' in line, line


@pytest.mark.slow
def test_missing_state_metadata_says_corrupted(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    os.remove(f'{workdir}/checkpoints/2/state/_METADATA')
    proc = main(workdir, '--config.train.steps=4')
    line = error_line(proc)
    assert 'checkpoints/2 is corrupted: state/_METADATA' in line and 'different model' not in line, line


@pytest.mark.slow
def test_refused_resume_keeps_config_json(trained, tmp_path):
    workdir = copy_of(trained, tmp_path)
    with open(f'{workdir}/config.json') as f:
        before = f.read()
    proc = main(workdir, '--config.model.num_heads=2', '--config.train.steps=4')
    assert 'saved with model.num_heads = 4' in error_line(proc)
    with open(f'{workdir}/config.json') as f:
        assert f.read() == before


@pytest.mark.slow
def test_export_path_that_cannot_be_written(trained, tmp_path):
    (tmp_path / 'a_file').write_text('x')
    for out, problem in ((tmp_path, 'is a directory'), (tmp_path / 'a_file' / 'p.safetensors', 'cannot be written')):
        proc = main(trained, f'--export_path={out}', mode='export')
        line = error_line(proc)
        assert f'--export_path={str(out)!r} {problem}' in line and 'Fix:' in line, line
