"""Tests of jaxfrontier.data (token_files, builtin, sources, loader): token-file format and validation, sampling, sharded batches, corpora."""

import json
import os
import platform
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxfrontier import config as config_lib
from jaxfrontier.data import builtin, loader, sources, token_files
from jaxfrontier.data import sampling
from jaxfrontier.errors import ConfigError

SEQ_LEN, BATCH = 13, 8  # distinct sizes so a swapped axis fails


def _config(kind='tokens', path='', vocab_size=256, seq_len=SEQ_LEN, val_fraction=0.1, seed=0):
    c = config_lib.base_config()
    c.data.kind, c.data.path, c.data.val_fraction = kind, str(path), val_fraction
    c.model.vocab_size, c.model.seq_len, c.seed = vocab_size, seq_len, seed
    return c


def _positions_file(tmp_path, num_tokens=5003):
    """A uint32 file whose token i is i: every row shows where it was read from."""
    return token_files.write_token_file(tmp_path / 'pos.bin', np.arange(num_tokens), num_tokens, 'uint32')


# --------------------------------------------------------------------------- format


@pytest.mark.parametrize('vocab_size,dtype,itemsize', [(50257, 'uint16', 2), (65537, 'uint32', 4)])
def test_write_read_round_trip(tmp_path, vocab_size, dtype, itemsize):
    tokens = np.random.default_rng(0).integers(0, vocab_size, size=1009)
    tokens[7] = vocab_size - 1
    path = token_files.write_token_file(tmp_path / 'x.bin', tokens, vocab_size)  # dtype picked
    with open(tmp_path / 'x.json') as f:
        header = json.load(f)
    assert header == {'format': 'jaxfrontier-tokens', 'version': 1, 'dtype': dtype,
                      'num_tokens': 1009, 'vocab_size': vocab_size}
    raw = (tmp_path / 'x.bin').read_bytes()
    assert raw == tokens.astype('<u2' if itemsize == 2 else '<u4').tobytes()  # little-endian
    token_file = token_files.open_token_file(path, vocab_size)
    assert isinstance(token_file.tokens, np.memmap)
    assert token_file.tokens.dtype.itemsize == itemsize and token_file.num_tokens == 1009
    np.testing.assert_array_equal(token_file.tokens, tokens)
    assert sorted(os.listdir(tmp_path)) == ['x.bin', 'x.json']  # no temp files left


def test_explicit_uint32_and_rewrite(tmp_path):
    token_files.write_token_file(tmp_path / 'x', np.arange(100), 300, dtype='uint32')
    token_files.write_token_file(tmp_path / 'x', np.arange(50), 300)  # rewrite as uint16
    token_file = token_files.open_token_file(tmp_path / 'x.bin', 300)
    assert token_file.header['dtype'] == 'uint16'
    np.testing.assert_array_equal(token_file.tokens, np.arange(50))


@pytest.mark.parametrize('tokens,vocab_size,dtype', [
    ([0, 5, 300], 300, None),  # token >= vocab
    ([-1, 2], 300, None),
    ([[1, 2]], 300, None),  # not 1-D
    ([1.5], 300, None),
    ([1, 2], 70000, 'uint16'),  # vocab does not fit
])
def test_write_rejects_bad_tokens(tmp_path, tokens, vocab_size, dtype):
    with pytest.raises(ValueError):
        token_files.write_token_file(tmp_path / 'x.bin', np.array(tokens), vocab_size, dtype)
    assert not (tmp_path / 'x.json').exists()


def _missing_bin(p):
    os.remove(p + '.bin')


def _missing_header(p):
    os.remove(p + '.json')


def _truncated(p):
    with open(p + '.bin', 'r+b') as f:
        f.truncate(2 * 99)


def _bad_json(p):
    with open(p + '.json', 'w') as f:
        f.write('{"format": ')


