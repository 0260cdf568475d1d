"""Token data: the on-disk token-file format, the built-in corpus and deterministic batches.

On disk (docs/data.md) a dataset is `<name>.bin`, raw little-endian uint16 or uint32 tokens,
with a small JSON header `<name>.json` beside it. Token files are memory-mapped, never loaded.

A batch is a pure function of (seed, split, step): row r of step s is the source's window
k = step * global_batch + r, drawn without replacement within an epoch (jaxfrontier/data/
sampling.py: a seeded permutation of the split's windows per epoch); `data.blend` mixes
several files with fixed rows per step. Any process can read any subset of rows and get the
same values however many processes or devices there are; `make_global_batch` relies on that
to read only the rows of the shards a process holds.

JAX is imported only inside `make_global_batch`: importing this module starts nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import dataclasses
import json
import os
import pathlib
import platform
import sys
import sysconfig
import tempfile
from typing import Any, Iterable, Iterator, NoReturn, Protocol

import ml_collections
import numpy as np

from jaxfrontier.config import DATA_KINDS, ConfigError
from jaxfrontier.data import sampling

FORMAT = 'jaxfrontier-tokens'
VERSION = 1
NUMPY_DTYPES = {'uint16': '<u2', 'uint32': '<u4'}  # header dtype -> explicit little-endian
BYTE_VOCAB = 256  # the built-in corpus is byte-level
TRAIN, VAL = 0, 1  # split ids, part of every sampling seed
_SCAN_CHUNK_TOKENS = 1 << 24
_WRITE_CHUNK_TOKENS = 1 << 24


def token_paths(path: str | os.PathLike) -> tuple[str, str]:
    """Returns (bin_path, header_path) of a token file named by its .bin, .json or base path."""
    root = os.fspath(path)
    for suffix in ('.bin', '.json'):
        if root.endswith(suffix):
            root = root[: -len(suffix)]
    return root + '.bin', root + '.json'


# --------------------------------------------------------------------------- writing


def _atomic_write(path: str, chunks: Iterable[bytes]) -> None:
    """Writes chunks to a temporary file beside `path`, syncs it, then renames it over `path`."""
    fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                    prefix=f'.{os.path.basename(path)}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_path, 0o644)  # mkstemp makes 0600; datasets are shared
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise


def write_token_file(path: str | os.PathLike, tokens: Any, vocab_size: int, dtype: str | None = None,
                     *, metadata: dict[str, Any] | None = None) -> str:
    """Writes a token file (docs/data.md) atomically and returns its .bin path.

    The old header is removed first and the new one written last, each file by temp file and
    rename, so at every moment the header is either absent or describes the .bin beside it.

    Args:
      path: the .bin path (or base path) to write; its directory is created if needed.
      tokens: 1-D integer tokens, each in [0, vocab_size).
      vocab_size: the tokenizer's vocabulary size, recorded in the header.
      dtype: 'uint16' or 'uint32'; None picks uint16 when vocab_size <= 65536.
      metadata: extra JSON-serialisable header fields (e.g. where the tokens came from).

    Raises:
      ValueError: the tokens are not 1-D integers in [0, vocab_size), or dtype cannot hold them.
    """
    bin_path, header_path = token_paths(path)
    tokens_n = np.asarray(tokens)
    if tokens_n.ndim != 1 or (tokens_n.size and not np.issubdtype(tokens_n.dtype, np.integer)):
        raise ValueError(f'tokens must be a 1-D integer array, got {tokens_n.dtype} {tokens_n.shape}')
    dtype = dtype or ('uint16' if vocab_size <= 1 << 16 else 'uint32')
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f'dtype must be one of {sorted(NUMPY_DTYPES)}, got {dtype!r}')
    np_dtype = np.dtype(NUMPY_DTYPES[dtype])
    if not 1 <= vocab_size <= np.iinfo(np_dtype).max + 1:
        raise ValueError(f'vocab_size {vocab_size} does not fit in {dtype}')
    if tokens_n.size and (tokens_n.min() < 0 or tokens_n.max() >= vocab_size):
        raise ValueError(f'tokens must be in [0, {vocab_size}), got [{tokens_n.min()}, {tokens_n.max()}]')
    header = {**(metadata or {}), 'format': FORMAT, 'version': VERSION, 'dtype': dtype,
              'num_tokens': int(tokens_n.size), 'vocab_size': int(vocab_size)}
    os.makedirs(os.path.dirname(os.path.abspath(bin_path)), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(header_path)
    _atomic_write(bin_path, (tokens_n[i:i + _WRITE_CHUNK_TOKENS].astype(np_dtype).tobytes()
                             for i in range(0, tokens_n.size, _WRITE_CHUNK_TOKENS)))
    _atomic_write(header_path, [json.dumps(header, indent=1).encode() + b'\n'])
    return bin_path


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """An open, validated token file."""

    path: str  # the .bin path
    header: dict[str, Any]
    tokens: np.ndarray  # [num_tokens] '<u2' or '<u4', memory-mapped read-only

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def _bad(path: Any, problem: str, fix: str) -> NoReturn:
    raise ConfigError('data.path', os.fspath(path), problem, fix)


_REWRITE = 'write the file with jaxfrontier.data.dataset.write_token_file (format: docs/data.md)'


def _read_header(path: Any, header_path: str) -> dict[str, Any]:
    """Reads and checks the JSON header; raises ConfigError naming data.path."""
    if not os.path.isfile(header_path):
        _bad(path, f'the header {header_path} is missing (the file may be partly written)', _REWRITE)
    try:
        with open(header_path, 'rb') as f:
            header = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nesting deeper than json's limit
        _bad(path, f'cannot read the header {header_path}: {e}', _REWRITE)
    if not isinstance(header, dict):
        _bad(path, f'the header {header_path} is not a JSON object', _REWRITE)

    def is_count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    expected = {'format': lambda v: v == FORMAT, 'version': lambda v: v == VERSION,
                'dtype': lambda v: isinstance(v, str) and v in NUMPY_DTYPES,  # a list is unhashable (tests/fuzz)
                'num_tokens': is_count, 'vocab_size': is_count}
    for key, ok in expected.items():
        if not ok(header.get(key)):
            _bad(path, f'invalid header {header_path}: "{key}" is {header.get(key)!r} (format '
                 f'{FORMAT!r} version {VERSION}, dtype one of {sorted(NUMPY_DTYPES)}, counts >= 0)', _REWRITE)
    return header


_MAX_TOKEN_MEMO: dict[tuple[Any, ...], tuple[int, int]] = {}


def _max_token(bin_path: str, tokens: np.ndarray) -> tuple[int, int]:
    """Returns (largest token, its position), scanning in chunks; memoized per file version."""
    st = os.stat(bin_path)
    key = (os.path.realpath(bin_path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _MAX_TOKEN_MEMO:
        best, where = -1, -1
        for start in range(0, tokens.shape[0], _SCAN_CHUNK_TOKENS):
            chunk = np.asarray(tokens[start:start + _SCAN_CHUNK_TOKENS])
            i = int(np.argmax(chunk))
            if int(chunk[i]) > best:
                best, where = int(chunk[i]), start + i
        _MAX_TOKEN_MEMO[key] = (best, where)
    return _MAX_TOKEN_MEMO[key]


def open_token_file(path: str | os.PathLike, vocab_size: int, *, seq_len: int | None = None) -> TokenFile:
    """Opens and validates a token file, memory-mapping its tokens.

    Args:
      path: the .bin path (or base path) of the token file.
      vocab_size: the model's real (unpadded) vocabulary; every token must be below it.
      seq_len: if given, the file must hold at least one window of seq_len + 1 tokens.

    Returns:
      The open TokenFile.

    Raises:
      ConfigError: naming data.path, if the .bin or header is missing, the header is invalid,
        the .bin size disagrees with the header, a token is >= vocab_size, or the file is too
        short for one sequence.
    """
    bin_path, header_path = token_paths(path)
    if not os.path.isfile(bin_path):
        _bad(path, f'the token file {bin_path} does not exist',
             f"check data.path, {_REWRITE}, or use data.kind='builtin'")
    header = _read_header(path, header_path)
    num_tokens, np_dtype = header['num_tokens'], np.dtype(NUMPY_DTYPES[header['dtype']])
    size_bytes, expected_bytes = os.path.getsize(bin_path), num_tokens * np_dtype.itemsize
    if size_bytes != expected_bytes:
        _bad(path, f'{bin_path} has {size_bytes:,} bytes but its header promises {num_tokens:,} '
             f'{header["dtype"]} tokens = {expected_bytes:,} bytes (truncated or partly written)', _REWRITE)
    if seq_len is not None and num_tokens < seq_len + 1:
        _bad(path, f'{bin_path} holds {num_tokens:,} tokens, fewer than one sequence '
             f'(model.seq_len + 1 = {seq_len + 1})', 'use a longer token file or a smaller model.seq_len')
    tokens = (np.memmap(bin_path, dtype=np_dtype, mode='r', shape=(num_tokens,)) if num_tokens
              else np.zeros(0, np_dtype))  # numpy cannot map an empty file
    max_token, position = _max_token(bin_path, tokens)
    if max_token >= vocab_size:
        _bad(path, f'{bin_path} holds token {max_token} (at position {position:,}) but the model '
             f'vocabulary is model.vocab_size = {vocab_size} (the header says {header["vocab_size"]})',
             f"set model.vocab_size to the tokenizer's vocabulary (at least {max_token + 1}), "
             'or re-tokenize the data')
    return TokenFile(bin_path, header, tokens)


def tokenizer_path(token_file: TokenFile) -> str | None:
    """The tokenizer file the header names (`"tokenizer"`, relative to the .bin), or None.

    Files written by `python -m jaxfrontier.prepare` record their Hugging Face tokenizer.json
    (and the end-of-text id, `"eot_id"`); older or hand-written files have no such key.
    """
    name = token_file.header.get('tokenizer')
    if not isinstance(name, str) or not name:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(token_file.path)), name)


# --------------------------------------------------------------------------- built-in corpus


def _stdlib_source_files(stdlib: str) -> list[pathlib.Path]:
    """All `*.py` under the stdlib, site-packages excluded, sorted by relative path."""
    root = pathlib.Path(stdlib)
    rel_paths = [p.relative_to(root) for p in root.rglob('*.py') if p.is_file()]
    rel_paths = [r for r in rel_paths if not {'site-packages', 'dist-packages'} & set(r.parts)]
    return [root / r for r in sorted(rel_paths, key=lambda r: r.as_posix())]


def builtin_corpus(cache_dir: str | os.PathLike) -> str:
    """Returns the .bin path of the built-in corpus, building and caching it on first use.

    The corpus is the running interpreter's own standard-library source (`*.py`, sorted by
    relative path, site-packages excluded) concatenated as bytes: vocabulary 256, nothing to
    download. A valid cached file is reused; a new one is written atomically, so concurrent
    builders or a crash never leave a partial file that looks complete.

    Args:
      cache_dir: directory for the cached token file; created if needed.
    """
    stdlib = sysconfig.get_paths()['stdlib']
    name = f'stdlib-{sys.implementation.name}-{platform.python_version()}'
    bin_path = os.path.join(os.fspath(cache_dir), name + '.bin')
    os.makedirs(os.fspath(cache_dir), exist_ok=True)
    # Processes of one job share the workdir: one builds while the others wait, then reuse it
    # (write_token_file removes the header while it writes, which a reader must not see).
    with _exclusive(bin_path + '.lock'):
        with contextlib.suppress(ConfigError):
            if open_token_file(bin_path, BYTE_VOCAB).header.get('source') == stdlib:
                return bin_path
        files = _stdlib_source_files(stdlib)
        if not files:
            raise ConfigError('data.kind', 'builtin', f'no Python source found in the stdlib at {stdlib}',
                              "use data.kind='tokens' with a token file, or data.kind='synthetic'")
        corpus_bytes = b''.join(f.read_bytes() for f in files)
        try:
            return write_token_file(bin_path, np.frombuffer(corpus_bytes, np.uint8), BYTE_VOCAB,
                                    metadata={'source': stdlib, 'num_files': len(files)})
        except OSError as e:  # a full disk: name the file (the loop turns it into one line, training/disk.py)
            if e.filename is None and e.errno is not None:
                raise OSError(e.errno, f'{e.strerror} (writing the built-in corpus, '
                              f'{len(corpus_bytes) / 2**20:.0f} MiB)', bin_path) from e
            raise


@contextlib.contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    """An advisory file lock (flock); a file system without locks runs unlocked."""
    with open(lock_path, 'a') as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- sources


class Source(Protocol):
    """What batches are read from: TokenSource or SyntheticSource."""

    seq_len: int

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        ...  # rows `rows` of step's global batch: [len(rows), seq_len + 1] int32

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        ...  # `data/epoch` (per file for a blend): epochs completed once step is read

    def describe(self) -> str: ...


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSource:
    """Windows of seq_len + 1 tokens sampled from tokens[start:stop] of a token file."""

    tokens: np.ndarray  # [num_tokens], memory-mapped
    start: int
    stop: int
    seq_len: int
    seed: int
    split_id: int  # TRAIN or VAL
    name: str

    @property
    def num_windows(self) -> int:
        """Windows of one epoch: seq_len + 1 tokens at stride seq_len (sampling.num_windows)."""
        return sampling.num_windows(self.stop - self.start, self.seq_len)

    def offsets_of(self, k: np.ndarray) -> np.ndarray:
        """Start offsets of the source's k-th windows: epoch k // W, permuted position k % W."""
        starts, _ = sampling.window_starts(k, self.stop - self.start, self.seq_len, self.seed, self.split_id)
        return self.start + starts

    def offsets(self, step: int, global_batch: int) -> np.ndarray:
        """Window start offsets [global_batch] of step; windows k = step * global_batch + row."""
        return self.offsets_of(step * global_batch + np.arange(global_batch, dtype=np.int64))

    def read_windows(self, k: np.ndarray) -> np.ndarray:
        """The source's k-th windows: [len(k), seq_len + 1] int32."""
        offsets = self.offsets_of(k)
        out_rl = np.empty((len(offsets), self.seq_len + 1), np.int32)
        for i, offset in enumerate(offsets):
            out_rl[i] = self.tokens[offset:offset + self.seq_len + 1]
        return out_rl

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        """Reads only rows `rows` of step's global batch: [len(rows), seq_len + 1] int32."""
        return self.read_windows(step * global_batch + np.asarray(rows, dtype=np.int64))

    def epoch_progress(self, step: int, rows_per_step: int) -> float:
        """Epochs completed once `step` is read (1.25: a quarter into epoch 1, counting from 0)."""
        return (step + 1) * rows_per_step / self.num_windows

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        return {'data/epoch': self.epoch_progress(step, global_batch)}

    def describe(self) -> str:
        return (f'{self.name}: tokens [{self.start:,}, {self.stop:,}) of {len(self.tokens):,}, '
                f'{self.num_windows:,} windows per epoch')


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """Uniformly random tokens for benchmarks; each row a pure function of (seed, split, step, row)."""

    vocab_size: int
    seq_len: int
    seed: int
    split_id: int

    def read_rows(self, step: int, rows: np.ndarray, global_batch: int) -> np.ndarray:
        """Generates rows `rows` of step's global batch: [len(rows), seq_len + 1] int32."""
        del global_batch  # each row has its own stream
        out_rl = np.empty((len(rows), self.seq_len + 1), np.int32)
        for i, row in enumerate(np.asarray(rows, dtype=np.int64)):
            rng = np.random.default_rng([self.seed, self.split_id, step, int(row)])
            out_rl[i] = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return out_rl

    def epochs(self, step: int, global_batch: int) -> dict[str, float]:
        del step, global_batch
        return {}

    def describe(self) -> str:
        return f'synthetic: uniform tokens in [0, {self.vocab_size})'


