"""Calibrate the planner's time model: `python -m jaxfrontier.calibrate --results=R.jsonl --hardware=H --out=hw.json`.

Reads measured step times (sweep or scaling `results.jsonl`, or published points: see
jaxfrontier/plan/measured.py), fits the time model's free parameters of the `--hardware`
description to them (jaxfrontier/plan/calibrate.py: identifiable parameters only, robust
least squares, leave-one-out held-out error, rank correlation) and writes

  --out     the calibrated description (JSON), usable wherever a hardware name is taken:
            `python -m jaxfrontier.main --mode=plan --hardware=hw.json`, `--search`, the
            sweep's planner filter, `python -m jaxfrontier.scaling --plan_only`;
  --report  fit error, held-out error, rank correlation, per-trial predicted vs measured.

Bad input (no results, another machine's or model's results mixed in, too few trials) is one
line `error: ...` and exit 2. docs/planner.md, "Calibrating the time model".
"""

from __future__ import annotations

import json

from absl import app, flags

from jaxfrontier import cli
from jaxfrontier import errors
from jaxfrontier import hardware as hw_lib  # no JAX at import

_RESULTS = flags.DEFINE_list('results', [], 'results.jsonl files: sweep or scaling trials, or published points.')
_HARDWARE = flags.DEFINE_string('hardware', 'local', 'The description to start from: a name '
                                f'({", ".join(hw_lib.NAMES)}) or a path.json.')
_OUT = flags.DEFINE_string('out', 'hw.json', 'Where to write the calibrated description (JSON).')
_REPORT = flags.DEFINE_string('report', '', 'Where to write the report (JSON); default: <out> with .report.json.')
_PARAMS = flags.DEFINE_list('params', None, 'Fit exactly these parameters (default: every identifiable one).')
_STATISTIC = flags.DEFINE_enum('step_time', 'median', ['median', 'mean', 'min'], "A trial's step time: the median "
                                'of its measured steps (robust to another job\'s load), their mean, or the fastest.')
_ACROSS = flags.DEFINE_bool('across_models', False, 'Fit measurements of several models together (else an error).')


def calibrate_main() -> int:
    if not _RESULTS.value:
        raise errors.UserError('--results is required: the results.jsonl of a sweep, a scaling study or published '
                               'points. Fix: pass --results=workdirs/sweep/results.jsonl')
    prior = hw_lib.get(_HARDWARE.value)
    from jaxfrontier.plan import calibrate as fit_lib  # pylint: disable=g-import-not-at-top  (imports JAX)
    from jaxfrontier.plan import measured  # pylint: disable=g-import-not-at-top

    ms = measured.load(_RESULTS.value, prior, _ACROSS.value, _STATISTIC.value)
    hw, report = fit_lib.calibrate(ms, prior, _PARAMS.value)
    report['hardware_out'] = _OUT.value
    report['step_time_statistic'] = _STATISTIC.value
    hw_lib.save(hw, _OUT.value)
    report_path = _REPORT.value or (_OUT.value[:-5] if _OUT.value.endswith('.json') else _OUT.value) + '.report.json'
    with open(report_path, 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=1, default=float)
    print(fit_lib.format_report(report))
    print(f'wrote {_OUT.value} (use --hardware={_OUT.value}) and {report_path}')
    return 0


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    try:
        return calibrate_main()
    except errors.UserError as e:
        return cli.exit_code(e)  # one line `error: ...`, exit 2


def run() -> None:
    cli.run_app(main)


if __name__ == '__main__':
    run()
