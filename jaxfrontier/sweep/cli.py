"""Throughput sweeps: `python -m jaxfrontier.sweep --config=configs/X.py --space tensor=1,2 --space pipeline=1,2`.

Each point of the search space is a trial: a short real training run in its own process
(`python -m jaxfrontier.main`, under Slurm an `srun` step) that measures tokens/s, TFLOP/s per
device, MFU, compile time and peak memory per device after warm-up steps. Points whose layout
breaks a config rule are recorded `invalid`, layouts the planner predicts will not fit are
`skipped_plan` (unless --noplan_filter), and a trial that crashes, runs out of memory or times
out is recorded with its reason while the sweep goes on. Results go to
`<workdir>/results.jsonl`; rerunning the same command skips finished trials. The report is
`<workdir>/report.md`, `results.csv` and `plots/`. Search: grid, random, or Bayesian
optimisation with DeepHyper (`pip install -e '.[tune]'`). Details: docs/sweeps.md.
"""

from __future__ import annotations

from typing import Any

from absl import flags

from jaxfrontier import config as config_lib  # no JAX
from jaxfrontier.errors import UserError
from jaxfrontier.sweep import flags as sweep_flags
from jaxfrontier.sweep import run as sweep_run
from jaxfrontier.sweep import space as sweep_space
from jaxfrontier.sweep import trials as sweep_trials

OBJECTIVES = ('tokens_per_s', 'tokens_per_s_per_device', 'tflops_per_device', 'mfu', 'hw_tflops_per_device')

_SPACE = flags.DEFINE_multi_string('space', [], 'NAME=V1,V2,... (repeatable): values to try. Names: '
                                   + ', '.join(sweep_space.PARAMS) + ', model.<field>.')
_SPACE_FILE = flags.DEFINE_string('space_file', '', 'JSON file {"NAME": [values], ...} (with or instead of --space).')
_METHOD = flags.DEFINE_enum('method', 'grid', ['grid', 'random', 'deephyper'], 'How points are chosen.')
_MAX_TRIALS = flags.DEFINE_integer('max_trials', None, 'Trials to run (invalid and skipped points are free); '
                                   'grid: default all; random and deephyper: required.')
_SEED = flags.DEFINE_integer('seed', 0, 'random and deephyper: the seed.')
_OBJECTIVE = flags.DEFINE_enum('objective', 'tokens_per_s', OBJECTIVES, 'What "best" means (deephyper maximises it).')
_DEVICES = flags.DEFINE_integer('devices', 0, 'Devices per trial (0: the base config mesh size). On simulated '
                                'CPU devices (config.mesh.cpu_devices > 0) each trial creates this many.')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Only rewrite the report from results.jsonl.')
F = sweep_flags


def _check_flags() -> None:
    if _MAX_TRIALS.value is not None and _MAX_TRIALS.value < 1:
        raise UserError(f'--max_trials={_MAX_TRIALS.value}: a budget of no trials runs nothing. Fix: '
                                   'give --max_trials >= 1, or leave it out for the whole grid')
    if _MAX_TRIALS.value is None and _METHOD.value != 'grid':
        raise UserError(f'--method={_METHOD.value} needs a budget. Fix: pass --max_trials=N')
    if _DEVICES.value < 0:
        raise UserError(f'--devices={_DEVICES.value}: must be >= 0. Fix: give the devices per trial, '
                                   'or 0 for the base config mesh size')


def _read_space() -> sweep_space.Space:
    text = ''
    if _SPACE_FILE.value:
        try:
            with open(_SPACE_FILE.value, encoding='utf-8') as f:
                text = f.read()
        except OSError as e:
            raise UserError(f'--space_file={_SPACE_FILE.value!r}: {e.strerror}. Fix: give a readable '
                                       'JSON file') from None
    return sweep_space.parse_space(_SPACE.value, text, f'--space_file={_SPACE_FILE.value}')


def select(study: sweep_run.Study, points: list[dict[str, Any]], devices: int, swept: list[str],
           budget: int | None) -> list[Any]:
    """Points prepared in order until `budget` trials would run (stored runs count, invalid ones do not).

    Raises:
      UserError: no point of the space has a valid layout (a contradictory space): nothing runs.
    """
    items, runs = [], 0
    for point in points:
        item = study.prepare(point, devices, swept)
        if isinstance(item, sweep_trials.Trial):
            if budget is not None and runs >= budget:
                break
            runs += 1
        items.append(item)
    if not any(isinstance(i, sweep_trials.Trial) or i['status'] in ('skipped_plan', 'skipped_verify') for i in items):
        reasons = sorted({i['error'] for i in items})
        raise UserError(
            f'no point of the search space has a valid layout on {devices} devices ({len(items)} tried, nothing '
            f'run; docs/sweeps.md). ' + (f'{len(reasons)} reasons; the first: ' if len(reasons) > 1 else '')
            + reasons[0])
    return items


def run_sweep(argv: list[str], config_spec: str, user_args: tuple[str, ...]) -> int:
    _check_flags()
    space = _read_space()
    sweep_space.check_fixed(space, [a.split('=', 1)[0][len('--config.'):] for a in user_args])
    devices = _DEVICES.value or config_lib.num_devices(F.CONFIG.value)
    study = F.make_study(config_spec, user_args, devices)
    swept = [n for n, _ in space]
    if _REPORT_ONLY.value:
        records = [r for r in study.store.records.values() if r.get('devices') == devices]
    elif _METHOD.value == 'deephyper':
        from jaxfrontier.sweep import deephyper as sweep_deephyper  # pylint: disable=g-import-not-at-top  (optional extra)
        records = sweep_deephyper.search(study, space, devices, _MAX_TRIALS.value, _SEED.value, _OBJECTIVE.value)
    else:
        points = sweep_space.grid(space) if _METHOD.value == 'grid' else sweep_space.random_order(space, _SEED.value)
        items = select(study, points, devices, swept, _MAX_TRIALS.value)
        to_run = sum(isinstance(i, sweep_trials.Trial) and study.finished(i) is None for i in items)
        F.log(f'{len(points)} points, {len(items)} taken; {to_run} trials to run, '
              f'{len(items) - to_run} already recorded or not runnable')
        records = study.run(items)
    from jaxfrontier.sweep import report as sweep_report  # pylint: disable=g-import-not-at-top  (matplotlib)
    paths = sweep_report.write_sweep_report(study.workdir, records, space, _OBJECTIVE.value,
                                            F.describe_run(argv, 'jaxfrontier.sweep', str(devices)))
    F.log(', '.join(f'{n} {s}' for s, n in sweep_report.counts(records).items()) + f'; report {paths["markdown"]}')
    best = sweep_report.ranked(records, _OBJECTIVE.value)
    if best and sweep_trials.objective(best[0], _OBJECTIVE.value) is not None:
        F.log(f'best: trial {best[0]["trial_id"]} {best[0]["point"]}: {best[0][_OBJECTIVE.value]:.6g} '
              f'{_OBJECTIVE.value}')
    return 0


def run() -> None:
    F.run_command(run_sweep)


if __name__ == '__main__':
    run()
