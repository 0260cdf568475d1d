"""Config validation: every rule a config must satisfy, checked before JAX compiles anything.

A broken rule raises `ConfigError`, whose message names the field, its value and the fix.
"""

from __future__ import annotations

import importlib.metadata
import math
import signal
from typing import Any

import ml_collections

from jaxfrontier import families
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.config import bounds
from jaxfrontier.config.rules import SEQUENCE_PARALLEL
from jaxfrontier.config.schema import (base_config, ATTENTION_IMPLS, DATA_KINDS, DISTRIBUTED_MODES, DTYPES, WANDB_MODES, LOSS_SCALES, LR_SCHEDULES, MESH_AXES, OPTIMIZERS, PIPELINE_SCHEDULES, REMAT_POLICIES, data_parallel_size, mesh_shape, mlp_dim, model_shape, num_devices)
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.errors import ConfigError



def _require(ok: bool, field: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(field, value, problem, fix)


def _validate_optimizer(c: ml_collections.ConfigDict) -> None:
    """optim.name and optim.schedule, and what each needs (training/optimizer.py, docs/training.md)."""
    o = c.optim
    _require(o.name in OPTIMIZERS, 'optim.name', o.name, 'unknown optimizer', f'use one of {OPTIMIZERS}')
    _require(o.schedule in LR_SCHEDULES, 'optim.schedule', o.schedule, 'unknown learning-rate schedule',
             f'use one of {LR_SCHEDULES}')
    _require(isinstance(o.factor_min_dim, int) and o.factor_min_dim >= 1, 'optim.factor_min_dim', o.factor_min_dim,
             'must be an integer >= 1', 'set e.g. 128 (the default)')
    # Padding changes Adafactor's statistics (the factors' means and the update's RMS count the
    # zeros), and its state is already ~1/d of the parameters: ZeRO-1 would save almost nothing.
    _require(o.name != 'adafactor' or not c.sharding.zero1, 'sharding.zero1', c.sharding.zero1,
             'adafactor does not run with ZeRO-1 (its factored state is already a few bytes per row)',
             'set --config.sharding.zero1=False, or use optim.name=adamw or lion')
    steps = o.decay_steps or c.train.steps
    if o.schedule == 'wsd':
        _require(isinstance(o.decay_fraction, (int, float)) and 0 < o.decay_fraction <= 1, 'optim.decay_fraction',
                 o.decay_fraction, 'must be in (0, 1]', 'set e.g. 0.2 (the last 20 % of the steps decay)')
        decay = round(o.decay_fraction * steps)
        _require(o.warmup_steps + decay <= steps, 'optim.decay_fraction', o.decay_fraction,
                 f'warm-up ({o.warmup_steps}) and decay ({decay}) steps exceed the {steps} steps of the schedule',
                 'lower optim.decay_fraction or optim.warmup_steps')
    if o.schedule == 'inverse_sqrt':
        _require(o.warmup_steps >= 1, 'optim.warmup_steps', o.warmup_steps,
                 'inverse_sqrt decays as lr * sqrt(warmup_steps / step), so it needs a warm-up',
                 'set optim.warmup_steps >= 1')


def _check_observers(c: ml_collections.ConfigDict) -> None:
    """train.wandb_* and train.straggler_factor (run/observe/wandb_log.py, run/observe/stragglers.py)."""
    t = c.train
    _require(t.wandb_mode in WANDB_MODES, 'train.wandb_mode', t.wandb_mode, 'unknown W&B mode',
             f'use one of {WANDB_MODES}')
    _require(bool(t.wandb_project) and not set(t.wandb_project) & set('/\\#?%:'), 'train.wandb_project',
             t.wandb_project, 'W&B project names are not empty and hold none of / \\ # ? % :',
             'set e.g. --config.train.wandb_project=my-model')
    _require(all(len(tag.strip()) <= 64 for tag in t.wandb_tags.split(',')), 'train.wandb_tags', t.wandb_tags,
             'a W&B tag has at most 64 characters', "separate tags with commas: 'baseline,1.3b'")
    _require(isinstance(t.straggler_factor, (int, float)) and (t.straggler_factor == 0 or t.straggler_factor > 1),
             'train.straggler_factor', t.straggler_factor, 'must be 0 (off) or a factor above 1',
             'set e.g. 1.5: a process 1.5 x slower than the median is named')


def _divides(divisor_field: str, divisor: int, field: str, value: int, what: str, divided: int | None = None) -> None:
    """`value` of `field` (or `divided`, a number derived from it) must be a multiple of `divisor`."""
    divided = value if divided is None else divided
    _require(divisor > 0 and divided % divisor == 0, field, value, f'{what} must be divisible by {divisor_field} = '
             f'{divisor}', f'choose {field} so that it is a multiple of {divisor}, or change {divisor_field}'
             if divided != value else f'choose {field} as a multiple of {divisor}, or change {divisor_field}')


def check_device_count(c: ml_collections.ConfigDict, n_devices: int, platform: str | None = None) -> None:
    """The one rule `validate` cannot check before JAX starts: the mesh uses every device present.

    `platform` (JAX's backend name, where known): on the CPU the fix names `mesh.cpu_devices`, which
    simulates the devices a mesh needs on one host.
    """
    if num_devices(c) != n_devices:
        raise ConfigError('mesh', _mesh_text(c), f'the mesh needs {num_devices(c)} devices but {n_devices} are present',
                          device_count_fix(c, platform))


def _mesh_text(c: ml_collections.ConfigDict) -> str:
    sizes = mesh_shape(c)
    return ' x '.join(f'{a} {sizes[a]}' for a in axes_lib.in_mesh(sizes))  # expert only where it is > 1


def device_count_fix(c: ml_collections.ConfigDict, platform: str | None = None) -> str:
    """The fix of a mesh that is not the devices present; on the CPU first the simulated devices."""
    others = ('change config.mesh.* so the product equals the devices present, or get a plan without devices: '
              'python -m jaxfrontier.main --config=... --mode=plan')
    if platform == 'cpu':
        n = num_devices(c)
        return (f'on the CPU, simulate them: --config.mesh.cpu_devices={n} (or the config argument cpu_devices={n} '
                f'where it takes one); or {others}')
    return f'run on a machine or allocation with that many devices, {others}'


def validate(c: ml_collections.ConfigDict, n_devices: int | None = None, platform: str | None = None) -> None:
    """Checks every rule of `c`; raises ConfigError naming the first broken one.

    Args:
      c: the config.
      n_devices: devices present; None skips the device-count rule (e.g. for planning).
      platform: JAX's backend where known ('cpu': the device-count fix names mesh.cpu_devices).
    """
    m, t = c.model, c.train
    max_sizes = {f'model.{k}': v for family in families.all_families() for k, v in family.max_sizes.items()}
    for problem in bounds.problems(c, base_config(), max_sizes):  # None, non-finite floats, absurd sizes (tests/fuzz)
        raise ConfigError(*problem)
    for axis in axes_lib.AXES:
        size = c.mesh[axis.name]
        _require(isinstance(size, int) and size >= 1, axis.field, size, 'mesh sizes must be integers >= 1',
                 f'set {axis.field} to a positive integer')
    _require(isinstance(c.mesh.cpu_devices, int) and c.mesh.cpu_devices >= 0, 'mesh.cpu_devices',
             c.mesh.cpu_devices, 'must be an integer >= 0', 'set 0 (use the devices present) or the number '
             'of simulated CPU devices')
    _require(c.train.workdir_lease_s > 0, 'train.workdir_lease_s', c.train.workdir_lease_s, 'must be > 0',
             'set the lease in seconds, e.g. 600')
    if n_devices is not None:
        check_device_count(c, n_devices, platform)

    _require(isinstance(m.scan_unroll, int) and m.scan_unroll >= 0, 'model.scan_unroll', m.scan_unroll,
             'must be an integer >= 0', 'set 0 (auto), 1 (rolled) or the layers per scan iteration')
    for field in ('num_layers', 'd_model', 'num_heads', 'seq_len', 'vocab_size', 'mlp_ratio', 'vocab_multiple',
                  'attention_block_q', 'attention_block_kv'):
        _require(isinstance(m[field], int) and m[field] >= 1, f'model.{field}', m[field],
                 'must be a positive integer', f'set model.{field} to a positive integer')
    _require(m.family in families.names(), 'model.family', m.family, 'unknown model family',
             f'use one of {families.names()}')
    _require(m.dtype in DTYPES, 'model.dtype', m.dtype, 'unknown dtype', f'use one of {DTYPES}')
    _require(m.attention in ATTENTION_IMPLS, 'model.attention', m.attention,
             'unknown attention implementation', f'use one of {ATTENTION_IMPLS}')
    _require(m.remat in REMAT_POLICIES, 'model.remat', m.remat, 'unknown remat policy',
             f'use one of {REMAT_POLICIES}')
    _require(0.0 <= m.dropout_rate < 1.0, 'model.dropout_rate', m.dropout_rate,
             'must be in [0, 1)', 'set model.dropout_rate to e.g. 0.0 or 0.1')
    _divides('model.num_heads', m.num_heads, 'model.d_model', m.d_model, 'the hidden size')
    _divides('mesh.tensor', c.mesh.tensor, 'model.num_heads', m.num_heads,
             'the number of heads (split over the tensor axis)')
    _validate_family(c)
    if 'lora' in c:  # LoRA's section (families/lora.py); a config dict saved before LoRA has none
        lora_lib.check(c.lora, families.get(m.family), lambda: model_shape(c), c.mesh.pipeline, _require)
    _divides('mesh.tensor', c.mesh.tensor, 'the MLP width (model.mlp_dim or the family rule)', mlp_dim(c),
             'the MLP width (split over the tensor axis)')
    for axis in axes_lib.AXES:
        if axis.shards_params:  # ZeRO-3: every weight's model dimension split over it
            _divides(axis.field, c.mesh[axis.name], 'model.d_model', m.d_model,
                     f'the hidden size (parameters are split over the {axis.name} axis)')
    pipelined = families.get(m.family).pipelined_layers(m)  # all but a stem group's (model/decoder.py)
    _divides('mesh.pipeline * pipeline.virtual_stages', c.mesh.pipeline * c.pipeline.virtual_stages,
             'model.num_layers', m.num_layers, 'the number of layers (split over pipeline stages)' if pipelined ==
             m.num_layers else f'the pipelined layers (model.num_layers - {m.num_layers - pipelined} dense ones = '
             f'{pipelined}: split over pipeline stages)', pipelined)
    if m.attention == 'cudnn':
        _require(m.dtype in ('bfloat16', 'float16'), 'model.dtype', m.dtype,
                 'cuDNN attention needs a 16-bit compute dtype', "set model.dtype='bfloat16' or model.attention='auto'")

    for field in ('steps', 'global_batch', 'micro_batch', 'accum_steps', 'log_every', 'eval_batches'):
        _require(isinstance(t[field], int) and t[field] >= 1, f'train.{field}', t[field],
                 'must be a positive integer', f'set train.{field} to a positive integer')
    _check_spikes(c)
    _check_hang(c)
    _check_observers(c)
    for field in ('profile_start', 'profile_steps'):
        _require(isinstance(t[field], int) and t[field] >= 0, f'train.{field}', t[field],
                 'must be an integer >= 0', f'set train.{field} to 0 or a number of steps')
    _require(t.profile_steps == 0 or t.profile_start < t.steps, 'train.profile_start', t.profile_start,
             f'no step of the run (train.steps = {t.steps}) would be traced',
             'set train.profile_start below train.steps')
    _require(isinstance(t.eval_every, int) and t.eval_every >= 0, 'train.eval_every', t.eval_every,
             'must be an integer >= 0', 'set train.eval_every to 0 (only at the end) or a step interval')
    _require(isinstance(t.compile_cache, str), 'train.compile_cache', t.compile_cache, 'must be a string',
             "set 'auto', 'off' or a directory")
    _require(isinstance(t.compile_cache_min_s, (int, float)) and t.compile_cache_min_s >= 0,
             'train.compile_cache_min_s', t.compile_cache_min_s, 'must be a number >= 0',
             'set the seconds a compile must take to be cached, e.g. 1.0')
    dp, present = data_parallel_size(c), axes_lib.in_mesh(mesh_shape(c))
    _require(t.global_batch == t.micro_batch * t.accum_steps * dp, 'train.global_batch', t.global_batch,
             f'must equal train.micro_batch ({t.micro_batch}) x train.accum_steps ({t.accum_steps}) x '
             f'data-parallel size ({" x ".join(a.field for a in axes_lib.of_role("batch") if a.name in present)} = {dp}) = '
             f'{t.micro_batch * t.accum_steps * dp}',
             'change train.global_batch, train.micro_batch or train.accum_steps so that the product holds')

    _validate_pipeline(c)
    _validate_context(c)
    check_compiles(c)

    o = c.optim
    _require(math.isfinite(o.lr) and o.lr > 0, 'optim.lr', o.lr, 'must be a finite number > 0',
             'set a positive learning rate, e.g. 3e-4')
    _require(0 <= o.min_lr <= o.lr, 'optim.min_lr', o.min_lr, 'must be in [0, optim.lr]', 'lower optim.min_lr')
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1, 'optim.b1/b2', (o.b1, o.b2), 'must be in [0, 1)',
             'use e.g. b1=0.9, b2=0.95')
    _require(o.loss_scale in LOSS_SCALES, 'optim.loss_scale', o.loss_scale, 'unknown loss scaling',
             f'use one of {LOSS_SCALES}')
    _require(o.loss_scale_init >= 1 and o.loss_scale_period >= 1, 'optim.loss_scale_init/period',
             (o.loss_scale_init, o.loss_scale_period), 'must be >= 1', 'use e.g. 2.0**15 and 2000')
    _require(o.warmup_steps >= 0 and o.decay_steps >= 0, 'optim.warmup_steps', o.warmup_steps,
             'warm-up and decay steps must be >= 0', 'set them to non-negative integers')
    _validate_optimizer(c)

    _require(c.data.kind in DATA_KINDS, 'data.kind', c.data.kind, 'unknown dataset kind',
             f'use one of {DATA_KINDS}')
    blend = c.data.get('blend', '')
    _require(c.data.kind != 'tokens' or bool(c.data.path) or bool(blend), 'data.path', c.data.path,
             'data.kind=tokens needs a token file', 'set data.path to a .bin token file (docs/data.md)')
    _require(not (blend and c.data.path), 'data.blend', blend, 'data.blend and data.path are both set',
             "keep one: data.path='' with a blend, or data.blend='' for one file")
    _require(not blend or c.data.kind == 'tokens', 'data.blend', blend, f'a blend mixes token files, but '
             f'data.kind={c.data.kind!r}', 'set data.kind=tokens')
    val_path = c.data.get('val_path', '')
    _require(not val_path or c.data.kind in ('tokens', 'builtin'), 'data.val_path', val_path,
             f'held-out token files score a model of real text, but data.kind={c.data.kind!r}',
             "set data.kind='tokens' (or 'builtin'), or data.val_path=''")
    dist = c.distributed
    _require(dist.mode in DISTRIBUTED_MODES, 'distributed.mode', dist.mode, 'unknown mode',
             f'use one of {DISTRIBUTED_MODES}')
    for field in ('initialization_timeout_s', 'heartbeat_timeout_s', 'shutdown_timeout_s'):
        _require(dist[field] >= 1, f'distributed.{field}', dist[field], 'must be >= 1 second',
                 f'set distributed.{field} to a positive number of seconds')
    _require(dist.devices_per_process >= 0, 'distributed.devices_per_process', dist.devices_per_process,
             'must be >= 0', 'use 1 (process per GPU), the GPUs per process, or 0 (all visible)')
    _require(0.0 < c.data.val_fraction < 0.5, 'data.val_fraction', c.data.val_fraction,
             'must be in (0, 0.5)', 'use e.g. 0.02')
    _validate_packing(c)

    _require(c.sharding.sequence_parallel in SEQUENCE_PARALLEL, 'sharding.sequence_parallel',
             c.sharding.sequence_parallel, 'unknown setting', f'use one of {SEQUENCE_PARALLEL}')
    axes = set(MESH_AXES) | {None}
    for i, rule in enumerate(c.sharding.rules):
        _require(isinstance(rule, (tuple, list)) and len(rule) == 2, f'sharding.rules[{i}]', rule,
                 'each rule is a (logical_name, mesh_axes) pair', "write e.g. ('mlp', 'tensor')")
        targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
        _require(all(a in axes for a in targets), f'sharding.rules[{i}]', rule,
                 'names an unknown mesh axis', f'use mesh axes from {MESH_AXES} or None')
    _validate_checkpoint(c.checkpoint)


