"""Entry point: `python -m jaxfrontier.main --config=configs/tiny.py --workdir=DIR [--mode=train|plan|export]`.

The only module that reads flags. Config overrides come as `--config.train.steps=10`;
a misspelt key is rejected. JAX is imported only after the config is read, so that
`config.mesh.cpu_devices` can set the simulated CPU device count before JAX starts.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jaxfrontier import cli
from jaxfrontier import config as config_lib  # no JAX import: safe before XLA_FLAGS is set
from jaxfrontier import distributed  # no JAX import either
from jaxfrontier import hardware as hardware_lib  # no JAX import at module level

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'tiny.py')

# No default here: config_flags would load a default config, and apply the --config.* overrides,
# at import time, outside any error handling. `parse_flags` adds --config=<tiny.py> when absent.
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py[:arg]); '
                                          f'default {_DEFAULT_CONFIG}.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/default', 'Directory for metrics, config and data cache.')
_EXPORT_PATH = flags.DEFINE_string('export_path', '', 'mode=export: the .safetensors file to write from the newest '
                                   'checkpoint of --workdir (default <workdir>/params.safetensors).')
_EXPORT_ALLOW_NONFINITE = flags.DEFINE_bool('export_allow_nonfinite', False, 'mode=export: write parameters '
                                            'that hold NaN or Inf instead of refusing.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'plan', 'export'],
                          'train: run training. plan: parameters, memory and FLOPs of the layout, no devices. '
                          'export: parameters of the newest checkpoint in --workdir to --export_path.')
_HARDWARE = flags.DEFINE_enum('hardware', 'mi250x', list(hardware_lib.NAMES),
                               'mode=plan: the device to plan for (local: this machine).')
_SEARCH = flags.DEFINE_bool('search', False, 'mode=plan: search layouts of the model that fit, fastest first.')
_SEARCH_DEVICES = flags.DEFINE_integer('search_devices', 0, 'mode=plan --search: devices (0: the config mesh).')
_PLAN_CHECK = flags.DEFINE_enum('plan_check', 'lower', ['none', 'lower', 'compile'],
                                'mode=plan: lower the train step on an AbstractMesh (lower), and also compile an '
                                'fp32 copy on <= 2048 simulated CPU devices (compile).')
_PLAN_JSON = flags.DEFINE_string('plan_json', '', 'mode=plan: also write the plan (or search) as JSON here.')


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    config = _CONFIG.value

    try:  # validate, then decide how this process joins the job, before JAX starts
        processes = distributed.ProcessSettings('none')
        if _MODE.value == 'train':
            config_lib.validate(config)
            processes = distributed.resolve(config.distributed, os.environ, cpu=config.mesh.cpu_devices > 0)
        per_process = distributed.cpu_devices_per_process(config.mesh.cpu_devices, processes.num_processes)
        config_lib.set_cpu_device_count(per_process)
    except (config_lib.UserError, distributed.DistributedError) as e:
        return cli.exit_code(e)
    logging.set_verbosity(logging.INFO)

    # Imported here, after the environment is final: these import JAX.
    from jaxfrontier.training import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

    try:
        if _MODE.value == 'plan':
            from jaxfrontier.plan import report as plan_report  # pylint: disable=g-import-not-at-top
            print(plan_report.report(config, hardware=_HARDWARE.value, search=_SEARCH.value,
                                     search_devices=_SEARCH_DEVICES.value, check=_PLAN_CHECK.value,
                                     json_path=_PLAN_JSON.value))
        elif _MODE.value == 'export':
            from jaxfrontier.training import export  # pylint: disable=g-import-not-at-top
            out = _EXPORT_PATH.value or os.path.join(_WORKDIR.value, 'params.safetensors')
            names = export.export_params(_WORKDIR.value, out, allow_nonfinite=_EXPORT_ALLOW_NONFINITE.value)
            print(f'exported {len(names)} parameter tensors of {_WORKDIR.value} to {out} (docs/checkpoints.md)')
        else:
            distributed.initialize(processes, config.distributed)
            logging.info(distributed.describe_process(processes, os.environ))
            if processes.process_id != 0:
                logging.set_verbosity(logging.WARNING)  # only process 0 logs progress
            from jaxfrontier.training import loop as train  # pylint: disable=g-import-not-at-top
            train.train_and_evaluate(config, _WORKDIR.value)
    except (config_lib.UserError, metrics_lib.NonFiniteLossError, distributed.DistributedError) as e:
        return cli.exit_code(e)
    return 0


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing; a mistake in --config or its overrides is one message (exit 2), not a traceback."""
    return cli.parse_config_flags(argv, _CONFIG, default_config=_DEFAULT_CONFIG)


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)


if __name__ == '__main__':
    run()
