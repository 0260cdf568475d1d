"""`train.profile_start` / `train.profile_steps`: a jax.profiler trace under <workdir>/profile/."""

import glob
import os

import pytest

import processes


def run_main(workdir, *more):
    return processes.run_main(f'--workdir={workdir}', '--config.train.steps=4', '--config.checkpoint.enabled=False',
                              *more)


@pytest.mark.slow  # a training subprocess with the profiler on: ~35 s
def test_trace_of_the_requested_steps_is_written(tmp_path):
    out = run_main(tmp_path, '--config.train.profile_start=1', '--config.train.profile_steps=2')
    assert out.returncode == 0, out.stderr[-3000:]
    traces = glob.glob(str(tmp_path / 'profile' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0, os.listdir(tmp_path)
    # The trace holds the annotated train steps 1 and 2 (their names are in the serialized XPlane).
    data = open(traces[0], 'rb').read()
    assert b'train' in data
    assert 'profile: steps 1..2 traced to' in out.stderr


def test_profile_off_by_default_and_bad_values_fail_cleanly(tmp_path):
    out = run_main(tmp_path / 'bad', '--config.train.profile_start=9', '--config.train.profile_steps=2')
    assert out.returncode == 2 and 'config.train.profile_start = 9' in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / 'bad' / 'profile').exists()
