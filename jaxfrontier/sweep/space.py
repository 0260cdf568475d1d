"""Search spaces of a throughput sweep: parsing, checking, enumeration and the config of one point.

A space maps parameter names to the values to try. The names are the knobs of the paper's
search plus any model field:

  every mesh axis but data (config/axes.py; e.g. tensor, fsdp), zero1, sequence_parallel,
  micro_batch, accum_steps, global_batch, remat, schedule, virtual_stages, attention, size (a row of
  config.MODEL_SIZES), model.<field> (e.g. model.d_model)

Written on the command line as `--space tensor=1,2,4 --space remat=full,none` or as a JSON file
`{"tensor": [1, 2, 4], "remat": ["full", "none"]}`.

How a point becomes a layout on D devices (`point_config`):
  * data = D / (the product of every other mesh axis): the replica axis takes the devices left over
    (`Axis.replica`);
  * when accum_steps is swept, the global batch follows: micro_batch x accum_steps x the data-parallel
    size (data x fsdp; the batch grows with it);
  * otherwise the global batch is kept (the base config's, or the swept global_batch) and
    accum_steps = global_batch / (micro_batch x data x fsdp), Megatron's rule.
A point whose layout breaks a rule of `config.validate` is a trial with status `invalid`.

No JAX here: the sweep's parent process plans and launches, it does not compute.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
from typing import Any, Sequence

import ml_collections

from jaxfrontier import config as config_lib
from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import ConfigError, SpaceError, UserError


@dataclasses.dataclass(frozen=True)
class Param:
    """A named knob: the config field it sets, its type and, for names, the allowed values."""

    path: str  # config field ('' for size, which sets three)
    kind: type
    choices: tuple[str, ...] = ()
    help: str = ''


PARAMS = {
    # Every mesh axis but the replica axis (data), which takes the devices the others leave.
    **{a.name: Param(a.field, int, help=a.help) for a in axes_lib.others()},
    'zero1': Param('sharding.zero1', bool, help='ZeRO-1: optimizer state sharded over data-parallel axes'),
    'sequence_parallel': Param('sharding.sequence_parallel', str, config_lib.SEQUENCE_PARALLEL,
                               'sequence-parallelism setting (true: the residual stream split over tensor)'),
    'micro_batch': Param('train.micro_batch', int, help='sequences per replica per accumulation step'),
    'accum_steps': Param('train.accum_steps', int, help='accumulation steps (pipeline micro-batches); '
                         'the global batch then follows'),
    'global_batch': Param('train.global_batch', int, help='sequences per step; accum_steps then follows'),
    'remat': Param('model.remat', str, config_lib.REMAT_POLICIES, 'activation recomputation policy'),
    'schedule': Param('pipeline.schedule', str, config_lib.PIPELINE_SCHEDULES, 'pipeline schedule'),
    'virtual_stages': Param('pipeline.virtual_stages', int, help='chunks per stage (interleaved schedule)'),
    'attention': Param('model.attention', str, config_lib.ATTENTION_IMPLS, 'attention kernel'),
    'size': Param('', str, tuple(config_lib.MODEL_SIZES), 'model size: layers, hidden size and heads'),
}
_SIZE_FIELDS = ('model.num_layers', 'model.d_model', 'model.num_heads')
# Fields a point sets, beyond its own parameters: derived by point_config.
DERIVED = (axes_lib.replica().field, 'train.accum_steps', 'train.global_batch')

Space = tuple[tuple[str, tuple[Any, ...]], ...]


def param_for(name: str) -> Param:
    """The Param of a name: a PARAMS entry or `model.<field>` of the base config."""
    if name in PARAMS:
        return PARAMS[name]
    model = config_lib.base_config().model
    field = name.split('.', 1)[1] if name.startswith('model.') else ''
    if field in model and field not in ('remat', 'attention'):
        return Param(name, type(model[field]), help=f'config.{name}')
    fields = ', '.join(k for k in model if k not in ('remat', 'attention'))
    known = f'{", ".join(PARAMS)}, model.<field> ({fields})'
    raise SpaceError(name, '...', 'unknown parameter', f'use one of: {known}')


def _convert(name: str, p: Param, raw: Any) -> Any:
    text = str(raw).strip()
    try:
        if p.kind is bool:
            if isinstance(raw, bool) or text.lower() in ('true', 'false', '1', '0', 'yes', 'no'):
                return raw if isinstance(raw, bool) else text.lower() in ('true', '1', 'yes')
            raise ValueError(text)
        if p.kind is int and isinstance(raw, float) and not raw.is_integer():
            raise ValueError(text)
        value = p.kind(raw) if not isinstance(raw, str) else p.kind(text)
    except ValueError:
        raise SpaceError(name, raw, f'is not a {p.kind.__name__}', f'give {name} {p.kind.__name__} values') from None
    if p.choices and value not in p.choices:
        raise SpaceError(name, value, f'unknown {p.help or name}', f'use values from {list(p.choices)}')
    if p.kind is int and value < 1:
        raise SpaceError(name, value, 'must be a positive integer', f'give {name} values >= 1')
    return value


def _parse_item(item: str) -> tuple[str, list[str]]:
    name, sep, values = item.partition('=')
    if not sep or not name.strip():
        raise SpaceError(item, '', 'is not NAME=V1,V2,...', 'write e.g. --space tensor=1,2,4')
    return name.strip(), [v for v in values.split(',') if v.strip()]


def parse_space(items: Sequence[str] = (), json_text: str = '', source: str = '--space_file') -> Space:
    """Parses `--space NAME=V1,V2` items and a JSON object of NAME -> list of values into a Space.

    Raises:
      SpaceError: an empty space, an unknown name, an empty or repeated value list, a value of the
        wrong type, a name given twice with different values, or contradictory parameters.
    """
    raw: list[tuple[str, list[Any]]] = []
    if json_text:
        try:
            data = json.loads(json_text)
        except json.JSONDecodeError as e:
            raise UserError(f'{source}: not JSON ({e}). Fix: write an object like '
                                       '{"tensor": [1, 2], "remat": ["full", "none"]}') from None
        if not isinstance(data, dict):
            raise UserError(f'{source}: must be a JSON object of name -> list of values')
        raw += [(k, v if isinstance(v, list) else [v]) for k, v in data.items()]
    raw += [_parse_item(item) for item in items]
    if not raw:
        raise SpaceError('', '', 'the search space is empty', 'give --space NAME=V1,V2 (e.g. tensor=1,2) or '
                         '--space_file with a JSON object of name -> values')
    space: dict[str, tuple[Any, ...]] = {}
    for name, values in raw:
        p = param_for(name)
        if not values:
            raise SpaceError(name, '', 'has no values', f'list at least one value for {name}')
        typed = tuple(_convert(name, p, v) for v in values)
        if len(set(typed)) != len(typed):
            raise SpaceError(name, ','.join(map(str, values)), 'lists a value twice', 'list each value once')
        if name in space and space[name] != typed:
            raise SpaceError(name, ','.join(map(str, values)), f'is given twice, also as {list(space[name])}',
                             'give each parameter once')
        space[name] = typed
    _check_contradictions(space)
    return tuple(space.items())


def _check_contradictions(space: dict[str, tuple[Any, ...]]) -> None:
    if 'accum_steps' in space and 'global_batch' in space:
        raise SpaceError('accum_steps', list(space['accum_steps']), 'contradicts global_batch: with micro_batch '
                         'and the data-parallel size, either one fixes the other',
                         'sweep accum_steps (the global batch follows) or global_batch (accumulation follows)')
    sized = [f for f in _SIZE_FIELDS if f in space]
    if 'size' in space and sized:
        raise SpaceError(sized[0], list(space[sized[0]]), 'contradicts size, which sets layers, hidden size and '
                         'heads', f'sweep either size or {", ".join(sized)}')


def check_fixed(space: Space, overridden: Sequence[str]) -> None:
    """Fails when a --config.* override fixes a field the space sweeps or the sweep derives."""
    names = dict(space)
    for path in overridden:
        swept = [n for n in names if param_for(n).path == path or (n == 'size' and path in _SIZE_FIELDS)]
        if swept:
            raise SpaceError(swept[0], list(names[swept[0]]), f'is swept, but --config.{path} also fixes it',
                             f'drop --config.{path} or the --space entry')
        if path in DERIVED and not (path == 'train.global_batch' and 'accum_steps' not in names):
            raise SpaceError(path, '', f'--config.{path} is derived for every point ({__name__} docstring)',
                             'drop the override; sweep accum_steps or global_batch instead')


def size(space: Space) -> int:
    return math.prod(len(v) for _, v in space)


def grid(space: Space) -> list[dict[str, Any]]:
    """Every point of the space, in order (the last parameter varies fastest)."""
    names = [n for n, _ in space]
    return [dict(zip(names, values)) for values in itertools.product(*(v for _, v in space))]


def random_order(space: Space, seed: int) -> list[dict[str, Any]]:
    """Every point of the space, shuffled by `seed` (random search without repeats)."""
    points = grid(space)
    random.Random(seed).shuffle(points)
    return points


def point_config(base: ml_collections.ConfigDict, point: dict[str, Any], devices: int,
                 swept: Sequence[str]) -> tuple[ml_collections.ConfigDict, dict[str, Any]]:
    """The config of one point on `devices` devices, and the fields it sets (path -> value).

    Raises:
      ConfigError: the point has no valid layout on `devices` (the trial is `invalid`).
    """
    c = ml_collections.ConfigDict(base.to_dict())
    sets: dict[str, Any] = {}
    if 'size' in point:
        sets.update(zip(_SIZE_FIELDS, config_lib.MODEL_SIZES[point['size']]))
    sets.update({param_for(n).path: v for n, v in point.items() if n != 'size'})
    for path, value in sets.items():
        section, field = path.split('.')
        c[section][field] = value
    model_parallel = axes_lib.product(c.mesh, axes_lib.others())
    if devices % model_parallel:
        raise ConfigError(
            'mesh', ' x '.join(f'{a.name} {c.mesh[a.name]}' for a in axes_lib.others()),
            f'{model_parallel} devices per data-parallel replica do not divide the {devices} devices of a trial',
            'sweep sizes whose product divides --devices')
    c.mesh[axes_lib.replica().name] = devices // model_parallel
    rows = c.train.micro_batch * config_lib.data_parallel_size(c)
    if 'accum_steps' in swept:
        c.train.global_batch = rows * c.train.accum_steps
    elif c.train.global_batch % rows:
        raise ConfigError(
            'train.global_batch', c.train.global_batch,
            f'is not a multiple of micro_batch {c.train.micro_batch} x data-parallel size '
            f'{config_lib.data_parallel_size(c)} = {rows}, so no whole number of accumulation steps fits',
            'sweep micro-batch sizes that divide the global batch per replica, or sweep accum_steps instead')
    else:
        c.train.accum_steps = c.train.global_batch // rows
    for path in (*(a.field for a in axes_lib.AXES), 'train.micro_batch', 'train.accum_steps', 'train.global_batch'):
        section, field = path.split('.')
        sets[path] = c[section][field]
    config_lib.validate(c, devices)
    return c, sets


def describe_model(c: ml_collections.ConfigDict) -> str:
    """A short model name: the MODEL_SIZES row it matches, else layers and hidden size."""
    shape = (c.model.num_layers, c.model.d_model, c.model.num_heads)
    named = [k for k, v in config_lib.MODEL_SIZES.items() if v == shape]
    return named[0] if named else f'L{c.model.num_layers} d{c.model.d_model}'


def layout_of(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """The layout fields a result record keeps, read from a trial's config."""
    return {
        'model': describe_model(c), **config_lib.mesh_shape(c), 'zero1': bool(c.sharding.zero1),
        'sequence_parallel': config_lib.sequence_parallel(c.sharding.sequence_parallel, c.mesh.tensor),
        'micro_batch': c.train.micro_batch, 'accum_steps': c.train.accum_steps, 'global_batch': c.train.global_batch, 'remat': c.model.remat,
        'schedule': c.pipeline.schedule if c.mesh.pipeline > 1 else '-',
        'virtual_stages': c.pipeline.virtual_stages, 'attention': c.model.attention, 'dtype': c.model.dtype,
        'seq_len': c.model.seq_len,
    }
