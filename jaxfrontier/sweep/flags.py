"""The flags `jaxfrontier.sweep` and `jaxfrontier.scaling` share, and the Study they describe.

Both are entry points like `jaxfrontier.main`: they read flags and the Slurm allocation's
variables here, and nowhere else. `--config` and its `--config.x=y` overrides work as in
`jaxfrontier.main`; the overrides are passed to every trial verbatim.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import signal
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from jaxfrontier import cli
from jaxfrontier import config as config_lib  # no JAX
from jaxfrontier import hardware as hw_lib  # no JAX at import
from jaxfrontier.errors import UserError
from jaxfrontier.sweep import launch as sweep_launch
from jaxfrontier.sweep import run as sweep_run

CONFIG = config_flags.DEFINE_config_file('config', None, 'Base config file (configs/*.py[:arg]); --config.x=y '
                                         'overrides apply to every trial.', lock_config=True)
WORKDIR = flags.DEFINE_string('workdir', 'workdirs/sweep', 'results.jsonl, report, plots and trials/<id>/.')
WARMUP = flags.DEFINE_integer('warmup', 3, 'Steps run before measuring (the first includes start-up).')
STEPS = flags.DEFINE_integer('steps', 5, 'Measured steps per trial.')
HARDWARE = flags.DEFINE_string('hardware', 'local', 'Device the planner filter assumes: '
                               f'{", ".join(hw_lib.NAMES)} (local: this machine; name the GPU when trials run on '
                               'GPUs), or a description path.json (python -m jaxfrontier.calibrate).')
PLAN_FILTER = flags.DEFINE_bool('plan_filter', True, 'Skip layouts the planner predicts will not fit '
                                '(--noplan_filter runs them all).')
LAUNCHER = flags.DEFINE_enum('launcher', 'local', ['local', 'slurm'], 'local: one trial at a time here. slurm: '
                             'srun steps inside the current allocation, several at once when they fit.')
TASKS_PER_NODE = flags.DEFINE_integer('tasks_per_node', 0, 'slurm: processes per node (0: from the allocation).')
DEVICES_PER_TASK = flags.DEFINE_integer('devices_per_task', 1, 'slurm: devices per process (GPUs; on simulated '
                                        'CPU devices, how many each process creates).')
TIMEOUT = flags.DEFINE_float('trial_timeout', 1800.0, 'Seconds before a trial is stopped and recorded as timeout.')
RETRY = flags.DEFINE_bool('retry_failed', False, 'Rerun trials recorded as oom, crashed or timeout.')
VERIFY = flags.DEFINE_bool('verify', False, 'Before trials run, check each distinct layout against one device '
                           '(python -m jaxfrontier.main --mode=verify, on this machine\'s CPU); trials of a failing '
                           'layout are recorded as skipped_verify (docs/preflight.md).')
PYTHON = flags.DEFINE_string('python', '', 'Command that runs Python for trials (default: this interpreter), '
                             'e.g. a virtualenv on the compute nodes or a profiler wrapper.')


def log(text: str) -> None:
    print(f'sweep: {text}', flush=True)


def check_common() -> None:
    for name, value, low in (('warmup', WARMUP.value, 1), ('steps', STEPS.value, 1),
                             ('trial_timeout', TIMEOUT.value, 1)):
        if value < low:
            raise UserError(f'--{name}={value}: must be >= {low}. Fix: pass --{name} >= {low}'
                                       + (' (the first step includes start-up)' if name == 'warmup' else ''))


def _launcher(cpu: bool, python: list[str]):
    if LAUNCHER.value == 'local':
        return sweep_launch.LocalLauncher(python), {}
    launcher = sweep_launch.SlurmLauncher.from_env(os.environ, python, TASKS_PER_NODE.value, DEVICES_PER_TASK.value,
                                                   gpus=not cpu)
    return launcher, ({} if cpu else {'distributed.devices_per_process': DEVICES_PER_TASK.value})


def make_study(config_spec: str, user_args: tuple[str, ...], max_devices: int) -> sweep_run.Study:
    """The Study of this command line; `max_devices` sizes this process's simulated CPU devices."""
    check_common()
    base = CONFIG.value
    cpu = base.mesh.cpu_devices > 0
    python = shlex.split(PYTHON.value) or [sys.executable]
    trial_env = sweep_run.trial_env(dict(os.environ), cpu)
    launcher, launch_fixed = _launcher(cpu, python)
    predict = None
    if PLAN_FILTER.value:
        # The planner imports JAX: keep this process off the GPUs its trials use.
        os.environ['JAX_PLATFORMS'] = 'cpu'
        config_lib.set_cpu_device_count(max_devices if cpu else 1)
        from jaxfrontier.sweep import plan as sweep_plan  # pylint: disable=g-import-not-at-top
        predict = sweep_plan.predictor(HARDWARE.value, cpu)
    os.makedirs(WORKDIR.value, exist_ok=True)
    check = None
    if VERIFY.value:
        from jaxfrontier.sweep import verify as sweep_verify  # pylint: disable=g-import-not-at-top
        check = sweep_verify.verifier(python, sweep_run.trial_env(dict(os.environ), True), WORKDIR.value, config_spec,
                                      TIMEOUT.value, log)
    return sweep_run.Study(workdir=WORKDIR.value, config_spec=config_spec, base=base, user_args=user_args,
                           warmup=WARMUP.value, steps=STEPS.value, launcher=launcher, trial_env=trial_env,
                           timeout_s=TIMEOUT.value, predict=predict, retry_failed=RETRY.value,
                           launch_fixed=launch_fixed, log=log, verify=check)


