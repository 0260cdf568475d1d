"""Measured step times the time model is calibrated against: sweep, scaling or published results.

A results file is JSON lines. Two kinds of record are read:

  * a trial of `jaxfrontier.sweep` / `jaxfrontier.scaling` (docs/sweeps.md): status `ok`, the
    median of its measured steps `step_time_median_s` (or the mean `step_time_s`), its whole
    `config` (written by the sweep since calibration exists; older records are completed from
    `<dir of results.jsonl>/trials/<id>/config.json`) and the `machine` it ran on;
  * a point measured elsewhere (`"source": "published"`): a `config_file` (configs/*.py), the
    `layout` it ran (its mesh axes, e.g. `tensor`, `pipeline`, `data`, `fsdp`; `micro_batch`, `accum_steps`,
    `schedule`, `zero1`, `remat`), the `machine`, and its throughput as `step_time_s`,
    `tokens_per_s` or `hw_tflops_per_device` (Megatron's counter, f = 4 with recomputation,
    the paper's figure). `benchmarks/results/frontier_paper.jsonl` holds the paper's three.

Each becomes a `Measurement`: the planner's `Work` of the layout (hardware independent but
for the topology) and the measured seconds per step.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import statistics
import sys
from typing import Any

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier import errors
from jaxfrontier import hardware as hw_lib
from jaxfrontier import layout as layout_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.plan import planner

# A published point's layout: every mesh axis (config/axes.py), and the knobs below.
LAYOUT_FIELDS = {**{a.name: a.field for a in axes_lib.AXES},
                 'micro_batch': 'train.micro_batch', 'accum_steps': 'train.accum_steps', 'remat': 'model.remat',
                 'schedule': 'pipeline.schedule', 'virtual_stages': 'pipeline.virtual_stages',
                 'zero1': 'sharding.zero1'}
MODEL_FIELDS = ('num_layers', 'd_model', 'num_heads', 'mlp_ratio', 'seq_len', 'vocab_size')


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured layout: what the planner needs to predict it, and what was measured."""

    name: str  # trial id or published point's name
    model: str  # the model's shape, as a short key (several models need --across_models)
    machine: str
    work: planner.Work
    measured_s: float  # seconds per optimizer step
    source: str  # the results file
    repeats: tuple[float, ...] = ()  # every measurement of this layout, when it was measured more than once

    @property
    def tokens(self) -> float:
        return self.work.layout.global_batch * self.work.shape.seq_len


def _fail(path: str, line: int, what: str, fix: str) -> errors.UserError:
    what = ' '.join(what.split())  # one line, also when a value's repr is not (a ConfigDict's is YAML)
    return errors.UserError(f'--results={path}, line {line}: {what}. Fix: {fix}')


def _load_config_file(spec: str, root: str) -> ml_collections.ConfigDict:
    """`get_config()` of one of the project's config files (configs/*.py[:arg] under `root`).

    Only those: a results file someone sent must not run code of its own choosing (a
    `config_file` beside it, in the working directory or by absolute path once did).
    """
    path, _, arg = spec.partition(':')
    configs = os.path.realpath(os.path.join(root, 'configs'))
    full = os.path.realpath(os.path.join(root, path))
    if os.path.dirname(full) != configs or not full.endswith('.py') or not os.path.isfile(full):
        raise FileNotFoundError(path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(full)))
    module_spec = importlib.util.spec_from_file_location(f'_jf_measured_{abs(hash(full))}', full)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def _set(c: ml_collections.ConfigDict, layout: dict[str, Any]) -> None:
    with c.unlocked():
        for key, value in layout.items():
            section, field = LAYOUT_FIELDS[key].split('.')
            c[section][field] = value
        c.train.global_batch = c.train.micro_batch * c.train.accum_steps * config_lib.data_parallel_size(c)


