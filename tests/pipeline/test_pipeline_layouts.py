"""Pipelines over context, fsdp and data (issue 35): no stage-dependent collective-permute; one device's numbers.

Context 2 x pipeline 2 x fsdp 2 deadlocked XLA:CPU in the first step, and --mode=verify aborted
compiling it (spmd_partitioner_util.cc:497). Both came from the token embedding's gather without
vocabulary axes (tensor 1), left to XLA's partitioner inside the pipeline's map: at the issue's
shapes the scatter-add of its gradient moved shards between fsdp and context with a
collective-permute inside the first stage's `lax.switch` branch (XLA:CPU's collective-permute waits
for every device of the process; the other stage's devices, in another branch, never came); at
verify's shrunk shapes, and at this file's, partitioning the gather aborted. model/layers.lookup_rows
now gathers locally from the whole table, its gradient one all-reduce.

Fast: the branch reader on HLO text (the GPT case itself is tests/pipeline/test_pipeline.py's
fast `test_pipeline_over_context_and_fsdp_matches_single_device`). Slow: the previously failing
combination with every schedule, GPT and Llama, and a sample of other pipelined layouts, each
through the loop's compiled train step: no collective-permute in a branch, and the loss, gradients
and parameters after 3 steps of one device (tests/layout_check.py's tolerances); the issue's
command through `python -m jaxfrontier.main`, training (shrunk to a 64-token sequence) and
--mode=verify (the command as the issue gives it). Every layout of 8 devices:
benchmarks/layout_sweep.py (docs/architecture.md, "Layouts that run").
"""

import subprocess
import sys

import pytest

import processes
from jaxfrontier.plan import hlo_collectives
from layout_check import LLAMA, check_against_reference, make_config, run_layout
from layout_once import run_layout_once

LAYERS = 4  # interleaved V = 2 over 2 stages needs 4


HLO = '''HloModule m

%branch_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %fused = f32[4]{0} fusion(%p), kind=kLoop, calls=%inner
}

%inner (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %collective-permute.3 = f32[4]{0} collective-permute(%q), channel_id=7, source_target_pairs={{0,1},{1,0}}
}

%branch_b (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %all-reduce.1 = f32[4]{0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
}

ENTRY %main (i: s32[], x: f32[4]) -> f32[4] {
  %i = s32[] parameter(0)
  %x = f32[4]{0} parameter(1)
  %c = f32[4]{0} conditional(%i, %x, %x), branch_computations={%branch_a, %branch_b}
  ROOT %ppermute.8 = f32[4]{0} collective-permute(%c), channel_id=1, source_target_pairs={{0,1},{1,0}}
}
'''


def no_permute_in_branches(compiled):
    """Fails before the compiled step runs (it would deadlock) if a stage's branch holds a collective-permute."""
    found = hlo_collectives.in_branches(compiled.as_text())
    assert not found, found[:2]


def test_in_branches_finds_collective_permutes_only_inside_conditionals():
    found = hlo_collectives.in_branches(HLO)
    assert len(found) == 1 and found[0].startswith('inner: ROOT %collective-permute.3 ='), found  # not ENTRY's
    assert hlo_collectives.in_branches(HLO, kinds=('all-reduce',))[0].startswith('branch_b: ROOT %all-reduce.1')
    called = HLO.replace('conditional', 'call').replace('branch_computations={%branch_a, %branch_b}',
                                                        'to_apply=%branch_a')
    assert hlo_collectives.in_branches(called) == []


# --------------------------------------------------------------------------- slow: layouts against one device


@pytest.fixture(scope='module')
def references():
    return {'gpt': run_layout(make_config(layers=LAYERS)), 'llama': run_layout(make_config(layers=LAYERS, **LLAMA))}


SCHEDULES = {'1f1b': 1, '1f1b_lockstep': 1, 'gpipe': 1, 'interleaved': 2}
# (family, schedule, mesh): pipeline 2 x fsdp 2 x context 2 (the issue's; GPT's staggered 1F1B is the
# fast test's) with every schedule and both families, then a sample: data-manual maps with context
# or fsdp (tensor beside them: tests/pipeline/test_pipeline.py, tests/test_context.py).
CASES = [('gpt', s, dict(fsdp=2, context=2)) for s in ('1f1b_lockstep', 'gpipe', 'interleaved')] + \
        [('llama', s, dict(fsdp=2, context=2)) for s in SCHEDULES] + [
            ('gpt', '1f1b', dict(data=2, context=2)),
            ('llama', 'gpipe', dict(data=2, fsdp=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize('family,schedule,mesh', CASES,
                         ids=[f'{f}-{s}-' + '-'.join(f'{k}{v}' for k, v in m.items()) for f, s, m in CASES])
def test_pipelined_layout_matches_single_device(family, schedule, mesh, references):
    c = make_config(layers=LAYERS, pipeline=2, schedule=schedule, virtual=SCHEDULES[schedule], accum=2, **mesh,
                    **(LLAMA if family == 'llama' else {}))
    check_against_reference(run_layout_once(c, inspect=no_permute_in_branches), references[family])


# --------------------------------------------------------------------------- slow: the issue's command

ISSUE = ('--config=configs/tiny.py', '--config.train.steps=3', '--config.model.seq_len=512',
         '--config.train.global_batch=4', '--config.data.kind=synthetic', '--config.mesh.pipeline=2',
         '--config.mesh.data=1', '--config.mesh.fsdp=2', '--config.mesh.tensor=1', '--config.mesh.context=2',
         '--config.mesh.cpu_devices=8', '--config.train.micro_batch=1', '--config.train.accum_steps=2')


def _main(*args, tmp_path):
    return subprocess.run([sys.executable, '-m', 'jaxfrontier.main', *args, f'--workdir={tmp_path}'],
                          cwd=processes.REPO, env=processes.subprocess_env(), capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize('schedule', ['1f1b', 'gpipe'])
def test_issue_command_trains(schedule, tmp_path):
    """Exit 0 and three finite steps (it aborted with exit 134 after XLA:CPU's 40 s collective timeout)."""
    proc = _main(*ISSUE, '--config.model.seq_len=64', f'--config.pipeline.schedule={schedule}',
                 '--config.train.progress=False', tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'done: {"step": 3' in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_issue_command_verifies(tmp_path):
    """--mode=verify certifies the layout against one device (it aborted compiling)."""
    proc = _main(*ISSUE, '--mode=verify', tmp_path=tmp_path)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-3000:]
    assert proc.returncode == 0 and line.startswith('verify: PASS'), line
    assert 'pipeline 2 x fsdp 2 x context 2' in line, line
