"""A third model family declared outside jaxfrontier/: GPT with RMSNorm in place of LayerNorm.

Its two halves, as an in-tree family has them (jaxfrontier/families/base.py): the JAX-free
declaration (`FAMILY`: one field of its own, `rms_eps`, with its check; its shape; its parameter
table; its FLOPs; no Hugging Face converter) and the NNX module (`RmsGPT`), which the declaration
names by import string. `families.register(FAMILY)` makes it a `config.model.family` value;
tests/model/test_third_family.py trains it on parallel layouts against one device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from jaxfrontier.families import Family, ModelShape, ParamSpec
from jaxfrontier.families import gpt as gpt_family
from jaxfrontier.model import gpt, stack
from jaxfrontier.model.layers import RMSNorm, param

NAME = 'rms_gpt'

# --------------------------------------------------------------------------- the declaration (no JAX)


@dataclasses.dataclass(frozen=True)
class RmsShape(ModelShape):
    rms_eps: float = 1e-6  # the RMSNorms' epsilon


def check(m: Mapping[str, Any], require: Callable[..., None]) -> None:
    require(isinstance(m.rms_eps, float) and math.isfinite(m.rms_eps) and m.rms_eps > 0, 'model.rms_eps',
            m.rms_eps, 'must be a finite number > 0', 'set e.g. 1e-6')


def param_specs(s: ModelShape) -> tuple[ParamSpec, ...]:
    """GPT's table without the norms' biases (RMSNorm has a scale only)."""
    biases = ('blocks/ln1/bias', 'blocks/ln2/bias', 'ln_f/bias')
    return tuple(p for p in gpt_family.param_specs(s) if p.path not in biases)


FAMILY = Family(
    name=NAME, module=f'{__name__}:RmsGPT', mlp_dim=gpt_family.mlp_dim, param_specs=param_specs,
    forward_flops=gpt_family.forward_flops, megatron_flops=gpt_family.megatron_flops,
    fields={'rms_eps': 1e-6}, check=check, shape_type=RmsShape,
    shape_fields_of=lambda m: {'rms_eps': m['rms_eps']})

# --------------------------------------------------------------------------- the NNX module


class Block(gpt.Block):
    """GPT's block (its __call__) with RMSNorms."""

    def __init__(self, s: RmsShape, *, rngs: nnx.Rngs):
        super().__init__(s, rngs=rngs)
        self.ln1 = RMSNorm(s.d_model, eps=s.rms_eps, rngs=rngs)
        self.ln2 = RMSNorm(s.d_model, eps=s.rms_eps, rngs=rngs)


class RmsGPT(gpt.GPT):
    """GPT (its embed and final_norm) with RMSNorm blocks and final norm."""

    def __init__(self, s: RmsShape, *, rngs: nnx.Rngs):  # pylint: disable=super-init-not-called
        self.shape = s
        self.wte = param(rngs.params(), (s.vocab_size, s.d_model), ('vocab', 'embed'), s.init_std)
        self.wpe = param(rngs.params(), (s.seq_len, s.d_model), ('positions', 'embed'), s.init_std)
        self.blocks = stack.create(lambda r: Block(s, rngs=r), s.num_layers, rngs)
        self.ln_f = RMSNorm(s.d_model, eps=s.rms_eps, rngs=rngs)
        if not s.tied_embeddings:
            self.head = param(rngs.params(), (s.d_model, s.vocab_size), ('embed', 'vocab'), s.init_std)