def _validate_packing(c: ml_collections.ConfigDict) -> None:
    """data.pack_documents and what it needs: documents to pack (every attention kernel masks by them);
    data.loss_mask's setting."""
    d = c.data
    for field in ('pack_documents', 'boundary_loss'):
        _require(isinstance(d[field], bool), f'data.{field}', d[field], 'must be true or false',
                 f'set data.{field}=true or false')
    _require(isinstance(d.eot_id, int) and not isinstance(d.eot_id, bool) and d.eot_id >= -1, 'data.eot_id',
             d.eot_id, 'must be an integer >= -1', "set -1 (the token file header's) or the end-of-text id")
    _require(not c.model.vocab_size or d.eot_id < c.model.vocab_size, 'data.eot_id', d.eot_id,
             f'is not a token of the vocabulary (model.vocab_size = {c.model.vocab_size})',
             "set -1 (the token file header's) or the tokenizer's end-of-text id")
    _require(d.loss_mask in LOSS_MASKS, 'data.loss_mask', d.loss_mask, 'unknown setting',
             f"use one of {LOSS_MASKS} ('auto': a token file's loss mask where it has one)")
    if not d.pack_documents:
        _require(not d.boundary_loss, 'data.boundary_loss', True, 'chooses what packed documents count in '
                 'the loss, but data.pack_documents=false (every prediction counts)',
                 'set data.pack_documents=true, or leave data.boundary_loss=false')
        return
    _require(d.kind == 'tokens', 'data.pack_documents', True, f'data.kind={d.kind!r} has no documents to keep '
             'apart (no end-of-text token between them)', 'use data.kind=tokens with a file from python -m '
             'jaxfrontier.prepare, or data.pack_documents=false')


