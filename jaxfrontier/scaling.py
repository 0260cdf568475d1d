"""Weak and strong scaling: `python -m jaxfrontier.scaling --config=configs/X.py --device_counts=8,16,32`.

The base config's model-parallel layout (every mesh axis but data) is kept at every device count
N; the data axis takes the rest, data = N / (their product). Each point is a trial
of the sweep machinery (`sweep_run`): its own process or `srun` step, warm-up then measured
steps, a record in `<workdir>/results.jsonl` (reruns skip finished points).

  weak    the batch per replica is fixed (train.micro_batch x train.accum_steps of the config),
          so the global batch grows with the data-parallel size;
  strong  the global batch is fixed (train.global_batch of the config); the accumulation steps
          shrink as the data-parallel size grows, accum = global_batch / (micro_batch x data x fsdp).

Efficiency at N devices, against the smallest count N0 that ran (docs/sweeps.md):
  speed-up   S(N) = T(N) / T(N0)                 (T: tokens/s of the whole job)
  efficiency E(N) = S(N) / (N / N0) = (T(N) / N) / (T(N0) / N0)
For weak scaling E(N) = 100 % when tokens/s per device stays constant as the job and its batch
grow (the paper: 100 % up to 1,024 and 3,072 GCDs); for strong scaling, when the same batch is
done N / N0 times faster (the paper: 89 % and 87 %).
Writes `scaling.md`, `scaling.csv` and `scaling.png` to --workdir.

`--plan_only` runs nothing: the planner predicts every point's throughput on `--hardware` (a
name or a calibrated description.json) and the same report is written from the predictions,
e.g. 175B on 128 .. 1,024 MI250X GCDs in seconds (docs/planner.md, "Scaling predicted").
"""

from __future__ import annotations

from typing import Any

from absl import flags

from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.sweep import flags as F
from jaxfrontier.sweep import trials as sweep_trials

_COUNTS = flags.DEFINE_list('device_counts', [], 'Device counts to run, e.g. 8,16,32 (at least two).')
_STUDY = flags.DEFINE_enum('study', 'both', ['weak', 'strong', 'both'], 'Which scaling study to run.')
_PLAN_ONLY = flags.DEFINE_bool('plan_only', False, 'Run nothing: predict every point with the planner on --hardware.')
flags.adopt_module_key_flags(F)  # --help lists the shared sweep flags too


def device_counts(values: list[str]) -> list[int]:
    """The --device_counts as sorted distinct integers; at least two, each >= 1."""
    try:
        counts = sorted({int(v) for v in values})
    except ValueError:
        raise UserError(f'--device_counts={",".join(values)}: not integers. Fix: give device counts '
                                   'like --device_counts=8,16,32') from None
    if len(counts) < 2 or counts[0] < 1:
        raise UserError(f'--device_counts={",".join(values)}: a scaling study needs at least two device '
                                   'counts >= 1. Fix: give e.g. --device_counts=8,16')
    return counts


def points(study: str, base) -> tuple[dict[str, Any], list[str]]:
    """(point, swept names) of one study: weak fixes the batch per replica, strong the global batch."""
    if study == 'weak':
        return {'accum_steps': base.train.accum_steps}, ['accum_steps']  # the global batch follows
    return {}, []  # the config's global batch; accumulation follows


def efficiencies(records: list[dict[str, Any]], study: str) -> list[dict[str, Any]]:
    """The study's rows: each record with speed-up and efficiency against the smallest count that ran."""
    ran = [r for r in records if sweep_trials.objective(r, 'tokens_per_s') is not None]
    ref = min(ran, key=lambda r: r['devices']) if ran else None
    rows = []
    for r in records:
        row = dict(r, study=study, speedup=None, efficiency=None)
        if ref is not None and r in ran:
            row['speedup'] = r['tokens_per_s'] / ref['tokens_per_s']
            row['efficiency'] = row['speedup'] / (r['devices'] / ref['devices'])
        rows.append(row)
    return rows


def planned_record(c, devices: int, hardware: str) -> dict[str, Any]:
    """The planner's prediction for one point, shaped like a trial's record."""
    from jaxfrontier.plan import planner  # pylint: disable=g-import-not-at-top  (imports JAX)
    from jaxfrontier.sweep import space as sweep_space  # pylint: disable=g-import-not-at-top

    p = planner.plan(c, hardware)
    return {'trial_id': 'plan', 'status': 'ok', 'devices': devices, **sweep_space.layout_of(c),
            'tokens_per_s': p.time.tokens_per_s, 'tokens_per_s_per_device': p.time.tokens_per_s / devices,
            'tflops_per_device': p.time.model_tflops_per_device,
            'hw_tflops_per_device': p.time.megatron_tflops_per_device,
            'step_time_s': p.time.step_s, 'bubble_fraction': p.time.bubble_fraction,
            'memory_gib': p.memory.total_bytes / 2**30, 'fits': p.fits}


