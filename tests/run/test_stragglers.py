"""Two processes, one made slow by the test (tests/delayed_main.py): the warning names it.

Process 1 sleeps 1 s in every batch's assembly (JF_TEST_STEP_DELAY_PROCESS=1:1.0, a delay
the test injects, not a clock reading). Both processes train configs/tiny.py's small layer over
data 2 x fsdp 2 x tensor 2; every 2 steps after the second they exchange their host and wait
seconds per step (run/observe/stragglers.py) and process 0 judges the previous round.
"""

import json
import os
import subprocess
import sys

import pytest

import processes

DELAY_S = 1.0  # well above the tiny step's device time even on a loaded CPU


@pytest.mark.slow  # two processes, 6 steps
def test_a_process_slowed_by_the_test_is_named_a_straggler(tmp_path):
    workdir = tmp_path / 'run'
    port = processes.free_port()
    env = processes.subprocess_env(JF_TEST_STEP_DELAY_PROCESS=f'1:{DELAY_S}')
    procs = []
    for process in (0, 1):
        cmd = [sys.executable, os.path.join(processes.REPO, 'tests', 'delayed_main.py'), *processes.TINY,
               '--config.sharding.zero1=True',  # test_multiprocess.py's programs: from the compile cache
               '--config.data.kind=synthetic', '--config.train.log_every=2', '--config.train.steps=6',
               '--config.checkpoint.enabled=False', f'--workdir={workdir}', '--config.distributed.mode=explicit',
               f'--config.distributed.coordinator_address=127.0.0.1:{port}',
               '--config.distributed.num_processes=2', f'--config.distributed.process_id={process}']
        procs.append(subprocess.Popen(cmd, cwd=processes.REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    warnings = [line for line in outputs[0].splitlines() if 'straggler: ' in line]
    assert warnings and all('process 1 ' in w and 'process 0 ' not in w for w in warnings), outputs[0][-4000:]
    assert not any('straggler: ' in line for line in outputs[1].splitlines())  # process 0 judges and warns

    rounds = [json.loads(line) for line in (workdir / 'process_times.jsonl').read_text().splitlines()]
    assert [r['step'] for r in rounds] == [4, 6]  # from step 2 on; 4 judged at 6, 6 after the last step
    for r in rounds:
        assert r['stragglers'] == [1], r
        assert r['host_s'][1] >= DELAY_S, r  # the injected sleep is process 1's own host work
    rows = processes.read_metrics(workdir)
    judged = [r for r in rows if 'straggler/slowest_process' in r]
    assert [r['step'] for r in judged] == [6] and judged[0]['straggler/slowest_process'] == 1