LOSS_MASKS = ('auto', 'on', 'off')  # data.loss_mask (data/loader.py resolve_loss_mask)


def _validate_family(c: ml_collections.ConfigDict) -> None:
    """The families' own fields: another family's refused away from their defaults (the configured one
    would silently ignore them), the configured family's checked by its declaration (`Family.check`)."""
    m = c.model
    _require(isinstance(m.mlp_dim, int) and m.mlp_dim >= 0, 'model.mlp_dim', m.mlp_dim, 'must be an integer >= 0',
             "set 0 (the family's rule) or the MLP width")
    for other in families.all_families():
        if other.name == m.family:
            continue
        for field, default in other.fields.items():
            _require(other.unset(m, field), f'model.{field}', m[field], f'only the {other.name} family uses it '
                     f'(model.family = {m.family!r} would ignore it)', f"set model.family='{other.name}', or leave "
                     f'model.{field} at {default!r}')
    family = families.get(m.family)
    family.check(m, _require)
    for axis in axes_lib.AXES:
        size = c.mesh[axis.name]
        if axis.holds_experts and size > 1:  # expert parallelism: each device holds E / size experts
            experts = family.experts(m)
            _require(experts > 0, axis.field, size, f'splits the experts of a mixture-of-experts model, and the '
                     f'{m.family} model has none (model.moe_experts = 0)', f'set {axis.field}=1, or a MoE model')
            _require(experts % size == 0, axis.field, size, f'must divide the model\'s {experts} experts (each '
                     'device holds the same number)', f'set {axis.field} to one of '
                     f'{[e for e in range(1, experts + 1) if experts % e == 0 and e > 1][:6]} (or 1)')
    family.check_mesh(m, mesh_shape(c), _require)


