"""Epochs without replacement, blends of token files and the vocabulary from the header (docs/data.md)."""

import json
import os

import numpy as np
import pytest

from jaxfrontier import config as config_lib
from jaxfrontier.data import loader, token_files
from jaxfrontier.data import sampling
from jaxfrontier.errors import ConfigError
import processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ_LEN, BATCH = 7, 10
VOCAB = 6000


def _config(path='', blend='', vocab_size=VOCAB, seed=0, global_batch=BATCH):
    c = config_lib.base_config()
    c.data.kind, c.data.path, c.data.blend, c.data.val_fraction = 'tokens', str(path), blend, 0.1
    c.model.vocab_size, c.model.seq_len, c.seed = vocab_size, SEQ_LEN, seed
    c.train.global_batch = global_batch
    return c


def _positions(tmp_path, name, first, num_tokens, vocab_size=VOCAB):
    """Token i of the file is first + i: every row shows which file and where it came from."""
    return token_files.write_token_file(tmp_path / f'{name}.bin', first + np.arange(num_tokens), vocab_size, 'uint16')


@pytest.fixture
def two_files(tmp_path):
    return _positions(tmp_path, 'a', 0, 1000), _positions(tmp_path, 'b', 3000, 2000)


# --------------------------------------------------------------------------- the permutation


@pytest.mark.parametrize('size', [1, 2, 3, 5, 64, 1000, 4097])
def test_permute_is_a_permutation_and_depends_on_the_key(size):
    perm = sampling.permute(np.arange(size), size, [0, 0, 0])
    np.testing.assert_array_equal(np.sort(perm), np.arange(size))
    if size >= 5:
        assert not np.array_equal(perm, sampling.permute(np.arange(size), size, [0, 0, 1]))
        assert not np.array_equal(perm, np.arange(size))


# --------------------------------------------------------------------------- epochs


def test_one_epoch_reads_every_window_once_and_the_next_epoch_reorders(tmp_path):
    cfg = _config(_positions(tmp_path, 'a', 0, 1000))
    train, _ = loader.make_datasets(cfg.data, '', loader.BatchSpec.of(cfg))
    w = train.num_windows
    assert w == (900 - 1) // SEQ_LEN  # 900 training tokens at stride seq_len
    steps = -(-2 * w // BATCH) + 1  # past two epochs; w is not a multiple of BATCH, so a step straddles
    starts = np.concatenate([train.read_rows(s, np.arange(BATCH), BATCH)[:, 0] for s in range(steps)])
    epoch0, epoch1 = starts[:w], starts[w:2 * w]
    np.testing.assert_array_equal(np.sort(epoch0), np.arange(w) * SEQ_LEN)  # every window exactly once
    np.testing.assert_array_equal(np.sort(epoch1), np.arange(w) * SEQ_LEN)
    assert not np.array_equal(epoch0, epoch1)  # a different permutation
    # every training token after the first is a target exactly once per epoch
    rows = np.stack([train.tokens[s:s + SEQ_LEN + 1] for s in epoch0])
    np.testing.assert_array_equal(np.sort(rows[:, 1:].ravel()), np.arange(1, w * SEQ_LEN + 1))


def test_epoch_metric(tmp_path):
    cfg = _config(_positions(tmp_path, 'a', 0, 1000))
    train, val = loader.make_datasets(cfg.data, '', loader.BatchSpec.of(cfg))
    assert train.epochs(0, BATCH) == {'data/epoch': BATCH / train.num_windows}
    assert train.num_windows == 128
    assert train.epochs(11, BATCH)['data/epoch'] == pytest.approx(120 / 128)  # still epoch 0
    assert train.epochs(12, BATCH)['data/epoch'] == pytest.approx(130 / 128)  # in epoch 1
    assert val.epochs(0, BATCH) == {'data/epoch': BATCH / val.num_windows}


# --------------------------------------------------------------------------- blends


@pytest.mark.parametrize('blend,counts', [('0.7:{a},0.3:{b}', (7, 3)), ('1:{a},1:{b}', (5, 5)),
                                          ('2:{b},8:{a}', (2, 8)), ('1:{a},2:{b}', (3, 7))])
def test_blend_rows_per_step_are_exact(two_files, blend, counts):
    a, b = two_files
    cfg = _config(blend=blend.format(a=a, b=b))
    train, val = loader.make_datasets(cfg.data, '', loader.BatchSpec.of(cfg))
    assert train.counts == counts and val.counts == counts and sum(counts) == BATCH
    from_a = 0 if blend.index('{a}') < blend.index('{b}') else 1
    for step in range(30):
        rows = train.read_rows(step, np.arange(BATCH), BATCH)
        np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(SEQ_LEN + 1))  # whole windows of one file
        in_a = rows[:, 0] < 3000
        assert in_a.sum() == counts[from_a], (step, rows[:, 0])
        assert rows[in_a].max() < 900 and rows[~in_a].min() >= 3000 and rows[~in_a].max() < 3000 + 1800


