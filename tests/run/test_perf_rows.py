"""metrics.jsonl's perf numbers are rates of steps that ran, also around saves and after a roll-back.

Issue 28: after a `checkpoint.restore_step` roll-back with `train.log_every=1`, `perf/mfu` read
3.69. A save waits for its step (the health check fetches that step's loss), so when the loop
fetched the previous step's metrics after the save, the next fetch returned at once: that row's
step time was the host's gap between two fetches (about a millisecond), not a step. On a model
big enough that a step is far longer than that gap (here ~0.1-0.5 s against a few ms), MFU came out
well above 1 on the row after each save and on the final row (the final save also waits).
"""

import os

import pytest
from ml_collections import config_flags

from jaxfrontier.run import loop
import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(steps: int, **checkpoint):
    c = config_flags.config_flags._LoadConfigModule('tiny', os.path.join(REPO, 'configs', 'tiny.py')).get_config()
    # A step of a tenth of a second or more on the CPU (pure data parallelism: MFU well above the
    # tiny model's), so one row timed on the host's gap alone would read far above 1.
    c.model.update(d_model=128, seq_len=128)
    c.mesh.update(data=8, fsdp=1, tensor=1)
    c.data.kind = 'synthetic'
    c.train.update(steps=steps, global_batch=16, micro_batch=2, log_every=1, eval_every=0, eval_batches=1,
                   progress=False)
    c.optim.decay_steps = 100
    c.checkpoint.update(every_steps=2, **checkpoint)
    return c


def perf_rows(workdir) -> list[dict]:
    return [r for r in processes.read_metrics(str(workdir)) if 'perf/mfu' in r]


@pytest.mark.slow  # two runs, one compile: ~30 s
def test_mfu_stays_at_most_one_around_saves_and_after_a_restore_step_rollback(tmp_path):
    loop.train_and_evaluate(config(5), str(tmp_path))
    first = perf_rows(tmp_path)
    assert [r['step'] for r in first] == [2, 3, 4, 5]  # step 1 starts the clock
    loop.train_and_evaluate(config(5, restore_step=2), str(tmp_path))  # roll back to step 2, run 3..5 again
    again = perf_rows(tmp_path)[len(first):]
    assert [r['step'] for r in again] == [4, 5] and all(r.get('replayed') for r in again), again
    for row in first + again:
        assert 0 < row['perf/mfu'] <= 1, row
        assert row['perf/step_time_s'] > 0, row
