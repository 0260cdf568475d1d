"""The launch scripts: syntax, and what they run, with stub `srun`, `module`, `scontrol`, `python`.

The batch scripts are run by bash as Slurm would run them (from the submit directory, with the
job's variables), with stubs first on PATH that record their arguments and environment. This
checks the task layout, GPU binding and environment a Frontier job gets, and the preemption
path: USR1 to the batch shell reaches the training step, and the job requeues itself once the
step has exited. tests/test_slurm.py runs launch/slurm.sbatch on a real Slurm.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(REPO, 'launch')
SCRIPTS = ('frontier.sbatch', 'frontier_env.sh', 'slurm.sbatch', 'local.sh')

# Records argv and environment as one JSON line; a `python` step waits for USR1 when asked to.
STUB = r'''#!/bin/bash
python3 - "$(basename "$0")" "$@" <<'EOF' >> "$STUB_LOG"
import json, os, sys
print(json.dumps({'cmd': sys.argv[1], 'args': sys.argv[2:], 'env': dict(os.environ)}))
EOF
if [[ "$(basename "$0")" == srun && " $* " == *" python "* && -n "${STUB_WAIT_FOR_USR1:-}" ]]; then
  trap 'echo "{\"cmd\": \"srun-got-USR1\"}" >> "$STUB_LOG"; exit 0' USR1
  echo '{"cmd": "srun-waiting"}' >> "$STUB_LOG"
  for _ in $(seq 600); do sleep 0.1; done
  exit 9
fi
'''


@pytest.mark.parametrize('name', SCRIPTS)
def test_scripts_parse(name):
    subprocess.run(['bash', '-n', os.path.join(LAUNCH, name)], check=True)


def sbatch_directives(name):
    with open(os.path.join(LAUNCH, name)) as f:
        return [line.split(None, 1)[1].strip() for line in f if line.startswith('#SBATCH')]


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for cmd in ('srun', 'module', 'scontrol'):
        (bin_dir / cmd).write_text(STUB)
        (bin_dir / cmd).chmod(0o755)
    log = tmp_path / 'calls.jsonl'
    env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'NCCL_', 'FI_', 'MIOPEN_'))}
    env.update(PATH=f'{bin_dir}:{env["PATH"]}', STUB_LOG=str(log), SLURM_JOB_ID='4242', SLURM_JOB_NAME='jaxfrontier',
               SLURM_JOB_NUM_NODES='2',
               SLURM_SUBMIT_DIR=REPO, USER='tester', JF_NODE_LOCAL=str(tmp_path / 'nvme'),
               JF_RCCL_PLUGIN_DIR='/opt/aws-ofi-rccl/lib')
    env.pop('BASH_ENV', None)

    def calls():
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return env, calls


def run_batch(name, env, *args):
    return subprocess.run(['bash', os.path.join(LAUNCH, name), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)


def training_step(calls):
    steps = [c for c in calls if c['cmd'] == 'srun' and 'python' in c['args']]
    assert len(steps) == 1, calls
    return steps[0]


def test_frontier_job_layout_binding_and_environment(stubs, tmp_path):
    env, calls = stubs
    proc = run_batch('frontier.sbatch', env, 'configs/175b.py', '--config.train.steps=5')
    assert proc.returncode == 0, proc.stderr

    directives = sbatch_directives('frontier.sbatch')
    for expected in ('--ntasks-per-node=8', '--gpus-per-node=8', '--gpu-bind=closest', '--requeue'):
        assert expected in directives, directives
    assert any(re.fullmatch(r'--signal=B:USR1@\d+', d) for d in directives), directives

    step = training_step(calls())
    args = step['args']
    python_at = args.index('python')
    assert {'--ntasks-per-node=8', '--gpus-per-node=8', '--gpu-bind=closest'} <= set(args[:python_at])
    assert args[python_at:] == ['python', '-m', 'jaxfrontier.main', '--config=configs/175b.py',
                                '--workdir=workdirs/jaxfrontier-4242', '--config.train.steps=5']

    job_env = step['env']
    expected_env = {'NCCL_SOCKET_IFNAME': 'hsn0,hsn1,hsn2,hsn3', 'NCCL_NET_GDR_LEVEL': '3', 'NCCL_CROSS_NIC': '1',
                    'FI_MR_CACHE_MONITOR': 'userfaultfd', 'FI_CXI_ATS': '0', 'FI_CXI_DISABLE_HOST_REGISTER': '1',
                    'FI_CXI_DEFAULT_CQ_SIZE': '131072', 'HSA_FORCE_FINE_GRAIN_PCIE': '1',
                    'HSA_NO_SCRATCH_RECLAIM': '1', 'PYTHONUNBUFFERED': '1'}
    assert {k: job_env.get(k) for k in expected_env} == expected_env
    assert job_env['LD_LIBRARY_PATH'].split(':')[0] == '/opt/aws-ofi-rccl/lib'
    node_local = str(tmp_path / 'nvme')
    for var in ('MIOPEN_USER_DB_PATH', 'MIOPEN_CUSTOM_CACHE_DIR', 'JAX_COMPILATION_CACHE_DIR'):
        assert job_env[var].startswith(node_local + '/'), (var, job_env[var])

    modules = [c['args'] for c in calls() if c['cmd'] == 'module']
    assert ['load', 'PrgEnv-gnu'] in modules and any(m[1].startswith('rocm/') for m in modules), modules
    mkdir = [c['args'] for c in calls() if c['cmd'] == 'srun' and 'mkdir' in c['args']]
    assert mkdir and {'--nodes=2', '--ntasks=2', '--ntasks-per-node=1'} <= set(mkdir[0])  # one per node
    assert job_env['MIOPEN_USER_DB_PATH'] in mkdir[0] and job_env['JAX_COMPILATION_CACHE_DIR'] in mkdir[0]
    assert not [c for c in calls() if c['cmd'] == 'scontrol']  # finished: no requeue


def test_frontier_env_warns_without_rccl_plugin(stubs):
    env, _ = stubs
    del env['JF_RCCL_PLUGIN_DIR']
    proc = subprocess.run(['bash', '-c', 'source launch/frontier_env.sh && echo "LD=${LD_LIBRARY_PATH:-}"'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert 'JF_RCCL_PLUGIN_DIR is not set' in proc.stderr


@pytest.mark.parametrize('name', ['frontier.sbatch', 'slurm.sbatch'])
def test_time_limit_signal_checkpoints_then_requeues(stubs, name):
    """USR1 to the batch shell (Slurm's --signal=B:USR1@N) reaches the step; then `scontrol requeue`."""
    env, calls = stubs
    env['STUB_WAIT_FOR_USR1'] = '1'
    job = subprocess.Popen(['bash', os.path.join(LAUNCH, name), 'configs/tiny.py'], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not any(c['cmd'] == 'srun-waiting' for c in calls()):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        job.send_signal(signal.SIGUSR1)
        out, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert 'time limit near' in out
    kinds = [c['cmd'] for c in calls()]
    assert kinds.index('srun-got-USR1') < kinds.index('scontrol'), kinds
    assert [c['args'] for c in calls() if c['cmd'] == 'scontrol'] == [['requeue', '4242']]


def test_slurm_sbatch_runs_the_users_command(stubs):
    env, calls = stubs
    proc = run_batch('slurm.sbatch', env, 'configs/gpt.py:size=125m', '--config.train.steps=7')
    assert proc.returncode == 0, proc.stderr
    args = training_step(calls())['args']
    assert '--gpu-bind=closest' in args and '--kill-on-bad-exit=1' in args
    assert args[args.index('python'):] == ['python', '-m', 'jaxfrontier.main', '--config=configs/gpt.py:size=125m',
                                           '--workdir=workdirs/jaxfrontier-4242', '--config.train.steps=7']
    directives = sbatch_directives('slurm.sbatch')
    assert '--gpus-per-node=8' in directives and '--ntasks-per-node=8' in directives


LOCAL_PYTHON_STUB = r'''#!/bin/bash
# Process 1 fails as soon as process 0 runs; process 0 would run for a minute unless stopped.
echo "python $*" >> "$STUB_LOG"
if [[ " $* " == *"--config.distributed.process_id=1 "* ]]; then
  for _ in $(seq 300); do grep -q "process 0 running" "$STUB_LOG" && exit 3; sleep 0.1; done
  exit 1
fi
trap 'echo "process 0 stopped" >> "$STUB_LOG"; exit 143' TERM
echo "process 0 running" >> "$STUB_LOG"
for _ in $(seq 600); do sleep 0.1; done
'''


def test_local_launcher_stops_the_others_when_one_fails(tmp_path):
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'python').write_text(LOCAL_PYTHON_STUB)
    (bin_dir / 'python').chmod(0o755)
    log = tmp_path / 'calls.log'
    env = dict(os.environ, PATH=f'{bin_dir}:{os.environ["PATH"]}', STUB_LOG=str(log), JF_PORT='23456',
               JF_CPU_DEVICES_PER_PROCESS='4')
    # The stub of process 1 sleeps 60 s: only being stopped ends it before the timeout (a guard, not a measure).
    proc = subprocess.run(['bash', os.path.join(LAUNCH, 'local.sh'), '2', '--config=configs/tiny.py'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 3, proc.stderr
    lines = log.read_text().splitlines()
    assert 'process 0 stopped' in lines
    for i in range(2):
        line = next(l for l in lines if f'process_id={i}' in l)
        assert ('--config=configs/tiny.py --config.mesh.cpu_devices=8 --config.distributed.mode=explicit '
                '--config.distributed.coordinator_address=127.0.0.1:23456 '
                f'--config.distributed.num_processes=2 --config.distributed.process_id={i}') in line
