"""Bayesian optimisation of a sweep with DeepHyper (the paper's tool): `--method=deephyper`.

DeepHyper's centralised Bayesian optimisation (`CBO`, UCB acquisition as in the paper) proposes
points of the search space; each is prepared and run as an ordinary trial of the sweep
(`sweep_run.Study`), so the records, the results file and resuming are the same as for grid
and random search. Each evaluation's objective (default tokens/s) is told back; a point that
is invalid, skipped by the planner or failed is told as a failure ("F"), which DeepHyper
learns to avoid. Each distinct runnable trial proposed counts against --max_trials, including
trials found already finished in results.jsonl (a rerun with the same seed replays them without
running them again); a repeated proposal is answered from the results file and does not count.

Seeded with the plan: when the planner filter is on, the points the planner (on `--hardware`,
a calibrated description.json included) predicts fastest run first and are told to the
optimiser before it proposes anything, so its first proposals start from the plan's best
layouts instead of random ones (`plan_seeds`).

DeepHyper is an optional extra: `pip install -e '.[tune]'`.
"""

from __future__ import annotations

import os
from typing import Any

from jaxfrontier.errors import UserError
from jaxfrontier.sweep import space as sweep_space
from jaxfrontier.sweep import trials as sweep_trials
from jaxfrontier.sweep.run import Study


def _hpo():
    try:
        from deephyper import hpo  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise UserError(f'--method=deephyper needs DeepHyper, which is not installed ({e}). Fix: '
                                   "pip install -e '.[tune]' (or pip install 'deephyper>=0.13,<0.14')") from None
    return hpo


MAX_SEED_POINTS = 4096  # spaces larger than this are not planned point by point


def plan_seeds(study: Study, space: sweep_space.Space, devices: int, count: int) -> list[dict[str, Any]]:
    """The `count` runnable points of the space the planner predicts fastest (none without the planner)."""
    if study.predict is None or count < 1 or sweep_space.size(space) > MAX_SEED_POINTS:
        return []
    swept = [name for name, _ in space]
    ranked = []
    for point in sweep_space.grid(space):
        item = study.prepare(point, devices, swept)
        if isinstance(item, sweep_trials.Trial) and item.plan.get('tokens_per_s'):
            ranked.append((-item.plan['tokens_per_s'], len(ranked), point))
    return [point for _, _, point in sorted(ranked)[:count]]


def search(study: Study, space: sweep_space.Space, devices: int, budget: int, seed: int,
           objective: str) -> list[dict[str, Any]]:
    """Runs up to `budget` trials proposed by DeepHyper's CBO; returns every evaluated point's record."""
    hpo = _hpo()
    problem = hpo.HpProblem()
    decode = {}
    for name, values in space:  # categorical over the values' text: every parameter kind alike
        decode[name] = {str(v): v for v in values}
        problem.add_hyperparameter(list(decode[name]), name)
    cbo = hpo.CBO(problem, random_state=seed, log_dir=os.path.join(study.workdir, 'deephyper'), acq_func='UCB',
                  n_initial_points=max(2, min(10, budget // 3)), checkpoint_history_to_csv=False)
    swept = [name for name, _ in space]
    records: dict[str, dict[str, Any]] = {}
    runnable: set[str] = set()  # distinct trials evaluated: a repeated proposal is free
    proposals = 0
    limit = max(4 * budget, sweep_space.size(space))  # proposals, runnable or not: the loop always ends
    seeds = [{n: str(v) for n, v in point.items()}
             for point in plan_seeds(study, space, devices, max(1, min(3, budget // 3)))]
    if seeds:
        study.log(f'deephyper: seeded with the plan\'s {len(seeds)} fastest layouts')
    while len(runnable) < budget and proposals < limit:
        asked = seeds or cbo.ask(min(study.launcher.capacity(devices), budget - len(runnable)))
        seeds = []
        proposals += len(asked)
        items = [study.prepare({n: decode[n][str(cfg[n])] for n in swept}, devices, swept) for cfg in asked]
        runnable |= {i.trial_id for i in items if isinstance(i, sweep_trials.Trial)}
        results = study.run(items)
        told = []
        for cfg, record in zip(asked, results):
            value = sweep_trials.objective(record, objective)
            told.append((cfg, value if value is not None else 'F'))
            records[record['trial_id']] = record
        cbo.tell(told)
        study.log(f'deephyper: {proposals} proposals, {len(runnable)} of {budget} trials')
    return list(records.values())
