"""What a model family declares, in one place: the config, checks, planner, exporters and trainer ask it.

A family is two modules: its declaration here in `families/` (a `Family`: its config fields and
their checks, its MLP width rule, its `ModelShape`, parameter table, FLOPs, Hugging Face names and
converter, what the verify check keeps and what the planner's traced proxy needs) and its NNX
module (`Family.module`, an import string resolved on the JAX side by model/params.py). Nothing
in `families/` imports JAX, not even inside a function: the config reads the declarations before
JAX starts (main sets XLA_FLAGS from the config). A declaration is data and plain functions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

# base_config's model.family, and the family of a config saved before model.family existed.
DEFAULT_FAMILY = 'gpt'


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """One LoRA target a family offers (families/lora.py): a Hugging Face-style module name and the matmul it is.

    Attributes:
      name: the name `lora.targets` uses ('q', 'k', 'v', 'o', 'gate', 'up', 'down').
      weight: our block weight it adapts, without 'blocks/' ('attn/w_kv').
      contracted: how many leading dimensions of the weight (after the layers axis) its matmul contracts
        (w_q [d, H, K]: 1; w_out [H, K, d]: 2): the adapter a is [contracted..., r], b [r, the rest...].
      index: a fused weight's slice (w_kv [d, 2, G, K]: k is 0, v 1; the fused axis is the first one after
        the contracted ones), or None for a weight that is one module.
      peft: the module's name after the Hugging Face layer prefix ('self_attn.k_proj') where the family's
        converter writes this matmul as one torch Linear [out, in] (our weight with its contracted dimensions
        flattened as `in`, the others as `out`, row-major); '' where it does not (no PEFT export).
    """

    name: str
    weight: str
    contracted: int
    index: int | None = None
    peft: str = ''


@dataclasses.dataclass(frozen=True)
class Lora:
    """The adapters a model carries (config section `lora`, resolved by families/lora.py): rank r, alpha
    (the update is alpha / r x a b), the dropout on an adapter's input, and the targets, in the family's order."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[LoraTarget, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def slices(self, weight: str) -> tuple[int, ...] | None:
        """The targeted slices of a fused `weight` in fused-axis order (None: a weight that is one module)."""
        return tuple(sorted(t.index for t in self.targets if t.weight == weight)) if any(
            t.weight == weight and t.index is not None for t in self.targets) else None

    def weights(self) -> dict[str, LoraTarget]:
        """Each adapted weight (one entry per weight, a fused weight's first target) in target order."""
        out: dict[str, LoraTarget] = {}
        for t in self.targets:
            out.setdefault(t.weight, t)
        return out

    def under(self, owner: str) -> 'Lora | None':
        """The targets of the weights of module `owner` ('attn'), their paths relative to it; None: none."""
        inside = tuple(dataclasses.replace(t, weight=t.weight.removeprefix(owner + '/')) for t in self.targets
                       if t.weight.startswith(owner + '/'))
        return dataclasses.replace(self, targets=inside) if inside else None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers the model needs, and nothing else; a family with fields of its own subclasses it
    (`Family.shape_type`)."""

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    vocab_size: int  # padded
    real_vocab_size: int  # logits at or beyond this index are masked out of the loss
    mlp_dim: int
    tied_embeddings: bool
    dropout_rate: float
    init_std: float
    dtype: str
    attention: str
    remat: str
    scan_unroll: int = 1
    attention_block_q: int = 64
    attention_block_kv: int = 64
    family: str = DEFAULT_FAMILY  # the registered family (families.get) that builds and describes the model
    lora: Lora | None = None  # LoRA adapters on the base weights (config section `lora`), or None

    @property
    def head_dim(self) -> int:
        """Each head's width K: d_model / num_heads, unless the family sets a width of its own (Llama's
        model.head_dim, Qwen3), when q projects to num_heads * K != d_model. Every user of K asks here."""
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: as many as query heads, unless the family groups them."""
        return self.num_heads


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