def test_blend_is_deterministic_resumable_and_per_file_epochs(two_files):
    a, b = two_files
    c = _config(blend=f'0.7:{a},0.3:{b}')
    train, _ = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    continuous = [train.read_rows(s, np.arange(BATCH), BATCH) for s in range(200)]
    for k in (0, 1, 57, 128, 199):  # a fresh source (a restarted run) at step k reads the same batch
        fresh, _ = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
        np.testing.assert_array_equal(fresh.read_rows(k, np.arange(BATCH), BATCH), continuous[k])
        np.testing.assert_array_equal(fresh.read_rows(k, np.array([9, 2, 4]), BATCH), continuous[k][[9, 2, 4]])
    cfg = _config(blend=f'0.7:{a},0.3:{b}', seed=1)
    other, _ = loader.make_datasets(cfg.data, '', loader.BatchSpec.of(cfg))
    assert not np.array_equal(other.read_rows(3, np.arange(BATCH), BATCH), continuous[3])
    # file i's rows of step s are its windows k = s * n_i + [0, n_i); each file runs its own epochs
    for step in (0, 17, 18, 150):
        rows_a = continuous[step][:, 0][continuous[step][:, 0] < 3000]
        np.testing.assert_array_equal(np.sort(rows_a), np.sort(train.sources[0].offsets_of(step * 7 + np.arange(7))))
    for source in train.sources:
        w = source.num_windows
        np.testing.assert_array_equal(np.sort(source.offsets_of(np.arange(w))), source.start + np.arange(w) * SEQ_LEN)
        np.testing.assert_array_equal(np.sort(source.offsets_of(w + np.arange(w))), source.start + np.arange(w) * SEQ_LEN)
    w_a, w_b = train.sources[0].num_windows, train.sources[1].num_windows
    epochs = train.epochs(199, BATCH)
    assert epochs == {'data/epoch/a': 200 * 7 / w_a, 'data/epoch/b': 200 * 3 / w_b}


def test_blend_metric_names_distinguish_equal_stems():
    assert sampling.source_names(['/x/a.bin', '/y/a.bin', '/z/c']) == [
        'a_0', 'a_1', 'c']


# --------------------------------------------------------------------------- vocabulary from the header


def test_vocab_size_zero_reads_the_header(two_files):
    a, b = two_files
    for c in (_config(a, vocab_size=0), _config(blend=f'1:{a},1:{b}', vocab_size=0)):
        loader.resolve_vocab(c)
        assert c.model.vocab_size == VOCAB
        loader.check_data(c)
    c = _config(a, vocab_size=123)
    loader.resolve_vocab(c)
    assert c.model.vocab_size == 123  # an explicit vocabulary is kept


@pytest.mark.parametrize('kind', ['builtin', 'synthetic'])
def test_vocab_size_zero_without_a_token_file(kind):
    c = _config(vocab_size=0)
    c.data.kind = kind
    with pytest.raises(ConfigError, match='no token file') as e:
        loader.resolve_vocab(c)
    assert e.value.field == 'model.vocab_size' and '\n' not in str(e.value)


