"""What an output path may replace: a training workdir, a Hugging Face export, stale temporaries.

`--mode=export --export_format=hf --export_path=<the training workdir>` replaced the run's
config.json with the Hugging Face one, and the next resume wrote the training config back over
the export; neither step said anything. `is_training_workdir` tells a workdir apart (exports
check their targets with it: interop/export_target.py), `check_not_hf_export` refuses training into
a Hugging Face directory, with one line. `remove_stale_temporaries` deletes `<path>.tmp<pid>` files that
an export killed by SIGKILL left behind (the writer's pid no longer runs).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re

from jaxfrontier.distributed import pid_alive
from jaxfrontier.errors import UserError

RUN_MARKERS = ('checkpoints', 'workdir.lock', 'metrics.jsonl')  # what only a training workdir holds


def _json(path: str) -> object:
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_training_workdir(path: str) -> bool:
    """A directory a training run wrote: checkpoints/, its lock or metrics, or our resolved config.json."""
    if not os.path.isdir(path):
        return False
    if any(os.path.exists(os.path.join(path, marker)) for marker in RUN_MARKERS):
        return True
    config = _json(os.path.join(path, 'config.json'))
    return isinstance(config, dict) and 'model' in config and 'train' in config


def is_hf_export(path: str) -> bool:
    """A Hugging Face model directory: model.safetensors and a config.json with a model_type."""
    config = _json(os.path.join(path, 'config.json'))
    return (os.path.isfile(os.path.join(path, 'model.safetensors')) and isinstance(config, dict)
            and 'model_type' in config)


def check_not_hf_export(workdir: str) -> None:
    """Raises UserError when `workdir` is a Hugging Face export that training would overwrite."""
    if is_hf_export(workdir) and not is_training_workdir(workdir):
        raise UserError(f'--workdir={workdir} is a Hugging Face model directory (config.json and '
                        'model.safetensors): training there would overwrite its config.json. Fix: train in a '
                        f'workdir of its own; to start from these weights pass '
                        f'--config.checkpoint.init_params_from={workdir}')


def remove_stale_temporaries(path: str) -> None:
    """Deletes `<path>.tmp<pid>` files whose writer no longer runs (an export killed by SIGKILL)."""
    for tmp in glob.glob(glob.escape(path) + '.tmp*'):
        match = re.fullmatch(r'.*\.tmp(\d+)', tmp)
        if match and not pid_alive(int(match.group(1))):
            with contextlib.suppress(OSError):
                os.remove(tmp)
