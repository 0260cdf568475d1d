"""lm-evaluation-harness adapter: score a checkpoint on harness tasks (`--mode=lm_eval`, docs/inference.md).

`JaxFrontierLM` is an `lm_eval.api.model.TemplateLM` registered as `jaxfrontier`. The
harness hands it text; TemplateLM splits each (context, continuation) pair at the token
boundary the harness expects (the whole text is encoded, then the context alone, and the
continuation is what the whole has beyond the context; spaces ending the context move to the
continuation) and this class scores the token ids with inference/scoring.py:

  loglikelihood          sum of the continuation's log-probabilities and whether greedy
                         decoding gives it, in fixed-size batches on the config's mesh.
  loglikelihood_rolling  a whole document in windows of model.seq_len, made by the harness's
                         own `get_rolling_token_windows` / `make_disjoint_window`, so every
                         token is predicted once, each window with as much context as fits.
  generate_until         inference/sample.py's decode loop (greedy unless the task samples),
                         cut before the task's `until` strings (inference/stops.py).

An empty context (and a document's first token) is conditioned on one prefix token: the
tokenizer's end-of-text, else the last token of "\\n" (the built-in corpus has no end-of-text;
its files begin after a line end). This module imports lm-eval, a heavy optional extra
(`pip install 'jaxfrontier[lm_eval]'`): only `--mode=lm_eval` imports it.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import ml_collections
from lm_eval import evaluator, utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager

from jaxfrontier import config as config_lib
from jaxfrontier import logs
from jaxfrontier.errors import UserError
from jaxfrontier.inference import generate as gen
from jaxfrontier.inference import load as load_lib
from jaxfrontier.inference import sample
from jaxfrontier.inference import scoring
from jaxfrontier.inference import text

log = logs.process0(__name__)
DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default for generate_until


@register_model('jaxfrontier')
class JaxFrontierLM(TemplateLM):
    """A jaxfrontier checkpoint as a harness model (see the module docstring).

    Args:
      workdir: the run whose newest checkpoint to score (or config.checkpoint.init_params_from).
      config: the config whose mesh to run on; default: every local device on `data`.
      batch_size: rows per batch (rounded up to the data-parallel size); default or 'auto':
        config.train.global_batch. The harness passes it from its own --batch_size.
      max_batch_size, device: the harness passes these to every model; JAX places the arrays.
    """

    def __init__(self, workdir: str = '', config: ml_collections.ConfigDict | None = None,
                 batch_size: int | str | None = None, max_batch_size: int | None = None, device: str | None = None):
        super().__init__()
        del max_batch_size, device
        if not workdir:
            raise UserError('the jaxfrontier lm-eval model needs a run. Fix: pass model_args workdir=DIR.')
        if config is None:
            config = config_lib.base_config()
            config.mesh.data = jax.device_count()  # every device a replica (each other axis is 1)
        self.loaded = load_lib.load(config, workdir)
        c = self.loaded.config
        self.codec = text.run_codec(self.loaded.run_config.get('data', {}), c.model.vocab_size, self.loaded.hf_dir)
        rows = c.train.global_batch if batch_size in (None, '', 'auto') else batch_rows(batch_size)
        self.scorer = scoring.Scorer(self.loaded, rows)

    @property
    def eot_token_id(self) -> int:
        return self.codec.eot_ids[0] if self.codec.eot_ids else self.codec.encode('\n')[-1]

    @property
    def max_length(self) -> int:
        return self.loaded.config.model.seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.codec.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        del add_special_tokens, kwargs  # our tokenizers add no special tokens
        return self.codec.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.codec.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        del disable_tqdm, kwargs
        scores = self.scorer.score([(context, continuation) for _, context, continuation in requests])
        answers = [(s.logprob, s.greedy) for s in scores]
        for (pair, _, _), answer in zip(requests, answers):
            if pair is not None:
                self.cache_hook.add_partial('loglikelihood', pair, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        del disable_tqdm
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.eot_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, score in zip(owner, self.scorer.score(windows)):
            totals[n] += score.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial('loglikelihood_rolling', req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        del disable_tqdm
        groups: dict[str, list[int]] = {}
        for n, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(n)
        out = [''] * len(requests)
        for members in groups.values():
            settings = generation_settings(requests[members[0]].args[1], self.max_length, self.codec.eot_ids)
            for n, continuation in zip(members, self._generate([requests[n].args[0] for n in members], settings)):
                out[n] = continuation
                self.cache_hook.add_partial('generate_until', requests[n].args, continuation)
        return out

    def _generate(self, contexts: list[str], s: Generation) -> list[str]:
        """Continuations of `contexts` (one task's settings), in batches of like prompt widths."""
        keep = self.max_length - s.max_new + 1  # prompt tokens that fit with max_new new ones
        encoded = [(self.tok_encode(ctx) or [self.eot_token_id]) for ctx in contexts]
        if any(len(ids) > keep for ids in encoded):
            log.warning('lm_eval: contexts longer than %d tokens (model.seq_len %d less %d to generate) keep their '
                        'last %d tokens', keep, self.max_length, s.max_new, keep)
        encoded = [ids[-keep:] for ids in encoded]
        order = sorted(range(len(contexts)), key=lambda i: -len(encoded[i]))
        texts = [''] * len(contexts)
        rows = self.scorer.rows
        for first in range(0, len(order), rows):
            batch = order[first:first + rows]
            result = sample.continue_tokens(
                self.loaded, self.codec, [contexts[i] for i in batch], [encoded[i] for i in batch],
                max_new=s.max_new, rule=s.rule, seed=0, stops=s.until, rows=rows,
                width=scoring.width_for(len(encoded[batch[0]]), self.max_length))
            for i, continuation in zip(batch, result.texts):
                texts[i] = continuation
        return texts


@dataclasses.dataclass(frozen=True)
class Generation:
    rule: gen.Sampling
    max_new: int
    until: list[str]


def generation_settings(kwargs: dict, seq_len: int, eot_ids: tuple[int, ...]) -> Generation:
    """A task's generation keywords (`until`, `max_gen_toks`, `do_sample`, `temperature`, `top_k`, `top_p`)."""
    kwargs = dict(kwargs)
    until = kwargs.pop('until', None)
    until = [until] if isinstance(until, str) else list(until or [])
    max_new = int(kwargs.pop('max_gen_toks', kwargs.pop('max_new_tokens', DEFAULT_MAX_GEN_TOKS)))
    do_sample = bool(kwargs.pop('do_sample', False))
    temperature = float(kwargs.pop('temperature', 1.0 if do_sample else 0.0))
    rule = gen.Sampling(temperature if do_sample else 0.0, int(kwargs.pop('top_k', 0) or 0),
                        float(kwargs.pop('top_p', 1.0) or 1.0), eot_ids=eot_ids)
    if kwargs:
        log.warning('lm_eval: generation settings %s are not supported and ignored', sorted(kwargs))
    if max_new > seq_len:
        log.warning('lm_eval: max_gen_toks %d is more than model.seq_len %d: generating %d', max_new, seq_len,
                    seq_len)
    return Generation(rule, max(1, min(max_new, seq_len)), [u for u in until if u])


def batch_rows(value: int | str) -> int:
    """The harness's batch size as rows; one line for anything but a positive integer or 'auto'."""
    try:
        rows = int(value)
    except (TypeError, ValueError):
        rows = 0
    if rows < 1:
        raise UserError(f'lm_eval batch size {value!r}: must be a positive integer or auto. Fix: '
                        '--lm_eval_batch=N (or the harness\'s --batch_size N).')
    return rows


def run(config: ml_collections.ConfigDict, workdir: str, tasks: list[str], *, num_fewshot: int | None = None,
        limit: float | None = None, include_path: str = '', batch_size: int = 0, log_samples: bool = False) -> dict:
    """Scores the run on harness `tasks` (names, or YAML tasks under `include_path`); the harness's results."""
    manager = TaskManager(include_path=include_path or None)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if not tasks or unknown:
        raise UserError(f'lm_eval: unknown task(s) {unknown or tasks}. Fix: name harness tasks (lm-eval ls tasks) '
                        'in --tasks=a,b, or task YAMLs in a directory given as --lm_eval_include=DIR.')
    model = JaxFrontierLM(workdir, config, batch_size=batch_size or None)
    return evaluator.simple_evaluate(model=model, tasks=tasks, num_fewshot=num_fewshot, limit=limit or None,
                                     task_manager=manager, log_samples=log_samples, torch_random_seed=None)


def report(results: dict) -> str:
    """The harness's table, then one JSON line of every task's metrics."""
    metrics = {task: {k: v for k, v in values.items() if isinstance(v, (int, float, str))}
               for task, values in results['results'].items()}
    return lm_utils.make_table(results) + '\nlm_eval: ' + json.dumps(metrics)
