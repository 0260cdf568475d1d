"""Weights & Biases: every metrics row of a run, its resolved config and its goodput (optional extra `wandb`).

`train.wandb_mode` is `disabled` by default; `online` or `offline` log from process 0 only. The
run's W&B id is kept in `<workdir>/wandb_run_id`, so a restarted run (a requeue, a resume after a
preemption) logs into the same W&B run (`resume='allow'`); offline runs are uploaded later with
`wandb sync <dir>/wandb/offline-run-*`. Rows of steps run again after a restart (`"replayed": true`
in metrics.jsonl) are not sent: W&B keeps one value per step and its steps only increase.

`wandb` is imported here only (a run that does not ask for it never does); `check_installed`
runs with the config's validation, before JAX starts, so a missing extra is one line, not a
traceback after the compile.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import string
from typing import Any, Mapping

import ml_collections

from jaxfrontier.errors import ConfigError
from jaxfrontier import files

ID_FILE = 'wandb_run_id'


def enabled(t: ml_collections.ConfigDict) -> bool:
    """Whether the run's `train` section asks for W&B logging."""
    return t.wandb_mode != 'disabled'


def check_installed(t: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the extra when the `train` section asks for W&B and `wandb` is missing."""
    if enabled(t) and importlib.util.find_spec('wandb') is None:
        raise ConfigError('train.wandb_mode', t.wandb_mode, 'needs the wandb package, which is not installed',
                          "pip install 'jaxfrontier[wandb]', or set --config.train.wandb_mode=disabled")


def directory(t: ml_collections.ConfigDict, workdir: str) -> str:
    """Where W&B writes its files (`train.wandb_dir`, default the workdir): `<it>/wandb/`."""
    return t.wandb_dir or workdir


def run_id(workdir: str) -> str:
    """The W&B run id of this workdir: the one kept from an earlier attempt, else a new one (kept)."""
    path = os.path.join(workdir, ID_FILE)
    try:
        with open(path, encoding='utf-8') as f:
            kept = f.read().strip()
        if kept.isalnum():
            return kept
    except FileNotFoundError:
        pass
    new = ''.join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id shape
    files.write_atomic(path, new + '\n')
    return new


class WandbSink:
    """A MetricsWriter sink that logs rows to one W&B run (process 0 builds it; no one else).

    Args:
      t: the run's `train` section (wandb_*).
      workdir: the run's workdir (the kept run id; W&B's files unless `train.wandb_dir`).
      run_config: the resolved config as JSON data, the W&B run's config.
    """

    def __init__(self, t: ml_collections.ConfigDict, workdir: str, run_config: Mapping[str, Any]):
        import wandb  # pylint: disable=g-import-not-at-top

        where = directory(t, workdir)
        os.makedirs(where, exist_ok=True)
        try:
            self.run = wandb.init(
                project=t.wandb_project, entity=t.wandb_entity or None, name=t.wandb_name or None,
                group=t.wandb_group or None, tags=[x.strip() for x in t.wandb_tags.split(',') if x.strip()] or None,
                notes=t.wandb_notes or None, mode=t.wandb_mode, dir=where, id=run_id(workdir), resume='allow')
        except wandb.errors.Error as e:  # no API key, no network, a project that is not yours: one line
            raise ConfigError('train.wandb_mode', t.wandb_mode, f'W&B could not start the run: {e}',
                              'log in (`wandb login`, or set WANDB_API_KEY), or use --config.train.wandb_mode=offline '
                              'and `wandb sync` the run later') from None
        # After init: on resume a changed value (a raised train.steps) replaces the old one, no error.
        self.run.config.update(dict(run_config), allow_val_change=True)
        self.last_step = -1

    def write(self, step: int, values: Mapping[str, float], replayed: bool) -> None:
        """Logs one metrics row at `step` (rows of replayed steps, or of a step already passed, are not)."""
        if replayed or step < self.last_step:
            return
        self.run.log(dict(values), step=int(step))
        self.last_step = int(step)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Sets the run's summary (the final goodput)."""
        self.run.summary.update(dict(values))

    def close(self, failed: bool = False) -> None:
        """Ends the W&B run (failed: exit code 1, shown as crashed)."""
        self.run.finish(exit_code=1 if failed else 0)