def _wrong_format(p):
    with open(p + '.json', 'w') as f:
        json.dump({'format': 'other', 'version': 1, 'dtype': 'uint16', 'num_tokens': 100,
                   'vocab_size': 256}, f)


def _wrong_dtype(p):
    with open(p + '.json', 'w') as f:
        json.dump({'format': 'jaxfrontier-tokens', 'version': 1, 'dtype': 'int8',
                   'num_tokens': 100, 'vocab_size': 256}, f)


@pytest.mark.parametrize('damage,words', [
    (_missing_bin, 'does not exist'), (_missing_header, 'header'), (_truncated, 'truncated'),
    (_bad_json, 'cannot read'), (_wrong_format, 'format'), (_wrong_dtype, 'dtype'),
])
def test_bad_file_raises_config_error_naming_data_path(tmp_path, damage, words):
    base = str(tmp_path / 'x')
    token_files.write_token_file(base + '.bin', np.arange(100) % 256, 256)
    damage(base)
    with pytest.raises(ConfigError, match=words) as e:
        token_files.open_token_file(base + '.bin', 256)
    assert e.value.field == 'data.path'


def test_token_beyond_vocab_reports_max_and_vocab(tmp_path):
    tokens = np.zeros(3001, np.int64)
    tokens[1234] = 777
    path = token_files.write_token_file(tmp_path / 'x.bin', tokens, 1000)
    token_files.open_token_file(path, 778)  # fits
    with pytest.raises(ConfigError, match=r'token 777 \(at position 1,234\).*= 500') as e:
        token_files.open_token_file(path, 500)
    assert e.value.field == 'data.path'
    assert 'at least 778' in str(e.value)


def test_scan_covers_every_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, '_SCAN_CHUNK_TOKENS', 64)
    tokens = np.zeros(1000, np.int64)
    tokens[-1] = 9  # in the last, partial chunk
    path = token_files.write_token_file(tmp_path / 'x.bin', tokens, 10)
    with pytest.raises(ConfigError, match='token 9 .at position 999'):
        token_files.open_token_file(path, 9)


def test_too_few_tokens_for_one_sequence(tmp_path):
    path = token_files.write_token_file(tmp_path / 'x.bin', np.arange(SEQ_LEN), 256)
    token_files.open_token_file(path, 256)
    with pytest.raises(ConfigError, match='fewer than one sequence') as e:
        token_files.open_token_file(path, 256, seq_len=SEQ_LEN)
    assert e.value.field == 'data.path'
    with pytest.raises(ConfigError) as e:
        loader.check_data(_config(path=path))
    assert e.value.field == 'data.path'


# --------------------------------------------------------------------------- sampling


