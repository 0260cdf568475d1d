"""The smallest model that keeps a config's parallel and numeric choices (`--mode=verify`).

`shrink(c)` keeps the mesh (every axis; data's extent only where it fits), the schedule and its virtual
stages, ZeRO-1, remat, attention kernel, dtype, dropout, tied embeddings, token split and
the sharding rules, and the family's choices (its declaration's `verify_kept` fields and its
`shrink` rule: e.g. query heads per key/value head, and whether the key/value heads divide
tensor, i.e. are split or replicated; biases, rotary theta and scaling, norm epsilon), and
shrinks what only sets the size: layers to one per pipeline chunk (two without a pipeline),
heads to what the tensor axis splits (the family's rule), a small width (a head width apart from
d_model / num_heads stays apart, on the same side: `ShrunkHeads.head_dim_field`),
MLP width (at the config's ratio to the width) and vocabulary the layout still divides, a
short sequence, a few micro-batches. Where the mesh
needs more devices than this machine can simulate, only the `data` extent shrinks (the
data-parallel reduction is the same collective at any size above 1). Everything shrunk is
recorded, so the certificate says what was and was not checked.

No JAX import: `main` reads the device count of the shrunk mesh before JAX starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import families
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import ConfigError

# --verify_max_devices by default: 8 processes of 256 devices, the most plan/fanout.py starts (one XLA:CPU
# process deadlocks past 256; the open-files limit may allow fewer: it says so).
MAX_DEVICES = 2048
SEQ_LEN = 32
HEAD_DIM = 8
VOCAB = 251  # a prime, so the padded vocabulary always pads
STEPS = 3
# Optimizer settings of the check (docs/preflight.md): Adam with eps 1e-6 keeps rounding noise of a
# vanishing gradient from becoming O(lr) updates; no warm-up, so the first update is not zero
# (the schedule is a scalar per step, the same on every layout: cosine needs no warm-up).
# AdamW whatever optim.name: Lion's update lr * sign(.) and Adafactor's first ones (g / |g|) turn
# that noise (the key bias's, whose true gradient is 0) into O(lr) updates that differ between
# layouts, a false FAIL. Their own layouts are checked against one device by the test suite
# (tests/training/test_optimizer.py: Lion with padded ZeRO-1, Adafactor's factors).
CHECK_OPTIM = dict(name='adamw', lr=1e-3, min_lr=1e-4, warmup_steps=0, eps=1e-6, schedule='cosine')

# Every mesh axis but the replica one (data), whose extent may shrink (`Axis.replica`).
KEPT = ('model.family', *(a.field for a in axes_lib.others()), 'model.context_balance', 'pipeline.schedule',
        'pipeline.virtual_stages', 'pipeline.shard_activations', 'sharding.zero1', 'sharding.sequence_parallel',
        'sharding.rules', 'model.remat',
        'model.attention', 'model.dtype', 'model.dropout_rate', 'model.tied_embeddings', 'model.scan_unroll',
        'train.micro_batch', 'optim.clip_norm', 'optim.weight_decay')
# Kept too: the family's `verify_kept` fields (what changes the numbers, not the size).


@dataclasses.dataclass(frozen=True)
class Shrunk:
    """The config to check, and what was kept and shrunk ({field: (old, new)})."""

    config: ml_collections.ConfigDict
    kept: dict[str, Any]
    shrunk: dict[str, tuple[Any, Any]]

    @property
    def num_devices(self) -> int:
        return config_lib.num_devices(self.config)


def _get(c: ml_collections.ConfigDict, field: str) -> Any:
    section, key = field.split('.')
    value = c[section][key]
    return [list(r) for r in value] if field == 'sharding.rules' else value


def _divisors_down(n: int):
    return [d for d in range(n, 0, -1) if n % d == 0]


def shrink(c: ml_collections.ConfigDict, max_devices: int = MAX_DEVICES) -> Shrunk:
    """The small config to verify for `c` (validated; see the module docstring).

    Raises:
      ConfigError: `c` itself is invalid, or its mesh needs more than `max_devices` devices
        even with `data` 1.
    """
    config_lib.validate(c)
    s = ml_collections.ConfigDict(c.to_dict())
    m, mesh = s.model, s.mesh
    changes: dict[str, tuple[Any, Any]] = {}

    def put(field: str, value: Any) -> None:
        section, key = field.split('.')
        old = s[section][key]
        if old != value:
            changes[field] = (old, value)
            s[section][key] = value

    replica = axes_lib.replica()
    others = axes_lib.product(mesh, axes_lib.others())
    if others > max_devices:
        raise ConfigError(
            'mesh', config_lib.mesh_shape(c), f'{" x ".join(a.name for a in axes_lib.others())} = {others} devices '
            f'even with {replica.name} 1, more than the {max_devices} this machine simulates',
            'verify on a larger machine, or a smaller layout')
    put(replica.field, next(d for d in _divisors_down(mesh[replica.name]) if d * others <= max_devices))
    put('mesh.cpu_devices', config_lib.num_devices(s))

    chunks = mesh.pipeline * (s.pipeline.virtual_stages if mesh.pipeline > 1 else 1)
    put('model.num_layers', chunks if mesh.pipeline > 1 else 2)
    shape = config_lib.model_shape(c)
    family = families.get(shape.family)
    rule = family.shrink(shape, mesh.tensor)
    heads = rule.num_heads
    # Even (rotary embeddings rotate pairs of a head's dimensions), and the width divides over the axes that
    # split it (fsdp).
    split = axes_lib.product(mesh, tuple(a for a in axes_lib.AXES if a.shards_params))
    head_dim = next(k for k in range(HEAD_DIM, HEAD_DIM * split * 8 + 1, 2) if (heads * k) % split == 0)
    put('model.num_heads', heads)
    for key, value in rule.fields.items():
        put(f'model.{key}', value)
    put('model.d_model', heads * head_dim)
    if rule.head_dim_field:  # the config's heads are not d_model / num_heads wide: neither are the small model's
        put(f'model.{rule.head_dim_field}', head_dim_apart(shape, head_dim))
    ratio = shape.mlp_dim / shape.d_model
    if config_lib.mlp_dim(s) != round(ratio * s.model.d_model):  # the rule at the small width: keep the ratio
        put('model.mlp_dim', mesh.tensor * max(1, round(ratio * s.model.d_model / mesh.tensor)))
    put('model.vocab_size', VOCAB)
    # The context axis splits the sequence into equal chunks (two per device when balanced).
    pieces = mesh.context * (2 if mesh.context > 1 and m.context_balance else 1)
    put('model.seq_len', pieces * max(2 if mesh.context > 1 else 1, -(-SEQ_LEN // pieces)))
    if m.attention == 'cudnn':  # NVIDIA only; XLA's kernel computes the same attention on the CPU
        put('model.attention', 'xla')
    put('model.attention_block_q', min(m.attention_block_q, SEQ_LEN // 2))
    put('model.attention_block_kv', min(m.attention_block_kv, SEQ_LEN // 2))
    # Enough micro-batches to fill the pipeline twice; the schedule's shape is the same beyond.
    accum = s.train.accum_steps
    put('train.accum_steps', min(accum, max(2, 2 * chunks)) if accum > 1 else 1)
    put('train.global_batch', s.train.micro_batch * s.train.accum_steps * config_lib.data_parallel_size(s))
    put('train.steps', STEPS)
    for key, value in CHECK_OPTIM.items():
        put(f'optim.{key}', value)
    put('data.kind', 'synthetic')
    config_lib.validate(s, config_lib.num_devices(s))
    kept = {field: _get(c, field) for field in KEPT + tuple(f'model.{f}' for f in family.verify_kept)}
    kept |= rule.kept
    kept['MLP width / model width'] = round(shape.mlp_dim / shape.d_model, 4)
    kept['mesh'] = config_lib.mesh_shape(s)
    return Shrunk(s, kept, changes)


def head_dim_apart(shape: config_lib.ModelShape, width: int) -> int:
    """An even head width for a small model whose d_model / num_heads is `width`, on the same side of it as
    `shape`'s head width is of its d_model / num_heads (Qwen3-30B-A3B's 128 against 64: twice), at about the
    same ratio, and never equal to it (else a layout that confused the two would pass)."""
    ratio = shape.head_dim * shape.num_heads / shape.d_model
    k = max(2, 2 * round(ratio * width / 2))
    return k if k != width else width + 2 if ratio > 1 else width - 2


def reference_config(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` on one device: the same model, batch, micro-batches and numerics, no parallelism.

    The vocabulary is padded as the layout pads it (to vocab_multiple x tensor): an untied
    head [d, V] drawn at another padded V gets other initial values in its real columns
    (the random stream is laid out row-major), and the check would compare two models.
    """
    r = ml_collections.ConfigDict(c.to_dict())
    r.model.vocab_multiple = c.model.vocab_multiple * c.mesh.tensor
    r.mesh.update({a.name: 1 for a in axes_lib.AXES}, cpu_devices=0)
    r.train.micro_batch = r.train.global_batch // r.train.accum_steps
    r.sharding.zero1 = False
    r.pipeline.virtual_stages = 1
    config_lib.validate(r, 1)
    return r


def describe(shrunk: Shrunk) -> str:
    """`data 6 -> 1, num_layers 128 -> 64, ...` (model/mesh/train fields; the check's optimizer omitted)."""
    parts = [f'{field.split(".")[1]} {old} -> {new}' for field, (old, new) in shrunk.shrunk.items()
             if field.split('.')[0] in ('mesh', 'model', 'train') and field != 'mesh.cpu_devices']
    return ', '.join(parts) or 'nothing'