def plan_scaling(argv: list[str], counts: list[int], studies: list[str]) -> int:
    """--plan_only: the weak and strong scaling the planner predicts; nothing runs."""
    import os  # pylint: disable=g-import-not-at-top

    from jaxfrontier import hardware as hw_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier.sweep import space as sweep_space  # pylint: disable=g-import-not-at-top

    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
    hw = hw_lib.get(F.HARDWARE.value)
    base = F.CONFIG.value
    rows = []
    for name in studies:
        point, swept = points(name, base)
        records = []
        for n in counts:
            try:
                c, _ = sweep_space.point_config(base, point, n, swept)
            except ConfigError as e:
                records.append({'trial_id': 'plan', 'status': 'invalid', 'devices': n, 'error': str(e)})
                continue
            records.append(planned_record(c, n, hw))
        rows += efficiencies(records, name)
    from jaxfrontier.sweep import report as sweep_report  # pylint: disable=g-import-not-at-top  (matplotlib)
    os.makedirs(F.WORKDIR.value, exist_ok=True)
    header = (f'Predicted by the planner on {hw.name} ({hw.description}); nothing ran. Command: '
              f'`python -m jaxfrontier.scaling {" ".join(argv[1:])}`')
    if hw.calibration:
        from jaxfrontier.plan import planner  # pylint: disable=g-import-not-at-top
        header += f'\n\nCalibration: {planner.calibration_line(hw)}'
    paths = sweep_report.write_scaling_report(F.WORKDIR.value, rows, header)
    for row in rows:
        eff = f'{row["efficiency"]:.1%}' if row.get('efficiency') is not None else row['status']
        tokens = f'{row["tokens_per_s"]:,.0f} tokens/s' if row.get('tokens_per_s') else ''
        F.log(f'{row["study"]:>6s} {row["devices"]:>5d} devices: predicted efficiency {eff} {tokens}')
    F.log(f'report {paths["markdown"]}')
    return 0


def run_scaling(argv: list[str], config_spec: str, user_args: tuple[str, ...]) -> int:
    counts = device_counts(_COUNTS.value)
    replica = axes_lib.replica()
    if any(a.startswith(f'--config.{replica.field}=') for a in user_args):
        raise UserError(f'--config.{replica.field}: the {replica.name} axis is derived at every device count '
                        f'({replica.name} = N / the product of the other mesh axes). Fix: drop the override')
    if _PLAN_ONLY.value:
        return plan_scaling(argv, counts, ['weak', 'strong'] if _STUDY.value == 'both' else [_STUDY.value])
    study = F.make_study(config_spec, user_args, max(counts))
    studies = ['weak', 'strong'] if _STUDY.value == 'both' else [_STUDY.value]
    plans = {name: points(name, study.base) for name in studies}
    items = {name: [study.prepare(point, n, swept) for n in counts] for name, (point, swept) in plans.items()}
    unique = list({(i.trial_id if isinstance(i, sweep_trials.Trial) else i['trial_id']): i
                   for group in items.values() for i in group}.values())  # weak and strong may share a point
    records = {r['trial_id']: r for r in study.run(unique)}
    rows = []
    for name, group in items.items():
        rows += efficiencies([records[i.trial_id if isinstance(i, sweep_trials.Trial) else i['trial_id']]
                              for i in group], name)
    from jaxfrontier.sweep import report as sweep_report  # pylint: disable=g-import-not-at-top  (matplotlib)
    paths = sweep_report.write_scaling_report(study.workdir, rows,
                                              F.describe_run(argv, 'jaxfrontier.scaling', ','.join(map(str, counts))))
    for row in rows:
        eff = f'{row["efficiency"]:.1%}' if row['efficiency'] is not None else row['status']
        F.log(f'{row["study"]:>6s} {row["devices"]:>5d} devices: efficiency {eff}')
    F.log(f'report {paths["markdown"]}')
    return 0


def run() -> None:
    F.run_command(run_scaling)


if __name__ == '__main__':
    run()
