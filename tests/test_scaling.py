"""Weak and strong scaling studies (jaxfrontier.scaling) on simulated CPU devices.

The simulated devices share this machine's two cores, so the efficiencies measured here say
nothing about a cluster; the test checks the study itself: the layouts and batches of each
point, the efficiency arithmetic on the measured numbers, the shared point, the table and plot.
"""

import csv
import json
import subprocess
import sys

import pytest

from jaxfrontier import scaling
from jaxfrontier.errors import UserError
from processes import REPO, subprocess_env
from sweeps import png_axes

# tensor 1, fsdp 1: the data axis takes every device; 8 sequences per step at 4 devices.
SMALL = ('--config=configs/tiny.py', '--config.model.d_model=32', '--config.model.seq_len=32',
         '--config.mesh.tensor=1', '--config.mesh.fsdp=1', '--config.train.micro_batch=2',
         '--config.train.global_batch=8')


def run_scaling(workdir, *args, timeout=600):
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.scaling', *SMALL, f'--workdir={workdir}', *args],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=timeout)


def test_efficiency_is_throughput_per_device_against_the_smallest_run():
    records = [{'trial_id': 'a', 'status': 'ok', 'devices': 2, 'tokens_per_s': 100.0},
               {'trial_id': 'b', 'status': 'ok', 'devices': 8, 'tokens_per_s': 300.0},
               {'trial_id': 'c', 'status': 'oom', 'devices': 16}]
    rows = scaling.efficiencies(records, 'strong')
    assert [r['speedup'] for r in rows] == [1.0, 3.0, None]
    assert [r['efficiency'] for r in rows] == [1.0, 0.75, None] and {r['study'] for r in rows} == {'strong'}


@pytest.mark.parametrize('args, message', [
    (['--device_counts=4'], 'needs at least two device counts'),
    (['--device_counts=4,x'], 'not integers'),
    (['--device_counts=2,4', '--config.mesh.data=2'], 'the data axis is derived'),
    (['--device_counts=2,4', '--warmup=0'], '--warmup=0: must be >= 1'),
])
def test_bad_input_is_one_line(tmp_path, args, message):
    proc = run_scaling(tmp_path, *args, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith('error: ') and message in proc.stderr, proc.stderr
    assert 'Traceback' not in proc.stderr
    with pytest.raises(UserError):
        scaling.device_counts(['1'])


@pytest.mark.slow
def test_weak_and_strong_scaling_on_two_device_counts(tmp_path):
    proc = run_scaling(tmp_path, '--device_counts=2,4', '--warmup=2', '--steps=3')
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout
    with open(tmp_path / 'scaling.csv') as f:
        rows = list(csv.DictReader(f))
    table = {(r['study'], int(r['devices'])): r for r in rows}
    assert sorted(table) == [('strong', 2), ('strong', 4), ('weak', 2), ('weak', 4)]
    assert all(r['status'] == 'ok' for r in rows), rows
    layout = {k: (int(r['data']), int(r['micro_batch']), int(r['accum_steps']), int(r['global_batch']))
              for k, r in table.items()}
    # weak: the batch per replica is the config's (2 x 1), the global batch grows with data;
    # strong: the config's global batch 8, accumulation shrinks as data grows.
    assert layout == {('weak', 2): (2, 2, 1, 4), ('weak', 4): (4, 2, 1, 8),
                      ('strong', 2): (2, 2, 2, 8), ('strong', 4): (4, 2, 1, 8)}
    # The 4-device point is the same run in both studies: measured once.
    assert table['weak', 4]['trial_id'] == table['strong', 4]['trial_id']
    assert len((tmp_path / 'results.jsonl').read_text().splitlines()) == 3
    for study in ('weak', 'strong'):
        t2, t4 = (float(table[study, n]['tokens_per_s']) for n in (2, 4))
        assert float(table[study, 2]['efficiency']) == 1.0
        assert float(table[study, 4]['speedup']) == pytest.approx(t4 / t2)
        assert float(table[study, 4]['efficiency']) == pytest.approx((t4 / 4) / (t2 / 2))
    report = (tmp_path / 'scaling.md').read_text()
    assert report.count('| weak |') == 2 and report.count('| strong |') == 2 and '![scaling](scaling.png)' in report
    axes = png_axes(tmp_path / 'scaling.png')
    assert [(a['x'], a['y']) for a in axes] == [('devices', 'tokens/s'), ('devices', 'scaling efficiency (%)')]
    records = [json.loads(line) for line in (tmp_path / 'results.jsonl').read_text().splitlines()]
    assert all(r['tokens_per_s'] > 0 and r['compile_time_s'] > 0 for r in records)
