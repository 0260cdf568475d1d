"""Token files: the on-disk format (a .bin of tokens and its JSON header), writing and reading.

On disk (docs/data.md) a dataset is `<name>.bin`, raw little-endian uint16 or uint32 tokens,
with a small JSON header `<name>.json` beside it. Token files are memory-mapped, never loaded;
a file is checked against the model's vocabulary when it is opened. A file may carry a loss
mask (supervised fine-tuning: data/loss_mask.py): `<name>.mask.bin`, one uint8 per token (1:
the prediction of this token counts, 0: it does not), named by the header's `loss_mask`.

Every file a header names (NAMED_FILES: `tokenizer`, `loss_mask`) must be a plain file beside the
.bin: a printable name without a directory part, and where it exists a regular file that is, or
links to, a file in the .bin's directory (or beside the file the .bin links to). `read_header`, the
one reader of headers, refuses anything else, so no reader opens, and no export copies, a path a
received header points elsewhere (`"tokenizer": "/home/me/.ssh/id_rsa"`).

A file's kind (KINDS: plain text, sft conversations, dpo pairs) is read from its header
(`file_kind`); `OBJECTIVE_KINDS` says which kinds each `train.objective` reads (data/loader.py checks it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from typing import Any, Iterable, NoReturn

import numpy as np

from jaxfrontier.data import sampling
from jaxfrontier.errors import ConfigError

FORMAT = 'jaxfrontier-tokens'
VERSION = 1
NUMPY_DTYPES = {'uint16': '<u2', 'uint32': '<u4'}  # header dtype -> explicit little-endian
MASK_SUFFIX = '.mask.bin'  # the loss mask beside NAME.bin: NAME.mask.bin
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


def mask_path_of(bin_path: str) -> str:
    """The loss mask's path beside a token file's .bin: NAME.bin -> NAME.mask.bin."""
    return bin_path[:-len('.bin')] + MASK_SUFFIX


def write_token_file(path: str | os.PathLike, tokens: Any, vocab_size: int, dtype: str | None = None,
                     *, metadata: dict[str, Any] | None = None, mask: Any = None) -> str:
    """Writes a token file (docs/data.md) atomically and returns its .bin path.

    The old header is removed first and the new one written last, each file by temp file and
    rename, so at every moment the header is either absent or describes the .bin (and mask) beside it.

    Args:
      path: the .bin path (or base path) to write; its directory is created if needed.
      tokens: 1-D integer tokens, each in [0, vocab_size).
      vocab_size: the tokenizer's vocabulary size, recorded in the header.
      dtype: 'uint16' or 'uint32'; None picks uint16 when vocab_size <= 65536.
      metadata: extra JSON-serialisable header fields (e.g. where the tokens came from).
      mask: optional loss mask, one 0/1 per token (1: the prediction of this token counts),
        written to NAME.mask.bin and named in the header (`loss_mask`).

    Raises:
      ValueError: the tokens are not 1-D integers in [0, vocab_size), or dtype cannot hold them, or
        the mask is not one 0 or 1 per token.
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
    header.pop('loss_mask', None)
    if mask is not None:
        mask_n = np.asarray(mask)
        if mask_n.shape != tokens_n.shape or (mask_n.size and not np.isin(mask_n, (0, 1)).all()):
            raise ValueError(f'the mask must be one 0 or 1 per token ({tokens_n.size}), got {mask_n.dtype} '
                             f'{mask_n.shape}')
        header['loss_mask'] = os.path.basename(mask_path_of(bin_path))
    os.makedirs(os.path.dirname(os.path.abspath(bin_path)), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.remove(header_path)
    _atomic_write(bin_path, (tokens_n[i:i + _WRITE_CHUNK_TOKENS].astype(np_dtype).tobytes()
                             for i in range(0, tokens_n.size, _WRITE_CHUNK_TOKENS)))
    if mask is not None:
        _atomic_write(mask_path_of(bin_path), [mask_n.astype(np.uint8).tobytes()])
    _atomic_write(header_path, [json.dumps(header, indent=1).encode() + b'\n'])
    return bin_path


# --------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True, eq=False)
class TokenFile:
    """An open, validated token file."""

    path: str  # the .bin path
    header: dict[str, Any]
    tokens: np.ndarray  # [num_tokens] '<u2' or '<u4', memory-mapped read-only
    mask: np.ndarray | None = None  # [num_tokens] uint8 loss mask (1: counts), memory-mapped; None: all count

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


# Header fields that name a file beside the .bin, and the fix of a bad one.
NAMED_FILES = {
    'tokenizer': 'rewrite the file with python -m jaxfrontier.prepare, or set "tokenizer" to the name of the '
                 'tokenizer.json beside the .bin (e.g. NAME.tokenizer.json), or drop it',
    'loss_mask': 'rewrite the file with python -m jaxfrontier.prepare --sft, or drop "loss_mask" from its header',
}
# What a file's rows are (file_kind), and which kinds each train.objective reads.
KINDS = {'plain': 'a plain token stream', 'sft': 'conversations of prepare --sft, with a loss mask',
         'dpo': 'preference pairs of prepare --dpo, row 2i chosen and 2i + 1 rejected'}
OBJECTIVE_KINDS = {'lm': ('plain', 'sft'), 'dpo': ('dpo',)}


def file_kind(header: dict[str, Any]) -> str:
    """The kind of a token file (KINDS) from its header: `dpo` (a "dpo" record), `sft` (a loss mask), else `plain`."""
    if 'dpo' in header:
        return 'dpo'
    return 'sft' if header.get('loss_mask') is not None else 'plain'


def _bad(path: Any, problem: str, fix: str) -> NoReturn:
    raise ConfigError('data.path', os.fspath(path), problem, fix)


_REWRITE = 'write the file with jaxfrontier.data.token_files.write_token_file (format: docs/data.md)'


def read_header(path: Any, header_path: str) -> dict[str, Any]:
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
    for key, fix in NAMED_FILES.items():
        if header.get(key) is not None:
            _check_named_file(path, header_path, key, header[key], fix)
    return header


def _check_named_file(path: Any, header_path: str, key: str, name: Any, fix: str) -> None:
    """A file the header names (module docstring): a printable name beside the .bin, a regular file there."""
    if (not isinstance(name, str) or not name.isprintable() or name in ('', '.', '..')
            or os.path.basename(name) != name or (os.altsep and os.altsep in name)):
        _bad(path, f'invalid header: "{key}" is {name!r}, not the name of a file beside the .bin', fix)
    directory = os.path.dirname(os.path.abspath(header_path))
    named = os.path.join(directory, name)
    if not os.path.lexists(named):
        return  # a missing mask is named by its reader; a missing tokenizer only means none is known
    bin_path = token_paths(header_path)[0]
    beside = {os.path.realpath(directory), os.path.dirname(os.path.realpath(bin_path))}
    if not os.path.isfile(named) or os.path.dirname(os.path.realpath(named)) not in beside:
        what = 'links outside the .bin\'s directory' if os.path.islink(named) else 'is not a regular file'
        _bad(path, f'invalid header: "{key}" names {named!r}, which {what}', fix)


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


_BAD_MASK_MEMO: dict[tuple[Any, ...], int] = {}


def _first_bad_mask_value(mask_path: str, mask: np.ndarray) -> int:
    """Position of the first mask byte that is neither 0 nor 1 (-1: none), scanned in chunks; memoized."""
    st = os.stat(mask_path)
    key = (os.path.realpath(mask_path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _BAD_MASK_MEMO:
        _BAD_MASK_MEMO[key] = -1
        for start in range(0, mask.shape[0], _SCAN_CHUNK_TOKENS):
            bad = np.flatnonzero(np.asarray(mask[start:start + _SCAN_CHUNK_TOKENS]) > 1)
            if bad.size:
                _BAD_MASK_MEMO[key] = start + int(bad[0])
                break
    return _BAD_MASK_MEMO[key]


def _open_mask(path: Any, bin_path: str, header: dict[str, Any]) -> np.ndarray | None:
    """The loss mask the header names (`loss_mask`, relative to the .bin), memory-mapped; None without one."""
    name = header.get('loss_mask')
    if name is None:
        return None
    fix = NAMED_FILES['loss_mask']  # the name is read_header's to check
    mask_path = os.path.join(os.path.dirname(os.path.abspath(bin_path)), name)
    if not os.path.isfile(mask_path):
        _bad(path, f'the loss mask {mask_path} its header names is missing', fix)
    num_tokens, size_bytes = header['num_tokens'], os.path.getsize(mask_path)
    if size_bytes != num_tokens:
        _bad(path, f'the loss mask {mask_path} has {size_bytes:,} bytes but the file holds {num_tokens:,} tokens '
             '(one byte per token; truncated or partly written)', fix)
    mask = np.memmap(mask_path, dtype=np.uint8, mode='r', shape=(num_tokens,)) if num_tokens else np.zeros(0, np.uint8)
    bad = _first_bad_mask_value(mask_path, mask) if num_tokens else -1
    if bad >= 0:
        _bad(path, f'the loss mask {mask_path} holds {int(mask[bad])} at position {bad:,}; each byte is 0 (the '
             'prediction of that token does not count) or 1 (it counts)', fix)
    return mask


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
        the .bin size disagrees with the header, a token is >= vocab_size, the file is too
        short for one sequence, or the loss mask the header names is missing or invalid.
    """
    bin_path, header_path = token_paths(path)
    if not os.path.isfile(bin_path):
        _bad(path, f'the token file {bin_path} does not exist',
             f"check data.path, {_REWRITE}, or use data.kind='builtin'")
    header = read_header(path, header_path)
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
    return TokenFile(bin_path, header, tokens, _open_mask(path, bin_path, header))


def tokenizer_path(token_file: TokenFile) -> str | None:
    """The tokenizer file the header names (`"tokenizer"`, relative to the .bin), or None.

    Files written by `python -m jaxfrontier.prepare` record their Hugging Face tokenizer.json
    (and the end-of-text id, `"eot_id"`); older or hand-written files have no such key. The name
    is a file beside the .bin (`read_header` refuses any other).
    """
    name = token_file.header.get('tokenizer')
    if name is None:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(token_file.path)), name)


def run_token_path(data_config: Any) -> str:
    """The token file a run's data config names: data.path, or the first file of data.blend
    (the files of a blend share one tokenizer); '' for none. Takes a dict or ConfigDict."""
    blend = data_config.get('blend', '')
    return sampling.parse_blend(blend)[0][1] if blend else data_config.get('path', '')
