"""The launch scripts: syntax, and what they run, with stub `srun`, `module`, `scontrol`, `python`.

The batch scripts are run by bash as Slurm would run them (from the submit directory, with the
job's variables), with stubs first on PATH that record their arguments and environment. This
checks the task layout, GPU binding and environment a Frontier job gets (docs/frontier.md lists
each setting with its source): the RCCL network plugin module by default and NCCL_NET=OFI for
multi-node jobs, HPE's CXI settings with `--network=disable_rdzv_get`, JAX's compilation cache
on the shared file system, `-c` on every `srun`, no inherited CUDA/HIP_VISIBLE_DEVICES; and the
preemption path: USR1 to the batch shell reaches the training step, and the job requeues itself
only once the step has exited 0. launch/local.sh: a free coordinator port by default, so that
jobs side by side do not collide; SIGTERM reaches its processes, and it waits for them and
returns their status. tests/test_slurm.py runs launch/slurm.sbatch on a real Slurm.
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
SCRIPTS = ('frontier.sbatch', 'frontier_env.sh', 'slurm.sbatch', 'sweep.sbatch', 'local.sh')

# Records argv and environment as one JSON line; a `python` step waits for USR1 when asked to,
# then exits with STUB_USR1_STATUS; `module load $STUB_MISSING_MODULE` fails as Lmod's does.
STUB = r'''#!/bin/bash
python3 - "$(basename "$0")" "$@" <<'EOF' >> "$STUB_LOG"
import json, os, sys
print(json.dumps({'cmd': sys.argv[1], 'args': sys.argv[2:], 'env': dict(os.environ)}))
EOF
if [[ "$(basename "$0")" == module && " $* " == *" ${STUB_MISSING_MODULE:-none} "* ]]; then exit 1; fi
if [[ "$(basename "$0")" == srun && " $* " == *" python "* && -n "${STUB_WAIT_FOR_USR1:-}" ]]; then
  trap 'echo "{\"cmd\": \"srun-got-USR1\"}" >> "$STUB_LOG"; exit "${STUB_USR1_STATUS:-0}"' USR1
  echo '{"cmd": "srun-waiting"}' >> "$STUB_LOG"
  for _ in $(seq 600); do sleep 0.1; done
  exit 9
fi
'''

# HPE's RCCL-over-Slingshot settings (docs/frontier.md gives each one's source).
CXI_ENV = {'FI_MR_CACHE_MONITOR': 'userfaultfd', 'FI_CXI_DISABLE_HOST_REGISTER': '1',
           'FI_CXI_DEFAULT_CQ_SIZE': '131072', 'FI_CXI_DEFAULT_TX_SIZE': '2048', 'FI_CXI_RX_MATCH_MODE': 'hybrid',
           'FI_CXI_RDZV_PROTO': 'alt_read', 'FI_CXI_RDZV_EAGER_SIZE': '0', 'FI_CXI_RDZV_THRESHOLD': '0',
           'FI_CXI_RDZV_GET_MIN': '0', 'HSA_FORCE_FINE_GRAIN_PCIE': '1'}
RCCL_ENV = {'NCCL_SOCKET_IFNAME': 'hsn0,hsn1,hsn2,hsn3', 'NCCL_NET_GDR_LEVEL': 'PHB', 'NCCL_CROSS_NIC': '1'}


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
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(('SLURM_', 'NCCL_', 'FI_', 'MIOPEN_', 'JF_', 'JAX_', 'HSA_', 'CRAY_'))}
    env.update(PATH=f'{bin_dir}:{env["PATH"]}', STUB_LOG=str(log), SLURM_JOB_ID='4242', SLURM_JOB_NAME='jaxfrontier',
               SLURM_JOB_NUM_NODES='2', SLURM_JOB_ACCOUNT='ABC123', SLURM_SUBMIT_DIR=REPO, USER='tester',
               JF_NODE_LOCAL=str(tmp_path / 'nvme'), JF_LUSTRE=str(tmp_path / 'lustre'),
               CRAY_LD_LIBRARY_PATH='/opt/cray/pe/lib64', LD_LIBRARY_PATH='/usr/lib/extra',
               # what the paper's scripts export: each task would count 8 GPUs
               CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7', HIP_VISIBLE_DEVICES='0,1,2,3,4,5,6,7')
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


def cpus_per_task(srun_args):
    """srun's -c of one call (`-c N`, `-cN` or `--cpus-per-task=N`), or None."""
    for i, arg in enumerate(srun_args):
        if arg == '-c':
            return int(srun_args[i + 1])
        match = re.fullmatch(r'(?:-c|--cpus-per-task=)(\d+)', arg)
        if match:
            return int(match.group(1))
    return None