def test_token_source_rows_are_windows_and_deterministic(tmp_path):
    c = _config(path=_positions_file(tmp_path), vocab_size=5003)
    train, val = loader.make_datasets(c.data, str(tmp_path / 'work'), loader.BatchSpec.of(c))
    rows = np.arange(BATCH)
    batch_bl = train.read_rows(3, rows, BATCH)
    assert batch_bl.shape == (BATCH, SEQ_LEN + 1) and batch_bl.dtype == np.int32
    # each row is seq_len + 1 consecutive tokens starting at the drawn offset
    np.testing.assert_array_equal(batch_bl, batch_bl[:, :1] + np.arange(SEQ_LEN + 1))
    # windows k = step * B + row of epoch 0's permutation of the stride-seq_len windows
    k = 3 * BATCH + rows
    offsets = sampling.permute(k, (train.stop - 1) // SEQ_LEN, [0, sources.TRAIN, 0]) * SEQ_LEN
    np.testing.assert_array_equal(batch_bl[:, 0], offsets)
    assert len(set(offsets.tolist())) == BATCH  # without replacement
    np.testing.assert_array_equal(train.read_rows(3, rows, BATCH), batch_bl)
    again, _ = loader.make_datasets(c.data, str(tmp_path / 'work'), loader.BatchSpec.of(c))
    np.testing.assert_array_equal(again.read_rows(3, rows, BATCH), batch_bl)
    assert not np.array_equal(train.read_rows(4, rows, BATCH), batch_bl)
    cfg = _config(path=c.data.path, vocab_size=5003, seed=1)
    other_seed, _ = loader.make_datasets(cfg.data, '', loader.BatchSpec.of(cfg))
    assert not np.array_equal(other_seed.read_rows(3, rows, BATCH), batch_bl)
    assert not np.array_equal(val.read_rows(3, rows, BATCH), batch_bl)


def test_train_and_val_windows_never_cross_the_boundary(tmp_path):
    c = _config(path=_positions_file(tmp_path, 1000), vocab_size=1000, val_fraction=0.05)
    train, val = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    boundary = 1000 - 50
    assert (train.start, train.stop, val.start, val.stop) == (0, boundary, boundary, 1000)
    train_bl = np.concatenate([train.read_rows(s, np.arange(64), 64) for s in range(20)])
    val_bl = np.concatenate([val.read_rows(s, np.arange(64), 64) for s in range(20)])
    assert train_bl.max() < boundary and val_bl.min() >= boundary and val_bl.max() < 1000
    # the split's first and last windows: 50 tokens hold 3 windows at stride 13 (tokens 950..989)
    assert val_bl.min() == boundary and val_bl.max() == boundary + 3 * SEQ_LEN


def test_validation_split_too_small(tmp_path):
    path = _positions_file(tmp_path, 100)
    with pytest.raises(ConfigError) as e:
        loader.check_data(_config(path=path, vocab_size=100, val_fraction=0.1))
    assert e.value.field == 'data.val_fraction' and 'at least 0.14' in str(e.value)
    loader.check_data(_config(path=path, vocab_size=100, val_fraction=0.14))


@pytest.mark.parametrize('kind', ['tokens', 'synthetic'])
def test_subset_of_rows_equals_full_batch_rows(tmp_path, kind):
    c = _config(kind=kind, path=_positions_file(tmp_path), vocab_size=5003)
    train, _ = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    full_bl = train.read_rows(5, np.arange(BATCH), BATCH)
    for rows in (np.array([6, 1]), np.arange(4, 8), np.array([], np.int64)):
        np.testing.assert_array_equal(train.read_rows(5, rows, BATCH), full_bl[rows])


def test_synthetic_is_deterministic_and_in_vocab():
    c = _config(kind='synthetic', vocab_size=97)
    train, val = loader.make_datasets(c.data, '/nonexistent', loader.BatchSpec.of(c))
    rows = np.arange(BATCH)
    batch_bl = train.read_rows(2, rows, BATCH)
    assert batch_bl.shape == (BATCH, SEQ_LEN + 1) and batch_bl.dtype == np.int32
    assert batch_bl.min() >= 0 and batch_bl.max() < 97 and len(np.unique(batch_bl)) > 50
    fresh, _ = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    np.testing.assert_array_equal(fresh.read_rows(2, rows, BATCH), batch_bl)
    assert not np.array_equal(train.read_rows(3, rows, BATCH), batch_bl)
    assert not np.array_equal(val.read_rows(2, rows, BATCH), batch_bl)
    assert not np.array_equal(train.read_rows(2, rows + 1, BATCH), batch_bl)


# --------------------------------------------------------------------------- global batches


class _CountingSource:
    """Wraps a source and records every row it is asked for."""

    def __init__(self, source):
        self.source, self.seq_len, self.rows_read = source, source.seq_len, []

    def read_rows(self, step, rows, global_batch):
        self.rows_read.extend(int(r) for r in rows)
        return self.source.read_rows(step, rows, global_batch)


@pytest.mark.parametrize('kind', ['tokens', 'synthetic'])
@pytest.mark.parametrize('mesh_shape,batch_axes', [
    ((1, 1, 1), ('data', 'fsdp')),  # one device
    ((8, 1, 1), ('data', 'fsdp')),
    ((2, 2, 2), ('data', 'fsdp')),  # replicated over tensor
    ((1, 2, 4), 'fsdp'),
])
def test_make_global_batch_matches_numpy_batch(tmp_path, kind, mesh_shape, batch_axes):
    c = _config(kind=kind, path=_positions_file(tmp_path), vocab_size=5003)
    train, _ = loader.make_datasets(c.data, '', loader.BatchSpec.of(c))
    devices = np.array(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
    sharding = NamedSharding(Mesh(devices, ('data', 'fsdp', 'tensor')), P(batch_axes, None))
    source = _CountingSource(train)
    batch_bl = loader.make_global_batch(source, 7, sharding, BATCH)
    assert batch_bl.shape == (BATCH, SEQ_LEN + 1) and batch_bl.dtype == np.int32
    assert batch_bl.sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch_bl), train.read_rows(7, np.arange(BATCH), BATCH))
    assert sorted(source.rows_read) == list(range(BATCH))  # each row read once, replicas share
    for shard in batch_bl.addressable_shards:
        rows = np.arange(BATCH)[shard.index[0]]
        np.testing.assert_array_equal(np.asarray(shard.data), train.read_rows(7, rows, BATCH))


