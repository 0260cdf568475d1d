"""Config schema: the shared base config, the model-size table, derived values and validation.

Every `configs/*.py` file starts from `base_config()` and changes only what differs. All
rules a config must satisfy are checked by `validate` before JAX compiles anything; a broken
rule raises `ConfigError`, whose message names the field, its value and the fix.

This module must not import JAX: `main` reads the config before JAX starts, so that it can
set the simulated CPU device count.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from typing import Any

import ml_collections

from jaxfrontier import config_bounds
from jaxfrontier.errors import UserError  # noqa: F401  (config_lib.UserError: the same class)

# Logical axis name -> mesh axes. Parameters and activations are annotated with the logical
# names on the left (see jaxfrontier/model/); this table decides the layout.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp')),  # activations: batch rows over every data-parallel axis
    ('layers', 'pipeline'),  # the stacked-layer axis of the block parameters
    ('embed', 'fsdp'),  # ZeRO-3: the model dimension of every weight over fsdp
    ('mlp', 'tensor'),  # Megatron column/row split of the MLP
    ('heads', 'tensor'),  # Megatron split of attention by heads
    ('vocab', 'tensor'),  # vocabulary-parallel embedding and head
    ('qkv', None),
    ('head_dim', None),
    ('positions', None),
    ('act_embed', None),  # activations' model dimension stays whole
)

ATTENTION_IMPLS = ('auto', 'reference', 'xla', 'cudnn', 'blockwise')
REMAT_POLICIES = ('none', 'full', 'save_dots', 'save_dots_no_batch')
# Staggered 1F1B (pipeline/staggered.py): model.remat -> what the recomputation keeps for the
# backward half-slot (one chunk, one micro-batch). `full` keeps the weight matmuls' outputs:
# keeping only layer inputs would leave the whole recomputation to the backward half-slot
# (3 forward-equivalents against the forward half-slot's 2).
STAGGERED_RESIDUALS = {'full': 'save_dots_no_batch', 'save_dots_no_batch': 'save_dots_no_batch',
                       'save_dots': 'save_dots', 'none': 'none'}
DTYPES = ('float32', 'bfloat16', 'float16')
LOSS_SCALES = ('dynamic', 'none')
DATA_KINDS = ('builtin', 'tokens', 'synthetic')
PIPELINE_SCHEDULES = ('gpipe', '1f1b', '1f1b_lockstep', 'interleaved')  # jaxfrontier/pipeline/schedules.py
DISTRIBUTED_MODES = ('auto', 'slurm', 'explicit', 'none')
MESH_AXES = ('pipeline', 'data', 'fsdp', 'tensor')

# name -> (layers, hidden, heads). The paper's models and the GPT-3 family sizes.
MODEL_SIZES = {
    '125m': (12, 768, 12),
    '350m': (24, 1024, 16),
    '1.3b': (24, 2048, 16),
    '6.7b': (32, 4096, 32),
    '22b': (48, 6144, 48),
    '175b': (96, 12288, 96),
    '1t': (128, 25600, 160),
}


class ConfigError(UserError, ValueError):
    """A config value breaks a rule. The message names the field, the value and the fix."""

    def __init__(self, field: str, value: Any, problem: str, fix: str):
        self.field, self.value = field, value
        super().__init__(f'config.{field} = {value!r}: {problem}. Fix: {fix}')


def base_config() -> ml_collections.ConfigDict:
    """The defaults every config starts from: a small GPT on the built-in corpus, one device."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.model = ml_collections.ConfigDict(dict(
        num_layers=2,
        d_model=128,
        num_heads=4,
        seq_len=128,
        vocab_size=256,  # 0: the token file header's vocab_size (data.kind=tokens)
        # The vocabulary is padded to a multiple of vocab_multiple * mesh.tensor
        # (Megatron pads GPT-2's 50,257 to a multiple of 128 * TP).
        vocab_multiple=128,
        mlp_ratio=4,
        tied_embeddings=True,
        dropout_rate=0.0,
        init_std=0.02,
        dtype='bfloat16',  # compute dtype; parameters and the loss are always fp32
        attention='auto',  # auto | reference | xla | cudnn | blockwise
        # Query / key-value rows per block of the blockwise kernel (model/blockwise.py);
        # 64 measured fastest on the CPU at sequence 256 and 2048 (docs/PERFORMANCE.md).
        attention_block_q=64,
        attention_block_kv=64,
        remat='full',  # none | full | save_dots | save_dots_no_batch
        # Layers per iteration of the layer scan (1: rolled; num_layers: fully unrolled).
        # 0 (auto): fully unrolled on GPUs, where the rolled scan cost 15 % of the 1.3b
        # step on an H200 (docs/PERFORMANCE.md, "GPU defaults"); rolled (1) on the CPU,
        # where unrolling costs compile time.
        scan_unroll=0,
    ))

    c.mesh = ml_collections.ConfigDict(dict(
        pipeline=1,
        data=1,
        fsdp=1,
        tensor=1,
        # > 0: simulate this many CPU devices (set by main before JAX starts).
        cpu_devices=0,
    ))

    c.sharding = ml_collections.ConfigDict(dict(
        rules=DEFAULT_RULES,
        # ZeRO-1: also shard the optimizer state over the data-parallel axes
        # (data and fsdp) while parameters keep their own layout.
        zero1=False,
    ))

    c.pipeline = ml_collections.ConfigDict(dict(
        schedule='1f1b',  # gpipe | 1f1b | 1f1b_lockstep | interleaved (jaxfrontier/pipeline/schedules.py)
        virtual_stages=1,  # chunks per stage (interleaved only)
        # Stashed stage inputs and the activations/gradients sent between stages are split
        # over `tensor` along the tokens (Megatron's sequence-parallel stash and scatter-gather
        # send): stash memory and pipeline traffic / TP, one all-gather over tensor per use.
        shard_activations=True,
    ))

    c.optim = ml_collections.ConfigDict(dict(
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=10,
        decay_steps=0,  # 0: decay over train.steps
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,
        # float16 compute only (training/loss_scale.py): 'dynamic' scales the loss so small
        # gradients do not underflow and skips steps that overflow; 'none' trains unscaled.
        loss_scale='dynamic',
        loss_scale_init=2.0**15,
        loss_scale_period=2000,  # finite steps before the scale doubles
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=100,
        global_batch=8,  # sequences per optimizer step
        micro_batch=8,  # sequences per data-parallel replica per accumulation step
        accum_steps=1,
        log_every=10,
        eval_every=50,  # 0: evaluate only at the end
        eval_batches=4,
        progress=True,
        # The workdir lock's lease (training/workdir_lock.py): a lock not renewed for this
        # long belongs to a dead run and is taken over. Renewed every lease / 10.
        workdir_lease_s=600.0,
        # Start even when the compiled step needs more memory than the device has.
        ignore_memory_check=False,
        # jax.profiler trace of steps [profile_start, profile_start + profile_steps) to
        # <workdir>/profile/ (0 steps: off); process 0 only unless profile_all_processes.
        profile_start=5,
        profile_steps=0,
        profile_all_processes=False,
    ))

    c.data = ml_collections.ConfigDict(dict(
        kind='builtin',  # builtin | tokens | synthetic
        path='',  # kind=tokens: path of the .bin token file (header beside it)
        # kind=tokens, instead of path: 'WEIGHT:PATH,WEIGHT:PATH' mixes token files (docs/data.md)
        blend='',
        val_fraction=0.02,
    ))

    # How processes join one job (jaxfrontier/distributed.py); mesh.cpu_devices is the job's total.
    c.distributed = ml_collections.ConfigDict(dict(
        mode='auto',  # auto (Slurm step > explicit address > none) | slurm | explicit | none
        coordinator_address='',  # explicit: process 0's host or host:port
        coordinator_port=0,  # 0: derived from the Slurm job id; explicit mode needs one
        num_processes=0,  # explicit: processes in the job
        process_id=-1,  # explicit: this process's id
        local_device_ids='',  # '': automatic (process per GPU), 'all', or e.g. '0,1'
        devices_per_process=1,  # GPUs per Slurm task; 0: every GPU the task sees
        initialization_timeout_s=300,  # all processes must join within this
        heartbeat_timeout_s=60,  # a peer silent this long is dead: the job ends
        shutdown_timeout_s=60,
    ))

    # Checkpoints in <workdir>/checkpoints (jaxfrontier/training/checkpoint.py, docs/checkpoints.md).
    c.checkpoint = ml_collections.ConfigDict(dict(
        enabled=True,  # False: never save or restore
        every_steps=1000,  # save every N steps (0: only at the end and on preemption)
        keep=3,  # the newest K checkpoints are kept
        keep_period=0,  # > 0: also keep every checkpoint whose step is a multiple of this
        async_save=True,  # write in the background; the loop waits only for the device copy
        # Signals that stop the run after its current step with a committed checkpoint:
        # Slurm's SIGTERM, and an early warning such as `#SBATCH --signal=USR1@120`.
        preemption_signals=('SIGTERM', 'SIGUSR1'),
        preemption_sync_every=1,  # multi-process: agree on the stop every N steps
        # Start from these parameters (a workdir, checkpoint directory or .safetensors file)
        # when the workdir has no checkpoint yet: fine-tuning. Optimizer state starts fresh.
        init_params_from='',
        # Resume from this step instead of the newest finite checkpoint (-1): roll back after
        # a loss spike. Newer checkpoints are moved to <workdir>/checkpoints.superseded/.
        restore_step=-1,
    ))
    return c


