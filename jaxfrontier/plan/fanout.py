"""`--mode=verify` over several local processes, when its mesh needs more devices than one process can run.

XLA:CPU runs the thunks of a program concurrently on one intra-op thread pool per process, and
PjRt's CPU client caps that pool at 256 threads (`kMaxIntraOpThreads`, xla/pjrt/cpu/cpu_client.cc).
A simulated device's collective blocks one of those threads until every participant has arrived,
so with more than 256 devices in one process the first 256 to arrive hold every thread and the rest
never run: a deadlock, not an error (configs/1t.py at data 1 is 512 devices: it compiled, then
256 device threads waited at a collective-permute forever). No XLA flag lifts the cap. So past
`PER_PROCESS_MAX` devices, verify starts P processes of itself on this machine, each with 1/P of
the devices, joined by `jax.distributed` on localhost (cross-process CPU collectives: gloo, as
tests/test_multiprocess.py trains). The parent imports no JAX: it waits, relays a failure as one
line, and leaves the certificate to process 0.

No JAX import: `main` decides before JAX starts.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from jaxfrontier import distributed
from jaxfrontier.errors import UserError

PER_PROCESS_MAX = 256  # simulated CPU devices one process can run collectives on (kMaxIntraOpThreads, above)
WORKER_ENV = 'JF_VERIFY_WORKER'  # set by the parent for each worker: 'process_id/num_processes@port'
POLL_S = 0.5
# Each process compiles the whole program (about 2 GB resident for configs/1t.py's shrunk one):
# more processes than this multiply memory and compile time past what a workstation has.
MAX_PROCESSES = 8
# Smaller collectives (a tensor or pipeline group) and the process's own files need sockets too.
FILES_SHARE = 0.8
AFTER_FIRST_S = 300  # once process 0 is done, the others get this long to leave jax.distributed


@dataclasses.dataclass(frozen=True)
class Worker:
    """One process of a multi-process verify: its id, the process count and the coordinator's port."""

    process_id: int
    num_processes: int
    port: int

    def encode(self) -> str:
        return f'{self.process_id}/{self.num_processes}@{self.port}'

    @classmethod
    def decode(cls, text: str) -> 'Worker':
        try:
            ids, port = text.split('@')
            process_id, count = ids.split('/')
            return cls(int(process_id), int(count), int(port))
        except ValueError:
            raise UserError(f'{WORKER_ENV}={text!r} is not process_id/num_processes@port. Fix: leave it unset: '
                            '--mode=verify sets it for the processes it starts') from None

    def settings(self) -> distributed.ProcessSettings:
        """How this worker joins the others (`distributed.initialize`'s explicit mode, on localhost)."""
        return distributed.ProcessSettings('explicit', self.num_processes, self.process_id, f'127.0.0.1:{self.port}')


