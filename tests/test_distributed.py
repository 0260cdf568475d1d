"""How a process joins a job: Slurm, explicit settings or none; GPU selection; start-up failures.

The environments below are the ones Slurm 22.05 sets inside `srun` steps (recorded on the test
cluster of tests/test_slurm.py and on Frontier's documented layout: `--gpu-bind=closest` gives
each task one GCD through ROCR_VISIBLE_DEVICES). No JAX starts in this file except in the
start-up subprocess.
"""

import subprocess
import sys

import pytest

from jaxfrontier import config as config_lib
from jaxfrontier import distributed
from jaxfrontier.errors import ConfigError
from processes import REPO, free_port, subprocess_env


def dist_config(**changes):
    d = config_lib.base_config().distributed
    d.update(changes)
    return d


def srun_env(procid=1, localid=1, ntasks=16, nodelist='frontier[00012-00013]', **more):
    """The variables of task `procid` in an srun step of job 4242."""
    env = {'SLURM_JOB_ID': '4242', 'SLURM_STEP_ID': '0', 'SLURM_STEP_NUM_TASKS': str(ntasks),
           'SLURM_NTASKS': str(ntasks), 'SLURM_PROCID': str(procid), 'SLURM_LOCALID': str(localid),
           'SLURM_STEP_NODELIST': nodelist, 'SLURM_JOB_NODELIST': nodelist}
    env.update(more)
    return env


def batch_script_env():
    """A batch script (not a step): Slurm sets PROCID/LOCALID/NTASKS but no step variables."""
    return {'SLURM_JOB_ID': '4242', 'SLURM_NTASKS': '16', 'SLURM_PROCID': '0', 'SLURM_LOCALID': '0',
            'SLURM_JOB_NODELIST': 'frontier[00012-00013]'}


# --------------------------------------------------------------------------- Slurm parsing


@pytest.mark.parametrize('nodelist, host', [
    ('frontier00012', 'frontier00012'),
    ('frontier00012,frontier00020', 'frontier00012'),
    ('frontier[00012-00015,00020],login1', 'frontier00012'),
    ('frontier[00007,00012-00015]', 'frontier00007'),
    ('node[3-4]-ib,other', 'node3-ib'),
    ('jfnode', 'jfnode'),
])
def test_first_host_of_slurm_nodelist(nodelist, host):
    assert distributed.first_host(nodelist) == host


def test_slurm_port_is_in_ephemeral_range_and_differs_per_step():
    ports = {distributed.slurm_port(srun_env(SLURM_STEP_ID=str(s))) for s in range(4)}
    assert len(ports) == 4 and all(61440 <= p <= 65535 for p in ports)


# --------------------------------------------------------------------------- resolve


def test_auto_without_launcher_is_one_process():
    assert distributed.resolve(dist_config(), {}) == distributed.ProcessSettings('none')


def test_auto_in_batch_script_is_one_process_not_task_zero_of_sixteen():
    settings = distributed.resolve(dist_config(), batch_script_env())
    assert settings.num_processes == 1 and settings.coordinator_address is None


def test_auto_in_srun_step_is_slurm():
    settings = distributed.resolve(dist_config(), srun_env(procid=9, localid=1, ROCR_VISIBLE_DEVICES='1'))
    assert settings == distributed.ProcessSettings(
        'slurm', 16, 9, f'frontier00012:{distributed.slurm_port(srun_env())}', None)


def test_slurm_port_and_device_ids_from_config_win():
    settings = distributed.resolve(dist_config(mode='slurm', coordinator_port=23456, local_device_ids='2,3'),
                                   srun_env())
    assert settings.coordinator_address == 'frontier00012:23456'
    assert settings.local_device_ids == (2, 3)


def test_single_task_srun_step_starts_no_coordinator():
    assert distributed.resolve(dist_config(), srun_env(procid=0, localid=0, ntasks=1)).num_processes == 1


def test_cpu_run_under_slurm_selects_no_gpus():
    env = srun_env(localid=5, ROCR_VISIBLE_DEVICES='0,1')  # would be an error on GPUs
    assert distributed.resolve(dist_config(), env, cpu=True).local_device_ids is None


def test_mode_slurm_outside_a_step_names_the_fix():
    with pytest.raises(ConfigError, match=r'distributed\.mode.*not a task of an srun step.*Fix: launch with srun'):
        distributed.resolve(dist_config(mode='slurm'), batch_script_env())


def test_explicit_settings():
    d = dist_config(coordinator_address='10.0.0.1', coordinator_port=1234, num_processes=4, process_id=3,
                    local_device_ids='all')
    assert distributed.resolve(d, {}) == distributed.ProcessSettings('explicit', 4, 3, '10.0.0.1:1234', None)
    assert distributed.resolve(d, srun_env()).mode == 'slurm'  # auto: an srun step wins; mode=explicit forces
    d = dist_config(mode='explicit', coordinator_address='node7:999', num_processes=2, process_id=0,
                    local_device_ids='1')
    assert distributed.resolve(d, {}) == distributed.ProcessSettings('explicit', 2, 0, 'node7:999', (1,))


