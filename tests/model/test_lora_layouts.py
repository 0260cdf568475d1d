"""LoRA on every layout it runs on computes what one device computes (tests/layout_check.py's tolerances).

The base is frozen and sharded as without LoRA; the adapters shard as their weights do (the rank dimension
whole). Per layout: step 0's loss, the adapters' step-0 gradients (read back from Adam's first moment,
tests/layout_once.py) and the adapters after 3 optimizer steps, against one device. b starts at zero, so
a's first gradient is zero and a trains from step 1 on: the 3 steps cover both. Targets adapt a fused
weight in part (Llama's w_kv: v only; GPT's w_qkv: q and v) and a row-parallel one (o). Fast tier: the
Llama data 2 x fsdp 2 x tensor 2 case; slow: the rest (pipelines are refused by config.validate).
"""

import pytest

from jaxfrontier import config as config_lib
from layout_check import LLAMA, check_against_reference, make_config
from layout_once import run_layout_once

TARGETS = {'llama': 'q,v,o,down', 'gpt': 'q,v,o,up'}
FAMILIES = {'llama': LLAMA, 'gpt': {}}


def lora_config(family: str, **layout):
    c = make_config(**layout, **FAMILIES[family])
    c.lora.update(rank=4, alpha=8.0, targets=TARGETS[family])
    config_lib.validate(c, config_lib.num_devices(c))
    return c


_REFERENCES = {}


def reference(family: str, accum: int):
    if (family, accum) not in _REFERENCES:
        _REFERENCES[family, accum] = run_layout_once(lora_config(family, accum=accum))
    return _REFERENCES[family, accum]


LAYOUTS = {
    'llama_d2_f2_t2': ('llama', dict(data=2, fsdp=2, tensor=2)),
    'llama_f8': ('llama', dict(fsdp=8)),
    'llama_d8_accum2': ('llama', dict(data=8, accum=2)),
    'llama_t2_zero1_d4': ('llama', dict(data=4, tensor=2, zero1=True)),
    'llama_c2_t2': ('llama', dict(context=2, tensor=2)),
    'gpt_d2_f2_t2': ('gpt', dict(data=2, fsdp=2, tensor=2)),
    'gpt_c2_f2_accum2': ('gpt', dict(context=2, fsdp=2, accum=2)),
}
FAST = set()  # all slow (~25 s each); the fast tier keeps LoRA's one-device checks (test_lora.py)


@pytest.mark.parametrize('case', [pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in LAYOUTS])
def test_lora_layout_equals_one_device(case):
    family, layout = LAYOUTS[case]
    result = run_layout_once(lora_config(family, **layout))
    loss, grads, adapters = result
    assert set(grads['blocks']) and all(k.endswith(('_lora_a', '_lora_b')) for k in _leaf_names(adapters))
    check_against_reference(result, reference(family, layout.get('accum', 1)))


def _leaf_names(tree, prefix=''):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_names(value, prefix + key + '/')
        else:
            yield key
