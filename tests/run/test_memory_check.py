"""A run that cannot fit is refused before its first step (run/observe/memory_check.py).

The compiled step's memory (XLA's analysis) is compared with what a device has; more is one
line, exit 2, with the figure, the largest parts and the fixes. An allocation failure of the
runtime (RESOURCE_EXHAUSTED) is the same kind of line.
"""

import subprocess
import sys
import types

import jax
import pytest

from jaxfrontier.errors import UserError
from jaxfrontier.run import loop
from jaxfrontier import hardware
from jaxfrontier.run.observe import memory_check
from jaxfrontier.training import state as ts
from jaxfrontier import mesh as mesh_lib
import processes
from test_bad_input import good_config

GIB = 2**30


class FakeCompiled:
    def __init__(self, temp, arguments=GIB // 4, outputs=GIB // 4, alias=GIB // 4):
        self.analysis = types.SimpleNamespace(argument_size_in_bytes=arguments, output_size_in_bytes=outputs,
                                              temp_size_in_bytes=temp, alias_size_in_bytes=alias)

    def memory_analysis(self):
        return self.analysis


class FakeDevice:
    platform = 'gpu'

    def memory_stats(self):
        return {'bytes_limit': 4 * GIB}


@pytest.fixture(scope='module')
def layout():
    c = good_config()
    return c, ts.make_placement(c, mesh_lib.mesh_from_config(c))


def test_step_that_does_not_fit_is_refused(layout):
    c, lay = layout
    with pytest.raises(UserError) as info:
        memory_check.check_fits(FakeCompiled(temp=5 * GIB), c.train, lay.abstract_state, lay.state_shardings,
                                devices=[FakeDevice()])
    message = str(info.value)
    for text in ('needs 5.25 GiB per device but a device has 4.00 GiB', 'gpu allocator limit',
                 'largest parts: temporaries (activations, gradients, workspace) 5.00 GiB',
                 '--mode=plan --search', '--config.train.ignore_memory_check=True'):
        assert text in message, (text, message)


def test_step_that_fits_and_the_override_pass(layout):
    c, lay = layout
    memory_check.check_fits(FakeCompiled(temp=3 * GIB), c.train, lay.abstract_state, lay.state_shardings,
                            devices=[FakeDevice()])
    c = good_config()
    c.train.ignore_memory_check = True
    memory_check.check_fits(FakeCompiled(temp=50 * GIB), c.train, lay.abstract_state, lay.state_shardings,
                            devices=[FakeDevice()])


def test_cpu_capacity_is_available_host_ram_shared_by_the_devices():
    capacity, source = hardware.device_capacity(jax.local_devices())
    available = hardware.host_memory_bytes()
    assert abs(capacity - available // jax.local_device_count()) < 2**28  # RAM in use moves a little meanwhile
    with open('/proc/meminfo') as f:
        total = int(next(line for line in f if line.startswith('MemTotal')).split()[1]) * 1024
    assert 0 < available <= total
    assert f'shared by {jax.local_device_count()} simulated cpu devices' in source


def test_allocation_failure_is_one_line(tmp_path, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.50GiB.\n'
                                         'BufferAssignment OOM Debugging ...')

    monkeypatch.setattr(loop.ts, 'make_placement', out_of_memory)  # raised where a real one would, earlier: cheap
    with pytest.raises(UserError) as info:
        loop.train_and_evaluate(good_config(), str(tmp_path / 'wd'))
    message = str(info.value)
    assert message.startswith('out of device memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate '
                              '9.50GiB.'), message
    assert 'BufferAssignment' not in message and '--mode=plan --search' in message, message


@pytest.mark.slow  # one compile of a large-batch step
def test_cli_refuses_a_step_larger_than_the_machine(tmp_path):
    """A one-layer, 32-wide model whose batch needs 19.6 GiB per device (XLA's figure): more than RAM / 8."""
    need_gib = 19.6
    if hardware.host_memory_bytes() / 8 / GIB > need_gib / 1.2:
        pytest.skip('this machine has enough RAM for the config')
    cmd = [sys.executable, '-m', 'jaxfrontier.main', *processes.TINY, '--config.model.seq_len=1024',
           '--config.train.micro_batch=1024', '--config.train.global_batch=4096', '--config.data.kind=synthetic',
           '--config.checkpoint.enabled=False', '--config.train.steps=1', f'--workdir={tmp_path / "wd"}']
    proc = subprocess.run(cmd, cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True,
                          text=True, timeout=600)
    line = processes.error_line(proc)
    assert 'GiB per device but a device has' in line, proc.stderr[-3000:]
    assert 'available host RAM shared by 8 simulated cpu devices' in line and 'ignore_memory_check' in line
    assert not (tmp_path / 'wd' / 'metrics.jsonl').exists() or not (tmp_path / 'wd' / 'metrics.jsonl').read_text()