# One layer's tensors: (our block parameter, HF name after the layer prefix, its shape), ... (HFConverter.layouts).
Layout = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclasses.dataclass(frozen=True)
class HFConverter:
    """A family's Hugging Face `transformers` names and its converter (numpy only), both directions.

    The driver (checkpoint/interop/hf.py, hf_files.py) is the same for every family: it streams one
    layer at a time through `to_hf` / `from_hf` and checks a directory against `top_shapes` /
    `layer_shapes` before reading it. Our parameter names are the params dict's paths.

    Attributes:
      architecture, model_type: what export writes to config.json (`hf_config` may choose another).
      activations: HF activation names that compute our MLP's activation.
      layer_prefix: HF prefix of layer l's tensors; `{layer}` stands for l.
      block_names: (our block parameter, HF name after the layer prefix); a parameter that stacks
        several HF tensors lists them in the order of its stacked axis.
      top_names: (our parameter outside the blocks, full HF name), written after the layers.
      prefix: the base model's prefix on every tensor but `lm_head.weight` (a base model saved
        alone has none).
      embed: the token embedding's HF name after `prefix`.
      reads: (architecture, model_type) import reads; config.json's `model_type` picks the
        family, else its `architectures`.
      position_table: learned positions (model.seq_len may not exceed the HF model's); rotary
        positions have no table.
      top_first: (ours, HF after `prefix`) written after the embedding, before the layers.
      config_ints, optional_ints, numbers: config.json fields that must be positive integers,
        positive integers or null, and numbers where present (checked before anything reads them).
      num_layers: config.json -> its layer count.
      check_exportable: (saved model.* fields, where) -> None, or one CheckpointError line.
      hf_config: (saved model.* fields, eot id or None) -> config.json.
      model_fields: (config.json, where) -> our model.* fields, `family` included; one ConfigError
        line for what our model cannot compute.
      top_shapes, layer_shapes: config.json -> {HF name: shape} outside the layers (after `prefix`;
        lm_head when untied; vocabulary rows a lower bound) and of one layer (after its prefix).
      to_hf: (our block parameter, one layer of it) -> its HF tensors (`block_names` order).
      from_hf: (our block parameter, its HF tensors, one layer's shape) -> one layer of it.
      layouts: config.json -> one layer's tensor layouts a directory may use, each ((ours, HF name after
        the layer prefix, shape), ...) in `block_names`' sense; the first is what export writes, import
        reads the first whose layer-0 tensors the directory has (a MoE's per-expert tensors of the hub or
        transformers 5's fused ones). None: one layout, `block_names` with `layer_shapes`.
      unmatched: model.* fields `model_fields` gives as a starting value (training coefficients) which an
        import does not hold the run's config to.
    """

    architecture: str
    model_type: str
    activations: tuple[str, ...]
    layer_prefix: str
    block_names: tuple[tuple[str, str], ...]
    top_names: tuple[tuple[str, str], ...]
    prefix: str
    embed: str
    reads: tuple[tuple[str, str], ...]
    position_table: bool
    config_ints: tuple[str, ...]
    optional_ints: tuple[str, ...]
    numbers: tuple[str, ...]
    num_layers: Callable[[dict[str, Any]], int]
    check_exportable: Callable[[dict[str, Any], str], None]
    hf_config: Callable[[dict[str, Any], int | None], dict[str, Any]]
    model_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    top_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    layer_shapes: Callable[[dict[str, Any]], dict[str, tuple[int, ...]]]
    to_hf: Callable[[str, Any], list[Any]]
    from_hf: Callable[[str, list[Any], tuple[int, ...]], Any]
    top_first: tuple[tuple[str, str], ...] = ()
    layouts: Callable[[dict[str, Any]], tuple[Layout, ...]] | None = None
    unmatched: tuple[str, ...] = ()

    def layer_layouts(self, hf: dict[str, Any]) -> tuple[Layout, ...]:
        """The layouts of one layer's tensors for config.json `hf` (the first: what export writes)."""
        if self.layouts is not None:
            return self.layouts(hf)
        shapes = self.layer_shapes(hf)
        return (tuple((ours, theirs, shapes[theirs]) for ours, theirs in self.block_names if theirs in shapes),)

    @property
    def model_types(self) -> tuple[str, ...]:
        """The config.json `model_type`s import reads."""
        return tuple(dict.fromkeys(t for _, t in self.reads))

    def lora_targets(self, contracted: Mapping[str, int] | None = None) -> tuple[LoraTarget, ...]:
        """LoRA targets from the block names: every torch Linear `<module>.<name>_proj.weight` is target `<name>`
        (q_proj -> 'q'), a parameter that stacks several one slice each in its order (w_kv: k 0, v 1), PEFT's
        module name its own; `contracted`: our weights whose matmul contracts more than their first dimension."""
        out, seen = [], {}
        linears = [(ours, theirs.removesuffix('.weight')) for ours, theirs in self.block_names
                   if theirs.endswith('_proj.weight')]
        for ours, module in linears:
            index, seen[ours] = seen.get(ours, 0), seen.get(ours, 0) + 1
            stacked = sum(o == ours for o, _ in linears) > 1
            out.append(LoraTarget(module.rsplit('.', 1)[-1].removesuffix('_proj'), ours,
                                  (contracted or {}).get(ours, 1), index if stacked else None, module))
        return tuple(out)

    @property
    def top_last(self) -> tuple[tuple[str, str], ...]:
        """(ours, HF after `prefix`) written after the layers."""
        return tuple((ours, theirs.removeprefix(self.prefix)) for ours, theirs in self.top_names)


