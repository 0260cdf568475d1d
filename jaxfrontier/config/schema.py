"""Config schema: the shared base config, the model-size table and derived values.

Every `configs/*.py` file starts from `base_config()` and changes only what differs; the
rules it must satisfy are in checks.py. No JAX import (the package's docstring says why).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import ml_collections

from jaxfrontier import families
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.families import lora as lora_lib
from jaxfrontier.errors import ConfigError
from jaxfrontier.families import ModelShape

# Logical axis name -> mesh axes. Parameters and activations are annotated with the logical
# names on the left (see jaxfrontier/model/); this table decides the layout.
DEFAULT_RULES = (
    ('batch', ('data', 'fsdp', 'expert')),  # activations: batch rows over every data-parallel axis
    ('length', 'context'),  # activations: the sequence dimension T (context parallelism)
    # Flat activations [N, ...] (N = B*T in model/context.py's order): length's axes, then batch's
    # (resolve_rules fills it in where a rule table lacks it).
    ('tokens', ('context', 'data', 'fsdp', 'expert')),
    ('experts', 'expert'),  # mixture of experts: the experts' weights, E / expert per device
    ('expert_mlp', 'tensor'),  # each expert's width, Megatron-split like the dense MLP's
    ('layers', 'pipeline'),  # the stacked-layer axis of the block parameters
    ('embed', 'fsdp'),  # ZeRO-3: the model dimension of every weight over fsdp
    ('mlp', 'tensor'),  # Megatron column/row split of the MLP
    ('heads', 'tensor'),  # Megatron split of attention by heads
    # grouped key/value heads: split like the query heads where their count divides the
    # axes, replicated where it does not (Megatron's GQA; `resolve_rules`)
    ('kv_heads', 'tensor'),
    ('vocab', 'tensor'),  # vocabulary-parallel embedding and head
    ('qkv', None),
    ('head_dim', None),
    ('positions', None),
    ('act_embed', None),  # activations' model dimension stays whole
)

# The families registered at import (jaxfrontier/families/); families.names() lists those registered now.
MODEL_FAMILIES = families.names()
ATTENTION_IMPLS = ('auto', 'reference', 'xla', 'cudnn', 'blockwise')
REMAT_POLICIES = ('none', 'full', 'save_dots', 'save_dots_no_batch', 'save_dots_attention')
# Staggered 1F1B (pipeline/staggered.py): model.remat -> what the recomputation keeps for the
# backward half-slot (one chunk, one micro-batch). `full` keeps the weight matmuls' outputs:
# keeping only layer inputs would leave the whole recomputation to the backward half-slot
# (3 forward-equivalents against the forward half-slot's 2).
STAGGERED_RESIDUALS = {'full': 'save_dots_no_batch', 'save_dots_no_batch': 'save_dots_no_batch',
                       'save_dots': 'save_dots', 'none': 'none', 'save_dots_attention': 'save_dots_attention'}
DTYPES = ('float32', 'bfloat16', 'float16')
LOSS_SCALES = ('dynamic', 'none')
OPTIMIZERS = ('adamw', 'lion', 'adafactor')  # training/optimizer.py
LR_SCHEDULES = ('cosine', 'linear', 'constant', 'wsd', 'inverse_sqrt')
DATA_KINDS = ('builtin', 'tokens', 'synthetic')
PIPELINE_SCHEDULES = ('gpipe', '1f1b', '1f1b_lockstep', 'interleaved')  # jaxfrontier/pipeline/schedules.py
DISTRIBUTED_MODES = ('auto', 'slurm', 'explicit', 'none')
WANDB_MODES = ('disabled', 'online', 'offline')  # train.wandb_mode (run/observe/wandb_log.py)
# Outermost to innermost: the rows of config/axes.py (the order says why).
MESH_AXES = axes_lib.MESH_AXES

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


def base_config() -> ml_collections.ConfigDict:
    """The defaults every config starts from: a small GPT on the built-in corpus, one device."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    model = dict(
        family=families.DEFAULT_FAMILY,  # a registered family, families.names() (docs/models.md)
        num_layers=2,
        d_model=128,
        num_heads=4,
        seq_len=128,
        vocab_size=256,  # 0: the token file header's vocab_size (data.kind=tokens)
        # The vocabulary is padded to a multiple of vocab_multiple * mesh.tensor
        # (Megatron pads GPT-2's 50,257 to a multiple of 128 * TP).
        vocab_multiple=128,
        mlp_ratio=4,  # the MLP is mlp_ratio * d_model wide where the family's rule says so (gpt)
        # The MLP's width; 0: the family's rule (`Family.mlp_dim`; docs/models.md).
        mlp_dim=0,
    )
    # Each registered family's own fields, with their defaults (`Family.fields`; their comments are
    # in the family's declaration, jaxfrontier/families/<family>.py, and docs/models.md).
    for family in families.all_families():
        assert not set(family.fields) & set(model), f'{family.name} declares a shared model.* field'
        model |= family.fields
    c.model = ml_collections.ConfigDict(model | dict(
        tied_embeddings=True,
        dropout_rate=0.0,
        init_std=0.02,
        dtype='bfloat16',  # compute dtype; parameters and the loss are always fp32
        attention='auto',  # auto | reference | xla | cudnn | blockwise
        # Query / key-value rows per block of the blockwise kernel (model/attention/blockwise.py);
        # 64 measured fastest on the CPU at sequence 256 and 2048 (docs/PERFORMANCE.md).
        attention_block_q=64,
        attention_block_kv=64,
        # none | full | save_dots | save_dots_no_batch | save_dots_attention (the weight matmuls' outputs and
        # attention's output: only element-wise work recomputed; the fastest on the CPU, docs/PERFORMANCE.md)
        remat='full',
        # With mesh.context > 1: device r of the context ring holds chunks r and 2c-1-r of the
        # sequence's 2c chunks (zigzag), so every device does the same causal attention work;
        # off, device r holds chunk r and the last device does the most (docs/long_context.md).
        context_balance=True,
        # Layers per iteration of the layer scan (1: rolled; k: a scan over groups of k, the
        # middle ground for compile time, docs/planner.md; num_layers: fully unrolled).
        # 0 (auto): fully unrolled on GPUs, where the rolled scan cost 15 % of the 1.3b
        # step on an H200 (docs/PERFORMANCE.md, "GPU defaults"); rolled (1) on the CPU,
        # where unrolling costs compile time.
        scan_unroll=0,
    ))

    c.mesh = ml_collections.ConfigDict(dict(
        # One size per mesh axis, 1 unless set: a field per row of config/axes.py, in its order
        # (the rows say what each axis splits; context parallelism: docs/long_context.md).
        **{a.name: 1 for a in axes_lib.AXES},
        # > 0: simulate this many CPU devices (set by main before JAX starts).
        cpu_devices=0,
    ))

    c.sharding = ml_collections.ConfigDict(dict(
        rules=DEFAULT_RULES,
        # ZeRO-1: also shard the optimizer state over the data-parallel axes
        # (data and fsdp) while parameters keep their own layout.
        zero1=False,
        # Megatron's sequence parallelism: the residual stream between the tensor-parallel matmuls
        # split over tensor too. 'auto' | 'true' | 'false' (strings: `=false` on the command line
        # is one); 'auto' is off for now (`sequence_parallel`; docs/long_context.md).
        sequence_parallel='auto',
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
        name='adamw',  # adamw | lion | adafactor (training/optimizer.py; docs/training.md)
        schedule='cosine',  # cosine | linear | constant | wsd | inverse_sqrt, each after a linear warm-up
        lr=6e-4,
        min_lr=6e-5,
        warmup_steps=10,
        decay_steps=0,  # 0: decay over train.steps
        decay_fraction=0.2,  # wsd: the share of the steps at the end that decay to min_lr
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,
        factor_min_dim=128,  # adafactor: factor the moment of weights whose two largest dims are >= this
        # float16 compute only (training/loss_scale.py): 'dynamic' scales the loss so small
        # gradients do not underflow and skips steps that overflow; 'none' trains unscaled.
        loss_scale='dynamic',
        loss_scale_init=2.0**15,
        loss_scale_period=2000,  # finite steps before the scale doubles
    ))

    c.train = ml_collections.ConfigDict(dict(
        steps=100,
        # DPO (training/dpo.py, docs/post_training.md): beta of the loss -log sigmoid(beta * (the policy's
        # log-ratio to the reference on the chosen answer minus on the rejected one)).
        dpo_beta=0.1,
        objective='lm',  # lm: next-token cross-entropy | dpo: preference pairs of prepare --dpo (training/dpo.py)
        global_batch=8,  # sequences per optimizer step
        micro_batch=8,  # sequences per data-parallel replica per accumulation step
        accum_steps=1,
        log_every=10,
        eval_every=50,  # 0: evaluate only at the end
        eval_batches=4,
        progress=True,
        # Mixture of experts: a warning when an expert receives no token for this many steps
        # (run/observe/experts.py); 0: off.
        moe_empty_warn_steps=100,
        # The workdir lock's lease (run/control/workdir_lock.py): a lock not renewed for this
        # long belongs to a dead run and is taken over. Renewed every lease / 10.
        workdir_lease_s=600.0,
        # Start even when the compiled step needs more memory than the device has.
        ignore_memory_check=False,
        # jax.profiler trace of steps [profile_start, profile_start + profile_steps) to
        # <workdir>/profile/ (0 steps: off); process 0 only unless profile_all_processes.
        profile_start=5,
        profile_steps=0,
        profile_all_processes=False,
        # JAX's persistent compilation cache, shared by runs and sweep trials (safe with several
        # processes): 'auto' is $JAX_COMPILATION_CACHE_DIR where set (the Frontier scripts set it),
        # else ~/.cache/jaxfrontier/xla ($XDG_CACHE_HOME); 'off' disables it; anything else is a path.
        compile_cache='auto',
        compile_cache_min_s=0.2,  # programs that compile faster are not cached (JAX's default: 1 s)
        # Loss spikes (training/spikes.py, docs/training.md): skip the update of a step whose loss or
        # gradient norm exceeds mean + max(spike_sigmas * std, spike_min_rise * mean) of a running
        # estimate (EMA decay spike_ema, judged after spike_warmup steps); spike_rollback_after skipped
        # steps within spike_window steps roll back to the checkpoint before them and skip their data
        # (at least spike_skip_batches batches), at most spike_max_rollbacks times. Off by default.
        spike_skip=False,
        spike_sigmas=6.0,
        spike_min_rise=0.1,
        spike_ema=0.99,
        spike_warmup=100,
        spike_rollback_after=3,  # 0: skip steps, never roll back
        spike_window=100,
        spike_skip_batches=0,
        spike_max_rollbacks=3,
        # Hang detection (run/control/watchdog.py, docs/checkpoints.md): no step result for
        # max(hang_min_s, hang_factor x the median step time) after 3 steps, or for hang_timeout_s
        # (the first step, evaluations, the final save; and the cap), writes every thread's stack
        # to <workdir>/hang/ and exits 5. hang_timeout_s=0: off; hang_factor=0: the timeout only.
        hang_factor=10.0,
        hang_min_s=120.0,
        hang_timeout_s=1800.0,
        hang_native_stacks=True,  # also the native stacks (py-spy or gdb: a minute for a large process)
        # Weights & Biases (run/observe/wandb_log.py, docs/training.md; pip install 'jaxfrontier[wandb]'):
        # process 0 logs every metrics row and the resolved config; a restart resumes the same W&B
        # run (its id is kept in <workdir>/wandb_run_id). wandb_dir '': the workdir; tags: 'a,b'.
        wandb_mode='disabled',  # disabled | online | offline
        wandb_project='jaxfrontier',
        wandb_entity='',  # '': your default entity
        wandb_name='',  # '': W&B picks one
        wandb_group='',
        wandb_tags='',
        wandb_notes='',
        wandb_dir='',
        # With several processes, a process whose own step time exceeds this x the median is named in
        # a warning every train.log_every steps (run/observe/stragglers.py); 0: off.
        straggler_factor=1.5,
    ))

    c.data = ml_collections.ConfigDict(dict(
        kind='builtin',  # builtin | tokens | synthetic
        # kind=builtin: where its token file is cached, shared by runs like the compilation cache: 'auto' is
        # ~/.cache/jaxfrontier/data ($XDG_CACHE_HOME); 'workdir' is <workdir>/data_cache; anything else a path.
        cache_dir='auto',
        path='',  # kind=tokens: path of the .bin token file (header beside it)
        # kind=tokens, instead of path: 'WEIGHT:PATH,WEIGHT:PATH' mixes token files (docs/data.md)
        blend='',
        # evaluation on held-out token files instead of the last val_fraction of the training stream:
        # a .bin path, or a blend 'WEIGHT:PATH,...' (eval loss per file and weighted overall; docs/data.md)
        val_path='',
        val_fraction=0.02,  # without val_path: the validation split is the stream's last share
        # Packed documents (model/packing.py, docs/data.md): attention stays inside each document
        # of a window and positions restart per document, from the end-of-text token prepare
        # writes after every document (data.kind=tokens only).
        pack_documents=False,
        # pack_documents: count the prediction of a document's first token from the end-of-text
        # token before it (no context of its own document) in the loss.
        boundary_loss=False,
        eot_id=-1,  # pack_documents: the end-of-text id; -1 = the token file header's eot_id
        # Loss mask of supervised fine-tuning data (prepare --sft; data/loss_mask.py): 'auto' counts only the
        # predictions a token file's mask marks (resolved to 'on' where a file has one, else 'off'); 'off': all.
        loss_mask='auto',  # auto | on | off
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

    # LoRA (docs/training.md, families/lora.py): low-rank adapters a [in, r], b [r, out] beside the targeted
    # weights, the update x W + alpha / rank x (x a) b; the base frozen (no gradients, no optimizer state),
    # read from checkpoint.init_params_from at every start; checkpoints hold the adapters alone.
    c.lora = ml_collections.ConfigDict(dict(
        rank=0,  # 0: off
        alpha=16.0,
        dropout=0.0,  # on an adapter's input, in training
        # Hugging Face-style module names, comma-separated: q, k, v, o, gate, up, down (the family's `lora_targets`).
        targets='q,k,v,o,gate,up,down',
    ))

    # Checkpoints in <workdir>/checkpoints (jaxfrontier/checkpoint/, docs/checkpoints.md).
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
        # The fast tier (jaxfrontier/checkpoint/fast/tiers.py): each process's shards on node-local disk,
        # and on a peer process's, every fast_every_steps. '' = off; `$VAR`s are expanded per process,
        # e.g. '$JF_NODE_LOCAL/fast' (launch/frontier_env.sh: Frontier's NVMe).
        fast_dir='',
        fast_every_steps=100,  # with fast_dir: save there every N steps
        fast_keep=2,  # with fast_dir: the newest K fast steps are kept, older ones deleted
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


def compile_cache_dir(c: ml_collections.ConfigDict, env: Mapping[str, str]) -> str | None:
    """Where `train.compile_cache` puts JAX's persistent compilation cache (None: off).

    `env` is the process environment (main passes it: only entry points read it).
    """
    setting = c.train.compile_cache
    if setting in ('off', '', None):
        return None
    if setting != 'auto':
        return os.path.abspath(os.path.expanduser(setting))
    if env.get('JAX_COMPILATION_CACHE_DIR'):
        return env['JAX_COMPILATION_CACHE_DIR']
    return _user_cache(env, 'xla')


def data_cache_dir(c: ml_collections.ConfigDict, env: Mapping[str, str]) -> str:
    """`data.cache_dir` as the entry points resolve it before a run: 'auto' becomes the user's cache
    (~/.cache/jaxfrontier/data, $XDG_CACHE_HOME as for the compilation cache), a path becomes
    absolute, 'workdir' stays (the loader puts it under the run's workdir).

    `env` is the process environment (main passes it: only entry points read it).
    """
    setting = c.data.get('cache_dir', 'workdir')
    if setting in ('workdir', ''):
        return 'workdir'
    if setting != 'auto':
        return os.path.abspath(os.path.expanduser(setting))
    return _user_cache(env, 'data')


def _user_cache(env: Mapping[str, str], name: str) -> str:
    """~/.cache/jaxfrontier/<name>, under $XDG_CACHE_HOME where set."""
    base = env.get('XDG_CACHE_HOME') or os.path.join(env.get('HOME') or os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'jaxfrontier', name)


def resolve_fast_dir(c: ml_collections.ConfigDict, env: Mapping[str, str]) -> str:
    """`checkpoint.fast_dir` with its `$VAR`s expanded from this process's `env` (main passes it: only
    entry points read it), as an absolute path; '' stays ''.

    Raises:
      ConfigError: it names a variable that is not set.
    """
    setting = c.checkpoint.fast_dir
    if not setting:
        return ''
    expanded = re.sub(r'\$(\w+)|\$\{(\w+)\}', lambda m: env.get(m.group(1) or m.group(2), m.group(0)), setting)
    if '$' in expanded:
        raise ConfigError('checkpoint.fast_dir', setting, f'names an environment variable that is not set ({expanded})',
                          'export it (launch/frontier_env.sh sets JF_NODE_LOCAL), or give a path')
    return os.path.abspath(os.path.expanduser(expanded))


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
    """Number of data-parallel replicas: the product of the batch axes (data x fsdp)."""
    return axes_lib.data_parallel(c.mesh)


def mesh_shape(c: ml_collections.ConfigDict) -> dict[str, int]:
    return {a.name: int(c.mesh[a.name]) for a in axes_lib.AXES}


def num_devices(c: ml_collections.ConfigDict) -> int:
    return math.prod(mesh_shape(c).values())


def padded_vocab(c: ml_collections.ConfigDict) -> int:
    """The vocabulary rounded up to a multiple of vocab_multiple * tensor (Megatron's rule)."""
    m = c.model.vocab_multiple * c.mesh.tensor
    return -(-c.model.vocab_size // m) * m


GPU_PLATFORMS = ('gpu', 'cuda', 'rocm')


def resolve_scan_unroll(scan_unroll: int, num_layers: int, platform: str | None) -> int:
    """model.scan_unroll with 0 (auto) resolved: every layer unrolled on GPUs, rolled elsewhere."""
    return scan_unroll or (num_layers if platform in GPU_PLATFORMS else 1)


def model_mlp_dim(m: Mapping[str, Any]) -> int:
    """The MLP's width of `model.*` fields (a config's, or a saved config.json's): model.mlp_dim where
    set, else the family's rule (`Family.mlp_dim`; fields a saved config predates take their defaults)."""
    return m.get('mlp_dim') or families.get(m.get('family', families.DEFAULT_FAMILY)).mlp_dim(m)


def mlp_dim(c: ml_collections.ConfigDict) -> int:
    """The MLP's width of config `c` (`model_mlp_dim` of its model fields)."""
    return model_mlp_dim(c.model)


def model_shape(c: ml_collections.ConfigDict, platform: str | None = None) -> ModelShape:
    """The model's static shape (the family's `ModelShape`); `platform` (a JAX platform name) resolves
    model.scan_unroll=0."""
    m = c.model
    same = ('num_layers', 'd_model', 'num_heads', 'seq_len', 'tied_embeddings', 'dropout_rate', 'init_std', 'dtype',
            'attention', 'remat', 'attention_block_q', 'attention_block_kv')  # model.* fields taken as they are
    family = families.get(m.family)
    return family.shape(
        m, **{k: m[k] for k in same}, vocab_size=padded_vocab(c), real_vocab_size=m.vocab_size, mlp_dim=mlp_dim(c),
        scan_unroll=resolve_scan_unroll(m.scan_unroll, m.num_layers, platform),
        lora=lora_lib.resolve(c.get('lora'), family))


def lora_dropout(c: ml_collections.ConfigDict) -> float:
    """The LoRA adapters' dropout rate in training (0 without LoRA)."""
    section = c.get('lora')
    return float(section.dropout) if section is not None and section.rank else 0.0


def flops_per_step(c: ml_collections.ConfigDict) -> tuple[float, float]:
    """Returns (model_flops, megatron_hw_flops) per optimizer step of config `c`.

    The configured family's count in Megatron's convention (flops.py, `Family.megatron_flops`): the
    padded vocabulary, and recomputation (f = 4) in the hardware figure when `model.remat != 'none'`.
    """
    shape = model_shape(c)
    megatron, batch = families.get(shape.family).megatron_flops, c.train.global_batch
    return megatron(batch, shape, False), megatron(batch, shape, shape.remat != 'none')
