"""What a checkpoint is on disk: its directories, format, model fields and the errors naming it.

A run's checkpoints live in `<workdir>/checkpoints/<step>/` (the package docstring,
jaxfrontier/checkpoint/__init__.py). Every reader and writer of them (manager, restore,
readers, safetensors, hf) starts from here.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from jaxfrontier import families
from jaxfrontier.errors import CheckpointError, ConfigError
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.families import moe as moe_lib
from jaxfrontier.checkpoint import integrity

FORMAT = 'jaxfrontier-checkpoint'
VERSION = 1
CHECKPOINT_SUBDIR = 'checkpoints'
SUPERSEDED_SUBDIR = 'checkpoints.superseded'  # steps newer than the one a run rolled back to
# The config fields every family shares that fix the shapes of the train state.
COMMON_SHAPE_FIELDS = ('family', 'num_layers', 'd_model', 'num_heads', 'seq_len', 'vocab_size', 'mlp_ratio',
                       'tied_embeddings', 'mlp_dim')


# The train state's entry that no checkpoint holds: LoRA's frozen base (training/state.py), read from
# checkpoint.init_params_from at every start instead.
FROZEN = 'frozen'


def persistent(state: Any) -> Any:
    """What of a train state (or its target, its shardings) a checkpoint holds: all of it but `FROZEN`."""
    return {k: v for k, v in state.items() if k != FROZEN} if isinstance(state, dict) and FROZEN in state else state


def model_shape_fields() -> tuple[str, ...]:
    """The model.* fields that fix the shapes of the train state (the shared ones, then each family's own,
    `Family.shape_fields`): a checkpoint restores only into a config that agrees on all of them."""
    return COMMON_SHAPE_FIELDS + tuple(f for family in families.all_families() for f in family.shape_fields)


def model_function_fields() -> tuple[str, ...]:
    """What else the families' models compute with (not shapes: a fine-tune may change them, a reader
    adopts them; `Family.function_fields`)."""
    return tuple(f for family in families.all_families() for f in family.function_fields)


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_SUBDIR)


def committed_steps(directory: str) -> list[int]:
    """Steps with a committed-looking directory `<step>/` (temporary directories excluded)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def padded_vocab_of(config_dict: dict[str, Any]) -> int:
    """Padded vocabulary of a saved (JSON) config; see config_lib.padded_vocab."""
    m = config_dict['model']['vocab_multiple'] * config_dict['mesh']['tensor']
    return -(-config_dict['model']['vocab_size'] // m) * m


def check_model_matches(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str, fix: str) -> None:
    """Raises ConfigError naming the first model field in which `c` differs from `saved`.

    Args:
      saved: the resolved config saved with the checkpoint (JSON dict).
      c: the config being run.
      where: the checkpoint, for the message.
      fix: what to do instead of changing the field, for the message.
    """
    for field in model_shape_fields():
        theirs, ours = saved.get('model', {}).get(field), c.model[field]
        if theirs is not None and theirs != ours:
            raise ConfigError(
                f'model.{field}', ours, f'the checkpoint {where} was saved with model.{field} = {theirs!r}',
                f'set --config.model.{field}={theirs} to match it, or {fix}')


def check_optimizer_matches(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Raises ConfigError when `c` runs another optimizer (or Adafactor factoring) than `saved` trained with.

    Refused rather than re-initialised: a silently fresh optimizer state changes the run's
    dynamics mid-way (Adam's moments restart from zero), and the deliberate way to switch exists:
    a new workdir with checkpoint.init_params_from (parameters kept, fresh optimizer state).
    Checkpoints from before optim.name existed were AdamW's.
    """
    optim = saved.get('optim', {}) if isinstance(saved.get('optim'), dict) else {}
    theirs, ours = optim.get('name', 'adamw'), c.optim.name
    fresh = (f'or keep only its parameters: a new --workdir with --config.checkpoint.init_params_from={where} '
             '(fresh optimizer state)')
    if theirs != ours:
        raise ConfigError('optim.name', ours, f'the checkpoint {where} holds the optimizer state of {theirs!r}',
                          f'set --config.optim.name={theirs} to resume it, {fresh}')
    if ours == 'adafactor' and optim.get('factor_min_dim', c.optim.factor_min_dim) != c.optim.factor_min_dim:
        theirs = optim['factor_min_dim']
        raise ConfigError('optim.factor_min_dim', c.optim.factor_min_dim,
                          f'the checkpoint {where} factored with optim.factor_min_dim = {theirs!r}',
                          f'set --config.optim.factor_min_dim={theirs} to resume it, {fresh}')


def check_routing_matches(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Raises ConfigError when a mixture-of-experts `c` routes tokens otherwise than `saved` trained with
    (families/moe.ROUTING_FIELDS: top-k, router, renormalisation, routed scale, dropless, node-limited groups).

    Refused as an optimizer switch is: the router and the experts were trained for those values, so a
    silent change on resume is a different model mid-run. A deliberate change is a fine-tune: a new
    workdir with checkpoint.init_params_from. A field the checkpoint lacks (saved before it existed) is
    not checked. The dispatch (model.moe_dispatch, its buffer) is not routing: it may change on resume.
    """
    model = saved.get('model', {}) if isinstance(saved.get('model'), dict) else {}
    if not (moe_lib.on(model) and moe_lib.on(c.model)):
        return  # dense on either side: check_model_matches names model.moe_experts
    for field in moe_lib.ROUTING_FIELDS:
        theirs, ours = model.get(field, moe_lib.ROUTING_BEFORE.get(field)), c.model[field]
        if theirs is not None and theirs != ours:
            raise ConfigError(
                f'model.{field}', ours, f'the checkpoint {where} was trained routing with model.{field} = {theirs!r} '
                '(its router and experts were trained for it)', f'set --config.model.{field}={theirs} to resume it, '
                f'or change it as a fine-tune: a new --workdir with --config.checkpoint.init_params_from={where}')


def check_lora_matches(saved: dict[str, Any], c: ml_collections.ConfigDict, where: str) -> None:
    """Raises ConfigError when `c` trains other LoRA adapters than the checkpoint holds (rank, targets, alpha), or
    LoRA over a checkpoint of a whole model, or the reverse (families/lora.py)."""
    theirs, ours = lora_lib.section_of(saved), lora_lib.section_of(c.to_dict())
    if not theirs['rank'] and ours['rank']:
        raise ConfigError('lora.rank', ours['rank'], f'the checkpoint {where} holds a whole model\'s train state, not '
                          'LoRA adapters', f'train adapters over it in a new --workdir with '
                          f'--config.checkpoint.init_params_from={where}, or set --config.lora.rank=0 to resume it')
    if theirs['rank'] and not ours['rank']:
        raise ConfigError('lora.rank', 0, f'the checkpoint {where} holds LoRA adapters (rank {theirs["rank"]}), '
                          'not a whole model', f'set --config.lora.rank={theirs["rank"]} (and its base as '
                          'checkpoint.init_params_from) to resume it, or export it merged: --mode=export '
                          '--export_format=hf')
    for field in ('rank', 'alpha', 'targets'):
        same = (set(lora_lib.target_names(theirs)) == set(lora_lib.target_names(ours)) if field == 'targets'
                else theirs[field] == ours[field])
        if theirs['rank'] and not same:
            raise ConfigError(f'lora.{field}', ours[field], f'the checkpoint {where} holds adapters of '
                              f'lora.{field} = {theirs[field]!r}', f'set --config.lora.{field}={theirs[field]} to '
                              'resume it, or train new adapters in a new --workdir')


def path_name(path) -> str:
    """'/'-joined keys of a pytree path: ('params', 'blocks', 'attn', 'w_qkv') -> params/blocks/attn/w_qkv."""
    return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def corrupted_error(directory: str, step: int | str, error: Exception, fix: str = '') -> CheckpointError:
    """The error for a checkpoint that Orbax or TensorStore could not read (`fix`: what to do instead)."""
    detail = integrity.read_error_text(error)[:400]
    if integrity.is_checksum_error(error):
        return CheckpointError(
            f'checkpoint {directory}/{step} fails its checksum ({detail}): its files were changed on disk. '
            f'Fix: {fix or "move that step directory away to resume from the previous checkpoint"}. '
            'Nothing was trained.')
    return CheckpointError(
        f'checkpoint {directory}/{step} cannot be read ({type(error).__name__}: {detail}); it is '
        'truncated or corrupted. Fix: move that step directory away to resume from the previous '
        'checkpoint, or use a new --workdir. Nothing was trained.')
