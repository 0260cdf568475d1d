"""Every XLA flag the launch scripts set is known to the installed XLA, and documented with a reason.

XLA aborts at start-up on a flag it does not know ("Unknown flag in XLA_FLAGS"). The CPU jaxlib
registers the GPU flags too (they live in XLA's shared DebugOptions), so starting JAX on the
CPU with the scripts' flags checks the names against the XLA this project installs; on a GPU
image the same test checks that image's XLA.
"""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_JAX = [sys.executable, '-c', 'import jax; jax.devices(); print("started")']


def sourced_env(preset=''):
    script = f'{preset} source launch/xla_flags.sh && echo "$XLA_FLAGS" && echo "$XLA_PYTHON_CLIENT_MEM_FRACTION"'
    out = subprocess.run(['bash', '-c', script], cwd=REPO, capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'JF_XLA_FLAGS')})
    flags, fraction = out.stdout.splitlines()
    return flags.split(), fraction


def start_jax(flags):
    env = dict(os.environ, XLA_FLAGS=' '.join(flags), JAX_PLATFORMS='cpu')
    return subprocess.run(START_JAX, env=env, capture_output=True, text=True, timeout=300)


def test_every_launch_script_sources_the_flags():
    for name in ('frontier_env.sh', 'slurm.sbatch'):
        text = open(os.path.join(REPO, 'launch', name)).read()
        assert re.search(r'^source .*xla_flags\.sh', text, re.M), name


def test_flags_are_known_to_the_installed_xla():
    flags, fraction = sourced_env()
    assert len(flags) >= 5 and all(f.startswith('--xla_gpu_') for f in flags), flags
    assert fraction == '0.90'
    out = start_jax(flags)
    assert out.returncode == 0 and 'started' in out.stdout, out.stderr[-2000:]
    # The check can fail: one misspelt flag stops XLA at start-up.
    bad = start_jax(flags + ['--xla_gpu_enable_latency_hiding_schedular=true'])
    assert bad.returncode != 0 and 'Unknown flag' in bad.stderr, bad.stderr[-2000:]


def test_users_flags_win_and_can_turn_ours_off():
    flags, _ = sourced_env("XLA_FLAGS='--xla_gpu_enable_latency_hiding_scheduler=false';")
    assert flags[-1] == '--xla_gpu_enable_latency_hiding_scheduler=false'  # XLA takes the last value
    flags, _ = sourced_env('JF_XLA_FLAGS=none;')
    assert flags == []


def test_every_flag_has_a_reason_in_the_docs():
    doc = open(os.path.join(REPO, 'docs', 'PERFORMANCE.md')).read()
    section = doc.split('## GPU flags', 1)[1].split('\n## ', 1)[0]
    for flag in sourced_env()[0]:
        name = flag.split('=')[0]
        assert name in section, f'{name} has no line in docs/PERFORMANCE.md "GPU flags"'
    assert 'XLA_PYTHON_CLIENT_MEM_FRACTION' in section
