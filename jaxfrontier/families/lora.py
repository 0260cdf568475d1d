"""LoRA on the families' matmuls, without JAX: the `lora` config section resolved against a family's targets,
its checks, the adapters' parameter table, and the adapters in numpy (merged into a weight, or as PEFT's pair).

A family offers targets by Hugging Face-style module name (`Family.lora_targets`, families/base.py
`LoraTarget`: q, k, v, o, gate, up, down -> our weight, its slice of a fused weight, its PEFT name);
`lora.targets` picks some. Each adapted weight W gets two parameters on its owner module beside it
(model/layers/linear.py creates and applies them), a = [contracted dims..., r] and b = [r, output dims...],
and the matmul x W becomes x W + alpha / r x (x a) b. A fused weight (GPT's w_qkv [d, 3, H, K], Llama's
w_kv [d, 2, G, K]) whose modules are targeted separately gets one pair stacked over its targeted slices only:
a = [contracted..., S, r], b = [S, r, output...] for the S targeted slices of the fused axis (the axis after
the contracted ones), in fused-axis order; an untargeted slice has no adapter at all (nothing to freeze, no
gradient, no optimizer state). That is exactly PEFT's separate adapters on q_proj / k_proj / v_proj: slice
s of the pair is module s's own a and b.

Names: `blocks/<weight>_lora_a`, `blocks/<weight>_lora_b` (`blocks/attn/w_kv_lora_a`): the base model's paths
are unchanged, and `is_adapter` tells the two kinds apart.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxfrontier.families.base import Family, Lora, LoraTarget, ModelShape, ParamSpec

SUFFIXES = ('_lora_a', '_lora_b')  # an adapter's parameter name: its weight's, then one of these
FIELDS = dict(rank=0, alpha=16.0, dropout=0.0, targets='q,k,v,o,gate,up,down')  # the `lora` config section


def is_adapter(name: str) -> bool:
    """Whether a parameter name (or '/'-joined path) is a LoRA adapter's."""
    return name.endswith(SUFFIXES)


def target_names(section: Mapping[str, Any]) -> tuple[str, ...]:
    """`lora.targets` as names ('q, v' -> ('q', 'v'))."""
    return tuple(n.strip() for n in str(section['targets']).split(','))


def _in_out(spec: ParamSpec, t: LoraTarget) -> tuple[int, int]:
    """(in, out) features of target t's matrix (the weight without its layers axis, one slice of a fused one)."""
    dims = spec.shape[1:]
    rest = dims[t.contracted + (t.index is not None):]
    return math.prod(dims[:t.contracted]), math.prod(rest)


def check(section: Mapping[str, Any], family: Family, shape_of: Callable[[], ModelShape], pipeline: int,
          require: Callable[..., None]) -> None:
    """The `lora` section of a config of `family` (`shape_of()`: its model's shape, asked once the section's
    numbers are known good) on `pipeline` stages; `require(ok, field, value, problem, fix)` raises the one-line
    ConfigError."""
    rank = section['rank']
    require(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, 'lora.rank', rank,
            'must be an integer >= 0', 'set 0 (no LoRA) or the adapters\' rank, e.g. 8')
    if rank == 0:
        # Targets named (not the default, every one) choose adapters that rank 0 does not train: a forgotten rank.
        require(section['targets'] == FIELDS['targets'], 'lora.targets', section['targets'], 'is set, but '
                'lora.rank = 0 turns LoRA off: the whole model would be trained, no adapters',
                'set lora.rank (e.g. 8) to train adapters on them, or leave lora.targets out for full fine-tuning')
        return
    alpha, dropout = section['alpha'], section['dropout']
    require(isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0, 'lora.alpha', alpha,
            'must be a finite number > 0', 'set e.g. 16 (the update is scaled by alpha / rank)')
    require(isinstance(dropout, (int, float)) and 0 <= dropout < 1, 'lora.dropout', dropout, 'must be in [0, 1)',
            'set e.g. 0.0 or 0.05')
    offered = {t.name: t for t in family.lora_targets}
    names = target_names(section)
    listed = ','.join(offered) or 'none'
    require(bool(offered), 'lora.rank', rank, f'the {family.name} family offers no LoRA targets',
            'set lora.rank=0')
    for name in names:
        require(name in offered, 'lora.targets', section['targets'], f'{name!r} matches nothing in the '
                f'{family.name} family (its targets: {listed})', f'name targets from {listed}, comma-separated')
    require(len(set(names)) == len(names), 'lora.targets', section['targets'], 'names a target twice',
            'name each target once')
    specs = {p.path: p for p in family.param_specs(shape_of())}
    dense = _dense_targets(family, specs)
    missing = [n for n in names if n not in dense]
    experts = any('blocks/' + offered[n].weight in specs for n in missing)
    kept = ','.join(n for n in names if n in dense) or ','.join(dense)
    require(not missing, 'lora.targets', section['targets'], f'{",".join(missing)} match{"es" * (len(missing) == 1)} '
            'no dense weight of this model ' + ('(its MLPs are mixture-of-experts experts, which take no LoRA '
                                                'adapters)' if experts else '(no such weight under blocks/)'),
            f'drop {",".join(missing)} from lora.targets (lora.targets={kept})')
    for name in names:
        t = offered[name]
        spec = specs['blocks/' + t.weight]
        smallest = min(_in_out(spec, t))
        require(rank <= smallest, 'lora.rank', rank, f'is larger than the {name!r} matrix allows ({t.weight}: '
                f'{" x ".join(map(str, _in_out(spec, t)))}, rank at most {smallest})',
                f'set lora.rank <= {smallest}')
    require(pipeline == 1, 'mesh.pipeline', pipeline, 'LoRA does not run in a pipeline (its executors '
            'differentiate every parameter of a chunk, a frozen base included)',
            'set mesh.pipeline=1 and shard the base with mesh.fsdp / mesh.tensor')


