"""The JSON saved with every checkpoint step (`<step>/meta`), checked before anything reads its fields.

Export, sample, eval and init_params_from read another run's checkpoint: its `meta` gives the
step and the saved config whose model shape, mesh and pipeline the readers adopt. A meta with
the right `format` but a missing or mistyped field (a hand-edited or damaged file) ended in a
KeyError or TypeError traceback deep in a reader. `check(meta, where)` holds the fields every
reader uses and raises one line naming the field; the fuzz suite feeds it mutated metas.
"""

from __future__ import annotations

import json
from typing import Any

from jaxfrontier.config import axes as axes_lib
from jaxfrontier.errors import CheckpointError

POSITIVE_MODEL_FIELDS = ('num_layers', 'd_model', 'num_heads', 'seq_len', 'vocab_size', 'mlp_ratio', 'vocab_multiple')
# Every mesh axis (config/axes.py) is a positive integer. Axes added later (`Axis.optional`: context) may be
# missing: a checkpoint written before them lacks the field (and ran at size 1).
POSITIVE_MESH_FIELDS = tuple(a.name for a in axes_lib.AXES if not a.optional)
OPTIONAL_MESH_FIELDS = tuple(a.name for a in axes_lib.AXES if a.optional)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _complaint(what: str, fix: str):
    """`bad(field, value, want) -> CheckpointError`: one line naming the field, its value (cut to 80
    characters) and what it should be."""
    def bad(field: str, value: Any, want: str) -> CheckpointError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + '...'
        return CheckpointError(f'{what} has {field} = {shown}, {want}; {fix}')
    return bad


def check(meta: Any, where: str) -> dict[str, Any]:
    """Returns `meta` when the fields the readers use are there and well typed; else one CheckpointError line."""
    bad = _complaint(f'{where}: its saved meta', 'the checkpoint is damaged or was edited. Fix: use another step '
                     'directory of the run (or retrain).')

    step = meta.get('step')
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise bad('step', step, 'not an integer >= 0')
    check_config(meta.get('config'), bad)
    return meta


def parse_config(text: str, where: str) -> dict[str, Any]:
    """The saved config in a safetensors file's metadata (export's `config`), parsed and checked."""
    bad = _complaint(f'{where}: its metadata', 'the file is damaged or was edited. Fix: export it again with '
                     '--mode=export, or use a file without that metadata.')
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        raise bad('config', text, 'not JSON') from None
    check_config(config, bad)
    return config


def check_config(config: Any, bad) -> None:
    """The fields of a saved config that readers use; `bad(field, value, want)` makes the error."""
    if not isinstance(config, dict):
        raise bad('config', config, 'not an object')
    for section in ('model', 'mesh', 'pipeline'):
        if not isinstance(config.get(section), dict):
            raise bad(f'config.{section}', config.get(section), 'not an object')
    model, mesh = config['model'], config['mesh']
    for field in POSITIVE_MODEL_FIELDS:
        if not _positive_int(model.get(field)):
            raise bad(f'config.model.{field}', model.get(field), 'not a positive integer')
    if model['d_model'] % model['num_heads']:
        raise bad('config.model.num_heads', model['num_heads'], f'not dividing d_model {model["d_model"]}')
    if not isinstance(model.get('tied_embeddings'), bool):
        raise bad('config.model.tied_embeddings', model.get('tied_embeddings'), 'not true or false')
    init_std = model.get('init_std')
    if not isinstance(init_std, (int, float)) or isinstance(init_std, bool) or not init_std >= 0:
        raise bad('config.model.init_std', init_std, 'not a number >= 0')
    for field in POSITIVE_MESH_FIELDS:
        if not _positive_int(mesh.get(field)):
            raise bad(f'config.mesh.{field}', mesh.get(field), 'not a positive integer')
    for field in OPTIONAL_MESH_FIELDS:
        if field in mesh and not _positive_int(mesh[field]):
            raise bad(f'config.mesh.{field}', mesh[field], 'not a positive integer')
    virtual = config['pipeline'].get('virtual_stages')
    if not _positive_int(virtual):
        raise bad('config.pipeline.virtual_stages', virtual, 'not a positive integer')
    if mesh['pipeline'] > 1 and model['num_layers'] % (mesh['pipeline'] * virtual):
        raise bad('config.model.num_layers', model['num_layers'],
                  f'not divisible by pipeline {mesh["pipeline"]} x virtual stages {virtual}')
    if not isinstance(config.get('data', {}), dict):
        raise bad('config.data', config.get('data'), 'not an object')