# --------------------------------------------------------------------------- built-in corpus


@pytest.fixture(scope='module')
def builtin_path(tmp_path_factory):
    return builtin.builtin_corpus(tmp_path_factory.mktemp('cache'))


def test_builtin_corpus_is_stdlib_bytes_and_cached(builtin_path):
    token_file = token_files.open_token_file(builtin_path, 256)
    assert token_file.header['vocab_size'] == 256 and token_file.header['num_files'] > 100
    assert token_file.num_tokens > 1_000_000
    stdlib_files = builtin._stdlib_source_files(token_file.header['source'])
    assert not any('site-packages' in str(f) for f in stdlib_files)
    first = stdlib_files[0].read_bytes()
    np.testing.assert_array_equal(token_file.tokens[:len(first)], np.frombuffer(first, np.uint8))
    mtimes = [os.stat(p).st_mtime_ns for p in token_files.token_paths(builtin_path)]
    assert builtin.builtin_corpus(os.path.dirname(builtin_path)) == builtin_path
    assert [os.stat(p).st_mtime_ns for p in token_files.token_paths(builtin_path)] == mtimes
    # the token file, its header and the builders' lock file; no temp files left
    assert sorted(os.listdir(os.path.dirname(builtin_path))) == sorted(
        [os.path.basename(p) for p in token_files.token_paths(builtin_path)] + [os.path.basename(builtin_path) + '.lock'])


def test_builtin_corpus_rebuilds_a_damaged_cache(builtin_path, tmp_path):
    cache = tmp_path / 'cache'
    cache.mkdir()
    name = os.path.basename(builtin_path)
    with open(builtin_path, 'rb') as src, open(cache / name, 'wb') as dst:
        dst.write(src.read(1 << 20))  # a crash left half the tokens...
    bin_path, header_path = token_files.token_paths(builtin_path)
    with open(header_path, 'rb') as src, open(token_files.token_paths(cache / name)[1], 'wb') as dst:
        dst.write(src.read())  # ...beside a complete header
    rebuilt = builtin.builtin_corpus(cache)
    assert os.path.getsize(rebuilt) == os.path.getsize(bin_path)


