"""Entry point: `python -m jaxfrontier.main --config=configs/tiny.py --workdir=DIR [--mode=train|plan|export|sample|eval|lm_eval]`.

The only module that reads flags. Config overrides come as `--config.train.steps=10`;
a misspelt key is rejected. JAX is imported only after the config is read, so that
`config.mesh.cpu_devices` can set the simulated CPU device count before JAX starts.
"""

from __future__ import annotations

import json
import os
import sys
import time

_STARTED = time.perf_counter()  # start-up phases are timed from here (the interpreter's own start is not)

from absl import app, flags, logging
from ml_collections import config_flags

from jaxfrontier import cli
from jaxfrontier import config as config_lib  # no JAX import: safe before XLA_FLAGS is set
from jaxfrontier import distributed  # no JAX import either
from jaxfrontier import hardware as hardware_lib  # no JAX import at module level
from jaxfrontier import logs  # no JAX import either
from jaxfrontier.checkpoint import run_files  # no JAX import
from jaxfrontier.checkpoint.interop import export_target  # no JAX import either
from jaxfrontier.data import builtin  # no JAX import
from jaxfrontier.data import loader as data_lib  # no JAX import at module level
from jaxfrontier.errors import ConfigError, DistributedError, NonFiniteLossError, UserError
from jaxfrontier.plan import fanout  # no JAX import either
from jaxfrontier.plan import shrink  # no JAX import either
from jaxfrontier.run import validation  # no JAX import: config and data checks only

VERIFY_XLA_TIMEOUTS = ('xla_cpu_collective_call_terminate_timeout_seconds', 'xla_cpu_collective_timeout_seconds')
_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'tiny.py')