# --------------------------------------------------------------------------- bad blends


def _bad_blends(tmp_path):
    a = _positions(tmp_path, 'a', 0, 1000)
    other_vocab = _positions(tmp_path, 'v', 0, 1000, vocab_size=VOCAB + 1)
    return {
        'zero weight': (f'0.5:{a},0:{a}', 'weights must be > 0'),
        'negative weight': (f'-1:{a}', 'weights must be > 0'),
        'not a number': (f'x:{a}', 'is not a number'),
        'no weight': (f'{a}', 'is not WEIGHT:PATH'),
        'different vocabularies': (f'1:{a},1:{other_vocab}', 'vocab_size'),
        'missing file': (f'1:{a},1:{tmp_path}/missing.bin', 'does not exist'),
        'too small a weight': (f'0.01:{a},1:{a}', 'gets 0 of the 10 rows'),
    }


@pytest.mark.parametrize('case', ['zero weight', 'negative weight', 'not a number', 'no weight',
                                  'different vocabularies', 'missing file', 'too small a weight'])
def test_bad_blend_is_one_config_error(tmp_path, case):
    blend, words = _bad_blends(tmp_path)[case]
    for vocab_size in (VOCAB + 1, 0):
        c = _config(blend=blend, vocab_size=vocab_size)
        with pytest.raises(ConfigError) as e:
            loader.resolve_vocab(c)
            loader.check_data(c)
        assert e.value.field == 'data.blend' and words in str(e.value) and 'Fix:' in str(e.value), str(e.value)
        assert '\n' not in str(e.value)


def test_blend_and_path_together_or_without_tokens(tmp_path):
    a = _positions(tmp_path, 'a', 0, 1000)
    with pytest.raises(ConfigError, match='both set'):
        config_lib.validate(_config(a, blend=f'1:{a}', global_batch=8))
    c = _config(blend=f'1:{a}', global_batch=8)
    c.data.kind = 'builtin'
    with pytest.raises(ConfigError, match='mixes token files'):
        config_lib.validate(c)


def _main(tmp_path, *args):
    return processes.run_main('--config=configs/tiny.py', f'--workdir={tmp_path}/wd', '--config.data.kind=tokens',
                              *args,
                              tiny=False, timeout=300,
                              env=processes.subprocess_env(XLA_FLAGS='--xla_force_host_platform_device_count=8'))


@pytest.mark.parametrize('case', ['zero weight', 'different vocabularies', 'missing file'])
def test_cli_bad_blend_exits_2_with_one_line(tmp_path, case):
    blend, words = _bad_blends(tmp_path)[case]
    proc = _main(tmp_path, f'--config.data.blend={blend}', '--config.model.vocab_size=0')
    line = processes.error_line(proc)
    assert 'config.data.blend' in line and words in line, line
    assert not os.path.exists(tmp_path / 'wd') or not os.listdir(tmp_path / 'wd')


@pytest.mark.slow
def test_cli_trains_a_blend_with_vocab_from_the_header(tmp_path):
    rng = np.random.default_rng(0)
    a = token_files.write_token_file(tmp_path / 'a.bin', rng.integers(0, 300, 20000), 300)
    b = token_files.write_token_file(tmp_path / 'b.bin', rng.integers(0, 300, 10000), 300)
    proc = _main(tmp_path, f'--config.data.blend=0.75:{a},0.25:{b}', '--config.model.vocab_size=0',
                 '--config.train.steps=2', '--config.train.log_every=1', '--config.train.eval_batches=1',
                 '--config.checkpoint.enabled=False', '--config.train.progress=False')
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / 'wd' / 'config.json') as f:
        assert json.load(f)['model']['vocab_size'] == 300
    with open(tmp_path / 'wd' / 'metrics.jsonl') as f:
        rows = [json.loads(line) for line in f]
    last = [r for r in rows if 'data/epoch/a' in r][-1]
    windows_a = (int(20000 * 0.98) - 1) // 128
    assert last['step'] == 2 and last['data/epoch/a'] == pytest.approx(2 * 12 / windows_a)