def _validate_checkpoint(ck: ml_collections.ConfigDict) -> None:
    for field, low in (('every_steps', 0), ('keep', 1), ('keep_period', 0), ('preemption_sync_every', 1),
                       ('restore_step', -1)):
        _require(isinstance(ck[field], int) and not isinstance(ck[field], bool) and ck[field] >= low,
                 f'checkpoint.{field}', ck[field], f'must be an integer >= {low}',
                 f'set checkpoint.{field} to an integer >= {low}')
    names = ck.preemption_signals
    _require(isinstance(names, (tuple, list)) and all(
        isinstance(n, str) and n in signal.Signals.__members__ and n not in ('SIGKILL', 'SIGSTOP') for n in names),
        'checkpoint.preemption_signals', names, 'must be a tuple of catchable signal names',
        "use e.g. ('SIGTERM', 'SIGUSR1'), or () to ignore signals")
    _require(isinstance(ck.init_params_from, str), 'checkpoint.init_params_from', ck.init_params_from,
             'must be a path string', "set it to a workdir, checkpoint directory, .safetensors file or ''")
    _require(isinstance(ck.fast_dir, str), 'checkpoint.fast_dir', ck.fast_dir, 'must be a path string',
             "set it to a node-local directory, e.g. '$JF_NODE_LOCAL/fast', or '' for no fast tier")
    for field in ('fast_every_steps', 'fast_keep'):
        _require(isinstance(ck[field], int) and not isinstance(ck[field], bool) and ck[field] >= 1,
                 f'checkpoint.{field}', ck[field], 'must be an integer >= 1', f'set checkpoint.{field} to e.g. 2')
    _require(ck.fast_keep <= 32, 'checkpoint.fast_keep', ck.fast_keep,
             'must be at most 32 (a restore lists the newest 32)',
             'set checkpoint.fast_keep to e.g. 2: the persistent tier keeps the history')
    _require(not (ck.fast_dir and not ck.enabled), 'checkpoint.fast_dir', ck.fast_dir,
             'the fast tier is a checkpoint tier, and checkpoint.enabled is False',
             "set checkpoint.fast_dir='' or checkpoint.enabled=True")


