"""A one-node Slurm cluster on loopback for the tests that submit real jobs (test_slurm.py, sweep/).

The `slurm` fixture starts munged, slurmctld and slurmd (Debian's packages; .ci/run installs
them) with the configuration in tests/slurm/, for one node with 4 CPUs and 2 fake GPUs, and
stops them by PID afterwards. Ports and directories are fresh per fixture, so two test workers
can each run a cluster.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from processes import REPO, free_port, subprocess_env

TEMPLATES = os.path.join(REPO, 'tests', 'slurm')
COMMANDS = ('munged', 'mungekey', 'slurmctld', 'slurmd', 'sbatch', 'sinfo', 'scancel', 'squeue')


def _stop(proc: subprocess.Popen) -> None:
    """Stops one daemon this fixture started, by its PID."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _fill(template: str, target: str, values: dict[str, str]) -> None:
    with open(os.path.join(TEMPLATES, template)) as f:
        text = f.read()
    for key, value in values.items():
        text = text.replace(f'@{key}@', value)
    with open(target, 'w') as f:
        f.write(text)


def _wait_idle(env, logs: str, daemons) -> None:
    deadline = time.monotonic() + 60
    while True:
        state = subprocess.run(['sinfo', '-h', '-o', '%T'], env=env, capture_output=True, text=True).stdout.strip()
        if state == 'idle':
            return
        dead = [p.args[0] for p in daemons if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tails = {name: open(os.path.join(logs, name)).read()[-1500:] for name in sorted(os.listdir(logs))}
            pytest.fail(f'Slurm did not come up (node state {state!r}, exited: {dead}): {tails}')
        time.sleep(0.5)


@pytest.fixture(scope='module')
def slurm(tmp_path_factory):
    """A running one-node Slurm cluster; yields the variables its commands need (SLURM_CONF)."""
    search = f'{os.environ.get("PATH", "")}:/usr/sbin:/sbin'  # daemons live in sbin, often not on PATH
    found = {d: shutil.which(d, path=search) for d in COMMANDS}
    missing = [d for d, path in found.items() if path is None]
    if missing:
        pytest.skip(f'Slurm is not installed here (missing {", ".join(missing)}); .ci/run installs Debian\'s '
                    'slurmctld, slurmd, slurm-client and munge so that CI always runs this test')
    if os.geteuid() != 0:
        pytest.skip('slurmd must run as root to start job steps; .ci/run runs as root')
    root = str(tmp_path_factory.mktemp('slurm'))
    for sub in ('munge', 'state', 'spool', 'log', 'dev'):
        os.makedirs(os.path.join(root, sub))
    os.chmod(os.path.join(root, 'munge'), 0o700)
    for i in range(2):
        os.symlink('/dev/null', os.path.join(root, 'dev', f'gpu{i}'))
    values = dict(DIR=root, HOSTNAME=socket.gethostname(), CTLD_PORT=str(free_port()), SLURMD_PORT=str(free_port()))
    conf = os.path.join(root, 'slurm.conf')
    _fill('slurm.conf.in', conf, values)
    _fill('gres.conf.in', os.path.join(root, 'gres.conf'), values)
    env = dict(os.environ, SLURM_CONF=conf)
    key, sock, logs = os.path.join(root, 'munge', 'munge.key'), os.path.join(root, 'munge', 'munge.socket'), \
        os.path.join(root, 'log')
    subprocess.run([found['mungekey'], '--create', f'--keyfile={key}'], check=True, capture_output=True)

    def start(*cmd):
        out = open(os.path.join(logs, os.path.basename(cmd[0]) + '.out'), 'w')  # pylint: disable=consider-using-with
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    daemons = [start(found['munged'], '--foreground', '--force', f'--socket={sock}', f'--key-file={key}',
                     f'--pid-file={root}/munge/munged.pid', f'--log-file={logs}/munged.log',
                     f'--seed-file={root}/munge/seed')]
    try:
        deadline = time.monotonic() + 20
        while not os.path.exists(sock):
            assert daemons[0].poll() is None and time.monotonic() < deadline, 'munged did not start'
            time.sleep(0.1)
        daemons.append(start(found['slurmctld'], '-D', '-f', conf))
        daemons.append(start(found['slurmd'], '-D', '-f', conf))
        _wait_idle(env, logs, daemons)
        yield {'SLURM_CONF': conf}
    finally:
        subprocess.run(['scancel', '--full', '--partition=debug'], env=env, capture_output=True)
        deadline = time.monotonic() + 30
        while (subprocess.run(['squeue', '-h'], env=env, capture_output=True, text=True).stdout.strip()
               and time.monotonic() < deadline):
            time.sleep(0.5)
        for proc in reversed(daemons):
            _stop(proc)


def sbatch(env, *args, timeout_s=900):
    """`sbatch --wait ARGS` from the repository root; returns the job's exit status."""
    proc = subprocess.run(['sbatch', '--wait', '--chdir', REPO, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def job_env(slurm, **more):
    """What the job inherits: the test's environment, CPU-only, with this interpreter first on PATH."""
    path = f'{os.path.dirname(sys.executable)}:{os.environ["PATH"]}'
    return subprocess_env(**slurm, PATH=path, **more)
