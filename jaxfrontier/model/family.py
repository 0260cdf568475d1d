"""What a model family declares, in one place: the trainer, pipeline, planner and exporters ask it.

A family (GPT today; Llama next) is one module that builds its NNX model and declares a
`Family`: the module class, its parameter table for the planner, its FLOP counts and its
Hugging Face names. `model/registry.py` maps `config.model.family` to the declaration.
Nothing here imports JAX: the declaration is data and plain functions of a `ModelShape`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jaxfrontier.config import ModelShape


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter array: its path in the params dict, shape and logical axis names."""

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_block(self) -> bool:
        return self.path.startswith('blocks/')


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How the family's parameters are named in a Hugging Face `transformers` checkpoint."""

    architecture: str  # config.json `architectures`, e.g. 'GPT2LMHeadModel'
    model_type: str  # config.json `model_type`, e.g. 'gpt2'
    activations: tuple[str, ...]  # HF activation names that compute our MLP's activation
    layer_prefix: str  # HF prefix of layer l's parameters; `{layer}` stands for l
    block_names: tuple[tuple[str, str], ...]  # (our block parameter, HF name after the layer prefix)
    top_names: tuple[tuple[str, str], ...]  # (our parameter outside the blocks, HF name)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's declaration (see the module docstring).

    Attributes:
      name: the `config.model.family` value (config.MODEL_FAMILIES lists them).
      module: the NNX model class, `module(shape, *, rngs)`: `embed`, `blocks` (stacked, run
        by `stack.apply_stack`), `logits`, `head_loss`, `loss`, `__call__`; its block takes an
        optional KV cache and positions (model/decode.py).
      param_specs: every parameter of `module(shape)` (the planner sums them in this order),
        block parameters [L, ...] with the `layers` name first (the planner's table; a test holds it to
        `jax.eval_shape` of the module).
      forward_flops: matmul FLOPs (2 per multiply-add) of one layer's and of the head's
        forward pass over one sequence of `shape.seq_len` tokens, attention counted in full.
      megatron_flops: `(global_batch, shape, recompute) -> FLOPs per step` in Megatron's
        published convention for this family (flops.py): the reported `megatron_hw` figure,
        and with recompute=False the model FLOPs behind MFU.
      hf: the Hugging Face names (checkpoint export and import).
    """

    name: str
    module: type
    param_specs: Callable[[ModelShape], tuple[ParamSpec, ...]]
    forward_flops: Callable[[ModelShape], tuple[float, float]]
    megatron_flops: Callable[[int, ModelShape, bool], float]
    hf: HFNames