@dataclasses.dataclass(frozen=True)
class ShrunkHeads:
    """What the verify check (plan/shrink.py) makes of a family's heads: the query heads, the family's
    model.* fields it sets with them, and what it records as kept (e.g. a grouping ratio).

    `head_dim_field` names the family's model.* field of a head width apart from d_model / num_heads
    where the config has one ('' otherwise): plan/shrink.py then sets it in the small model, apart from
    its d_model / num_heads too and on the same side of it, so a layout that confused the two shows.
    """

    num_heads: int
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    kept: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    head_dim_field: str = ''


def two_heads_per_shard(shape: ModelShape, tensor: int) -> ShrunkHeads:
    """The default verify rule: two query heads per tensor shard, so a swapped head order shows."""
    del shape
    return ShrunkHeads(2 * tensor)


def no_check(m: Mapping[str, Any], require: Callable[..., None]) -> None:
    del m, require


def _no_proxy_fields(choice: Any, sizes: Mapping[str, int]) -> dict[str, Any]:
    del choice, sizes
    return {}


def no_check_mesh(m: Mapping[str, Any], mesh: Mapping[str, int], require: Callable[..., None]) -> None:
    del m, mesh, require


def all_layers_pipelined(m: Mapping[str, Any]) -> int:
    return m['num_layers']


