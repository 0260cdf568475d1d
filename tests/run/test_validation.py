"""A run's config is validated once: by `main` before JAX starts, not again by the preflight or the loop.

Library callers that hand over a config nobody validated (`loop.train_and_evaluate(c, workdir)`,
`preflight.check(c)`, `planner.plan(c)`) still get it validated (tests/test_bad_input.py holds the loop's).
"""

import os
import subprocess
import sys

import pytest

import processes
from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.plan import preflight

COUNTING_MAIN = os.path.join(processes.REPO, 'tests', 'counting_main.py')


def validate_calls(tmp_path, *flags: str) -> int:
    """`config.validate` calls of one `python -m jaxfrontier.main` process (tests/counting_main.py)."""
    count = tmp_path / 'validate_calls'
    proc = subprocess.run([sys.executable, COUNTING_MAIN, *processes.TINY, *flags], cwd=processes.REPO,
                          env=processes.subprocess_env(JF_TEST_VALIDATE_COUNT=str(count)),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return int(count.read_text())


@pytest.mark.slow  # one compile of a one-layer model
def test_a_training_run_validates_once(tmp_path):
    """Was 2: main's validate_run, then the memory preflight's planner call validated again."""
    assert validate_calls(tmp_path, '--config.train.steps=1', f'--workdir={tmp_path / "wd"}') == 1


def test_a_plan_validates_once(tmp_path):
    assert validate_calls(tmp_path, '--mode=plan', '--plan_check=none') == 1


def small_config():
    """A valid config for the 8 test devices: data 2 x fsdp 2 x tensor 2, tiny model."""
    c = config_lib.base_config()
    c.model.update(num_layers=2, d_model=32, num_heads=4, seq_len=16, vocab_size=256, vocab_multiple=128,
                   dtype='float32', remat='none', attention='xla')
    c.mesh.update(data=2, fsdp=2, tensor=2)
    c.train.update(steps=2, global_batch=8, micro_batch=2, accum_steps=1, progress=False)
    c.data.kind = 'synthetic'
    return c


def test_the_preflight_validates_a_library_callers_config_but_not_mains_again(monkeypatch):
    calls = []
    validate = config_lib.validate

    def counted(*args, **kwargs):
        calls.append(args)
        return validate(*args, **kwargs)

    monkeypatch.setattr(config_lib, 'validate', counted)
    preflight.check(small_config(), validated=True)  # main's path: validate_run ran before JAX started
    assert not calls
    preflight.check(small_config())
    assert len(calls) == 1
    bad = small_config()
    bad.model.num_heads = 3  # d_model 32 is not a multiple
    with pytest.raises(ConfigError) as info:
        preflight.check(bad)
    assert info.value.field == 'model.d_model'
