"""Entry point: `python -m jaxfrontier.main --config=configs/tiny.py --workdir=DIR [--mode=train|plan]`.

The only module that reads flags. Config overrides come as `--config.train.steps=10`;
a misspelt key is rejected. JAX is imported only after the config is read, so that
`config.mesh.cpu_devices` can set the simulated CPU device count before JAX starts.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'tiny.py')

_CONFIG = config_flags.DEFINE_config_file('config', _DEFAULT_CONFIG, 'Config file (configs/*.py[:arg]).',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/default', 'Directory for metrics, config and data cache.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'plan'],
                          'train: run training. plan: parameters, memory and FLOPs of the layout, no devices.')


def set_cpu_device_count(n: int) -> None:
    """Asks XLA for n simulated CPU devices; must run before JAX initialises its backends."""
    flag = f'--xla_force_host_platform_device_count={n}'
    current = os.environ.get('XLA_FLAGS', '')
    if n > 0 and 'xla_force_host_platform_device_count' not in current:
        os.environ['XLA_FLAGS'] = f'{current} {flag}'.strip()


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    config = _CONFIG.value
    set_cpu_device_count(config.mesh.cpu_devices)
    logging.set_verbosity(logging.INFO)

    # Imported here, after the environment is final: these import JAX.
    from jaxfrontier import config as config_lib  # pylint: disable=g-import-not-at-top
    from jaxfrontier import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

    try:
        if _MODE.value == 'plan':
            from jaxfrontier import planner  # pylint: disable=g-import-not-at-top
            print(planner.format_plan(planner.plan(config)))
        else:
            from jaxfrontier import train  # pylint: disable=g-import-not-at-top
            train.train_and_evaluate(config, _WORKDIR.value)
    except config_lib.UserError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    except metrics_lib.NonFiniteLossError as e:
        print(f'error: {e}', file=sys.stderr)
        return 3
    return 0


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == '__main__':
    run()
