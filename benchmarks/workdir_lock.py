"""Cost of the workdir lock (docs/checkpoints.md "The workdir lock").

  python benchmarks/workdir_lock.py [DIR ...]

Per directory (default: a temporary one): the time to take and release the lock, and of one
lease renewal (read the record, write a private file with fsync, rename it over the lock);
the renewal runs in a background thread every train.workdir_lease_s / 10 (60 s by default),
so its share of one core is renewal time / 60 s.
"""

import json
import os
import statistics
import sys
import tempfile
import time

from jaxfrontier.run.control import workdir_lock


def measure(directory: str, renewals: int = 200) -> dict:
    os.makedirs(directory, exist_ok=True)
    t0 = time.perf_counter()
    lock = workdir_lock.WorkdirLock(directory, lease_s=1e9)  # the thread waits 1e8 s: renew by hand
    lock.acquire()
    acquire_s = time.perf_counter() - t0
    times = []
    for _ in range(renewals):
        t = time.perf_counter()
        lock.renew()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    lock.release()
    release_s = time.perf_counter() - t
    renew_s = statistics.median(times)
    return {'dir': directory, 'acquire_ms': acquire_s * 1e3, 'release_ms': release_s * 1e3,
            'renew_median_ms': renew_s * 1e3, 'renew_max_ms': max(times) * 1e3,
            'share_of_a_core_at_default_lease': renew_s / 60.0}


def main():
    dirs = sys.argv[1:] or [tempfile.mkdtemp(prefix='lock_bench_')]
    for d in dirs:
        print(json.dumps({k: round(v, 9) if isinstance(v, float) else v for k, v in measure(d).items()}))


if __name__ == '__main__':
    main()
