"""`--mode=eval` of a DPO run (inference/evaluate_dpo.py): a held-out file that is not one of preference pairs, or
of another row length, is one line naming --eval_path or the run's data.val_path (its metrics against the loop's
eval/dpo/* are held by tests/post_training/test_dpo_journey.py)."""

import types

import numpy as np
import pytest

from jaxfrontier.data import token_files
from jaxfrontier.errors import UserError
from jaxfrontier.inference import evaluate_dpo


def loaded(val_path='', seq_len=8):
    config = types.SimpleNamespace(model=types.SimpleNamespace(vocab_size=64, seq_len=seq_len))
    return types.SimpleNamespace(config=config, run_config={'train': {'objective': 'dpo'},
                                                            'data': {'val_path': val_path}})


def test_a_file_that_is_not_pairs_is_one_line(tmp_path):
    stream = token_files.write_token_file(tmp_path / 'stream', np.arange(40) % 64, 64)
    assert evaluate_dpo.is_dpo(loaded())
    with pytest.raises(UserError) as e:
        evaluate_dpo._pairs(loaded(), stream)  # pylint: disable=protected-access
    assert str(e.value).startswith(f'--eval_path={stream}: ') and 'prepare --dpo' in str(e.value)
    assert '\n' not in str(e.value) and 'data.path' not in str(e.value)
    with pytest.raises(UserError) as e:
        evaluate_dpo._pairs(loaded(val_path=stream), '')  # pylint: disable=protected-access
    assert str(e.value).startswith(f"the run's data.val_path {stream}: ")
    with pytest.raises(UserError, match='no held-out pairs'):
        evaluate_dpo._pairs(loaded(), '')  # pylint: disable=protected-access