def model_size_config(c: ml_collections.ConfigDict, size: str) -> ml_collections.ConfigDict:
    """Sets layers, hidden size and heads of `c` from `MODEL_SIZES[size]`."""
    if size not in MODEL_SIZES:
        raise ConfigError('model', size, 'unknown model size', f'use one of {sorted(MODEL_SIZES)}')
    c.model.num_layers, c.model.d_model, c.model.num_heads = MODEL_SIZES[size]
    return c


def parse_arg(arg: str | None, **defaults: Any) -> ml_collections.ConfigDict:
    """Parses a config argument like 'size=1.3b,steps=10' into a ConfigDict of typed values.

    Each key must appear in `defaults`; the value is converted to the default's type.
    """
    out = ml_collections.ConfigDict(defaults)
    if not arg:
        return out
    for item in arg.split(','):
        key, sep, value = item.partition('=')
        if not sep and len(defaults) == 1:
            key, value = next(iter(defaults)), item
        if key not in defaults:
            raise ConfigError(f'<arg>.{key}', value, 'unknown config argument', f'use one of {sorted(defaults)}')
        kind = type(defaults[key])
        out[key] = (value.lower() in ('1', 'true', 'yes')) if kind is bool else kind(value)
    return out


def set_cpu_device_count(n: int) -> None:
    """Asks XLA for n simulated CPU devices (config.mesh.cpu_devices); call before JAX starts.

    An explicit --xla_force_host_platform_device_count in XLA_FLAGS wins.
    """
    flag = f'--xla_force_host_platform_device_count={n}'
    current = os.environ.get('XLA_FLAGS', '')
    if n > 0 and 'xla_force_host_platform_device_count' not in current:
        os.environ['XLA_FLAGS'] = f'{current} {flag}'.strip()