def _dense_targets(family: Family, specs: Mapping[str, ParamSpec]) -> tuple[str, ...]:
    """The family's targets whose weight this model has as a plain matrix per layer. A mixture-of-experts
    layer's experts (blocks/mlp/w_gate [L, E, d, F], axis `experts`) take no adapters: not implemented."""
    return tuple(t.name for t in family.lora_targets
                 if (p := specs.get('blocks/' + t.weight)) is not None and 'experts' not in p.names)


def resolve(section: Mapping[str, Any] | None, family: Family) -> Lora | None:
    """The adapters a `lora` section asks for (None: rank 0, or no section: a config saved before LoRA).

    Unchecked: `check` refuses what is wrong; unknown names are dropped here."""
    rank = section.get('rank') if section else None
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return None
    wanted = set(target_names(section))
    targets = tuple(t for t in family.lora_targets if t.name in wanted)
    return Lora(int(section['rank']), float(section['alpha']), float(section['dropout']), targets)


def adapter_specs(specs: tuple[ParamSpec, ...], lora: Lora) -> tuple[ParamSpec, ...]:
    """The adapters' parameters for a model whose parameter table is `specs` (model/layers/linear.py
    `adapt` makes them; tests hold the two to eval_shape): a [L, contracted..., (S,) r], b [L, (S,) r, out...]
    with the weight's logical names on its dimensions (so they shard as it does) and the rank whole."""
    by_path, out = {p.path: p for p in specs}, []
    for weight, t in lora.weights().items():
        p = by_path['blocks/' + weight]
        (layers, *dims), (lead, *names), c, r = p.shape, p.names, t.contracted, lora.rank
        slices = lora.slices(weight)
        fused = () if slices is None else (len(slices),)
        fused_names = () if slices is None else (names[c],)
        rest = len(fused)
        out += [ParamSpec(p.path + '_lora_a', (layers, *dims[:c], *fused, r), (lead, *names[:c], *fused_names, None)),
                ParamSpec(p.path + '_lora_b', (layers, *fused, r, *dims[c + rest:]),
                          (lead, *fused_names, None, *names[c + rest:]))]
    return tuple(out)


def trainable(spec: ParamSpec, shape: ModelShape) -> bool:
    """Whether the optimizer trains a parameter of `shape`'s model: every one without LoRA, else the adapters."""
    return shape.lora is None or is_adapter(spec.path)


# --------------------------------------------------------------------------- numpy: merge, PEFT


def delta(a: np.ndarray, b: np.ndarray, contracted: int, slices: tuple[int, ...] | None,
          weight_shape: tuple[int, ...]) -> np.ndarray:
    """a b of one layer's adapters, shaped like the weight (an untargeted slice of a fused weight: zeros)."""
    if slices is None:
        return np.tensordot(a, b, axes=([a.ndim - 1], [0]))
    out = np.zeros(weight_shape, np.result_type(a, b))
    for s, i in enumerate(slices):
        out[(slice(None),) * contracted + (i,)] = np.tensordot(a[..., s, :], b[s], axes=([a.ndim - 2], [0]))
    return out


def merged(w: np.ndarray, a: np.ndarray, b: np.ndarray, lora: Lora, weight: str) -> np.ndarray:
    """One layer of `weight` with its adapters merged in: W + alpha / r x a b (fp32, like W)."""
    t = lora.weights()[weight]
    d = delta(a.astype(np.float64), b.astype(np.float64), t.contracted, lora.slices(weight), w.shape)
    return (w.astype(np.float64) + lora.scale * d).astype(w.dtype)


def peft_pair(a: np.ndarray, b: np.ndarray, lora: Lora, t: LoraTarget) -> tuple[np.ndarray, np.ndarray]:
    """Target t's one-layer adapters as PEFT's (lora_A.weight [r, in], lora_B.weight [out, r]) of its torch
    Linear: the contracted dimensions flattened as `in`, the output ones as `out` (`LoraTarget.peft`)."""
    slices = lora.slices(t.weight)
    if slices is not None:
        s = slices.index(t.index)
        a, b = a[..., s, :], b[s]
    r = lora.rank
    return np.ascontiguousarray(a.reshape(-1, r).T), np.ascontiguousarray(b.reshape(r, -1).T)


def peft_config(lora: Lora, base: str) -> dict[str, Any]:
    """adapter_config.json of PEFT's LoraConfig for `lora` on the base model at `base`."""
    return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base, 'r': lora.rank,
            'lora_alpha': lora.alpha, 'lora_dropout': lora.dropout,
            'target_modules': sorted({t.peft.rsplit('.', 1)[-1] for t in lora.targets}), 'bias': 'none',
            'fan_in_fan_out': False, 'inference_mode': True, 'init_lora_weights': True, 'use_rslora': False,
            'use_dora': False, 'modules_to_save': None, 'layers_to_transform': None, 'layers_pattern': None,
            'rank_pattern': {}, 'alpha_pattern': {}, 'revision': None}


def section_of(saved_config: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config's `lora` section (rank 0 for a config saved before LoRA existed)."""
    section = saved_config.get('lora')
    return dict(FIELDS) | (dict(section) if isinstance(section, Mapping) else {})


def replace_lora(shape: ModelShape, lora: Lora | None) -> ModelShape:
    return dataclasses.replace(shape, lora=lora)
