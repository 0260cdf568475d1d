"""The model to sample from or evaluate: its parameters, on the config's mesh without a pipeline.

A LoRA run's checkpoint (adapters alone) runs with its base read again from the run's
`checkpoint.init_params_from` (checked to be the same files), the adapters applied unmerged, as trained.

Source: the newest checkpoint of --workdir, else config.checkpoint.init_params_from (a workdir,
a checkpoint step, a .safetensors file or a Hugging Face directory of an architecture a family's
converter reads, families/). The model's shape comes from the source (the checkpoint's saved config, or
config.json), so `--config` needs only the mesh. A pipelined checkpoint is regathered: the pipeline axis folds into `data`, and block
arrays saved [V, L / V, ...] are read back as [L, ...] (restore onto any mesh, checkpoint/reshard.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import mesh as mesh_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import ConfigError, UserError
from jaxfrontier.families import lora as lora_np
from jaxfrontier.model import lora as lora_lib
from jaxfrontier.checkpoint import format as format_lib
from jaxfrontier.checkpoint.interop import hf
from jaxfrontier.checkpoint.interop import hf_files
from jaxfrontier.checkpoint.interop import init_from
from jaxfrontier.checkpoint import lora_base
from jaxfrontier.checkpoint import manager
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint import target as target_lib


def adopted_fields() -> tuple[str, ...]:
    """The source's model: its shape and family (format.model_shape_fields) and what it computes with (a
    family's norm and rotary settings, format.model_function_fields)."""
    return format_lib.model_shape_fields() + format_lib.model_function_fields() + ('vocab_multiple', 'init_std')


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model ready to run: config (pipeline folded away), parameter layout, parameters and their source."""

    config: ml_collections.ConfigDict
    layout: target_lib.ParamPlacement
    params: Any
    source: str
    step: int | None
    run_config: dict[str, Any]  # the saved config of the run ({} for a Hugging Face directory)
    hf_dir: str | None


def resolve_source(c: ml_collections.ConfigDict, workdir: str) -> str:
    """The newest checkpoint of `workdir`, else checkpoint.init_params_from; one-line error without either."""
    if format_lib.committed_steps(format_lib.checkpoint_dir(workdir)):
        return os.path.abspath(workdir)
    if c.checkpoint.init_params_from:
        return c.checkpoint.init_params_from
    raise UserError(f'no checkpoint in --workdir={workdir} and no checkpoint.init_params_from. Fix: train '
                    'into that workdir first, or pass --config.checkpoint.init_params_from=<workdir, '
                    '.safetensors file or Hugging Face directory>.')


def decode_config(c: ml_collections.ConfigDict, model: dict[str, Any]) -> ml_collections.ConfigDict:
    """`c` with the source's model shape, no pipeline and no context (both fold into `data`), dropout off."""
    c = ml_collections.ConfigDict(c.to_dict())  # unlocked copy
    for key in adopted_fields():
        if key in model:
            c.model[key] = model[key]
    c.model.dropout_rate = 0.0
    c.lora.rank = 0  # the source's adapters, if any, are set by `load` (a LoRA run's)
    # Decoding keeps whole sequences (its KV cache is not split) and runs no pipeline: the pipeline and
    # sequence axes (pipeline, context) fold into the replica axis (data).
    replica = axes_lib.replica().name
    for axis in axes_lib.AXES:
        if axis.role in ('pipeline', 'sequence'):
            c.mesh[replica], c.mesh[axis.name] = c.mesh[replica] * c.mesh[axis.name], 1
    c.pipeline.virtual_stages = 1
    c.sharding.zero1 = False
    if c.model.num_heads % c.mesh.tensor:
        raise ConfigError('mesh.tensor', c.mesh.tensor, f'the model has {c.model.num_heads} heads, '
                                     'which the tensor axis must divide', 'choose mesh.tensor dividing the heads')
    return c


def load(c: ml_collections.ConfigDict, workdir: str) -> Loaded:
    """Reads the parameters to run (see the module docstring) onto this config's devices."""
    manager.quiet_orbax_logs()  # Orbax's INFO lines (handlers created, read throughput) tell a user nothing
    source = resolve_source(c, workdir)
    step, run_config, hf_dir = None, {}, None
    if hf_files.looks_like_hf(source):
        hf_dir = source
        model = hf.model_fields(hf_files.check(source)[0], source)
    elif os.path.isfile(source):
        model = {}  # a .safetensors file: its metadata is checked against the config on load
    else:
        meta = readers.read_meta(readers.step_dir_of(source))
        step, run_config, model = meta['step'], meta['config'], meta['config']['model']
    c = decode_config(c, model)
    lora = lora_np.section_of(run_config) if run_config else {'rank': 0}
    if lora['rank']:  # a LoRA run: its adapters over its base, as it trained (c builds the model with them)
        c.lora.update(lora)
    config_lib.check_device_count(c, jax.device_count(), jax.default_backend())
    mesh = mesh_lib.mesh_from_config(c)
    layout = target_lib.param_placement(c, mesh)  # the parameters alone: no optimizer state
    params = _lora_params(c, source, layout) if lora['rank'] else init_from.load_params(source, c, layout.target())
    return Loaded(c, layout, params, source, step, run_config, hf_dir)


def _lora_params(c: ml_collections.ConfigDict, source: str, layout: target_lib.ParamPlacement) -> Any:
    """A LoRA run's parameters: its base (checked to be the one it trained over, checkpoint/lora_base.py)
    read from checkpoint.init_params_from, joined with the checkpoint's adapters (model/lora.py)."""
    step_dir = readers.step_dir_of(source)
    meta = readers.read_meta(step_dir)
    base_source = meta['config']['checkpoint']['init_params_from']
    lora_base.check(meta.get('lora_base'), base_source, step_dir)
    adapters, base = lora_lib.split(layout.target())
    return lora_lib.join(init_from.load_params(base_source, c, base),
                         readers.load_checkpoint_params(step_dir, c, adapters))