def process_count(num_devices: int, per_process_max: int = PER_PROCESS_MAX, open_files: int | None = None) -> int:
    """The fewest processes of at most `per_process_max` devices each that split `num_devices` evenly,
    and, with several, whose sockets fit `open_files` (see `sockets_per_process`).
    """
    count = -(-num_devices // per_process_max)
    while num_devices % count or (count > 1 and open_files is not None
                                  and sockets_per_process(num_devices, count) > FILES_SHARE * open_files):
        count += 1
    return count


def workers_needed(num_devices: int, per_process_max: int = PER_PROCESS_MAX) -> int:
    """`process_count` under this process's open-files limit (raised to its hard limit here).

    Raises:
      UserError: more than MAX_PROCESSES would be needed; names the limit that set the count.
    """
    files = open_files()
    count = process_count(num_devices, per_process_max, files)
    if count > MAX_PROCESSES:
        by_devices = process_count(num_devices, per_process_max)
        raise UserError(
            f'--mode=verify: {num_devices} simulated devices would need {count} local processes here'
            + (f' (the open-files limit {files}, ulimit -Hn, allows {num_devices // count} devices a process: gloo '
               f'opens one socket per pair of devices of a collective, {num_devices - 1} for each device of a '
               f'collective over all)' if count > by_devices else '')
            + f', more than {MAX_PROCESSES} (each compiles the whole program). Fix: '
            + ('raise the hard limit of open files (/etc/security/limits.conf nofile, docker run --ulimit '
               f'nofile={2 * sockets_per_process(num_devices, by_devices)}), or ' if count > by_devices else '')
            + 'verify with fewer devices (--verify_max_devices) or on a larger machine')
    return count


def sockets_per_process(num_devices: int, num_processes: int) -> int:
    """Sockets one process opens for a collective over every device, in gloo (an estimate).

    Across processes every collective of XLA:CPU goes through gloo, even between two devices of
    one process, and gloo connects each pair of a collective's devices with its own TCP socket:
    a process holds (its devices) x (all devices - 1) of them for one collective over every
    device (the loss, the gradient norm). configs/1t.py at data 1 in 2 processes: 256 x 511 =
    130,816, past a 20,000 limit ("accept: Too many open files", then an abort).
    """
    return num_devices // num_processes * (num_devices - 1)


def open_files() -> int:
    """This process's hard limit of open files, made its soft limit too (the workers inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard if hard != resource.RLIM_INFINITY else 1 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _last_line(path: str) -> str:
    """A failed worker's last line of stderr, or the line that says why it aborted."""
    with open(path, errors='replace') as f:
        lines = [line.strip() for line in f if line.strip()]
    cause = [line for line in lines if line.startswith(('what():', 'error:', 'F0', 'E0'))]
    return (cause or lines or ['(no output)'])[-1]


def _end_with_parent() -> None:
    """In a worker, before it starts: SIGKILL when the parent dies (Linux's PR_SET_PDEATHSIG).

    A parent killed outright (a sweep's trial timeout, `timeout`, SIGKILL) runs no clean-up, and
    its workers would compute on, holding cores and memory, until their collectives time out.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own clean-up is all there is
        pass


def run_workers(argv: Sequence[str], num_processes: int, env: Mapping[str, str]) -> int:
    """Runs `python -m jaxfrontier.main argv[1:]` as `num_processes` workers; returns process 0's status.

    Process 0 writes to this process's stdout and stderr (the certificate, its progress); the
    others' stderr goes to temporary files, read back only when one fails. A worker that ends
    with a non-zero status ends the rest at once (they would otherwise wait on its collectives
    for XLA's timeout), and its last line of stderr is relayed as one line.
    """
    port = _free_port()
    procs, logs = [], []
    with tempfile.TemporaryDirectory(prefix='jaxfrontier_verify_') as log_dir:
        try:
            for process_id in range(num_processes):
                worker = Worker(process_id, num_processes, port)
                child_env = dict(env, **{WORKER_ENV: worker.encode()})
                log = None if process_id == 0 else os.path.join(log_dir, f'process_{process_id}.log')
                out = None if log is None else open(log, 'w')  # pylint: disable=consider-using-with
                procs.append(subprocess.Popen([sys.executable, '-m', 'jaxfrontier.main', *argv[1:]], env=child_env,
                                              stdout=None if out is None else subprocess.DEVNULL, stderr=out,
                                              preexec_fn=_end_with_parent))
                logs.append(log)
                if out is not None:
                    out.close()
            # Not 'verify: ...': a sweep takes the last line so prefixed for the certificate's.
            print(f'mode=verify: {num_processes} local processes (more than {PER_PROCESS_MAX} simulated devices '
                  'deadlock in one: plan/fanout.py)', file=sys.stderr, flush=True)
            return _wait(procs, logs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def _wait(procs: list[subprocess.Popen], logs: list[str | None]) -> int:
    """Process 0's status once every worker ended; the first failure ends the others (see run_workers)."""
    first_done = None
    while True:
        statuses = [p.poll() for p in procs]
        failed = [i for i, s in enumerate(statuses) if s not in (None, 0) and not (i == 0 and s == 1)]
        if failed:
            i = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.kill()
            status = statuses[i] if statuses[i] > 0 else 128 - statuses[i]  # killed by signal n: 128 + n
            if i == 0 and status in (2, 3, 4):  # process 0 wrote its one-line error to this process's stderr
                return status
            why = 'its output above' if i == 0 else _last_line(logs[i])
            print(f'error: verify process {i} of {len(procs)} ended with status {status}: {why}', file=sys.stderr)
            return status
        if all(s is not None for s in statuses):
            return statuses[0]
        if statuses[0] is not None:
            first_done = first_done or time.monotonic()
            if time.monotonic() - first_done > AFTER_FIRST_S:
                late = [i for i, s in enumerate(statuses) if s is None]
                print(f'error: verify processes {late} still running {AFTER_FIRST_S} s after process 0 ended; '
                      'ended them', file=sys.stderr)
                return statuses[0] or 1
        time.sleep(POLL_S)