def _split_boundary(c: ml_collections.ConfigDict, token_file: TokenFile) -> int:
    """First validation token: the last data.val_fraction of the stream is validation."""
    num_tokens, needed = token_file.num_tokens, c.model.seq_len + 1
    num_val = int(num_tokens * c.data.val_fraction)
    if num_val < needed:
        problem = (f'the validation split gets {num_val:,} of the {num_tokens:,} tokens of '
                   f'{token_file.path}, fewer than one sequence (model.seq_len + 1 = {needed})')
        if num_tokens <= 2 * needed:  # no val_fraction < 0.5 can help
            _bad(token_file.path, problem, 'use a longer token file or a smaller model.seq_len')
        raise ConfigError('data.val_fraction', c.data.val_fraction, problem,
                          f'raise data.val_fraction to at least {needed / num_tokens:.4g}, use a '
                          'longer token file, or lower model.seq_len')
    return num_tokens - num_val


def _open_checked(c: ml_collections.ConfigDict, path: str) -> tuple[TokenFile, int]:
    token_file = open_token_file(path, c.model.vocab_size, seq_len=c.model.seq_len)
    return token_file, _split_boundary(c, token_file)


def _as_blend_error(c: ml_collections.ConfigDict, e: ConfigError, path: str) -> ConfigError:
    """A data.path error about one file of data.blend, renamed to data.blend."""
    problem = str(e).split('. Fix: ')[0][len(f'config.{e.field} = {e.value!r}: '):]
    fix = str(e).split('. Fix: ', 1)[1] if '. Fix: ' in str(e) else 'check the path'
    return ConfigError('data.blend', c.data.blend, f'{path}: {problem}' if path not in problem else problem, fix)


