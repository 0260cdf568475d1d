"""Every check of a training run's config, once, before anything is written or compiled.

Imports no JAX: `main` runs it before JAX starts (and before the process joins a
multi-process job), so a mistake is one line at once, on every process alike. After it neither
the memory preflight (`plan/preflight.check(..., validated=True)`) nor the loop
(`train_and_evaluate(..., validated=True)`) validates again; a library caller that passes no
`validated` gets the config validated there.
"""

from __future__ import annotations

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier.data import dpo as dpo_data
from jaxfrontier.errors import ConfigError
from jaxfrontier.data import loader as data_lib
from jaxfrontier.run.observe import wandb_log


def validate_run(c: ml_collections.ConfigDict, n_devices: int | None = None, platform: str | None = None) -> None:
    """Resolves `model.vocab_size=0`, packing's `data.eot_id=-1` and `data.loss_mask='auto'` from the token
    file headers (data.loader.resolve_headers), then checks the config and its data.

    `n_devices`: the devices present, where known (None before JAX starts: then
    `train_and_evaluate(..., validated=True)` checks only the device count,
    `config.check_device_count`); `platform`, JAX's backend where known, words that check's fix.

    Raises:
      ConfigError: naming the field, the value and the fix (also: W&B asked for, `wandb` not installed).
    """
    data_lib.resolve_headers(c)
    config_lib.validate(c, n_devices, platform)
    if c.lora.rank and not c.checkpoint.init_params_from:
        raise ConfigError('checkpoint.init_params_from', '', 'LoRA (lora.rank > 0) trains adapters over a base '
                          'model, and names none', 'set it to the base: a Hugging Face directory, a .safetensors '
                          'file or a checkpoint (or set lora.rank=0)')
    data_lib.check_data(c)
    dpo_data.check_run(c)  # train.objective
    wandb_log.check_installed(c.train)  # a missing optional extra: one line before JAX starts