def _validate_pipeline(c: ml_collections.ConfigDict) -> None:
    p, v, m = c.mesh.pipeline, c.pipeline.virtual_stages, c.train.accum_steps
    _require(c.pipeline.schedule in PIPELINE_SCHEDULES, 'pipeline.schedule', c.pipeline.schedule,
             'unknown pipeline schedule', f'use one of {PIPELINE_SCHEDULES}')
    _require(isinstance(c.pipeline.shard_activations, bool), 'pipeline.shard_activations',
             c.pipeline.shard_activations, 'must be True or False', 'set pipeline.shard_activations=True (the default)')
    _require(isinstance(v, int) and v >= 1, 'pipeline.virtual_stages', v, 'must be an integer >= 1',
             'set pipeline.virtual_stages to 1, or to 2+ with the interleaved schedule')
    if p == 1:
        return
    _require(m >= p, 'train.accum_steps', m,
             f'a pipeline of {p} stages needs at least {p} micro-batches (accumulation steps) per step',
             f'set train.accum_steps >= {p} (more micro-batches also shrink the bubble (P-1)/(M+P-1))')
    if c.pipeline.schedule == 'interleaved':
        _require(m % p == 0, 'train.accum_steps', m,
                 f'the interleaved schedule runs micro-batches in groups of mesh.pipeline = {p}',
                 f'set train.accum_steps to a multiple of {p}')
    else:
        _require(v == 1, 'pipeline.virtual_stages', v,
                 f'the {c.pipeline.schedule} schedule has one chunk per stage',
                 "set pipeline.virtual_stages=1 or pipeline.schedule='interleaved'")