def test_builtin_datasets_split_disjoint(builtin_path, tmp_path):
    workdir = tmp_path / 'work'
    os.makedirs(workdir / 'data_cache')
    for src in token_files.token_paths(builtin_path):  # reuse the module's cache instead of rebuilding
        os.link(src, workdir / 'data_cache' / os.path.basename(src))
    cfg = _config(kind='builtin', vocab_size=256, seq_len=64)
    train, val = loader.make_datasets(cfg.data, str(workdir), loader.BatchSpec.of(cfg))
    assert train.stop == val.start and val.stop == len(train.tokens)
    assert val.stop - val.start == int(len(train.tokens) * 0.1)
    train_bl = train.read_rows(0, np.arange(16), 16)
    assert train_bl.max() < 256
    assert (train.offsets(0, 16) + 65 <= train.stop).all() and (val.offsets(0, 16) >= val.start).all()


def test_the_builtin_corpus_cache_follows_data_cache_dir(tmp_path):
    """'auto' is the user's cache (resolved by the entry points, as the compilation cache is); 'workdir',
    an unresolved 'auto' and a run config from before the setting existed keep <workdir>/data_cache."""
    home = {'HOME': str(tmp_path)}
    c = config_lib.base_config()
    assert config_lib.data_cache_dir(c, home) == str(tmp_path / '.cache' / 'jaxfrontier' / 'data')
    assert config_lib.data_cache_dir(c, dict(home, XDG_CACHE_HOME='/x')) == '/x/jaxfrontier/data'
    c.data.cache_dir = '~/corpora'
    assert config_lib.data_cache_dir(c, home) == os.path.expanduser('~/corpora')
    c.data.cache_dir = 'workdir'
    assert config_lib.data_cache_dir(c, home) == 'workdir'
    for data in ({'cache_dir': 'workdir'}, {'cache_dir': 'auto'}, {}):
        assert loader.builtin_cache_dir(data, '/wd') == '/wd/data_cache'
    assert loader.builtin_cache_dir({'cache_dir': '/x/jaxfrontier/data'}, '/wd') == '/x/jaxfrontier/data'


def test_an_unwritable_builtin_corpus_cache_is_a_config_error(tmp_path):
    (tmp_path / 'file').write_text('')
    with pytest.raises(ConfigError) as e:
        builtin.builtin_corpus(tmp_path / 'file' / 'cache')  # (a file as its parent: refused even as root)
    assert e.value.field == 'data.cache_dir' and 'Not a directory' in str(e.value), e.value
    assert "'workdir'" in str(e.value)


def test_check_data_writes_nothing_and_checks_vocab(tmp_path):
    loader.check_data(_config(kind='builtin'))
    loader.check_data(_config(kind='synthetic'))
    with pytest.raises(ConfigError) as e:
        loader.check_data(_config(kind='builtin', vocab_size=200))
    assert e.value.field == 'model.vocab_size'
    with pytest.raises(ConfigError) as e:
        loader.check_data(_config(kind='tokens', path=tmp_path / 'missing.bin'))
    assert e.value.field == 'data.path'
    assert os.listdir(tmp_path) == []


def test_builtin_corpus_builders_wait_for_each_other(tmp_path):
    """Processes of one job share the workdir: a builder waits while another holds the cache.

    (Without the lock, a second builder's write_token_file removes the header the first one
    just wrote while the first opens it: "header missing" in a two-process run.)
    """
    import multiprocessing  # pylint: disable=g-import-not-at-top
    name = f'stdlib-{sys.implementation.name}-{platform.python_version()}.bin'
    ctx = multiprocessing.get_context('spawn')
    with builtin._exclusive(str(tmp_path / (name + '.lock'))):  # pylint: disable=protected-access
        builder = ctx.Process(target=_build_and_open, args=(str(tmp_path),))
        builder.start()
        builder.join(timeout=3.0)
        assert builder.is_alive(), 'the builder did not wait for the lock'
        assert not (tmp_path / name).exists()
    builder.join(timeout=120)
    assert builder.exitcode == 0
    token_files.open_token_file(str(tmp_path / name), 256)


def _build_and_open(cache_dir):
    token_files.open_token_file(builtin.builtin_corpus(cache_dir), 256)  # raises on a missing or bad header
