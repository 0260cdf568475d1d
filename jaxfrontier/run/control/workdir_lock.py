"""One run per workdir: `<workdir>/workdir.lock`, created atomically, with a renewed lease.

Two runs writing one workdir (a double `sbatch`, a requeue that overlaps the old job, a
second terminal) would interleave metrics.jsonl and overwrite each other's checkpoints. The
first process to start owns the workdir; a second refuses at start (exit 2) naming the
holder.

Why not `flock`/`fcntl`: on a parallel file system (Lustre, GPFS, NFS) those are off, local
to one client, or not released when a node dies. What every such file system does atomically
is create a name that does not exist yet: the holder writes its record to a private file and
`link()`s it to the lock's name (falling back to `O_CREAT | O_EXCL` where hard links are not
supported), so the lock appears with its contents complete. A background thread renews the
lease (`renewed_at` in the record) every `lease_s / 10`. A lock is taken over, with a
warning, when its holder is gone:

- same host and its pid no longer exists (killed, crashed);
- same Slurm job id as this process (a requeued job restarting on its own workdir);
- its lease was not renewed for `config.train.workdir_lease_s` (a dead node elsewhere).

Taking over renames the stale lock aside (atomic) and creates a fresh one; two processes
that both find it stale cannot both win: only one `link()` succeeds. In a multi-process job
process 0 holds the lock for the job and every process agrees on the outcome.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Mapping

from absl import logging

from jaxfrontier import distributed
from jaxfrontier import errors

LOCK_NAME = 'workdir.lock'


def _now_iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec='seconds')


def describe(holder: Mapping[str, Any]) -> str:
    """`host h, pid p, Slurm job j, started 2026-...` for messages."""
    job = holder.get('slurm_job_id') or 'none'
    return (f'host {holder.get("host")}, pid {holder.get("pid")}, Slurm job {job}, '
            f'started {holder.get("start_time")}')


def stale_reason(holder: Mapping[str, Any], me: Mapping[str, Any], lease_s: float,
                 now: float | None = None) -> str | None:
    """Why `holder` no longer holds the lock (None: it is live).

    Args:
      holder: the record read from the lock file.
      me: this process's record (host, pid, slurm_job_id).
      lease_s: a lease older than this is expired.
      now: the time to compare the lease with (time.time()).
    """
    now = time.time() if now is None else now
    if holder.get('host') == me['host'] and holder.get('pid') == me['pid']:
        return 'it is this process'
    if (holder.get('host') == me['host'] and isinstance(holder.get('pid'), int)
            and not distributed.pid_alive(holder['pid'])):
        return f'its process {holder["pid"]} on this host is gone'
    if me.get('slurm_job_id') and holder.get('slurm_job_id') == me['slurm_job_id']:
        return f'it is this Slurm job ({me["slurm_job_id"]}), requeued'
    renewed = holder.get('renewed_at')
    if not isinstance(renewed, (int, float)) or now - renewed > lease_s:
        age = f'{now - renewed:.0f} s' if isinstance(renewed, (int, float)) else 'never'
        return f'its lease was last renewed {age} ago (> train.workdir_lease_s={lease_s:g})'
    return None


class WorkdirLock:
    """The lock on one workdir. `acquire()` once the workdir exists; `release()` at exit (idempotent).

    Args:
      workdir: the run's directory.
      lease_s: config.train.workdir_lease_s; the lease is renewed every lease_s / 10.
      env: the environment (SLURM_JOB_ID).
      warn: where the takeover warning goes.
    """

    def __init__(self, workdir: str, lease_s: float, env: Mapping[str, str] = os.environ,
                 warn: Callable[[str], None] = logging.warning):
        self.path = os.path.join(workdir, LOCK_NAME)
        self.lease_s = float(lease_s)
        self.warn = warn
        start = time.time()
        self.record = {'host': socket.gethostname(), 'pid': os.getpid(),
                       'slurm_job_id': env.get('SLURM_JOB_ID') or None, 'start_time': _now_iso(start),
                       'renewed_at': start, 'token': uuid.uuid4().hex}
        self.held = False
        self.renewals = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ files
    def _private_path(self) -> str:
        return f'{self.path}.{self.record["host"]}.{self.record["pid"]}.{self.record["token"][:8]}'

    def _write(self, path: str) -> None:
        with open(path, 'w') as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())

    def _create(self) -> bool:
        """Creates the lock with this record, atomically; False if it exists."""
        private = self._private_path()
        self._write(private)
        try:
            os.link(private, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: exclusive create (contents follow a moment later)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, 'w') as f:
                json.dump(self.record, f)
            return True
        finally:
            os.remove(private)

    def read(self) -> dict[str, Any] | None:
        """The record in the lock file; {} if unreadable; None if there is none."""
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    # ------------------------------------------------------------------ acquire / release
    def acquire(self) -> None:
        """Takes the lock, or a dead holder's; raises UserError naming a live holder."""
        for _ in range(5):
            if self._create():
                self.held = True
                self._start_renewing()
                return
            holder = self.read()
            if holder is None:
                continue  # released meanwhile
            if holder == {}:  # being written (O_EXCL fallback) or damaged: judged by its age
                holder = {'renewed_at': os.stat(self.path).st_mtime} if os.path.exists(self.path) else {}
            reason = stale_reason(holder, self.record, self.lease_s)
            if reason is None:
                raise errors.UserError(
                    f'--workdir={os.path.dirname(self.path)!r} is in use by another run ({describe(holder)}; '
                    f'lease renewed {time.time() - holder["renewed_at"]:.0f} s ago). Fix: wait for it to end, '
                    'stop it, or pick another --workdir; a holder that died is taken over automatically '
                    f'(same host and pid gone, same Slurm job, or lease older than train.workdir_lease_s='
                    f'{self.lease_s:g} s), or remove {self.path} if you are sure no run uses the workdir.')
            aside = f'{self.path}.stale.{self.record["token"][:8]}'
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            with open(aside) as f:
                moved = f.read()
            if holder.get('token') is not None and json.loads(moved or '{}').get('token') != holder['token']:
                # another process took it over between our read and rename: give it back
                try:
                    os.link(aside, self.path)
                finally:
                    os.remove(aside)
                continue
            os.remove(aside)
            self.warn(f'workdir lock: taking over {self.path} from {describe(holder)}: {reason}')
        raise errors.UserError(f'{self.path}: could not take the workdir lock (it changed hands 5 times). '
                               'Fix: make sure only one run uses this --workdir')

    def renew(self) -> bool:
        """Writes a fresh `renewed_at`; False (and stops renewing) if the lock is no longer ours."""
        holder = self.read()
        if not holder or holder.get('token') != self.record['token']:
            self.warn(f'workdir lock: {self.path} is no longer held by this run ({describe(holder or {})})')
            self._stop.set()
            return False
        self.record['renewed_at'] = time.time()
        private = self._private_path()
        self._write(private)
        os.replace(private, self.path)  # atomic: a reader sees the old or the new record
        self.renewals += 1
        return True

    def _start_renewing(self) -> None:
        interval = max(self.lease_s / 10, 0.05)

        def loop():
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except OSError as e:  # a transient file-system error must not kill the run
                    self.warn(f'workdir lock: renewing {self.path} failed: {e}')

        self._thread = threading.Thread(target=loop, name='workdir-lock-lease', daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stops renewing and removes the lock if it is still this run's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.held:
            holder = self.read()
            if holder and holder.get('token') == self.record['token']:
                os.remove(self.path)
            self.held = False

    def __enter__(self) -> WorkdirLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()


def acquire_for_job(workdir: str, lease_s: float) -> WorkdirLock:
    """Process 0 takes the lock for the whole job; every process raises the same UserError if it cannot."""
    import jax  # pylint: disable=g-import-not-at-top  (the module itself stays JAX-free for its tests)
    from jaxfrontier.run.control import preemption  # pylint: disable=g-import-not-at-top

    lock = WorkdirLock(workdir, lease_s)
    refusal = None
    if jax.process_index() == 0:
        try:
            lock.acquire()
        except errors.UserError as e:
            refusal = str(e)
    if jax.process_count() > 1:
        from jax._src.distributed import global_state  # pylint: disable=g-import-not-at-top  (no public API)
        refusal = preemption.agree_any(global_state.client, 'jaxfrontier/workdir_lock', refusal, jax.process_index())
    if refusal is not None:
        lock.release()
        raise errors.UserError(refusal)
    return lock