@pytest.mark.parametrize('changes, field', [
    (dict(coordinator_address='', mode='explicit', num_processes=2, process_id=0), 'distributed.coordinator_address'),
    (dict(coordinator_address='h', num_processes=2, process_id=0), 'distributed.coordinator_port'),
    (dict(coordinator_address='h:1', num_processes=0, process_id=0), 'distributed.num_processes'),
    (dict(coordinator_address='h:1', num_processes=2, process_id=2), 'distributed.process_id'),
    (dict(coordinator_address='h:1', num_processes=2, process_id=0, local_device_ids='0;1'),
     'distributed.local_device_ids'),
])
def test_explicit_mistakes_name_the_field(changes, field):
    with pytest.raises(ConfigError, match='config.' + field.replace('.', r'\.') + '.*Fix:'):
        distributed.resolve(dist_config(**changes), {})


def test_config_validation_of_distributed_fields():
    c = config_lib.base_config()
    c.distributed.mode = 'mpi'
    with pytest.raises(ConfigError, match=r'distributed\.mode'):
        config_lib.validate(c)
    c = config_lib.base_config()
    c.distributed.heartbeat_timeout_s = 0
    with pytest.raises(ConfigError, match=r'distributed\.heartbeat_timeout_s'):
        config_lib.validate(c)


def test_cpu_devices_are_the_jobs_total():
    assert distributed.cpu_devices_per_process(8, 1) == 8
    assert distributed.cpu_devices_per_process(8, 2) == 4
    assert distributed.cpu_devices_per_process(0, 16) == 0  # real devices
    with pytest.raises(ConfigError, match=r'mesh\.cpu_devices.*multiple of 3'):
        distributed.cpu_devices_per_process(8, 3)


# --------------------------------------------------------------------------- GPU selection


@pytest.mark.parametrize('env, per_process, ids', [
    # Frontier: --gpu-bind=closest leaves task 3 one GCD: it is device 0 of what the process sees.
    (srun_env(localid=3, ROCR_VISIBLE_DEVICES='3'), 1, None),
    # No binding: every task sees the node's 8 GCDs and takes its own.
    (srun_env(localid=5, ROCR_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'), 1, (5,)),
    # HIP_VISIBLE_DEVICES indexes inside ROCR's set, so it is the one that counts.
    (srun_env(localid=1, ROCR_VISIBLE_DEVICES='0,1,2,3', HIP_VISIBLE_DEVICES='2'), 1, None),
    # NVIDIA with Slurm's map_gpu binding (recorded on the test cluster: task 1 gets CUDA_VISIBLE_DEVICES=1).
    (srun_env(localid=1, CUDA_VISIBLE_DEVICES='1'), 1, None),
    # Two GPUs per process, node unbound: task 3 takes GPUs 6 and 7.
    (srun_env(localid=3, CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'), 2, (6, 7)),
    # Nothing set (no GPU plugin in Slurm): by local id, as JAX's own Slurm detection.
    (srun_env(localid=2), 1, (2,)),
    # devices_per_process = 0: everything the process sees.
    (srun_env(localid=2, ROCR_VISIBLE_DEVICES='0,1,2,3'), 0, None),
])
def test_gpu_selection_for_process_per_gpu(env, per_process, ids):
    assert distributed.slurm_local_device_ids(env, per_process) == ids


def test_gpu_selection_that_cannot_work_says_how_to_bind():
    env = srun_env(localid=5, ROCR_VISIBLE_DEVICES='0,1')
    with pytest.raises(ConfigError, match=r'devices_per_process = 1: .*needs GPUs \[5\] but sees 2.*gpu-bind=closest'):
        distributed.slurm_local_device_ids(env, 1)


# --------------------------------------------------------------------------- start-up failure


def test_unreachable_coordinator_fails_with_a_message_not_a_hang(tmp_path):
    """Process 1 of 2 with nobody at the coordinator's address: exit 4 after the 2 s timeout."""
    cmd = [sys.executable, '-m', 'jaxfrontier.main', '--config=configs/tiny.py', f'--workdir={tmp_path}',
           f'--config.distributed.coordinator_address=127.0.0.1:{free_port()}',
           '--config.distributed.num_processes=2', '--config.distributed.process_id=1',
           '--config.distributed.initialization_timeout_s=2']
    # Not a hang: the 2 s initialization timeout ends it (the message says so); timeout= is only a guard.
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert 'process 1 of 2 could not reach the coordinator at 127.0.0.1:' in proc.stderr
    assert 'Fix:' in proc.stderr and 'Traceback' not in proc.stderr
