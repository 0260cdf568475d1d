"""Turning points into trials and running them: shared by `sweep` and `scaling`.

`Study` holds what every trial of one sweep or scaling study shares: the base config and the
`--config.*` overrides the user gave, the measurement (warm-up and measured steps), the
launcher and the results file. `Study.prepare(point, devices)` gives a runnable `Trial`, or
the record of a point that is `invalid` (a config rule), `skipped_plan` (predicted not to
fit) or `skipped_verify` (`--verify`: its layout does not compute what one device computes,
sweep/verify.py); `Study.run(items)` runs the trials not yet finished, as many at once as the launcher
allows, appending each record as its trial ends.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any, Callable, Sequence

import ml_collections

from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.sweep import space as sweep_space
from jaxfrontier.sweep import trials as sweep_trials
from jaxfrontier.sweep.trials import Trial

# Fields every trial sets: the measurement needs them; the user chooses them with sweep flags.
FIXED = {'train.steps': '--warmup and --steps', 'train.log_every': '(every step is logged)'}
# Fields trials set unless the user's --config.* overrides choose otherwise.
DEFAULTS = {'train.eval_every': 0, 'train.eval_batches': 1, 'train.progress': False, 'checkpoint.enabled': False,
            'data.kind': 'synthetic'}  # throughput does not depend on token values; no data file on every node


@dataclasses.dataclass
class Study:
    """Everything the trials of one sweep or scaling study share."""

    workdir: str
    config_spec: str  # --config as given (configs/x.py[:arg])
    base: ml_collections.ConfigDict  # loaded, with the user's overrides
    user_args: tuple[str, ...]  # the user's --config.* overrides, verbatim
    warmup: int
    steps: int
    launcher: Any  # sweep_launch.LocalLauncher | SlurmLauncher
    trial_env: dict[str, str]
    timeout_s: float = 1800.0
    predict: Callable[[ml_collections.ConfigDict, int], dict[str, Any]] | None = None  # sweep_plan
    retry_failed: bool = False
    launch_fixed: dict[str, Any] = dataclasses.field(default_factory=dict)  # e.g. devices per process
    log: Callable[[str], None] = print
    verify: Callable[[Trial, ml_collections.ConfigDict], dict[str, Any]] | None = None  # sweep/verify.py

    def __post_init__(self):
        os.makedirs(os.path.join(self.workdir, 'trials'), exist_ok=True)
        self.store = sweep_trials.ResultStore(os.path.join(self.workdir, 'results.jsonl'))
        self.cpu = self.base.mesh.cpu_devices > 0
        overridden = {a.split('=', 1)[0][len('--config.'):] for a in self.user_args}
        for path, how in FIXED.items():
            if path in overridden:
                raise UserError(f'--config.{path}: the sweep sets it for every trial. Fix: drop it; '
                                           f'choose it with {how}')
        self.fixed = {'train.steps': self.warmup + self.steps + sweep_trials.EXTRA_STEPS, 'train.log_every': 1}
        self.fixed.update({k: v for k, v in DEFAULTS.items() if k not in overridden})
        self.fixed.update(self.launch_fixed)

    # ------------------------------------------------------------------ points -> trials

    def prepare(self, point: dict[str, Any], devices: int, swept: Sequence[str]) -> Trial | dict[str, Any]:
        """A runnable Trial of `point` on `devices`, or the record of why it will not run."""
        fixed = dict(self.fixed, **({'mesh.cpu_devices': devices} if self.cpu else {}))
        base = ml_collections.ConfigDict(self.base.to_dict())
        for path, value in fixed.items():
            section, field = path.split('.')
            base[section][field] = value
        # --devices decides the simulated device count: a --config.mesh.cpu_devices > 0 only says "CPU"
        head = [a for a in self.user_args if a.split('=', 1)[0][len('--config.'):] not in fixed]
        head += [f'--config.{p}={v}' for p, v in fixed.items()]
        measure = (self.warmup, self.steps)
        try:
            c, sets = sweep_space.point_config(base, point, devices, swept)
        except ConfigError as e:
            args = head + [f'--config.{sweep_space.param_for(n).path or n}={v}' for n, v in point.items()]
            trial = Trial(sweep_trials.trial_id(self.config_spec, args, devices, measure), point, devices,
                          tuple(args), {'model': sweep_space.describe_model(base), **point})
            return sweep_trials.base_record(trial, 'invalid', error=str(e))
        args = head + [f'--config.{p}={v}' for p, v in sets.items()]
        trial = Trial(sweep_trials.trial_id(self.config_spec, args, devices, measure), point, devices, tuple(args),
                      sweep_space.layout_of(c), config=c.to_dict())
        unrunnable = self.launcher.unrunnable(trial)
        if unrunnable:
            return sweep_trials.base_record(trial, 'invalid', error=f'{self.launcher.name} launcher: {unrunnable}')
        if self.predict is not None:
            trial = dataclasses.replace(trial, plan=self.predict(c, devices))
            if not trial.plan['fits']:
                return sweep_trials.base_record(
                    trial, 'skipped_plan', error=f'the planner predicts {trial.plan["memory_gib"]:.2f} GiB per device '
                    f'on {trial.plan["hardware"]}, {trial.plan["usable_gib"]:.2f} GiB usable (--noplan_filter runs it)')
        if self.verify is not None and self.finished(trial) is None:
            checked = self.verify(trial, c)
            if not checked['passed']:
                return sweep_trials.base_record(trial, 'skipped_verify', error=checked['line'],
                                                certificate=checked['certificate'])
        return trial

    def finished(self, item: Trial | dict[str, Any]) -> dict[str, Any] | None:
        """The stored record of a trial that ran and needs no rerun, else None.

        Only runs count: whether a point is invalid or predicted not to fit is decided afresh each
        time (it is cheap, and --noplan_filter must run what an earlier sweep skipped).
        """
        tid = item.trial_id if isinstance(item, Trial) else item['trial_id']
        record = self.store.finished(tid, self.retry_failed)
        return record if record is not None and record['status'] in sweep_trials.RAN else None

    # ------------------------------------------------------------------ running

    def _launch(self, trial: Trial) -> sweep_trials.TrialProcess | None:
        prefix = self.launcher.start(trial)
        if prefix is None:
            return None
        trial_dir = os.path.join(self.workdir, 'trials', trial.trial_id)
        shutil.rmtree(trial_dir, ignore_errors=True)  # a retried trial starts clean
        os.makedirs(trial_dir)
        command = prefix + ['-m', 'jaxfrontier.main', f'--config={self.config_spec}', f'--workdir={trial_dir}',
                            *trial.args]
        self.log(f'trial {trial.trial_id} started on {trial.devices} devices: {_describe(trial.point)}')
        return sweep_trials.TrialProcess(trial, command, self.trial_env, trial_dir, self.timeout_s)

    def run(self, items: Sequence[Trial | dict[str, Any]]) -> list[dict[str, Any]]:
        """Records of `items` in order: stored ones reused, new failures stored, trials run."""
        results: dict[str, dict[str, Any]] = {}
        queue: list[Trial] = []
        for item in items:
            tid = item.trial_id if isinstance(item, Trial) else item['trial_id']
            done = self.finished(item)
            if done is not None:  # measured before (a measurement beats a prediction): keep it
                results[tid] = done
            elif isinstance(item, Trial):
                queue.append(item)
            else:
                stored = self.store.records.get(tid, {})
                if (stored.get('status'), stored.get('error')) != (item['status'], item.get('error')):
                    self.store.append(item)
                results[tid] = item
        running: list[sweep_trials.TrialProcess] = []
        try:
            while queue or running:
                while queue and (tp := self._launch(queue[0])) is not None:
                    running.append(tp)
                    queue.pop(0)
                time.sleep(0.2)
                for tp in list(running):
                    rc = tp.poll()
                    if rc is None:
                        continue
                    running.remove(tp)
                    self.launcher.release(tp.trial)
                    record = sweep_trials.finish(tp, rc, self.warmup, self.steps, self.timeout_s)
                    self.store.append(record)
                    results[tp.trial.trial_id] = record
                    self.log(f'trial {tp.trial.trial_id} {record["status"]} in {record["wall_s"]:.0f} s: '
                             f'{_summary(record)}')
        finally:  # interrupted: the running trials must not outlive the sweep
            for tp in running:
                tp.stop()
        return [results[item.trial_id if isinstance(item, Trial) else item['trial_id']] for item in items]


def _describe(point: dict[str, Any]) -> str:
    return ' '.join(f'{k}={v}' for k, v in point.items()) or '(base config)'


def _summary(record: dict[str, Any]) -> str:
    if record['status'] == 'ok':
        return (f'{record["tokens_per_s"]:,.0f} tokens/s, {record["tflops_per_device"]:.4g} TFLOP/s per device, '
                f'compile {record["compile_time_s"]} s')
    return record.get('error', '').splitlines()[0][:200] if record.get('error') else ''


def trial_env(env: dict[str, str], cpu: bool) -> dict[str, str]:
    """The environment of a trial: the sweep's, and on simulated CPU devices no fixed device count.

    main sets the simulated device count from config.mesh.cpu_devices, unless XLA_FLAGS already
    fixes one; a sweep's trials differ in their device count, so an inherited one is dropped.
    """
    env = dict(env, PYTHONUNBUFFERED='1')
    if cpu:
        env['JAX_PLATFORMS'] = 'cpu'
        flags = [f for f in env.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
        env['XLA_FLAGS'] = ' '.join(flags)
    return env