def _blend_files(c: ml_collections.ConfigDict) -> tuple[list[int], list[str], list[tuple[TokenFile, int]]]:
    """Parses data.blend, opens and checks every file: (rows per step of each, paths, [(file, boundary)])."""
    entries = sampling.parse_blend(c.data.blend)
    weights, paths = [w for w, _ in entries], [p for _, p in entries]
    opened = []
    for path in paths:
        try:
            opened.append(_open_checked(c, path))
        except ConfigError as e:
            if e.field != 'data.path':
                raise
            raise _as_blend_error(c, e, path) from None
    _check_same_tokenizer(c.data.blend, [f for f, _ in opened])
    return sampling.check_blend_counts(c.data.blend, paths, weights, c.train.global_batch), paths, opened


def _tokenizer_bytes(token_file: TokenFile) -> bytes | None:
    path = tokenizer_path(token_file)
    if path is None or not os.path.isfile(path):
        return None
    with open(path, 'rb') as f:
        return f.read()


def _check_same_tokenizer(blend: str, files: list[TokenFile]) -> None:
    """All files of a blend share vocab_size, eot_id and (where recorded) the tokenizer file."""
    first = files[0]
    for other in files[1:]:
        for key in ('vocab_size', 'eot_id'):
            a, b = first.header.get(key), other.header.get(key)
            if key == 'vocab_size' or (a is not None and b is not None):
                if a != b:
                    raise ConfigError('data.blend', blend, f'{first.path} has {key} {a} but {other.path} has {b}: '
                                      'the files were tokenised differently', 'blend only files written with '
                                      'the same tokenizer (re-run python -m jaxfrontier.prepare --tokenizer=...)')
        a, b = _tokenizer_bytes(first), _tokenizer_bytes(other)
        if a is not None and b is not None and a != b:
            raise ConfigError('data.blend', blend, f'{first.path} and {other.path} name different tokenizer '
                              'files', 'blend only files written with the same tokenizer')


