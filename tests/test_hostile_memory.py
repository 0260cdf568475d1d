"""A model too big for the host is refused before anything is allocated (issue 28, failure 1).

`python -m jaxfrontier.main --config=configs/gpt.py:size=1.3b --config.train.steps=2` on a 24 GiB
machine built the parameters and Adam state (15.8 GB) and was compiling at 18.2 GB when it was
killed by hand: the refusal in run/observe/memory_check.py came after the state and the compile.
`plan/preflight.py` now refuses from the planner's figures, before the state exists.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

from jaxfrontier.plan import planner
from jaxfrontier.plan import preflight
from jaxfrontier import hardware
from jaxfrontier.run.observe import memory_check
import processes

GIB = 2**30


def gpt_config(arg):
    spec = importlib.util.spec_from_file_location('gpt_config', os.path.join(processes.REPO, 'configs', 'gpt.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def test_tiny_config_passes_and_ignore_skips(monkeypatch):
    c = gpt_config('size=125m,data=8')
    c.model.update(num_layers=1, d_model=64, num_heads=2, seq_len=32, vocab_size=256)
    preflight.check(c)  # fits: no error
    monkeypatch.setattr(hardware, 'host_memory_bytes', lambda: 1)
    with pytest.raises(preflight.UserError):
        preflight.check(c)
    c.train.ignore_memory_check = True
    preflight.check(c)


def test_refusal_names_bytes_and_a_layout_that_fits(monkeypatch):
    """125M on 8 data-parallel devices of 2 GiB each: the replicated Adam state does not fit, a sharded layout does."""
    c = gpt_config('size=125m,data=8,micro_batch=1')
    monkeypatch.setattr(hardware, 'host_memory_bytes', lambda: 8 * 2 * GIB)
    with pytest.raises(preflight.UserError) as e:
        preflight.check(c, jax.local_devices())
    line = str(e.value)
    assert '\n' not in line
    assert 'GiB per device but a device has 2.00 GiB' in line and '2,147,483,648 available' in line
    assert 'a layout of these 8 devices that fits' in line and 'ignore_memory_check' in line
    # the suggested overrides do fit by the planner's figures
    for override in line.split('fits (')[1].split(': ', 1)[1].split(';')[0].split():
        key, value = override.removeprefix('--config.').split('=')
        section, field = key.split('.')
        old = c[section][field]
        c[section][field] = type(old)(value == 'True') if isinstance(old, bool) else type(old)(value)
    p = planner.plan(c, preflight.local_hardware(jax.local_devices(), 2 * GIB))
    assert p.memory.total_bytes <= 2 * GIB


def test_cli_refuses_1_3b_before_allocating(tmp_path):
    """The issue's command: exit 2 with one line, in seconds, well under 2 GiB resident, nothing written."""
    need = planner.plan(gpt_config('size=1.3b'), preflight.local_hardware(jax.local_devices()[:1], 1)).memory.total_bytes
    if hardware.host_memory_bytes() >= need:
        pytest.skip(f'this host has {hardware.host_memory_bytes() / GIB:.0f} GiB available: 1.3b would fit')
    workdir = tmp_path / 'run'
    measure = ('import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); '
               'print("maxrss_kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)')
    proc = subprocess.run([sys.executable, '-c', measure, sys.executable, '-m', 'jaxfrontier.main',
                           '--config=configs/gpt.py:size=1.3b', '--config.train.steps=2', f'--workdir={workdir}'],
                          cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    line = processes.error_line(proc)
    assert 'GiB per device but a device has' in line and 'bytes needed' in line
    maxrss_gib = int(proc.stdout.split('maxrss_kib')[1].split()[0]) / 2**20
    assert maxrss_gib < 2, maxrss_gib
    assert not (workdir / 'checkpoints').exists()


def test_a_config_the_planner_cannot_model_is_left_to_the_compiled_check(monkeypatch):
    def cannot(*args, **kwargs):
        raise ValueError('no model of this layout')

    monkeypatch.setattr(planner, 'plan', cannot)
    monkeypatch.setattr(hardware, 'host_memory_bytes', lambda: 1)
    preflight.check(gpt_config('size=125m,data=8'))  # no error: training goes on to the compiled step's check
