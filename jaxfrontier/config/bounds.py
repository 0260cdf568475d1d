"""Rules of `config.validate` for numbers an override can set to anything (found by tests/fuzz).

`--config.model.init_std=nan` trained NaN parameters; `--config.model.seq_len=4611686018427387904`
(2^62) passed validation and hung the planner (and would hang the trainer's set-up) counting
attention blocks. `problems(c)` lists (field, value, problem, fix) for every float that must be
finite and in range and every size beyond what any model on any machine uses; `config.validate`
raises the first as a ConfigError. No JAX; imports nothing of ours, so config.py can call it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

# Sizes no model trained on any machine reaches; above them set-up loops or overflows.
MAX_SIZES = {'model.seq_len': 2**24, 'model.d_model': 2**20, 'model.num_layers': 2**16, 'model.num_heads': 2**16,
             'model.mlp_ratio': 2**10, 'model.vocab_size': 2**32, 'model.vocab_multiple': 2**16,
             'model.attention_block_q': 2**24, 'model.attention_block_kv': 2**24, 'train.global_batch': 2**31,
             'train.micro_batch': 2**31, 'train.accum_steps': 2**31, 'pipeline.virtual_stages': 2**16,
             'model.mlp_dim': 2**24, 'data.eot_id': 2**32}
# Floats: the range each must lie in (all finite), and a usual value.
FLOAT_RANGES = {'model.init_std': (0.0, math.inf, 0.02), 'optim.eps': (0.0, math.inf, 1e-8),
                'optim.weight_decay': (0.0, math.inf, 0.1), 'optim.clip_norm': (0.0, math.inf, 1.0),
                'data.val_fraction': (0.0, 1.0, 0.02), 'optim.decay_fraction': (0.0, 1.0, 0.2),
                'train.hang_factor': (0.0, math.inf, 10.0), 'train.hang_min_s': (0.0, math.inf, 120.0),
                'train.hang_timeout_s': (0.0, math.inf, 1800.0),
                'train.straggler_factor': (0.0, math.inf, 1.5)}


def _get(c: Any, dotted: str) -> Any:
    section, field = dotted.split('.')
    return c[section][field] if section in c and field in c[section] else None


def problems(c: Any, defaults: Any, max_sizes: Mapping[str, int] = MappingProxyType({})
             ) -> Iterator[tuple[str, Any, str, str]]:
    """(field, value, problem, fix) of each rule `c` breaks; `defaults` is config.base_config(), `max_sizes`
    more of MAX_SIZES (the model families' own fields, `Family.max_sizes`)."""
    for section, sub in defaults.items():  # ml_collections lets an override set any field to None
        if not hasattr(sub, 'items'):
            if sub is not None and section in c and c[section] is None:
                yield section, None, 'must not be None', f'set it to a value like its default {sub!r}'
            continue
        if section not in c or not hasattr(c[section], 'items'):
            continue
        for field, default in sub.items():
            value = c[section][field] if field in c[section] else None
            if default is not None and field in c[section] and value is None:
                yield (f'{section}.{field}', None, 'must not be None',
                       f'set it to a value like its default {default!r}, or leave it out')
            # Every float field is a finite number (a lease, a timeout, a factor, a rate): inf and NaN are
            # never a setting, whatever range a field's own check then asks for.
            if (isinstance(default, float) and isinstance(value, float) and not math.isfinite(value)
                    and f'{section}.{field}' not in FLOAT_RANGES):
                yield (f'{section}.{field}', value, 'must be a finite number',
                       f'set {section}.{field} to a number like its default {default!r}')
    for field, limit in (MAX_SIZES | dict(max_sizes)).items():
        value = _get(c, field)
        if isinstance(value, int) and value > limit:
            yield field, value, f'exceeds {limit:,}, beyond any model this trains', f'set {field} to a real size'
    for field, (low, high, example) in FLOAT_RANGES.items():
        value = _get(c, field)
        if isinstance(value, (int, float)) and not (math.isfinite(value) and low <= value <= high):
            yield (field, value, f'must be a finite number in [{low}, {high}]',
                   f'set {field} to e.g. {example}')