def _with_defaults(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """A recorded config, with the fields added since it was written at today's defaults."""
    c = ml_collections.ConfigDict(saved)

    def fill(dst: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> None:
        for key, value in defaults.items():
            if key not in dst:
                dst[key] = value
            elif isinstance(value, ml_collections.ConfigDict) and isinstance(dst[key], ml_collections.ConfigDict):
                fill(dst[key], value)

    fill(c, config_lib.base_config())
    return c


def _trial_config(record: dict[str, Any], path: str, line: int) -> ml_collections.ConfigDict:
    if 'config' in record:
        return _with_defaults(record['config'])
    fallback = os.path.join(os.path.dirname(os.path.abspath(path)), 'trials', str(record.get('trial_id')),
                            'config.json')
    try:
        with open(fallback, encoding='utf-8') as f:
            return _with_defaults(json.load(f))
    except (OSError, ValueError):
        raise _fail(path, line, f'trial {record.get("trial_id")} has no config and {fallback} is not readable',
                    'rerun the sweep with this version (its records hold the config), or keep the trials/ '
                    'folder beside results.jsonl') from None


def _published_config(record: dict[str, Any], path: str, line: int) -> ml_collections.ConfigDict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        c = _load_config_file(str(record['config_file']), root)
    except (KeyError, FileNotFoundError):
        raise _fail(path, line, f'published point whose config_file ({record.get("config_file")!r}) is not one of '
                    'the project\'s configs/*.py (a results file runs no code of its own)',
                    'name the model\'s config, e.g. "config_file": "configs/22b.py"') from None
    unknown = sorted(set(record.get('layout', {})) - set(LAYOUT_FIELDS))
    if unknown:
        raise _fail(path, line, f'unknown layout field(s) {", ".join(unknown)}', f'use {", ".join(LAYOUT_FIELDS)}')
    _set(c, record.get('layout', {}))
    return c


STATISTICS = {'median': 'step_time_median_s', 'mean': 'step_time_s', 'min': 'step_time_min_s'}


def _measured_s(record: dict[str, Any], work: planner.Work, path: str, line: int, statistic: str) -> float:
    devices, tokens = work.layout.num_devices, work.layout.global_batch * work.shape.seq_len
    def positive(key: str) -> float:
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise _fail(path, line, f'{key} = {value!r} is not a positive number', f'give {key} in its unit')
        return float(value)

    for key in (STATISTICS[statistic], 'step_time_s'):  # records of older sweeps have the mean only
        if record.get(key):
            return positive(key)
    if record.get('tokens_per_s'):
        return tokens / positive('tokens_per_s')
    if record.get('hw_tflops_per_device'):
        return work.flops.megatron_hw / (devices * positive('hw_tflops_per_device') * 1e12)
    raise _fail(path, line, 'no measured throughput', 'give step_time_s, tokens_per_s or hw_tflops_per_device')


def model_key(c: ml_collections.ConfigDict) -> str:
    m = c.model
    return 'L{} d{} h{} mlp{} s{} V{}'.format(*(m[f] for f in MODEL_FIELDS))


def _measurement(record: dict[str, Any], path: str, line: int, hw: hw_lib.Hardware, statistic: str) -> Measurement:
    try:
        return _read_measurement(record, path, line, hw, statistic)
    except (TypeError, AttributeError, KeyError, ValueError, ZeroDivisionError, OverflowError) as e:
        if isinstance(e, errors.UserError):
            raise
        problem = ' '.join(f'{type(e).__name__}: {e}'.split())[:200]  # a record someone wrote by hand or cut
        raise _fail(path, line, f'the record cannot be read as a measurement ({problem})',
                    'give a record a sweep or scaling study wrote, or a published point as in '
                    'benchmarks/results/frontier_paper.jsonl') from None


def _read_measurement(record: dict[str, Any], path: str, line: int, hw: hw_lib.Hardware,
                      statistic: str) -> Measurement:
    published = record.get('source') == 'published'
    c = _published_config(record, path, line) if published else _trial_config(record, path, line)
    try:
        config_lib.validate(c)
    except errors.UserError as e:
        raise _fail(path, line, f'its config is not valid ({e})', 'give a layout the trainer accepts') from None
    work = planner.layout_work(config_lib.model_shape(c), layout_lib.Layout.from_config(c), hw, rules=c.sharding.rules)
    name = str(record.get('name') or record.get('trial_id') or f'line {line}')
    return Measurement(name, model_key(c), str(record.get('machine', 'unknown machine')), work,
                       _measured_s(record, work, path, line, statistic), path)


def _records(path: str) -> list[tuple[int, dict[str, Any]]]:
    try:
        with open(path, encoding='utf-8') as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise errors.UserError(f'--results={path}: {e.strerror}. Fix: give a results.jsonl of a sweep, a scaling '
                               'study or published points') from None
    except UnicodeDecodeError as e:
        raise errors.UserError(f'--results={path}: not UTF-8 text (byte {e.start}). Fix: give a results.jsonl of a '
                               'sweep, a scaling study or published points') from None
    out = []
    for i, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except (ValueError, RecursionError):
            raise _fail(path, i, 'not a JSON record', 'give a results.jsonl (one JSON object per line)') from None
        if not isinstance(record, dict):
            raise _fail(path, i, 'not a JSON object', 'give a results.jsonl (one JSON object per line)')
        out.append((i, record))
    return out


def combine_repeats(ms: list[Measurement]) -> list[Measurement]:
    """Repeated measurements of one layout of one model become one: the median of their step times.

    (Held out, a repeat left in the fit would predict its twin.)
    """
    groups: dict[tuple[str, layout_lib.Layout], list[Measurement]] = {}
    for m in ms:
        groups.setdefault((m.model, m.work.layout), []).append(m)
    out = []
    for group in groups.values():
        name = group[0].name + (f' (+{len(group) - 1} repeats)' if len(group) > 1 else '')
        out.append(dataclasses.replace(group[0], name=name, measured_s=statistics.median(m.measured_s for m in group),
                                       repeats=tuple(m.measured_s for m in group) if len(group) > 1 else ()))
    return out


def load(paths: list[str], hw: hw_lib.Hardware, across_models: bool = False,
         statistic: str = 'median') -> list[Measurement]:
    """Every usable measurement of `paths` (trials with status ok, published points).

    A trial's step time is the median of its measured steps (`statistic`: or their mean, or
    the fastest): on a shared machine one slow step, another job's, should not move it.

    Raises:
      UserError: no paths or no usable measurement; a record that cannot be read; measurements of
        several machines, or of several models without `across_models`.
    """
    if not paths:
        raise errors.UserError('--results is required: the results.jsonl of a sweep, a scaling study or published '
                               'points. Fix: pass --results=workdirs/sweep/results.jsonl')
    out = []
    for path in paths:
        for line, record in _records(path):
            if record.get('source') == 'published' or record.get('status') == 'ok':
                out.append(_measurement(record, path, line, hw, statistic))
    out = combine_repeats(out)
    if not out:
        raise errors.UserError(f'--results={",".join(paths)}: no measured step times (no trial with status ok, no '
                               'published point). Fix: give the results of a sweep whose trials ran')
    machines = sorted({m.machine for m in out})
    if len(machines) > 1:
        raise errors.UserError(f'--results: measurements of {len(machines)} machines mixed ({"; ".join(machines)}): '
                               'one calibration describes one machine. Fix: calibrate each machine on its own results')
    models = sorted({m.model for m in out})
    if len(models) > 1 and not across_models:
        raise errors.UserError(f'--results: measurements of {len(models)} models mixed ({"; ".join(models)}). Fix: '
                               'give one model\'s results, or pass --across_models to fit them together')
    return out