def check_compiles(c: ml_collections.ConfigDict, jax_version: str | None = None) -> None:
    """A layout the installed jax (or `jax_version`) is known to abort compiling: one line instead.

    Part of `validate`, so training, --mode=plan and --mode=verify refuse such a layout alike,
    before anything compiles. benchmarks/layout_sweep.py holds every small layout to this: it runs
    equal to one device or is refused here (docs/architecture.md, "Layouts that run").

    jax 0.11.2 aborts the process (spmd_partitioner_util.cc:498) on a pipeline map with both
    `data` and `fsdp` > 1 left automatic inside it. The train and eval steps keep `data` manual
    where gradients are reduced once per step (training/reduction.py); dropout rules that out for
    training, since masks are drawn per whole micro-batch.
    """
    version = jax_version or _installed_jax()
    if version is None or _release(version) < (0, 11) or 1 in (c.mesh.pipeline, c.mesh.data, c.mesh.fsdp):
        return
    _require(c.model.dropout_rate == 0.0, 'model.dropout_rate', c.model.dropout_rate,
             f'jax {version} aborts compiling a pipeline whose data ({c.mesh.data}) and fsdp ({c.mesh.fsdp}) '
             'axes are both automatic, which dropout needs',
             'set model.dropout_rate=0.0, or mesh.fsdp=1 (sharding.zero1=True shards the optimizer state), or jax 0.10')


