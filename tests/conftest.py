"""Test setup: 8 simulated CPU devices, unoptimised CPU code generation and one compilation cache
for the session, set before JAX starts; the `slurm` cluster fixture; the files with the most slow tests run first."""

import atexit
import collections
import os
import shutil
import tempfile

import pytest

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
).strip()
# LLVM's optimisation of XLA:CPU's generated code off in tests (and every subprocess, which inherits
# XLA_FLAGS): most of the suite's time is compiling, and this is the slowest part of a CPU compile
# (configs/tiny.py's train step 7.9 s -> 4.7 s, its init 2.8 s -> 1.7 s, the same losses), while
# the steps run are few and small. It changes only how the CPU code is generated, not XLA's HLO
# passes: the program, its shardings, collectives and buffer assignment (compiled memory) are
# those of a user's run, and every comparison runs both sides with the same flags. A run in the
# product keeps XLA's default (level 2). An explicit level in the caller's XLA_FLAGS wins.
if 'xla_backend_optimization_level' not in os.environ['XLA_FLAGS']:
    os.environ['XLA_FLAGS'] += ' --xla_backend_optimization_level=0'
os.environ.setdefault('JAX_PLATFORMS', 'cpu')


def _session_compile_cache() -> None:
    """JAX's persistent compilation cache, one directory for the whole test session.

    Most of the suite's time is XLA compiling, and many tests compile the same program again:
    every `python -m jaxfrontier.main` subprocess its init, steps and eager ops; tests in other
    files (and on the other xdist worker) a layout another test compiled. The controller
    creates the directory before xdist starts its workers, which inherit it through the
    environment, as every subprocess does (main's train.compile_cache='auto' keeps it). Minimum
    compile time 0: the tiny programs are the ones repeated most. Starts empty every session, as
    on the CI's clean clone, so nothing stale is ever loaded; a loaded executable is the same
    binary, so bit-for-bit comparisons between runs hold. A test of the cache itself takes its
    own (tests/test_compile_cache.py removes both variables).
    """
    if os.environ.get('JAXFRONTIER_TEST_SESSION_CACHE'):  # an xdist worker: the controller made it
        return
    path = tempfile.mkdtemp(prefix='jaxfrontier_test_cache_')
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.makedirs(os.path.join(path, 'xla'))  # JAX's entries; the session's other records (processes.py) beside it
    os.environ.update(JAXFRONTIER_TEST_SESSION_CACHE=path, JAX_COMPILATION_CACHE_DIR=os.path.join(path, 'xla'),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
                      # data.cache_dir=auto's user cache: the built-in corpus built once per session, not in ~
                      XDG_CACHE_HOME=os.path.join(path, 'user_cache'))


_session_compile_cache()

from slurm_cluster import slurm  # noqa: E402,F401  (a loopback Slurm cluster, for any test that asks)


@pytest.hookimpl(trylast=True)  # after -m has deselected: the tests that will run
def pytest_collection_modifyitems(items):
    """Files with more selected slow tests first, then files with more tests (a file keeps its order).

    Under `--dist loadfile` a worker takes whole files in this order (pytest.ini turns off
    xdist's own reordering by test count, which started the few-test, long files (test_slurm,
    test_multiprocess, test_gpu_check) last): the long files start early and short ones fill the
    end, instead of one worker finishing a long file alone. Under -m "not slow" no slow test is
    selected and the order is by test count, as xdist's. Replayed on full3.xml's per-test times
    with xdist's scheduler: makespan 2,988 s instead of 3,062 s for the full suite, 330 s for the
    fast tier either way (a summed 5,949 s and 658 s on 2 workers).
    """
    slow = collections.Counter(item.path for item in items if item.get_closest_marker('slow'))
    count = collections.Counter(item.path for item in items)
    items.sort(key=lambda item: (-slow[item.path], -count[item.path]))
