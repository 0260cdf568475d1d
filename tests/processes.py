"""Running `python -m jaxfrontier.main` as separate processes, for the multi-process tests.

Each subprocess gets the test environment without conftest's 8-device XLA flag, so that main
sizes the simulated CPU devices per process from config.mesh.cpu_devices (the job's total).
"""

import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# configs/tiny.py (data 2 x fsdp 2 x tensor 2 on 8 CPU devices) with a one-layer, 32-wide model:
# a compile of a few seconds. Every step is logged; the LR schedule does not depend on train.steps.
TINY = ('--config=configs/tiny.py', '--config.model.num_layers=1', '--config.model.d_model=32',
        '--config.model.seq_len=32', '--config.train.log_every=1', '--config.train.eval_every=0',
        '--config.train.eval_batches=1', '--config.train.progress=False', '--config.optim.decay_steps=100')


def run_main(*args: str, tiny: bool = True, module: str = 'jaxfrontier.main', env: dict | None = None,
             cwd: str = REPO, timeout: float = 600, text: bool = True) -> subprocess.CompletedProcess:
    """`python -m jaxfrontier.main ARGS` (or another jaxfrontier module) as a user runs it, output captured.

    `tiny` puts TINY's flags before ARGS (later flags win); the environment is `subprocess_env()`.
    """
    cmd = [sys.executable, '-m', module, *(TINY if tiny else ()), *args]
    return subprocess.run(cmd, cwd=cwd, env=env or subprocess_env(), capture_output=True, text=text, timeout=timeout)


def run_ok(*args: str, module: str = 'jaxfrontier.main', timeout: float = 900) -> tuple[str, str]:
    """(stdout, stderr) of `python -m MODULE ARGS` (no TINY flags), which must exit 0."""
    proc = run_main(*args, tiny=False, module=module, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout, proc.stderr


def error_line(proc: subprocess.CompletedProcess, code: int | None = 2) -> str:
    """The one `error:` line of a refused command: exit `code` (unless None), no traceback, exactly one line."""
    stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode(errors='replace')
    assert code is None or proc.returncode == code, (proc.returncode, stderr[-4000:])
    assert 'Traceback' not in stderr, stderr[-4000:]
    lines = [line for line in stderr.splitlines() if line.startswith('error:')]
    assert len(lines) == 1, stderr[-4000:]
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def subprocess_env(**more: str) -> dict[str, str]:
    """The test environment for a jaxfrontier subprocess: CPU, no fixed device count, and the
    session's compilation cache (JAX_COMPILATION_CACHE_DIR, set by conftest)."""
    env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=REPO, PYTHONUNBUFFERED='1')
    # Scripts (launch/*.sh) call `python`: the one running the tests, even from an unactivated venv.
    env['PATH'] = os.pathsep.join([os.path.dirname(sys.executable), env.get('PATH', '')])
    flags = [f for f in env.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    env['XLA_FLAGS'] = ' '.join(flags)
    env.update(more)
    return env


def read_metrics(workdir: str) -> list[dict]:
    """The rows of `<workdir>/metrics.jsonl` (written by process 0 only)."""
    path = os.path.join(workdir, 'metrics.jsonl')
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.cache
def single_process_losses(*overrides: str) -> dict[int, float]:
    """{step: loss} of steps 1..4 of TINY + overrides in one process on 8 devices (once per session).

    The losses are kept in the session's directory (conftest), which both xdist workers share:
    test_multiprocess and test_slurm compare with the same run and usually run on different
    workers. A float survives JSON exactly (repr), so a loaded reference is the computed one.
    """
    session = os.environ.get('JAXFRONTIER_TEST_SESSION_CACHE')
    key = hashlib.sha256(json.dumps(overrides).encode()).hexdigest()[:16]
    kept = os.path.join(session, f'reference_losses_{key}.json') if session else None
    if kept and os.path.exists(kept):
        with open(kept) as f:
            return {int(step): loss for step, loss in json.load(f).items()}
    workdir = tempfile.mkdtemp(prefix='jaxfrontier_reference_')
    cmd = [sys.executable, '-m', 'jaxfrontier.main', *TINY, *overrides, '--config.train.steps=4',
           f'--workdir={workdir}']
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = {row['step']: row['train/loss'] for row in read_metrics(workdir)}
    shutil.rmtree(workdir, ignore_errors=True)
    assert sorted(losses) == [1, 2, 3, 4], losses
    if kept:
        with open(f'{kept}.{os.getpid()}', 'w') as f:
            json.dump(losses, f)
        os.replace(f'{kept}.{os.getpid()}', kept)  # whole or absent for the other worker
    return losses
