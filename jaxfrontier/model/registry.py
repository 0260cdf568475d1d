"""The model families by `config.model.family` name, and what callers ask of the configured one.

Adding a family: its module declares a `family.Family` (as model/gpt.py's `FAMILY`), it is
listed in `FAMILIES` here, and its name in `config.MODEL_FAMILIES` (config.py imports no JAX;
a test holds the two lists equal).
"""

from __future__ import annotations

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.model import gpt, llama
from jaxfrontier.model.family import Family

FAMILIES: dict[str, Family] = {f.name: f for f in (gpt.FAMILY, llama.FAMILY)}


def get(name: str) -> Family:
    """The declaration of family `name` (config.validate has already checked the name)."""
    if name not in FAMILIES:
        raise ConfigError('model.family', name, 'unknown model family',
                                     f'use one of {tuple(FAMILIES)}')
    return FAMILIES[name]


def flops_per_step_from_config(config: ml_collections.ConfigDict) -> tuple[float, float]:
    """Returns (model_flops, megatron_hw_flops) per optimizer step for a jaxfrontier config.

    The configured family's count in Megatron's convention (flops.py): the padded vocabulary,
    and recomputation (f = 4) in the hardware figure when `config.model.remat != 'none'`.
    """
    shape = config_lib.model_shape(config)
    family, batch = get(shape.family), config.train.global_batch
    return family.megatron_flops(batch, shape, False), family.megatron_flops(batch, shape, shape.remat != 'none')
