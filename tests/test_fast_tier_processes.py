"""Two processes, two "node-local" directories: a killed process's lost fast tier comes back from its peer.

The pair of tests/test_multiprocess.py (configs/tiny.py, data 2 x fsdp 2 x tensor 2 with ZeRO-1 over
2 processes x 4 CPU devices) saves the persistent tier every 2 steps and the fast tier every step,
to `$JF_NODE_LOCAL`, which the test sets to a directory of its own for each process (as two nodes'
NVMe; the processes are started directly rather than through launch/local.sh, which gives every
process one environment). Process 1 kills itself (SIGKILL) right after fast step 3 is on its disk
(tests/killed_main.py), so step 3 is newer than the persistent step 2; process 0 is killed too (a
lost node ends the job), and process 1's whole directory is deleted. The rerun restores step 3 from
the fast tier, process 1's shards from the copy process 0 holds (sent back over the interconnect),
trains step 4, and every loss equals the uninterrupted single-process run's to fp32 rounding.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from processes import REPO, TINY, free_port, read_metrics, single_process_losses, subprocess_env

LOSS_RTOL = 2e-6


def start(flags, tmp_path, name, script, **env):
    port, procs = free_port(), []
    for process in (0, 1):
        cmd = [sys.executable, *script, *flags, '--config.distributed.mode=explicit',
               f'--config.distributed.coordinator_address=127.0.0.1:{port}', '--config.distributed.num_processes=2',
               f'--config.distributed.process_id={process}']
        log = open(tmp_path / f'{name}_{process}.log', 'w')  # pylint: disable=consider-using-with
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(
            JF_NODE_LOCAL=str(tmp_path / f'node{process}'), **env)))
        log.close()
    return procs


def committed(node, process, step):
    return all(os.path.exists(node / f'process_{process}' / str(step) / part / 'manifest.json') for part in ('own', 'peer'))


@pytest.mark.slow
def test_lost_fast_tier_is_restored_from_the_peer_copy(tmp_path):
    reference = single_process_losses('--config.sharding.zero1=True')  # steps 1..4, uninterrupted
    workdir = tmp_path / 'run'
    flags = [*TINY, '--config.sharding.zero1=True', f'--workdir={workdir}', '--config.train.steps=4',
             '--config.checkpoint.every_steps=2', '--config.checkpoint.fast_dir=$JF_NODE_LOCAL',
             '--config.checkpoint.fast_every_steps=1', '--config.checkpoint.fast_keep=2']
    procs = start(flags, tmp_path, 'first', ['tests/killed_main.py'], JF_TEST_KILL_AT='1:3',
                  JF_TEST_KILL_AFTER=str(workdir / 'checkpoints' / '2'))
    try:
        assert procs[1].wait(timeout=400) == -signal.SIGKILL, open(tmp_path / 'first_1.log').read()[-4000:]
        deadline = time.monotonic() + 60  # process 0 wrote its step 3 too before waiting on its dead peer
        while not committed(tmp_path / 'node0', 0, 3):
            assert time.monotonic() < deadline, open(tmp_path / 'first_0.log').read()[-4000:]
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [n for n in os.listdir(workdir / 'checkpoints') if n.isdigit()] == ['2']  # the persistent tier: step 2
    assert {'2', '3'} <= set(os.listdir(tmp_path / 'node1' / 'process_1'))  # (step 1 pruned after the kill, or not)
    shutil.rmtree(tmp_path / 'node1')  # the lost node's disk

    procs = start(flags, tmp_path, 'rerun', ['-m', 'jaxfrontier.main'])
    statuses = [p.wait(timeout=400) for p in procs]
    log = open(tmp_path / 'rerun_0.log').read()
    assert statuses == [0, 0], log[-4000:] + open(tmp_path / 'rerun_1.log').read()[-4000:]
    assert "restored step 3 from the fast tier" in log and "processes [1] from their peer's copy" in log, log[-4000:]
    rows = {row['step']: row for row in read_metrics(workdir)}
    assert 4 in rows and max(rows) == 4
    for step, row in rows.items():  # the first run's rows, and step 4 after the restore
        assert row['train/loss'] == pytest.approx(reference[step], rel=LOSS_RTOL), (step, row)
    # Process 1 saved again after the restore: its fast tier holds its own shards and its peer's again.
    assert committed(tmp_path / 'node1', 1, 4)
