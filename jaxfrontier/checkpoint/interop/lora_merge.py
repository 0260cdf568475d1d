"""LoRA checkpoints merged into their base: what every export format of a LoRA run streams.

A LoRA checkpoint holds the adapters (training/state.py); its base is the run's
`checkpoint.init_params_from`, recorded with every save (lora_base.py) and checked here before it is read.
`merged_reader` gives a reader with ParamReader's interface (`read(name, index)`, `layer(name, l)`) whose
block weights are W + alpha / r a b of the base's layer and the checkpoint's adapters (families/lora.py
`merged`), one layer of one parameter at a time, so the Hugging Face and safetensors exports (hf.py,
safetensors.py) stream a merged model as they stream any checkpoint. The base is read from what it is: a
checkpoint (readers.ParamReader), a .safetensors file of ours (one slice at a time) or a Hugging Face
directory (one layer's HF tensors through the family's converter). The adapters alone: peft.py.
"""

from __future__ import annotations

import os
from typing import Any

import ml_collections
import numpy as np

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.errors import CheckpointError
from jaxfrontier.families import Lora
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.checkpoint import lora_base
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint.interop import hf_files


def lora_of(config: dict[str, Any]) -> Lora | None:
    """The adapters a saved config trained (None: not a LoRA run)."""
    return lora_lib.resolve(lora_lib.section_of(config), families.get(config['model'].get(
        'family', families.DEFAULT_FAMILY)))


class _SafetensorsBase:
    """A base in our .safetensors format (safetensors.export_params: [L, ...] block tensors by path)."""

    def __init__(self, path: str):
        from safetensors import safe_open  # pylint: disable=g-import-not-at-top
        self.f = safe_open(path, framework='numpy')

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return np.asarray(self.f.get_slice(name)[index] if index else self.f.get_tensor(name))

    def layer(self, name: str, layer: int) -> np.ndarray:
        return np.asarray(self.f.get_slice(f'blocks/{name}')[layer])


class _HFBase:
    """A base as a Hugging Face directory: our parameters from its tensors through the family's converter."""

    def __init__(self, hf_dir: str, config: dict[str, Any]):
        self.converter = families.get(config['model'].get('family', families.DEFAULT_FAMILY)).hf
        self.tensors = hf_files.weights(hf_dir)
        c = ml_collections.ConfigDict(config)
        specs = families.get(c.model.family).param_specs(config_lib.model_shape(c))
        self.shapes = {p.path: p.shape for p in specs}
        self.blocks: dict[str, list[str]] = {}
        for ours, theirs in self.converter.block_names:
            self.blocks.setdefault(ours, []).append(theirs)

    def _get(self, name: str) -> np.ndarray:
        prefix = self.converter.prefix
        key = name if name in self.tensors else name.removeprefix(prefix)
        if key not in self.tensors:
            raise CheckpointError(f'the Hugging Face base has no tensor {name!r}. Fix: name the base the adapters '
                                  'were trained over as checkpoint.init_params_from.')
        return hf_files.read_tensor(self.tensors[key])

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        conv = self.converter
        top = {ours: conv.prefix + theirs for ours, theirs in conv.top_first + conv.top_last}
        if name == 'wte':
            full = self._get(conv.prefix + conv.embed)
        elif name == 'head':
            full = self._get('lm_head.weight').T
        else:
            full = self._get(top[name])
        return full[index] if index else full

    def layer(self, name: str, layer: int) -> np.ndarray:
        prefix = self.converter.layer_prefix.format(layer=layer)
        return self.converter.from_hf(name, [self._get(prefix + t) for t in self.blocks[name]],
                                      self.shapes['blocks/' + name][1:])


def base_reader(source: str, config: dict[str, Any]):
    """A reader of base model `source` (checkpoint.init_params_from of the LoRA run whose config is `config`)."""
    if not os.path.exists(source):
        raise CheckpointError(f'the base model {source} of these LoRA adapters is gone. Fix: put it back (the '
                              'adapters alone are in PEFT\'s format: --export_format=peft).')
    if os.path.isfile(source):
        return _SafetensorsBase(source)
    if hf_files.looks_like_hf(source):
        hf_files.check(source)
        return _HFBase(source, config)
    step_dir = readers.step_dir_of(source)
    base_config = readers.read_meta(step_dir)['config']
    if lora_of(base_config) is not None:
        raise CheckpointError(f'the base {step_dir} holds LoRA adapters itself. Fix: train over a merged export '
                              '(--export_format=safetensors of that run) instead.')
    return readers.ParamReader(step_dir, base_config)


class MergedReader:
    """ParamReader's interface over a LoRA checkpoint: the base's parameters with the adapters merged in."""

    def __init__(self, base, adapters: readers.ParamReader, lora: Lora):
        self.base, self.adapters, self.lora = base, adapters, lora

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        return self.base.read(name, index)

    def layer(self, name: str, layer: int) -> np.ndarray:
        w = np.asarray(self.base.layer(name, layer), np.float32)
        if name not in self.lora.weights():
            return w
        a, b = (self.adapters.layer(name + sfx, layer) for sfx in lora_lib.SUFFIXES)
        return lora_lib.merged(w, a, b, self.lora, name)


def merged_reader(step_dir: str, meta: dict[str, Any]):
    """The reader an export streams a checkpoint's parameters from: ParamReader, or MergedReader for adapters
    (their base checked against the one they were trained over: one line if it changed)."""
    config = meta['config']
    adapters = readers.ParamReader(step_dir, config)
    lora = lora_of(config)
    if lora is None:
        return adapters
    source = config['checkpoint']['init_params_from']
    lora_base.check(meta.get('lora_base'), source, step_dir)
    return MergedReader(base_reader(source, config), adapters, lora)


def base_config(config: dict[str, Any]) -> dict[str, Any]:
    """A LoRA run's saved config as its merged model's: LoRA off (what an export's metadata records)."""
    return {**config, 'lora': {**lora_lib.section_of(config), 'rank': 0}}
