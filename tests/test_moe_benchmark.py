"""`python benchmarks/moe.py` (issue 49): each dispatch's compiled bytes over `expert` beside the plan's."""

import json
import os
import subprocess
import sys

import pytest

import processes


@pytest.mark.slow  # two compiles on 8 simulated devices: ~40 s on two cores
def test_dispatch_bytes_beside_the_plan(tmp_path):
    out = tmp_path / 'moe.json'
    env = dict(os.environ, PYTHONPATH=processes.REPO)
    env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split() if 'device_count' not in f)
    proc = subprocess.run([sys.executable, 'benchmarks/moe.py', '--eps=2', '--dispatches=gather,ragged', '--steps=1',
                           '--warmup=0', f'--out={out}'], cwd=processes.REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gather, ragged = json.loads(out.read_text())
    assert (gather['dispatch'], ragged['dispatch']) == ('gather', 'ragged')
    assert gather['dispatch_B_hlo'] == gather['dispatch_B_plan'] > 0
    # The CPU runs ragged's all-gather stand-in; the plan charges the GPU op.
    assert 'ragged-all-to-all expert' in ragged['plan_bytes_by_kind']
    assert 'ragged-all-to-all expert' not in ragged['hlo_bytes_by_kind']
    assert ragged['dispatch_B_hlo'] > ragged['dispatch_B_plan'] > 0
    assert ragged['median_step_s'] > 0 and ragged['expert_B_hlo'] > ragged['dispatch_B_hlo']
    assert 'dispatch_kB_hlo' in proc.stdout and 'all-gather stand-in' in proc.stdout