def run_token_path(data_config: Any) -> str:
    """The token file a run's data config names: data.path, or the first file of data.blend
    (the files of a blend share one tokenizer); '' for none. Takes a dict or ConfigDict."""
    blend = data_config.get('blend', '')
    return sampling.parse_blend(blend)[0][1] if blend else data_config.get('path', '')


def resolve_vocab(c: ml_collections.ConfigDict) -> None:
    """`model.vocab_size = 0`: sets it to the token file's header `vocab_size` (data.path or data.blend).

    Raises:
      ConfigError: vocab_size is 0 but there is no token file (data.kind != tokens, no path),
        or the file or its header cannot be read.
    """
    if c.model.vocab_size != 0:
        return
    blend, path = c.data.get('blend', ''), c.data.path
    if c.data.kind != 'tokens' or not (blend or path):
        raise ConfigError('model.vocab_size', 0, f'0 takes the vocabulary from a token file header, but '
                          f'data.kind={c.data.kind!r} has no token file',
                          'set model.vocab_size to a positive number, or use data.kind=tokens with data.path '
                          'or data.blend')
    paths = [p for _, p in sampling.parse_blend(blend)] if blend else [path]
    vocabs = []
    for p in paths:
        bin_path, header_path = token_paths(p)
        field, value = ('data.blend', blend) if blend else ('data.path', p)
        if not os.path.isfile(bin_path):
            raise ConfigError(field, value, f'the token file {bin_path} does not exist (model.vocab_size=0 reads '
                              'the vocabulary from its header)', 'check the path, or set model.vocab_size')
        try:
            vocabs.append(_read_header(p, header_path)['vocab_size'])
        except ConfigError as e:
            raise (_as_blend_error(c, e, p) if blend else e) from None
    if len(set(vocabs)) > 1:
        i = next(i for i, v in enumerate(vocabs) if v != vocabs[0])
        raise ConfigError('data.blend', blend, f'{paths[0]} has vocab_size {vocabs[0]} but {paths[i]} has '
                          f'{vocabs[i]}: the files were tokenised differently',
                          'blend only files written with the same tokenizer')
    c.model.vocab_size = int(vocabs[0])


