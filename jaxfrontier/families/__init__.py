"""The model families: one declaration each (families/base.py `Family`), registered by name.

`get(name)` is what the config, its checks, the planner, the verify shrink, the checkpoint
format and the Hugging Face interop ask instead of branching on `config.model.family`. Every
module of this package but base.py and lora.py (LoRA on any family's matmuls) declares one
family (its `FAMILY`), registered on import in name order; `register` adds another at run time
(tests/model/test_third_family.py declares one in a test). No JAX import here or below (base.py says why).

Adding a family: a declaration module here (its fields, checks, shape, parameter table, FLOPs,
Hugging Face converter, verify rule) and its NNX module (e.g. model/<family>.py, which the
declaration names); nothing else names it. `SHARED` modules are parts families share (base.py; moe.py,
the mixture-of-experts MLP's fields, shape, table and FLOPs; hf_moe.py, its Hugging Face names), not families.
"""

from __future__ import annotations

import importlib
import pkgutil

from jaxfrontier.errors import ConfigError
from jaxfrontier.families.base import (  # noqa: F401
    DEFAULT_FAMILY, Family, HFConverter, Lora, LoraTarget, ModelShape, ParamSpec, ShrunkHeads)

_FAMILIES: dict[str, Family] = {}
SHARED = ('base', 'hf_moe', 'lora', 'moe')  # modules of this package that declare no family


def register(family: Family) -> Family:
    """Adds `family` under its name (a name already taken is refused: unregister it first)."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f'model family {family.name!r} is already registered')
    clash = {f for other in _FAMILIES.values() if other is not family for f in other.fields} & set(family.fields)
    if clash:
        raise ValueError(f'model family {family.name!r} declares fields another family has: {sorted(clash)}')
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes family `name` (a test's own family, when the test ends)."""
    _FAMILIES.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered families' names, in registration order."""
    return tuple(_FAMILIES)


def all_families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def get(name: str) -> Family:
    """The declaration of family `name`.

    Raises:
      ConfigError: no family has that name.
    """
    if name not in _FAMILIES:
        raise ConfigError('model.family', name, 'unknown model family', f'use one of {names()}')
    return _FAMILIES[name]


for _info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    if _info.name not in SHARED:
        register(importlib.import_module(f'{__name__}.{_info.name}').FAMILY)
