"""launch/restarts.sh's restart loop (`jf_train`) with stand-ins for srun and scontrol: no Slurm needed.

The stand-in srun plays a scripted attempt per call (the failure lines a real srun prints, then
its status: 143 whenever it ended the other tasks, as tests/test_slurm.py's cluster shows) and
records its arguments. Checked: which failures restart and which do not, the spare-node
arithmetic and the exclusion of a killed task's node, the restarts.jsonl record, and the requeue
once the restarts are spent. The real cluster's run is tests/test_slurm.py's.
"""

import json
import os
import subprocess

import pytest

from processes import REPO

# Attempt k (1-based) runs `attempts/k`: its srun error lines on stderr, then `exit STATUS`.
_SRUN = '''#!/bin/bash
n=$(( $(cat "$FAKE/count" 2>/dev/null || echo 0) + 1 ))
echo "$n" > "$FAKE/count"
echo "srun $*" >> "$FAKE/calls"
source "$FAKE/attempts/$n"
'''
_SCONTROL = '#!/bin/bash\necho "scontrol $*" >> "$FAKE/calls"\n'
KILLED = 'echo "srun: error: node2: task 9: Killed" >&2; exit 143'
NODE_FAILURE = 'echo "srun: error: Node failure on node3" >&2; exit 1'
DONE = 'exit 0'


def exited(code, node='node1', task=0):
    return (f'echo "srun: error: {node}: task {task}: Exited with exit code {code}" >&2; '
            f'echo "srun: error: node2: tasks 1-7: Terminated" >&2; exit 143')


def run_train(tmp_path, attempts, keep=False, **env):
    """jf_train with these attempts; `keep`: in the workdir of an earlier call (a requeued job's)."""
    fake = tmp_path / ('fake_again' if keep else 'fake')
    (fake / 'attempts').mkdir(parents=True)
    for name, text in (('srun', _SRUN), ('scontrol', _SCONTROL)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    for k, body in enumerate(attempts, 1):
        (fake / 'attempts' / str(k)).write_text(body + '\n')
    workdir = tmp_path / 'workdir'
    (workdir / 'checkpoints' / '20').mkdir(parents=True, exist_ok=keep)
    (workdir / 'metrics.jsonl').write_text('{"step": 24, "train/loss": 3.0}\n')
    variables = dict(os.environ, FAKE=str(fake), PATH=f'{fake}:{os.environ["PATH"]}', WORKDIR=str(workdir),
                     **{'SLURM_JOB_ID': '77', 'SLURM_JOB_NUM_NODES': '3', **env})
    proc = subprocess.run(['bash', '-c', 'set -euo pipefail; source launch/restarts.sh; '
                           'jf_train 8 --kill-on-bad-exit=1 python -m jaxfrontier.main'],
                          cwd=REPO, env=variables, capture_output=True, text=True, timeout=60)
    calls = (fake / 'calls').read_text().splitlines()
    log = workdir / 'restarts.jsonl'
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls, records


def test_lost_process_and_hang_restart_then_finish(tmp_path):
    proc, calls, records = run_train(tmp_path, [exited(5), exited(4, 'node2', 3), DONE])
    assert proc.returncode == 0, proc.stderr
    assert calls == ['srun --kill-on-bad-exit=1 python -m jaxfrontier.main'] * 3  # no spares: nothing excluded
    assert [(r['event'], r['restart'], r['code'], r['excluded']) for r in records] == [
        ('restart', 1, '5', ''), ('restart', 2, '4', '')]
    assert records[0]['checkpoint_step'] == 20 and records[0]['last_step'] == 24 and records[0]['lost_steps'] == 4
    assert records[0]['failure'] == 'task on node1: exit 5' and records[0]['job'] == '77'
    assert 'jaxfrontier: restart 1/3 of job 77 inside its allocation: task on node1: exit 5' in proc.stderr


def test_a_killed_task_s_node_is_excluded_where_spares_were_asked_for(tmp_path):
    proc, calls, records = run_train(tmp_path, [KILLED, NODE_FAILURE, DONE], JF_SPARE_NODES='2',
                                     SLURM_JOB_NUM_NODES='5')
    assert proc.returncode == 0, proc.stderr
    base = 'srun --nodes=3 --ntasks=24'  # 5 nodes, 2 spares: 3 nodes of 8 tasks
    tail = ' --kill-on-bad-exit=1 python -m jaxfrontier.main'
    assert calls == [base + tail, base + ' --exclude=node2' + tail, base + ' --exclude=node2,node3' + tail]
    assert [r['excluded'] for r in records] == ['node2', 'node2,node3']
    assert records[1]['failure'] == 'node(s) failed: node3'


@pytest.mark.parametrize('code', [2, 3, 1])
def test_user_errors_nans_and_bugs_are_not_restarted(tmp_path, code):
    proc, calls, records = run_train(tmp_path, [exited(code), DONE])
    assert proc.returncode == code and len(calls) == 1 and records == []
    assert f'not restarting: task on node1: exit {code}' in proc.stderr


def test_restarts_spent_then_one_requeue(tmp_path):
    proc, calls, records = run_train(tmp_path, [exited(5)] * 3, JF_MAX_RESTARTS='2')
    assert proc.returncode == 143 and [r['event'] for r in records] == ['restart', 'restart', 'requeue']
    assert calls[-1] == 'scontrol requeue 77' and calls.count('scontrol requeue 77') == 1
    assert '2 restart(s) used of JF_MAX_RESTARTS=2' in proc.stderr
    # The requeued job (same id, same workdir; SLURM_RESTART_COUNT also counts time-limit requeues): spent.
    proc, calls, records = run_train(tmp_path, [exited(5)], JF_MAX_RESTARTS='0', SLURM_RESTART_COUNT='4',
                                     keep=True)
    assert proc.returncode == 143 and not any(c.startswith('scontrol') for c in calls), calls
    assert 'JF_MAX_REQUEUES=1 spent' in proc.stderr and len(records) == 3


def test_too_few_healthy_nodes_leave_the_allocation(tmp_path):
    proc, _, records = run_train(tmp_path, [KILLED, DONE], SLURM_JOB_NUM_NODES='1')
    assert proc.returncode == 0 and len(records) == 1  # no spares: the same node again
    killed_node1 = KILLED.replace('node2', 'node1')
    proc, calls, records = run_train(tmp_path / 'b', [KILLED, killed_node1, DONE], JF_SPARE_NODES='1',
                                     SLURM_JOB_NUM_NODES='2')
    assert [(r['event'], r.get('excluded')) for r in records] == [('restart', 'node2'), ('requeue', None)]
    assert calls[-1] == 'scontrol requeue 77' and '0 healthy node(s) for 1: leaving this allocation' in proc.stderr