def check_data(c: ml_collections.ConfigDict) -> None:
    """Validates the data config cheaply and writes nothing; for kind=tokens, checks the file(s).

    Raises:
      ConfigError: naming the field to fix.
    """
    if c.data.kind not in DATA_KINDS:
        raise ConfigError('data.kind', c.data.kind, 'unknown dataset kind', f'use one of {DATA_KINDS}')
    if not (isinstance(c.seed, int) and c.seed >= 0):
        raise ConfigError('seed', c.seed, 'the data seed must be an integer >= 0', 'set seed to e.g. 0')
    if c.data.kind == 'builtin' and c.model.vocab_size < BYTE_VOCAB:
        raise ConfigError('model.vocab_size', c.model.vocab_size,
                          f'the built-in corpus is byte-level ({BYTE_VOCAB} tokens)',
                          f'set model.vocab_size to at least {BYTE_VOCAB}')
    if c.data.kind == 'tokens' and c.data.get('blend', ''):
        _blend_files(c)
    elif c.data.kind == 'tokens':
        _open_checked(c, c.data.path)


def _splits(c: ml_collections.ConfigDict, token_file: TokenFile, boundary: int,
            name: str) -> tuple[TokenSource, TokenSource]:
    m, seed = c.model, c.seed
    return (TokenSource(token_file.tokens, 0, boundary, m.seq_len, seed, TRAIN, f'{name} train'),
            TokenSource(token_file.tokens, boundary, token_file.num_tokens, m.seq_len, seed, VAL,
                        f'{name} val'))