def _installed_jax() -> str | None:
    """The installed jax's version, read without importing it (None where it is not installed)."""
    try:
        return importlib.metadata.version('jax')
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """'0.11.2' / '0.10.2.dev20260101' -> (0, 11)."""
    return tuple(int(x) for x in version.split('.')[:2])


def _validate_context(c: ml_collections.ConfigDict) -> None:
    """mesh.context splits each sequence into equal chunks, one per device (two with balancing)."""
    ctx, balance = c.mesh.context, c.model.context_balance
    _require(isinstance(balance, bool), 'model.context_balance', balance, 'must be True or False',
             'set model.context_balance=True (the default) or False')
    if ctx == 1:
        return
    chunks = 2 * ctx if balance else ctx
    how = (f'2 x mesh.context = {chunks} (balanced: each device holds a chunk from the front and its mirror '
           'from the back)' if balance else f'mesh.context = {ctx}')
    _require(c.model.seq_len % chunks == 0, 'model.seq_len', c.model.seq_len,
             f'the sequence is split into equal chunks, so it must be divisible by {how}',
             f'choose model.seq_len as a multiple of {chunks}, or change mesh.context')


def _check_spikes(c: ml_collections.ConfigDict) -> None:
    """train.spike_* (training/spikes.py): numbers in range, and a checkpoint to roll back to."""
    t = c.train
    _require(isinstance(t.spike_skip, bool), 'train.spike_skip', t.spike_skip, 'must be True or False',
             'set train.spike_skip=True to skip loss spikes, False to train every step')
    for field in ('spike_sigmas', 'spike_min_rise'):
        _require(isinstance(t[field], (int, float)) and not isinstance(t[field], bool) and t[field] >= 0,
                 f'train.{field}', t[field], 'must be a number >= 0', f'set train.{field} to e.g. 6.0 or 0.1')
    _require(isinstance(t.spike_ema, float) and 0.0 < t.spike_ema < 1.0, 'train.spike_ema', t.spike_ema,
             'must be a decay in (0, 1)', 'set train.spike_ema to e.g. 0.99 (about 100 steps of memory)')
    for field in ('spike_warmup', 'spike_rollback_after', 'spike_skip_batches', 'spike_max_rollbacks'):
        _require(isinstance(t[field], int) and not isinstance(t[field], bool) and t[field] >= 0, f'train.{field}',
                 t[field], 'must be an integer >= 0', f'set train.{field} to 0 or a count')
    _require(isinstance(t.spike_window, int) and t.spike_window >= max(1, t.spike_rollback_after),
             'train.spike_window', t.spike_window, f'must be an integer >= train.spike_rollback_after '
             f'({t.spike_rollback_after}) and >= 1', 'set train.spike_window to the steps in which '
             'spike_rollback_after skipped steps roll back, e.g. 100')
    _require(not (t.spike_skip and t.spike_rollback_after and not c.checkpoint.enabled),
             'train.spike_rollback_after', t.spike_rollback_after,
             'a roll-back needs a checkpoint, and checkpoint.enabled is False',
             'set train.spike_rollback_after=0 (skip spikes without rolling back), or checkpoint.enabled=True')


def _check_hang(c: ml_collections.ConfigDict) -> None:
    """train.hang_* (run/control/watchdog.py): the floor no larger than the timeout (bounds.py: each >= 0)."""
    t = c.train
    _require(isinstance(t.hang_native_stacks, bool), 'train.hang_native_stacks', t.hang_native_stacks,
             'must be True or False', 'set train.hang_native_stacks=False to write only the Python stacks')
    _require(t.hang_timeout_s == 0 or t.hang_min_s <= t.hang_timeout_s, 'train.hang_min_s', t.hang_min_s,
             f'exceeds train.hang_timeout_s ({t.hang_timeout_s}), which caps every limit',
             'set train.hang_min_s below train.hang_timeout_s, or hang_timeout_s=0 to turn hang detection off')