def describe_run(argv: list[str], module: str, devices: str) -> str:
    """The report's header: the command, the measurement and where it ran."""
    return '\n'.join([
        f'Command: `python -m {module} {" ".join(shlex.quote(a) for a in argv[1:])}`', '',
        f'Measured {STEPS.value} steps after {WARMUP.value} warm-up steps per trial, {devices} devices per trial, '
        f'{LAUNCHER.value} launcher, on {platform.machine()} with {os.cpu_count()} cores, '
        f'{time.strftime("%Y-%m-%d")}. Planner filter: '
        + (f'on (hardware {HARDWARE.value})' if PLAN_FILTER.value else 'off') + '.'])


def user_overrides(argv: list[str]) -> tuple[str, tuple[str, ...]]:
    """(--config value, the --config.* overrides verbatim) from the command line, for the trials."""
    spec, overrides = '', []
    for i, arg in enumerate(argv[1:], 1):
        if re.match(r'^--?config=', arg):
            spec = arg.split('=', 1)[1]
        elif arg in ('--config', '-config') and i + 1 < len(argv):
            spec = argv[i + 1]
        elif re.match(r'^--?config\.', arg):
            key, sep, value = arg.lstrip('-').partition('=')
            overrides.append(f'--{key}={value}' if sep else f'--{key}')
    return spec, tuple(overrides)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing; a bad flag or --config override is one line (exit 2), not a traceback."""
    return cli.parse_config_flags(
        argv, CONFIG, required='--config is required: the base config of every trial, e.g. --config=configs/tiny.py')


def run_command(body) -> None:
    """The absl entry point of `jaxfrontier.sweep` and `jaxfrontier.scaling`.

    `body(argv, config_spec, user_args) -> exit status` runs after flag parsing; a UserError
    is one line `error: ...` and exit 2; SIGTERM ends it through its cleanup.
    """
    def main(argv: list[str]) -> int:
        if len(argv) > 1:
            raise app.UsageError(f'unexpected arguments: {argv[1:]}')
        spec, user_args = user_overrides(sys.argv)
        # SIGTERM (scancel, the time limit) ends the sweep through its cleanup: running trials are stopped.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            return body(sys.argv, spec, user_args)
        except UserError as e:
            print(f'error: {e}', file=sys.stderr)
            return 2

    cli.run_app(main, flags_parser=parse_flags)
