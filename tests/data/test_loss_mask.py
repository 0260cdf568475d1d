"""A token file's loss mask (docs/data.md): the NAME.mask.bin sidecar written and checked, the
loader's flag bit (data/loss_mask.py) on the tokens whose prediction does not count, and
`data.loss_mask` resolved from the headers ('auto' -> 'on' / 'off'); old files read as before."""

import json
import os

import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, loss_mask, token_files
from jaxfrontier.errors import ConfigError

SEQ = 16


def _file(tmp_path, name='d', n=400, masked=True, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 250, n)
    mask = np.repeat(rng.random(n // 8 + 1) < 0.5, 8)[:n].astype(np.uint8) if masked else None
    return token_files.write_token_file(tmp_path / f'{name}.bin', tokens, 250, mask=mask), tokens, mask


def _config(**data):
    c = config_lib.base_config()
    c.model.update(vocab_size=250, seq_len=SEQ)
    c.train.update(global_batch=4, micro_batch=4)
    c.data.update(**{'kind': 'tokens', 'val_fraction': 0.1, **data})
    return c


def test_flag_bit_round_trip():
    ids = np.array([0, 7, 249, (1 << 30) - 1], np.int32)
    flagged = loss_mask.mark(ids, np.array([1, 0, 1, 0], np.uint8))
    np.testing.assert_array_equal(flagged, [0, 7 | (1 << 30), 249, (1 << 31) - 1])
    np.testing.assert_array_equal(loss_mask.token_ids(flagged), ids)
    np.testing.assert_array_equal(loss_mask.counted(flagged), [True, False, True, False])
    assert flagged.dtype == np.int32 and flagged.min() >= 0  # bit 30 fits int32's positive range


def test_mask_is_written_named_and_read_back(tmp_path):
    path, tokens, mask = _file(tmp_path)
    header = json.load(open(tmp_path / 'd.json'))
    assert header['loss_mask'] == 'd.mask.bin'
    assert (tmp_path / 'd.mask.bin').read_bytes() == mask.tobytes()
    opened = token_files.open_token_file(path, 250)
    np.testing.assert_array_equal(opened.mask, mask)
    plain = token_files.open_token_file(_file(tmp_path, 'p', masked=False)[0], 250)
    assert plain.mask is None and 'loss_mask' not in plain.header  # old files: no mask, as before
    with pytest.raises(ValueError, match='one 0 or 1 per token'):
        token_files.write_token_file(tmp_path / 'bad.bin', tokens, 250, mask=mask[:-1])
    with pytest.raises(ValueError, match='one 0 or 1 per token'):
        token_files.write_token_file(tmp_path / 'bad.bin', tokens, 250, mask=mask * 2)


@pytest.mark.parametrize('damage,words', [
    (lambda t: os.remove(t / 'd.mask.bin'), 'is missing'),
    (lambda t: (t / 'd.mask.bin').write_bytes(b'\x01' * 399), 'has 399 bytes but the file holds 400 tokens'),
    (lambda t: (t / 'd.mask.bin').write_bytes(b'\x01' * 10 + b'\x02' + b'\x00' * 389), 'holds 2 at position 10'),
    (lambda t: (t / 'd.json').write_text(json.dumps({**json.load(open(t / 'd.json')), 'loss_mask': 3})),
     '"loss_mask" is 3'),
    # the name is a file beside the .bin: no line break (the CI fuzzer's case), no directory, no escape upwards
    *[(lambda t, name=name: (t / 'd.json').write_text(json.dumps({**json.load(open(t / 'd.json')), 'loss_mask': name})),
       f'"loss_mask" is {name!r}') for name in ('\n', 'd.mask.bin\n', 'sub/d.mask.bin', '..', '/etc/passwd')],
])
def test_a_damaged_mask_is_one_config_error(tmp_path, damage, words):
    path = _file(tmp_path)[0]
    damage(tmp_path)
    with pytest.raises(ConfigError) as e:
        token_files.open_token_file(path, 250)
    assert e.value.field == 'data.path' and words in str(e.value) and '\n' not in str(e.value)


def test_the_loader_flags_the_tokens_the_mask_leaves_out(tmp_path):
    path, tokens, mask = _file(tmp_path)
    c = _config(path=path)
    loader.resolve_headers(c)
    assert c.data.loss_mask == 'on'
    train, val = loader.make_datasets(c.data, str(tmp_path), loader.BatchSpec.of(c))
    rows = train.read_rows(0, np.arange(4), 4)
    starts = train.offsets(0, 4)
    for row, start in zip(rows, starts):
        np.testing.assert_array_equal(loss_mask.token_ids(row), tokens[start:start + SEQ + 1])
        np.testing.assert_array_equal(loss_mask.counted(row), mask[start:start + SEQ + 1] == 1)
    assert 'with its loss mask' in train.describe() and val.mask is not None
    c.data.loss_mask = 'off'  # the user's choice: every prediction counts, no flag
    rows = loader.make_datasets(c.data, str(tmp_path), loader.BatchSpec.of(c))[0].read_rows(0, np.arange(4), 4)
    assert np.all(loss_mask.counted(rows))


def test_auto_resolves_from_the_headers(tmp_path):
    masked, plain = _file(tmp_path)[0], _file(tmp_path, 'p', masked=False)[0]
    c = _config(path=plain)
    loader.resolve_headers(c)
    assert c.data.loss_mask == 'off'
    c = _config(blend=f'1:{plain},1:{masked}')  # a blend of pre-training and SFT data: the mask where there is one
    loader.resolve_headers(c)
    assert c.data.loss_mask == 'on'
    blend = loader.make_datasets(c.data, str(tmp_path), loader.BatchSpec.of(c))[0]
    assert blend.sources[0].mask is None and blend.sources[1].mask is not None
    c = _config(path=plain, val_path=masked)  # held-out conversations of a masked file
    loader.resolve_headers(c)
    assert c.data.loss_mask == 'on'
    c = _config(kind='builtin')
    loader.resolve_loss_mask(c)
    assert c.data.loss_mask == 'off'


@pytest.mark.parametrize('data,vocab,field,words', [
    (dict(loss_mask='on', path='{plain}'), 250, 'data.loss_mask', 'carries a loss mask'),
    (dict(loss_mask='auto', path='{masked}'), (1 << 30) + 1, 'model.vocab_size', 'bit 30'),
])
def test_what_cannot_be_masked_is_one_config_error(tmp_path, data, vocab, field, words):
    paths = {'plain': _file(tmp_path, 'p', masked=False)[0], 'masked': _file(tmp_path)[0]}
    c = _config(**{k: v.format(**paths) for k, v in data.items()})
    c.model.vocab_size = vocab
    with pytest.raises(ConfigError) as e:
        loader.resolve_headers(c)
    assert e.value.field == field and words in str(e.value) and '\n' not in str(e.value)


def test_an_unknown_setting_is_refused():
    c = config_lib.base_config()
    c.data.loss_mask = 'assistant'
    with pytest.raises(ConfigError, match='data.loss_mask'):
        config_lib.validate(c)


def test_a_broken_header_is_named_by_its_field(tmp_path):
    masked = _file(tmp_path)[0]
    broken = _file(tmp_path, 'b', masked=False)[0]
    (tmp_path / 'b.json').write_text('{')
    for data, field in ((dict(path=masked, val_path=broken), 'data.val_path'),
                        (dict(blend=f'1:{masked},1:{broken}'), 'data.blend')):
        with pytest.raises(ConfigError) as e:
            loader.resolve_loss_mask(_config(**data))
        assert e.value.field == field and 'b.json' in str(e.value)