def no_experts(m: Mapping[str, Any]) -> int:
    del m
    return 0


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family's declaration (see the module docstring).

    Attributes:
      name: the `config.model.family` value.
      module: the NNX model class as 'package.module:Class', built as `Class(shape, *, rngs)`:
        `embed`, `blocks` (stacked, run by `stack.apply_stack`), `logits`, `head_loss`, `loss`,
        `__call__` (model/decoder.py); its block takes an optional KV cache and positions.
      mlp_dim: model.* fields -> the MLP's width when model.mlp_dim is 0 (the family's rule; a saved
        config may predate a field: use `.get` with the field's default).
      param_specs: every parameter of `module(shape)` (the planner sums them in this order), block
        parameters [L, ...] with the `layers` name first (tests hold it to `jax.eval_shape`).
      forward_flops: matmul FLOPs (2 per multiply-add) of one layer's and of the head's forward pass
        over one sequence of `shape.seq_len` tokens, attention counted in full.
      megatron_flops: `(global_batch, shape, recompute) -> FLOPs per step` in Megatron's published
        convention for this family (flops.py): the reported `megatron_hw` figure, and with
        recompute=False the model FLOPs behind MFU.
      fields: the family's own model.* fields -> default (base_config's model section has every
        registered family's); another family's config refuses them away from their defaults.
      shape_fields: those of `fields` that fix the train state's shapes (a checkpoint restores only
        into a config that agrees); the others are what the model computes with (a reader adopts them).
      max_sizes: model.* integer fields -> the largest value any model uses (config/bounds.py).
      effective: model.* fields -> the family's fields with what a rule's value stands for (0 kv heads:
        as many as query heads); a value meaning the same as the default counts as unset.
      check: `(model section, require)` checks the family's fields, `require(ok, field, value, problem,
        fix)` raising the one-line ConfigError.
      shape_type: the ModelShape (sub)class the module is built from.
      shape_fields_of: model.* fields -> `shape_type`'s own fields (beyond ModelShape's).
      hf: the Hugging Face names and converter, or None (no HF interop).
      verify_kept: model.* fields the verify check keeps as they are (what changes the numbers, not
        the size).
      shrink: `(shape, tensor) -> ShrunkHeads`: the verify check's heads and the family's fields set with them
        (and its head-width field, where its heads are not d_model / num_heads wide).
      proxy_choice: shape -> what of the family's choices the planner's traced proxy keeps (hashable,
        JSON; plan/activations.py keys its cache with it).
      lora_targets: the LoRA targets it offers (`LoraTarget`: module name -> weight, slice, PEFT name).
      proxy_fields: `(choice, proxy sizes {'h': heads, 'g': kv heads, 'k': head width, 'd_apart': a model
        width other than h k}) -> shape_type fields` of the proxy (d_model among them where its heads are not
        d / h wide).
      check_mesh: `(model section, mesh sizes {axis: size}, require)` checks what the mesh asks of the
        family's fields (e.g. an expert width split over `tensor`).
      pipelined_layers: model.* fields -> the layers of the group a pipeline splits (model/decoder.py's
        `blocks`; the others run as a stem on the first stage): what mesh.pipeline x virtual must divide.
      experts: model.* fields -> the routed experts of a mixture-of-experts model (0: dense), which the
        `expert` mesh axis splits.
    """

    name: str
    module: str
    mlp_dim: Callable[[Mapping[str, Any]], int]
    param_specs: Callable[[ModelShape], tuple[ParamSpec, ...]]
    forward_flops: Callable[[ModelShape], tuple[float, float]]
    megatron_flops: Callable[[int, ModelShape, bool], float]
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    shape_fields: tuple[str, ...] = ()
    max_sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    effective: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    check: Callable[[Mapping[str, Any], Callable[..., None]], None] = no_check
    shape_type: type[ModelShape] = ModelShape
    shape_fields_of: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda m: {}
    hf: HFConverter | None = None
    verify_kept: tuple[str, ...] = ()
    shrink: Callable[[ModelShape, int], ShrunkHeads] = two_heads_per_shard
    proxy_choice: Callable[[ModelShape], Any] = lambda shape: False
    proxy_fields: Callable[[Any, Mapping[str, int]], dict[str, Any]] = _no_proxy_fields
    check_mesh: Callable[[Mapping[str, Any], Mapping[str, int], Callable[..., None]], None] = no_check_mesh
    pipelined_layers: Callable[[Mapping[str, Any]], int] = all_layers_pipelined
    experts: Callable[[Mapping[str, Any]], int] = no_experts
    lora_targets: tuple[LoraTarget, ...] = ()

    @property
    def function_fields(self) -> tuple[str, ...]:
        """The family's fields that are not shapes: what its model computes with."""
        return tuple(f for f in self.fields if f not in self.shape_fields)

    def unset(self, m: Mapping[str, Any], field: str) -> bool:
        """Whether model.`field` of `m` means its default (so a model of another family may carry it)."""
        default = self.fields[field]
        if m[field] == default:
            return True
        if self.effective is None:
            return False
        try:  # a value this family would refuse (multiple_of 0) is not its default either
            return self.effective(m)[field] == self.effective({**dict(m.items()), field: default})[field]
        except (ArithmeticError, TypeError, ValueError):
            return False

    def shape(self, m: Mapping[str, Any], **common: Any) -> ModelShape:
        """The model's shape: ModelShape's fields (`common`) and the family's own from model.* `m`."""
        return self.shape_type(**common, family=self.name, **self.shape_fields_of(m))