def assert_every_srun_has_cores(calls):
    sruns = [c['args'] for c in calls if c['cmd'] == 'srun']
    assert sruns and all(cpus_per_task(a) for a in sruns), sruns


def test_frontier_job_layout_binding_and_environment(stubs, tmp_path):
    env, calls = stubs
    proc = run_batch('frontier.sbatch', env, 'configs/175b.py', '--config.train.steps=5')
    assert proc.returncode == 0, proc.stderr

    directives = sbatch_directives('frontier.sbatch')
    for expected in ('--ntasks-per-node=8', '--gpus-per-node=8', '--gpu-bind=closest', '--requeue',
                     '--constraint=nvme', '--network=disable_rdzv_get'):
        assert expected in directives, directives
    assert any(re.fullmatch(r'--signal=B:USR1@\d+', d) for d in directives), directives

    step = training_step(calls())
    args = step['args']
    python_at = args.index('python')
    assert {'--ntasks-per-node=8', '--gpus-per-node=8', '--gpu-bind=closest'} <= set(args[:python_at])
    assert cpus_per_task(args[:python_at]) == 7
    assert args[python_at:] == ['python', '-m', 'jaxfrontier.main', '--config=configs/175b.py',
                                '--workdir=workdirs/jaxfrontier-4242', '--config.train.steps=5']
    assert_every_srun_has_cores(calls())

    job_env = step['env']
    expected_env = {**RCCL_ENV, **CXI_ENV, 'NCCL_NET': 'OFI', 'PYTHONUNBUFFERED': '1'}  # 2 nodes: OFI or fail
    assert {k: job_env.get(k) for k in expected_env} == expected_env
    for dropped in ('FI_CXI_ATS', 'HSA_NO_SCRATCH_RECLAIM', 'CUDA_VISIBLE_DEVICES', 'HIP_VISIBLE_DEVICES'):
        assert dropped not in job_env, dropped
    assert job_env['LD_LIBRARY_PATH'].split(':') == ['/opt/cray/pe/lib64', '/usr/lib/extra']
    node_local = str(tmp_path / 'nvme')
    for var in ('MIOPEN_USER_DB_PATH', 'MIOPEN_CUSTOM_CACHE_DIR'):
        assert job_env[var].startswith(node_local + '/'), (var, job_env[var])
    # JAX's cache on the shared file system, per project and user, created once by the batch script.
    cache = str(tmp_path / 'lustre' / 'abc123' / 'scratch' / 'tester' / 'jax_cache')
    assert job_env['JAX_COMPILATION_CACHE_DIR'] == cache and os.path.isdir(cache)

    modules = [c['args'] for c in calls() if c['cmd'] == 'module']
    assert modules == [['load', 'PrgEnv-gnu'], ['load', 'cpe/26.03'], ['load', 'rocm/7.0.2'],
                       ['load', 'craype-accel-amd-gfx90a'], ['load', 'rccl-net-plugin']], modules
    mkdir = [c['args'] for c in calls() if c['cmd'] == 'srun' and 'mkdir' in c['args']]
    assert mkdir and {'--nodes=2', '--ntasks=2', '--ntasks-per-node=1'} <= set(mkdir[0])  # one per node
    assert job_env['MIOPEN_USER_DB_PATH'] in mkdir[0]
    assert not [c for c in calls() if c['cmd'] == 'scontrol']  # finished: no requeue


