"""`config.checkpoint.init_params_from`: initial parameters from a file, a Hugging Face directory or a run.

The one dispatch over the three sources, on top of the readers of each (safetensors.py, hf.py,
readers.py); the training loop passes `load_params` to `Checkpointer.restore_or_init`, and
inference reads the parameters it runs with through it.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections

from jaxfrontier.errors import ConfigError
from jaxfrontier.checkpoint import finite
from jaxfrontier.checkpoint.interop import hf
from jaxfrontier.checkpoint.interop import hf_files
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint.interop import safetensors as safetensors_lib


def load_params(source: str, c: ml_collections.ConfigDict, target: Any) -> dict[str, Any]:
    """Initial parameters for config.checkpoint.init_params_from: a .safetensors file, a Hugging Face
    directory (an architecture a family's converter reads, families/) or a checkpoint, read into the shardings of `target` (the abstract parameters
    with shardings, target.abstract_target)."""
    if not os.path.exists(source):
        raise ConfigError('checkpoint.init_params_from', source, 'no such file or directory',
                                     'name a training workdir, a checkpoint directory or a .safetensors file')
    if os.path.isfile(source):
        return finite.check(safetensors_lib.load_safetensors(source, c, target), source)
    if hf_files.looks_like_hf(source):  # a transformers directory (config.json + model.safetensors)
        hf_files.check(source)  # a damaged one: one line
        return finite.check(hf.load_hf(source, c, target), source)
    return finite.check(readers.load_checkpoint_params(source, c, target), source)