def make_datasets(c: ml_collections.ConfigDict, workdir: str) -> tuple[Source, Source]:
    """Returns (train, validation) sources for `c.data.kind`.

    builtin: the stdlib corpus, cached in `<workdir>/data_cache`; tokens: `c.data.path`, or
    the files of `c.data.blend` mixed with their weights (each split per file);
    synthetic: random tokens, no file. Token files split into train (first part) and
    validation (the last `c.data.val_fraction`); no window crosses the boundary.
    """
    check_data(c)
    m, seed = c.model, c.seed
    if c.data.kind == 'synthetic':
        return (SyntheticSource(m.vocab_size, m.seq_len, seed, TRAIN),
                SyntheticSource(m.vocab_size, m.seq_len, seed, VAL))
    if c.data.kind == 'tokens' and c.data.get('blend', ''):
        counts, paths, opened = _blend_files(c)
        splits = [_splits(c, f, boundary, f'tokens {f.path}') for f, boundary in opened]
        names = tuple(sampling.metric_names(paths))
        return tuple(sampling.BlendSource(tuple(s[i] for s in splits), tuple(counts), names, seed, i)  # type: ignore
                     for i in (TRAIN, VAL))
    path = builtin_corpus(os.path.join(workdir, 'data_cache')) if c.data.kind == 'builtin' else c.data.path
    token_file, boundary = _open_checked(c, path)
    return _splits(c, token_file, boundary, f'{c.data.kind} {token_file.path}')


def make_global_batch(source: Source, step: int, sharding: Any, global_batch: int) -> Any:
    """Builds step's global batch [global_batch, seq_len + 1] int32 as a sharded jax.Array.

    Each process reads only the rows of its addressable shards; devices that hold the same
    rows (replicas along non-batch mesh axes) share one read.

    Args:
      source: a TokenSource or SyntheticSource.
      step: the step whose batch to build.
      sharding: a jax.sharding.NamedSharding whose dim 0 is split over the batch axes.
      global_batch: rows in the whole batch, over all processes.
    """
    import jax  # pylint: disable=g-import-not-at-top  (importing this module must not start JAX)

    all_rows = np.arange(global_batch)
    read: dict[bytes, np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        rows = all_rows[index[0]]
        if rows.tobytes() not in read:
            read[rows.tobytes()] = source.read_rows(step, rows, global_batch)
        return read[rows.tobytes()][(slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback((global_batch, source.seq_len + 1), sharding, callback, dtype=np.int32)