# No default here: config_flags would load a default config, and apply the --config.* overrides,
# at import time, outside any error handling. `parse_flags` adds --config=<tiny.py> when absent.
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (configs/*.py[:arg]); '
                                          f'default {_DEFAULT_CONFIG}.', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', 'workdirs/default', 'Directory for metrics, config and data cache.')
_EXPORT_PATH = flags.DEFINE_string('export_path', '', 'mode=export: the .safetensors file to write from the newest '
                                   'checkpoint of --workdir (default <workdir>/params.safetensors; '
                                   'with --export_format=hf a directory, default <workdir>/hf).')
_EXPORT_MAX_POSITIONS = flags.DEFINE_integer('export_max_positions', 0, 'mode=export --export_format=hf: a rotary '
                                             "model's max_position_embeddings (0: the imported Hugging Face model's "
                                             'where the run continued one, else the training seq_len).')
_FORCE = flags.DEFINE_bool('force', False, 'mode=export --export_format=hf or peft: replace an --export_path that '
                           'holds only a previous export of ours of the same kind, all of its files at once (never '
                           'the run\'s base, a workdir or another model\'s directory).')
_EXPORT_ALLOW_NONFINITE = flags.DEFINE_bool('export_allow_nonfinite', False, 'mode=export: write parameters '
                                            'that hold NaN or Inf instead of refusing.')
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'plan', 'verify', 'export', 'sample', 'eval', 'lm_eval'],
                          'train: run training. plan: parameters, memory and FLOPs of the layout, no devices: exit 0 if it '
                          'fits, 1 if not (its last line names a layout that fits). '
                          'verify: the layout shrunk to a small model on simulated CPU devices against one device: '
                          'a certificate, exit 0 (pass) or 1 (docs/preflight.md). '
                          'export: parameters of the newest checkpoint in --workdir to --export_path. '
                          'sample: continue --prompt with the newest checkpoint. eval: loss, perplexity and bits '
                          'per byte over --eval_path or the validation split (docs/inference.md); of a DPO run, '
                          'dpo/* over its held-out pairs (docs/post_training.md). lm_eval: '
                          'lm-evaluation-harness --tasks on the newest checkpoint (pip install jaxfrontier[lm_eval]).')
_EXPORT_FORMAT = flags.DEFINE_enum('export_format', 'safetensors', ['safetensors', 'hf', 'peft'],
                                   'mode=export: our safetensors names, or a Hugging Face directory in the '
                                   "architecture of the model's family (--export_path=DIR, loads with "
                                   'transformers.AutoModelForCausalLM); a LoRA run\'s adapters merged into its '
                                   'base in either, or alone as a PEFT adapter directory (peft: --export_path=DIR, '
                                   'default <workdir>/peft; loads with peft.PeftModel.from_pretrained).')
_PROMPT = flags.DEFINE_multi_string('prompt', [], 'mode=sample: a text to continue; repeat the flag for several '
                                    '(one batch, each printed with its own continuation).')
_PROMPT_FILE = flags.DEFINE_string('prompt_file', '', 'mode=sample: a file of prompts, one per line (one batch).')
_CHAT = flags.DEFINE_multi_string('chat', [], 'mode=sample: a conversation as JSON, [{"role": "user", "content": '
                                  '"..."}], rendered with the run\'s chat template and answered as the assistant '
                                  '(ends at its end-of-turn token); repeatable.')
_CHAT_FILE = flags.DEFINE_string('chat_file', '', 'mode=sample: a file of conversations, one JSON list of messages '
                                 'per line (as --chat).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'mode=sample: tokens to generate per prompt.')
_TEMPERATURE = flags.DEFINE_float('temperature', 1.0, 'mode=sample: softmax temperature (0: greedy).')
_TOP_K = flags.DEFINE_integer('top_k', 0, 'mode=sample: sample among the k most likely tokens (0: all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'mode=sample: nucleus sampling mass (1: off).')
_REPETITION_PENALTY = flags.DEFINE_float('repetition_penalty', 1.0, 'mode=sample: divide the logits of tokens '
                                         'already in the prompt or output by this where positive, multiply where '
                                         'negative (CTRL, as Hugging Face; 1: off).')
_STOP = flags.DEFINE_multi_string('stop', [], 'mode=sample: end a row when its text contains this string (cut '
                                  'before it); repeatable. The tokenizer\'s end-of-text token ends a row too.')
_IGNORE_EOT = flags.DEFINE_bool('ignore_eot', False, 'mode=sample: do not end a row at the tokenizer\'s end-of-text '
                                'token (always --max_new_tokens, e.g. to measure speed).')
_SEED = flags.DEFINE_integer('seed', 0, 'mode=sample: random seed of the sampling.')
_CPU_FP32 = flags.DEFINE_bool('cpu_fp32', True, 'mode=sample, eval and lm_eval: on a CPU, compute in float32 whatever '
                              'model.dtype (XLA:CPU has no fast 16-bit matmul, and a bf16 greedy continuation drifts '
                              'from the fp32 one transformers computes there); --nocpu_fp32 keeps model.dtype.')
_EVAL_PATH = flags.DEFINE_string('eval_path', '', 'mode=eval: a token file to score whole (default: the run\'s '
                                 'data.val_path, else its validation split); of a DPO run, a file of prepare --dpo '
                                 'whose pairs\' dpo/* it reports.')
_TASKS = flags.DEFINE_list('tasks', [], 'mode=lm_eval: harness task names (or globs), comma-separated.')
_NUM_FEWSHOT = flags.DEFINE_integer('num_fewshot', None, 'mode=lm_eval: few-shot examples per prompt '
                                    '(default: each task\'s own).')
_LIMIT = flags.DEFINE_float('limit', 0, 'mode=lm_eval: documents per task (a fraction if < 1; 0: all).')
_LM_EVAL_INCLUDE = flags.DEFINE_string('lm_eval_include', '', 'mode=lm_eval: a directory of your own task YAMLs.')
_LM_EVAL_BATCH = flags.DEFINE_integer('lm_eval_batch', 0, 'mode=lm_eval: rows per batch (0: train.global_batch).')
_LM_EVAL_JSON = flags.DEFINE_string('lm_eval_json', '', 'mode=lm_eval: also write the harness\'s results, with '
                                    'every document\'s requests and answers (samples), as JSON here.')
_HARDWARE = flags.DEFINE_string('hardware', 'mi250x', 'mode=plan: the device to plan for: '
                                 f'{", ".join(hardware_lib.NAMES)} (local: this machine), or a description '
                                 'path.json (python -m jaxfrontier.calibrate writes one).')
_SEARCH = flags.DEFINE_bool('search', False, 'mode=plan: search layouts of the model that fit, fastest first.')
_SEARCH_DEVICES = flags.DEFINE_integer('search_devices', 0, 'mode=plan --search: devices (0: the config mesh).')
_MAX_SEARCH_DEVICES = 2**20  # beyond any machine (Frontier: 75,264 GCDs); 2^62 hung the search counting divisors
flags.register_validator(  # checked while the flags are parsed: one line, exit 2 (cli.parse_config_flags)
    'search_devices', lambda n: 0 <= n <= _MAX_SEARCH_DEVICES,
    message=f'is not a device count: 0 (the config\'s mesh) or 1 to {_MAX_SEARCH_DEVICES:,}. Fix: pass the devices to '
            'search layouts for, e.g. --search_devices=64, or leave it out')
_PLAN_CHECK = flags.DEFINE_enum('plan_check', 'lower', ['none', 'lower', 'compile'],
                                'mode=plan: lower the train step on an AbstractMesh (lower), and also compile an '
                                'fp32 copy on <= 2048 simulated CPU devices (compile).')
_PLAN_JSON = flags.DEFINE_string('plan_json', '', 'mode=plan: also write the plan (or search) as JSON here.')
_VERIFY_MAX_DEVICES = flags.DEFINE_integer('verify_max_devices', shrink.MAX_DEVICES, 'mode=verify: simulated CPU '
                                           'devices at most; a larger mesh is checked with a smaller data extent '
                                           f'(said so). Past {fanout.PER_PROCESS_MAX} the check runs as several local '
                                           'processes joined by jax.distributed (one XLA:CPU process deadlocks '
                                           'beyond that: docs/preflight.md).')
# Tests only: a lower per-process device limit, so that a small layout takes the multi-process path.
_PER_PROCESS_MAX_ENV = 'JF_VERIFY_PER_PROCESS_MAX'
_VERIFY_JSON = flags.DEFINE_string('verify_json', '', 'mode=verify: also write the certificate as JSON here.')


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    config = _CONFIG.value

    try:  # validate, then decide how this process joins the job, before JAX starts
        processes = distributed.ProcessSettings('none')
        if _MODE.value == 'plan':
            data_lib.resolve_headers(config)  # model.vocab_size=0, data.eot_id=-1, data.loss_mask=auto
        if _MODE.value == 'lm_eval':  # before the seconds JAX and the harness take to import
            _check_lm_eval_flags()
        if _MODE.value == 'export':  # before JAX, before anything is written
            _check_export_path(config)
        if _MODE.value == 'train':
            validation.validate_run(config)  # once; the device count is checked when JAX has started
            config.checkpoint.fast_dir = config_lib.resolve_fast_dir(config, os.environ)  # $JF_NODE_LOCAL, per process
            _resolve_data_cache(config)
            processes = distributed.resolve(config.distributed, os.environ, cpu=config.mesh.cpu_devices > 0)
        if _MODE.value in ('train', 'verify'):
            _use_compile_cache(config)
        if _MODE.value == 'verify':  # the shrunk mesh on simulated CPU devices, whatever this machine has
            data_lib.resolve_headers(config)
            to_verify = shrink.shrink(config, _VERIFY_MAX_DEVICES.value)  # once: its mesh sizes the devices
            if fanout.WORKER_ENV in os.environ:  # one of the processes started just below, by the parent
                processes = fanout.Worker.decode(os.environ[fanout.WORKER_ENV]).settings()
            else:
                count = fanout.workers_needed(to_verify.num_devices, int(os.environ.get(
                    _PER_PROCESS_MAX_ENV, fanout.PER_PROCESS_MAX)))
                if count > 1:  # the parent: no JAX here, it waits for the workers (plan/fanout.py)
                    return fanout.run_workers(sys.argv, count, os.environ)
            os.environ['JAX_PLATFORMS'] = 'cpu'
            # Hundreds of simulated devices share this machine's cores: a collective may wait minutes for
            # its last participant, past XLA:CPU's 40 s abort.
            os.environ['XLA_FLAGS'] = ' '.join(
                [f for f in os.environ.get('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
                + [f'--{flag}=3600' for flag in VERIFY_XLA_TIMEOUTS])
            config_lib.set_cpu_device_count(to_verify.num_devices // processes.num_processes)
        else:
            per_process = distributed.cpu_devices_per_process(config.mesh.cpu_devices, processes.num_processes)
            config_lib.set_cpu_device_count(per_process)
    except (UserError, DistributedError) as e:
        return cli.exit_code(e)
    logging.set_verbosity(logging.INFO)
    logs.quiet_library_logs()  # JAX's backend probing and the like: nothing a user can act on

    try:
        if _MODE.value == 'plan':
            from jaxfrontier.plan import report as plan_report  # pylint: disable=g-import-not-at-top
            planned = plan_report.make(config, hardware=_HARDWARE.value, search=_SEARCH.value,
                                       search_devices=_SEARCH_DEVICES.value, check=_PLAN_CHECK.value,
                                       json_path=_PLAN_JSON.value)
            print(planned.text)
            return 0 if planned.fits else 1  # a script tests it (docs/planner.md)
        elif _MODE.value == 'verify':
            distributed.initialize(processes, config.distributed)  # the workers of a multi-process check
            from jaxfrontier.plan import verify  # pylint: disable=g-import-not-at-top
            text, passed = verify.report(_config_name(), to_verify)
            if processes.process_id != 0:  # every process computes the certificate; process 0 tells it
                return 0
            if _VERIFY_JSON.value:
                with open(_VERIFY_JSON.value, 'w') as f:
                    f.write(text.rsplit('\n', 1)[0] + '\n')
            print(text)
            return 0 if passed else 1
        elif _MODE.value in ('sample', 'eval', 'lm_eval') or (_MODE.value == 'export' and _EXPORT_FORMAT.value == 'hf'):
            print(_run_inference(config))
        elif _MODE.value == 'export' and _EXPORT_FORMAT.value == 'peft':
            from jaxfrontier.checkpoint.interop import peft  # pylint: disable=g-import-not-at-top
            out = _export_path()
            summary = peft.export_peft(_WORKDIR.value, out, force=_FORCE.value,
                                       bases=(config.checkpoint.init_params_from,))
            print(f'exported the LoRA adapters of step {summary["step"]} of {_WORKDIR.value} to {out} '
                  f'({summary["tensors"]} tensors, {",".join(summary["target_modules"])}; base {summary["base"]})')
        elif _MODE.value == 'export':
            from jaxfrontier.checkpoint.interop import safetensors as safetensors_lib  # pylint: disable=g-import-not-at-top
            out = _export_path()
            names = safetensors_lib.export_params(_WORKDIR.value, out, allow_nonfinite=_EXPORT_ALLOW_NONFINITE.value,
                                                  bases=(config.checkpoint.init_params_from,))
            print(f'exported {len(names)} parameter tensors of {_WORKDIR.value} to {out} (docs/checkpoints.md)')
        else:
            startup = {'flags_and_imports': time.perf_counter() - _STARTED}  # JAX comes in with distributed/preflight
            t0 = time.perf_counter()
            distributed.initialize(processes, config.distributed)
            logging.info(distributed.describe_process(processes, os.environ))  # starts JAX's backend: timed here
            startup['distributed'] = time.perf_counter() - t0
            t0 = time.perf_counter()
            if processes.process_id != 0:
                logging.set_verbosity(logging.WARNING)  # only process 0 logs progress
            run_files.check_not_hf_export(_WORKDIR.value)  # training would overwrite the export's config.json
            from jaxfrontier.plan import preflight  # pylint: disable=g-import-not-at-top
            # The planner's bytes per device vs. a device's, before any allocation; the config was validated above.
            preflight.check(config, validated=True)
            from jaxfrontier.run import loop  # pylint: disable=g-import-not-at-top
            startup['preflight'] = time.perf_counter() - t0
            loop.train_and_evaluate(config, _WORKDIR.value, validated=True, startup=startup, started=_STARTED)
    except (UserError, NonFiniteLossError, DistributedError) as e:
        return cli.exit_code(e)
    return 0


_EXPORT_DEFAULTS = {'safetensors': 'params.safetensors', 'hf': 'hf', 'peft': 'peft'}  # below --workdir


def _export_path() -> str:
    return _EXPORT_PATH.value or os.path.join(_WORKDIR.value, _EXPORT_DEFAULTS[_EXPORT_FORMAT.value])


def _check_export_path(config) -> None:
    """mode=export: a target that is the run's base, in what a run rotates, a workdir or another model's
    directory is one line before JAX starts (export_target.py); the exporter checks it again."""
    out, fmt, bases = _export_path(), _EXPORT_FORMAT.value, (config.checkpoint.init_params_from,)
    if fmt == 'safetensors':
        export_target.check_file(out, source=_WORKDIR.value, bases=bases)
        return
    if out.endswith('.safetensors'):
        raise UserError(f'--export_path={out} names a .safetensors file, but --export_format={fmt} writes a '
                        f'directory. Fix: --export_format=safetensors for one file, or name a directory, e.g. '
                        f'--export_path={os.path.join(_WORKDIR.value, fmt)}')
    export_target.check_dir(out, fmt, source=_WORKDIR.value, force=_FORCE.value, bases=bases)


def _resolve_data_cache(config) -> None:
    """data.cache_dir as a path (or 'workdir'), created before the run writes anything: an unwritable
    directory the user named is one line; `auto`'s user cache, where it cannot be written (a home that
    is read-only on compute nodes), falls back to the workdir, which the `data:` line then names."""
    setting = config.data.cache_dir
    config.data.cache_dir = config_lib.data_cache_dir(config, os.environ)  # auto: ~/.cache/jaxfrontier/data
    if config.data.kind != 'builtin' or config.data.cache_dir == 'workdir':
        return
    try:
        builtin.ensure_cache_dir(config.data.cache_dir)
    except ConfigError:
        if setting != 'auto':
            raise
        config.data.cache_dir = 'workdir'


def _use_compile_cache(config) -> None:
    """JAX's persistent compilation cache for this process (train.compile_cache), set before JAX starts."""
    path = config_lib.compile_cache_dir(config, os.environ)
    if path is None:
        os.environ.pop('JAX_COMPILATION_CACHE_DIR', None)
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError('train.compile_cache', config.train.compile_cache,
                          f'cannot create the compilation cache {path}: {e.strerror}',
                          "name a writable directory, or 'off'") from None
    os.environ['JAX_COMPILATION_CACHE_DIR'] = path
    os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', str(config.train.compile_cache_min_s))


def _config_name() -> str:
    """The --config the user named (its file and argument), for the certificate."""
    return config_flags.get_config_filename(flags.FLAGS['config']) or _DEFAULT_CONFIG


def _run_inference(config) -> str:
    """mode=sample, mode=eval and the Hugging Face export (jaxfrontier/inference/, checkpoint/interop/hf.py)."""
    # pylint: disable=g-import-not-at-top
    if _MODE.value == 'export':
        from jaxfrontier.checkpoint.interop import hf
        out = _export_path()
        summary = hf.export_hf(_WORKDIR.value, out, _EXPORT_MAX_POSITIONS.value, force=_FORCE.value,
                               bases=(config.checkpoint.init_params_from,))
        return f'exported step {summary["step"]} of {_WORKDIR.value} as a Hugging Face {summary["architecture"]} ' \
               f'directory {out} ({summary["tensors"]} tensors, tokenizer: {summary["tokenizer"]}, ' \
               f'max positions: {summary["max_positions"]})'
    _log_compute_dtype(config)
    if _MODE.value == 'lm_eval':
        return _run_lm_eval(config)
    if _MODE.value == 'eval':
        from jaxfrontier.inference import evaluate
        return evaluate.report(evaluate.evaluate(config, _WORKDIR.value, _EVAL_PATH.value))
    from jaxfrontier.inference import generate, sample
    rule = generate.Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _REPETITION_PENALTY.value)
    chats = None
    if _CHAT.value or _CHAT_FILE.value:
        if _PROMPT.value or _PROMPT_FILE.value:
            raise UserError('both --chat/--chat_file and --prompt/--prompt_file given. Fix: pass conversations '
                            '(rendered with the chat template) or plain prompts, not both.')
        from jaxfrontier.inference import chat_prompts
        chats, prompts = chat_prompts.read_chats(_CHAT.value, _CHAT_FILE.value), []
    else:
        prompts = sample.read_prompts(_PROMPT.value, _PROMPT_FILE.value)
    return sample.report(sample.sample(config, _WORKDIR.value, prompts, max_new=_MAX_NEW.value, rule=rule,
                                       seed=_SEED.value, stops=tuple(_STOP.value), eot=not _IGNORE_EOT.value,
                                       chats=chats))


def _log_compute_dtype(config) -> None:
    """mode=sample, eval, lm_eval: the compute dtype, float32 on a CPU unless --nocpu_fp32 (said in the first lines)."""
    import jax  # pylint: disable=g-import-not-at-top
    dtype = config.model.dtype
    if _CPU_FP32.value and jax.default_backend() == 'cpu' and dtype != 'float32':
        config.model.dtype = 'float32'
        logging.info(f'compute: float32 on the CPU, not model.dtype={dtype} (--nocpu_fp32 keeps it); parameters '
                     'float32')
    else:
        logging.info(f'compute: {dtype} (model.dtype); parameters float32')


def _check_lm_eval_flags() -> None:
    """mode=lm_eval's flags: one line for a mistake, before JAX or the harness is imported."""
    if not _TASKS.value:
        raise UserError('--mode=lm_eval needs --tasks. Fix: --tasks=hellaswag,arc_easy (harness task names), '
                        'or your own task YAMLs with --lm_eval_include=DIR.')
    for name, value in (('num_fewshot', _NUM_FEWSHOT.value), ('limit', _LIMIT.value),
                        ('lm_eval_batch', _LM_EVAL_BATCH.value)):
        if value is not None and value < 0:
            raise UserError(f'--{name}={value}: must be >= 0. Fix: leave it out for the default.')
    if _LM_EVAL_INCLUDE.value and not os.path.isdir(_LM_EVAL_INCLUDE.value):
        raise UserError(f'--lm_eval_include={_LM_EVAL_INCLUDE.value} is not a directory. Fix: name the directory '
                        'that holds your task YAMLs.')


def _run_lm_eval(config) -> str:
    """mode=lm_eval: the harness, imported only here (it is heavy and optional; inference/harness.py)."""
    try:
        from jaxfrontier.inference import harness  # pylint: disable=g-import-not-at-top
    except ModuleNotFoundError as e:
        if e.name != 'lm_eval' and not (e.name or '').startswith('lm_eval.'):
            raise
        raise UserError('--mode=lm_eval needs lm-evaluation-harness. Fix: pip install "jaxfrontier[lm_eval]" '
                        '(or pip install lm-eval).') from None
    results = harness.run(config, _WORKDIR.value, _TASKS.value, num_fewshot=_NUM_FEWSHOT.value, limit=_LIMIT.value,
                          include_path=_LM_EVAL_INCLUDE.value, batch_size=_LM_EVAL_BATCH.value,
                          log_samples=bool(_LM_EVAL_JSON.value))
    if _LM_EVAL_JSON.value:
        try:
            with open(_LM_EVAL_JSON.value, 'w', encoding='utf-8') as f:
                json.dump(results, f, indent=1, default=str)
        except OSError as e:
            raise UserError(f'cannot write --lm_eval_json={_LM_EVAL_JSON.value}: {e.strerror}. Fix: name a file in '
                            'a writable directory.') from None
    return harness.report(results)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing; a mistake in --config or its overrides is one message (exit 2), not a traceback."""
    return cli.parse_config_flags(argv, _CONFIG, default_config=_DEFAULT_CONFIG)


def run() -> None:
    cli.run_app(main, flags_parser=parse_flags)


if __name__ == '__main__':
    run()