def source_env(env, command='env -0'):
    """`source launch/frontier_env.sh` as a batch script does; returns the process and the environment after."""
    proc = subprocess.run(['bash', '-c', f'set -e; source launch/frontier_env.sh; {command}'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=30)
    after = dict(item.split('=', 1) for item in proc.stdout.split('\0') if '=' in item)
    return proc, after


def test_frontier_env_single_node_and_own_plugin_build(stubs):
    env, calls = stubs
    env.update(SLURM_JOB_NUM_NODES='1', JF_RCCL_PLUGIN_DIR='/opt/aws-ofi-nccl/lib', FI_MR_CACHE_MONITOR='kdreg2')
    proc, after = source_env(env)
    assert proc.returncode == 0, proc.stderr
    assert 'NCCL_NET' not in after  # one node: RCCL needs no network plugin
    assert after['LD_LIBRARY_PATH'].split(':')[:2] == ['/opt/cray/pe/lib64', '/opt/aws-ofi-nccl/lib']
    assert ['load', 'rccl-net-plugin'] not in [c['args'] for c in calls() if c['cmd'] == 'module']
    assert after['FI_MR_CACHE_MONITOR'] == 'kdreg2'  # set already (by the plugin module or the user): kept


def test_frontier_env_missing_plugin_module_fails_multi_node_jobs_at_start(stubs):
    env, _ = stubs
    env['STUB_MISSING_MODULE'] = 'rccl-net-plugin'
    proc, after = source_env(env)
    assert proc.returncode == 0, proc.stderr
    assert 'could not load module rccl-net-plugin' in proc.stderr and 'JF_RCCL_PLUGIN_DIR' in proc.stderr
    assert after['NCCL_NET'] == 'OFI'  # RCCL then stops at start instead of running over TCP sockets


def test_frontier_env_without_node_local_nvme_says_fix(stubs, tmp_path):
    """Any job sourcing it (launch/sweep.sbatch with JF_ENV, salloc) without -C nvme stops with the fix."""
    env, calls = stubs
    del env['JF_NODE_LOCAL']  # default /mnt/bb/tester: absent here, as on a node without -C nvme
    env['JF_ENV'] = 'launch/frontier_env.sh'
    proc = run_batch('sweep.sbatch', env, 'configs/tiny.py')
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith('error: /mnt/bb/tester does not exist') and '-C nvme' in proc.stderr
    assert not [c for c in calls() if c['cmd'] == 'srun']


def test_frontier_env_cache_dir_override_and_no_project(stubs):
    env, _ = stubs
    proc, after = source_env(dict(env, JF_JAX_CACHE='/lustre/orion/xyz/proj-shared/cache'))
    assert after['JAX_COMPILATION_CACHE_DIR'] == '/lustre/orion/xyz/proj-shared/cache'
    del env['SLURM_JOB_ACCOUNT']
    proc, after = source_env(env)
    assert proc.returncode == 0 and 'JAX_COMPILATION_CACHE_DIR' not in after
    assert "JAX's compilation cache is off" in proc.stderr


@pytest.mark.parametrize('step_status', [0, 1])
@pytest.mark.parametrize('name', ['frontier.sbatch', 'slurm.sbatch'])
def test_time_limit_signal_checkpoints_then_requeues_after_clean_stop(stubs, name, step_status):
    """USR1 to the batch shell (Slurm's --signal=B:USR1@N) reaches the step; `scontrol requeue` only after exit 0."""
    env, calls = stubs
    env.update(STUB_WAIT_FOR_USR1='1', STUB_USR1_STATUS=str(step_status))
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
    assert job.returncode == step_status, err
    assert 'time limit near' in out
    kinds = [c['cmd'] for c in calls()]
    assert 'srun-got-USR1' in kinds, kinds
    requeues = [c['args'] for c in calls() if c['cmd'] == 'scontrol']
    if step_status == 0:
        assert kinds.index('srun-got-USR1') < kinds.index('scontrol'), kinds
        assert requeues == [['requeue', '4242']]
    else:
        assert requeues == [] and 'not requeueing: the training step exited with status 1' in err


def test_slurm_sbatch_runs_the_users_command(stubs):
    env, calls = stubs
    env.update(SLURM_CPUS_ON_NODE='56', SLURM_NTASKS_PER_NODE='8')
    proc = run_batch('slurm.sbatch', env, 'configs/gpt.py:size=125m', '--config.train.steps=7')
    assert proc.returncode == 0, proc.stderr
    args = training_step(calls())['args']
    assert '--gpus-per-task=1' in args and '--kill-on-bad-exit=1' in args and '--gpu-bind=closest' not in args
    assert cpus_per_task(args) == 7  # the node's 56 CPUs among its 8 tasks
    assert args[args.index('python'):] == ['python', '-m', 'jaxfrontier.main', '--config=configs/gpt.py:size=125m',
                                           '--workdir=workdirs/jaxfrontier-4242', '--config.train.steps=7']
    directives = sbatch_directives('slurm.sbatch')
    assert '--gpus-per-node=8' in directives and '--ntasks-per-node=8' in directives

    env.update(SLURM_CPUS_PER_TASK='3', SLURM_NTASKS_PER_NODE='', SLURM_TASKS_PER_NODE='8(x2)')
    assert run_batch('slurm.sbatch', env, 'configs/tiny.py').returncode == 0
    assert cpus_per_task([c for c in calls() if c['cmd'] == 'srun'][-1]['args']) == 3  # the job's --cpus-per-task
    assert_every_srun_has_cores(calls())


def local_sh(tmp_path, stub, num_processes=2, **env):
    """Popen of launch/local.sh with `stub` as python; its log file."""
    bin_dir, log = tmp_path / 'bin', tmp_path / 'calls.log'
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / 'python').write_text(stub)
    (bin_dir / 'python').chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if k != 'JF_PORT'}
    full_env.update(PATH=f'{bin_dir}:{os.environ["PATH"]}', STUB_LOG=str(log), **env)
    proc = subprocess.Popen(['bash', os.path.join(LAUNCH, 'local.sh'), str(num_processes), '--config=configs/tiny.py'],
                            cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, log


def wait_for_lines(log, text, count, proc):
    deadline = time.monotonic() + 30
    while not (log.exists() and log.read_text().count(text) >= count):
        assert proc.poll() is None and time.monotonic() < deadline, (proc.communicate(), log.read_text())
        time.sleep(0.05)


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
    proc, log = local_sh(tmp_path, LOCAL_PYTHON_STUB, JF_PORT='23456', JF_CPU_DEVICES_PER_PROCESS='4')
    # The stub of process 1 sleeps 60 s: only being stopped ends it before the timeout (a guard, not a measure).
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == 3, err
    lines = log.read_text().splitlines()
    assert 'process 0 stopped' in lines
    for i in range(2):
        line = next(l for l in lines if f'process_id={i}' in l)
        assert ('--config=configs/tiny.py --config.mesh.cpu_devices=8 --config.distributed.mode=explicit '
                '--config.distributed.coordinator_address=127.0.0.1:23456 '
                f'--config.distributed.num_processes=2 --config.distributed.process_id={i}') in line


# Like the trainer: on SIGTERM finish the step (a second here), then exit; status 7 to see it passed on.
TERM_STUB = r'''#!/bin/bash
args="$*"; id="${args##*process_id=}"; id="${id%% *}"
trap 'echo "process ${id} got TERM" >> "$STUB_LOG"; sleep 1; echo "process ${id} exiting" >> "$STUB_LOG"; exit 7' TERM
echo "process ${id} running" >> "$STUB_LOG"
for _ in $(seq 600); do sleep 0.1; done
exit 9
'''


def test_local_launcher_passes_sigterm_on_and_waits_for_its_processes(tmp_path):
    proc, log = local_sh(tmp_path, TERM_STUB)
    try:
        wait_for_lines(log, 'running', 2, proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = log.read_text().splitlines()  # as the script returned: both processes had exited
    assert proc.returncode == 7, (err, lines)
    assert {'process 0 got TERM', 'process 1 got TERM', 'process 0 exiting', 'process 1 exiting'} <= set(lines)


# Process 0 holds the coordinator's port, as jax.distributed's service does, until told to exit.
PORT_STUB = r'''#!/bin/bash
[[ " $* " == *"process_id=0 "* ]] || exit 0
args="$*"; port="${args##*127.0.0.1:}"; port="${port%% *}"
exec python3 -c '
import os, socket, sys, time
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
except OSError as e:
    open(os.environ["STUB_LOG"], "a").write(f"port {sys.argv[1]} taken\n"); sys.exit(134)
open(os.environ["STUB_LOG"], "a").write(f"port {sys.argv[1]} bound\n")
while not os.path.exists(os.environ["STUB_LOG"] + ".release"):
    time.sleep(0.05)
' "$port"
'''


def test_local_launcher_jobs_side_by_side_get_their_own_port(tmp_path):
    first, log = local_sh(tmp_path, PORT_STUB)
    second = None
    try:
        wait_for_lines(log, 'bound', 1, first)
        second, _ = local_sh(tmp_path, PORT_STUB)  # starts while the first job's coordinator holds its port
        deadline = time.monotonic() + 30
        while not re.search(r'port \d+ (bound|taken)\n.*port \d+ (bound|taken)', log.read_text(), re.S):
            assert time.monotonic() < deadline and second.poll() is None, log.read_text()
            time.sleep(0.05)
        (tmp_path / 'calls.log.release').write_text('')
        assert first.wait(timeout=30) == 0 and second.wait(timeout=30) == 0, log.read_text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    ports = re.findall(r'port (\d+) bound', log.read_text())
    assert len(ports) == 2 and len(set(ports)) == 2, log.read_text()
