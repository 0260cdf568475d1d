"""`python benchmarks/gpu_check.py --quick` runs every part of the GPU check on the CPU."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # several compiles in one process: ~1-2 minutes on two cores
def test_gpu_check_quick_runs_every_part(tmp_path):
    out = tmp_path / 'gpu_check.json'
    env = dict(os.environ, PYTHONPATH=REPO)
    env['XLA_FLAGS'] = ' '.join(f for f in env.get('XLA_FLAGS', '').split() if 'device_count' not in f)
    proc = subprocess.run([sys.executable, 'benchmarks/gpu_check.py', '--quick', f'--out={out}', '--budget_s=1500'],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record['environment']['devices'] == 8 and record['environment']['versions']['jax']
    assert record['matmul']['tflops'] > 0
    gg = record['grouped_gemm']  # benchmarks/grouped_gemm.py at its --smoke shape
    assert gg['smoke'] and {r['case'] for r in gg['rows']} == {'dense', 'even', 'skewed', 'padded'}, gg
    assert all(r['tflops'] > 0 for r in gg['rows']) and '| projection | case | shape |' in proc.stdout
    assert record['layout'].get('ok') is True, record['layout']
    assert record['checkpoint']['save_gib_per_s'] > 0 and record['checkpoint']['restore_gib_per_s'] > 0
    ran = [r for r in record['steps'] if 'step_s' in r and r.get('impl') != 'torch']
    assert {(r['attention'], r['remat']) for r in ran} == {('auto', 'full'), ('auto', 'none'), ('xla', 'none')}
    for r in ran:
        assert r['tokens_per_s'] > 0 and r['xla_peak_gib'] > 0 and r['planner_gib'] > 0, r
    assert not [r for r in record['steps'] if 'error' in r], record['steps']
    # Implementations this platform or config cannot run are listed with the reason, not dropped.
    skipped = {r['attention']: r['skipped'] for r in record['steps'] if 'skipped' in r and 'attention' in r}
    assert 'cudnn' in skipped
    torch_rows = [r for r in record['steps'] if r.get('impl') == 'torch']
    assert torch_rows and ('step_s' in torch_rows[0] or 'torch not importable' in torch_rows[0]['skipped'])
    assert '| size | impl | attention | remat |' in proc.stdout