# --------------------------------------------------------------------------- derived values


def data_parallel_size(c: ml_collections.ConfigDict) -> int:
    """Number of data-parallel replicas: data x fsdp."""
    return c.mesh.data * c.mesh.fsdp


def mesh_shape(c: ml_collections.ConfigDict) -> dict[str, int]:
    return {axis: int(c.mesh[axis]) for axis in MESH_AXES}


def num_devices(c: ml_collections.ConfigDict) -> int:
    return math.prod(mesh_shape(c).values())


def padded_vocab(c: ml_collections.ConfigDict) -> int:
    """The vocabulary rounded up to a multiple of vocab_multiple * tensor (Megatron's rule)."""
    m = c.model.vocab_multiple * c.mesh.tensor
    return -(-c.model.vocab_size // m) * m


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers the model needs, and nothing else (see jaxfrontier/model/gpt.py)."""

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

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')


def resolve_scan_unroll(scan_unroll: int, num_layers: int, platform: str | None) -> int:
    """model.scan_unroll with 0 (auto) resolved: every layer unrolled on GPUs, rolled elsewhere."""
    return scan_unroll or (num_layers if platform in GPU_PLATFORMS else 1)


def model_shape(c: ml_collections.ConfigDict, platform: str | None = None) -> ModelShape:
    """The model's static shape; `platform` (a JAX platform name) resolves model.scan_unroll=0."""
    m = c.model
    same = ('num_layers', 'd_model', 'num_heads', 'seq_len', 'tied_embeddings', 'dropout_rate', 'init_std', 'dtype',
            'attention', 'remat', 'attention_block_q', 'attention_block_kv')  # model.* fields taken as they are
    return ModelShape(**{k: m[k] for k in same}, vocab_size=padded_vocab(c), real_vocab_size=m.vocab_size,
                      mlp_dim=m.mlp_ratio * m.d_model,
                      scan_unroll=resolve_scan_unroll(m.scan_unroll, m.num_layers, platform))


# --------------------------------------------------------------------------- validation


def _require(ok: bool, field: str, value: Any, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(field, value, problem, fix)


def _divides(divisor_field: str, divisor: int, field: str, value: int, what: str) -> None:
    _require(divisor > 0 and value % divisor == 0, field, value, f'{what} must be divisible by {divisor_field} = '
             f'{divisor}', f'choose {field} as a multiple of {divisor}, or change {divisor_field}')


def validate(c: ml_collections.ConfigDict, n_devices: int | None = None) -> None:
    """Checks every rule of `c`; raises ConfigError naming the first broken one.

    Args:
      c: the config.
      n_devices: devices present; None skips the device-count rule (e.g. for planning).
    """
    m, t = c.model, c.train
    for problem in config_bounds.problems(c, base_config()):  # None, non-finite floats, absurd sizes (tests/fuzz)
        raise ConfigError(*problem)
    for axis in MESH_AXES:
        _require(isinstance(c.mesh[axis], int) and c.mesh[axis] >= 1, f'mesh.{axis}', c.mesh[axis],
                 'mesh sizes must be integers >= 1', f'set mesh.{axis} to a positive integer')
    _require(isinstance(c.mesh.cpu_devices, int) and c.mesh.cpu_devices >= 0, 'mesh.cpu_devices',
             c.mesh.cpu_devices, 'must be an integer >= 0', 'set 0 (use the devices present) or the number '
             'of simulated CPU devices')
    _require(c.train.workdir_lease_s > 0, 'train.workdir_lease_s', c.train.workdir_lease_s, 'must be > 0',
             'set the lease in seconds, e.g. 600')
    if n_devices is not None and num_devices(c) != n_devices:
        shape = ' x '.join(f'{a} {s}' for a, s in mesh_shape(c).items())
        raise ConfigError('mesh', shape, f'the mesh needs {num_devices(c)} devices but {n_devices} are present',
                          'run on a machine or allocation with that many devices, change config.mesh.* so the '
                          'product equals the devices present, or get a plan without devices: '
                          'python -m jaxfrontier.main --config=... --mode=plan')

    _require(isinstance(m.scan_unroll, int) and m.scan_unroll >= 0, 'model.scan_unroll', m.scan_unroll,
             'must be an integer >= 0', 'set 0 (auto), 1 (rolled) or the layers per scan iteration')
    for field in ('num_layers', 'd_model', 'num_heads', 'seq_len', 'vocab_size', 'mlp_ratio', 'vocab_multiple',
                  'attention_block_q', 'attention_block_kv'):
        _require(isinstance(m[field], int) and m[field] >= 1, f'model.{field}', m[field],
                 'must be a positive integer', f'set model.{field} to a positive integer')
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
    _divides('mesh.tensor', c.mesh.tensor, 'model.mlp_ratio * model.d_model', m.mlp_ratio * m.d_model,
             'the MLP width (split over the tensor axis)')
    _divides('mesh.fsdp', c.mesh.fsdp, 'model.d_model', m.d_model,
             'the hidden size (parameters are split over the fsdp axis)')
    _divides('mesh.pipeline * pipeline.virtual_stages', c.mesh.pipeline * c.pipeline.virtual_stages,
             'model.num_layers', m.num_layers, 'the number of layers (split over pipeline stages)')
    if m.attention == 'cudnn':
        _require(m.dtype in ('bfloat16', 'float16'), 'model.dtype', m.dtype,
                 'cuDNN attention needs a 16-bit compute dtype', "set model.dtype='bfloat16' or model.attention='auto'")

    for field in ('steps', 'global_batch', 'micro_batch', 'accum_steps', 'log_every', 'eval_batches'):
        _require(isinstance(t[field], int) and t[field] >= 1, f'train.{field}', t[field],
                 'must be a positive integer', f'set train.{field} to a positive integer')
    for field in ('profile_start', 'profile_steps'):
        _require(isinstance(t[field], int) and t[field] >= 0, f'train.{field}', t[field],
                 'must be an integer >= 0', f'set train.{field} to 0 or a number of steps')
    _require(t.profile_steps == 0 or t.profile_start < t.steps, 'train.profile_start', t.profile_start,
             f'no step of the run (train.steps = {t.steps}) would be traced',
             'set train.profile_start below train.steps')
    _require(isinstance(t.eval_every, int) and t.eval_every >= 0, 'train.eval_every', t.eval_every,
             'must be an integer >= 0', 'set train.eval_every to 0 (only at the end) or a step interval')
    dp = data_parallel_size(c)
    _require(t.global_batch == t.micro_batch * t.accum_steps * dp, 'train.global_batch', t.global_batch,
             f'must equal train.micro_batch ({t.micro_batch}) x train.accum_steps ({t.accum_steps}) x '
             f'data-parallel size (mesh.data x mesh.fsdp = {dp}) = {t.micro_batch * t.accum_steps * dp}',
             'change train.global_batch, train.micro_batch or train.accum_steps so that the product holds')

    _validate_pipeline(c)

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

    _require(c.data.kind in DATA_KINDS, 'data.kind', c.data.kind, 'unknown dataset kind',
             f'use one of {DATA_KINDS}')
    blend = c.data.get('blend', '')
    _require(c.data.kind != 'tokens' or bool(c.data.path) or bool(blend), 'data.path', c.data.path,
             'data.kind=tokens needs a token file', 'set data.path to a .bin token file (docs/data.md)')
    _require(not (blend and c.data.path), 'data.blend', blend, 'data.blend and data.path are both set',
             "keep one: data.path='' with a blend, or data.blend='' for one file")
    _require(not blend or c.data.kind == 'tokens', 'data.blend', blend, f'a blend mixes token files, but '
             f'data.kind={c.data.kind!r}', 'set data.kind=tokens')
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

    axes = set(MESH_AXES) | {None}
    for i, rule in enumerate(c.sharding.rules):
        _require(isinstance(rule, (tuple, list)) and len(rule) == 2, f'sharding.rules[{i}]', rule,
                 'each rule is a (logical_name, mesh_axes) pair', "write e.g. ('mlp', 'tensor')")
        targets = rule[1] if isinstance(rule[1], (tuple, list)) else (rule[1],)
        _require(all(a in axes for a in targets), f'sharding.rules[{i}]', rule,
                 'names an unknown mesh axis', f'use mesh axes from {MESH_AXES} or None')
    _validate_checkpoint(c.checkpoint)


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
