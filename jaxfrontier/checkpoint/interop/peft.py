"""LoRA adapters alone, in PEFT's format: what `peft.PeftModel.from_pretrained` loads onto the base.

`export_peft` writes `adapter_config.json` (LoraConfig: r, lora_alpha, lora_dropout, target_modules, the base,
CAUSAL_LM, bias none, fan_in_fan_out false) and `adapter_model.safetensors` with PEFT's tensor names
(`base_model.model.<layer prefix><module>.lora_A.weight` [r, in], `lora_B.weight` [out, r]) for a LoRA
checkpoint (training/state.py); `peft.PeftModel.from_pretrained(<the base as transformers loads it>, <dir>)`
computes what our model with the adapters computes. Each target its own pair: a fused weight's slice s
(Llama's w_kv: k_proj, v_proj) its own a and b (families/lora.py `peft_pair`). Only for families whose
targets are torch Linears (`LoraTarget.peft`): Llama's; GPT-2 holds q, k, v in one Conv1D (its adapters
export merged: lora_merge.py). `base_model_name_or_path` is the run's base (checkpoint.init_params_from):
a Hugging Face directory loads as it is; a checkpoint or .safetensors base is exported first
(--export_format=hf of the run it came from).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from jaxfrontier import families
from jaxfrontier.errors import CheckpointError
from jaxfrontier.families import Lora
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.checkpoint import readers
from jaxfrontier.checkpoint.interop import export_target
from jaxfrontier.checkpoint.interop import lora_merge
from jaxfrontier.checkpoint.interop import safetensors as safetensors_lib

ADAPTER_CONFIG, ADAPTER_WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'
PEFT_PREFIX = 'base_model.model.'  # PeftModel's wrapper around the transformers model


def _check(lora: Lora | None, family: str, where: str) -> None:
    if lora is None:
        raise CheckpointError(f'{where} holds no LoRA adapters (lora.rank 0). Fix: export the model with '
                              '--export_format=hf or safetensors.')
    missing = [t.name for t in lora.targets if not t.peft]
    if missing:
        raise CheckpointError(f'{where}: the {family} family\'s LoRA targets {missing} have no PEFT module (no '
                              'torch Linear of their own in its Hugging Face model). Fix: export the adapters merged '
                              'into the base with --export_format=hf.')


def _pair_shapes(reader: readers.ParamReader, lora: Lora, t) -> tuple[tuple[int, int], tuple[int, int]]:
    """(lora_A, lora_B) shapes of target t from the stored adapters' shapes (nothing read)."""
    a, b = (tuple(reader.open(f'blocks/{t.weight}{sfx}').shape)[1:] for sfx in lora_lib.SUFFIXES)
    fused = lora.slices(t.weight) is not None
    return (lora.rank, math.prod(a[:t.contracted])), (math.prod(b[1 + fused:]), lora.rank)


def export_peft(source: str, out_dir: str, *, force: bool = False, bases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Writes a LoRA checkpoint's adapters as a PEFT adapter directory (module docstring).

    Args:
      source: a training workdir (its newest checkpoint), its checkpoints/ directory or a step directory.
      out_dir: the directory to write, whole or not at all (export_target.py: never the run's base, which
        transformers would then load with the adapter applied, a workdir or a directory of model weights).
      force: replace a directory that holds only a previous PEFT export of ours.
      bases: more base models the export must not write into (the command's `checkpoint.init_params_from`).

    Returns:
      A summary: step, tensors written, the base, the target modules.
    """
    export_target.check_dir(out_dir, 'peft', source=source, force=force, bases=bases)
    step_dir = readers.step_dir_of(source)
    meta = readers.read_meta(step_dir)
    config, m = meta['config'], meta['config']['model']
    family = m.get('family', families.DEFAULT_FAMILY)
    lora = lora_merge.lora_of(config)
    _check(lora, family, step_dir)
    converter = families.get(family).hf
    converter.check_exportable(m, step_dir)
    reader = readers.ParamReader(step_dir, config)
    tensors: dict[str, tuple[int, Any]] = {}  # PEFT name -> (layer, target)
    shapes: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    for layer in range(m['num_layers']):
        for t in lora.targets:
            name = f'{PEFT_PREFIX}{converter.layer_prefix.format(layer=layer)}{t.peft}.lora_'
            tensors[name] = (layer, t)
            for kind, shape in zip('AB', _pair_shapes(reader, lora, t)):
                shapes[f'{name}{kind}.weight'] = (shape, np.dtype('float32'))

    def arrays():
        for name, (layer, t) in tensors.items():
            a, b = (reader.layer(t.weight + sfx, layer) for sfx in lora_lib.SUFFIXES)
            pair = lora_lib.peft_pair(a, b, lora, t)
            if not all(np.isfinite(x).all() for x in pair):
                raise CheckpointError(f'{step_dir}: the adapters of {name.removesuffix(".lora_")} hold NaN or Inf; '
                                      'refusing to export them. Fix: export an older step directory.')
            yield from pair

    base = (meta.get('lora_base') or {}).get('path') or config['checkpoint']['init_params_from']
    peft = lora_lib.peft_config(lora, base)
    with export_target.staged(out_dir, 'peft', step=meta['step']) as stage:
        safetensors_lib.write_safetensors(os.path.join(stage, ADAPTER_WEIGHTS), shapes, {'format': 'pt'}, arrays())
        with open(os.path.join(stage, ADAPTER_CONFIG), 'w') as f:
            json.dump(peft, f, indent=2)
    return {'step': meta['step'], 'tensors': len(shapes), 'source': step_dir, 'base': base,
            'target_modules': peft['target_modules']}
