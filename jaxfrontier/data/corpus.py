"""Reading a text corpus for `python -m jaxfrontier.prepare`: files, formats and batches.

A corpus is a list of input files, each read as a stream of *pieces* of text: `Piece(text,
end_of_document, num_bytes)`. Formats (picked by the file's extension):

- `.txt`: one document per file. A file is read in pieces of about `PIECE_BYTES`, cut after a
  line end where there is one, so a file of any size streams in bounded memory.
- `.jsonl`: one JSON object per line, the document in the field `text_field`; blank lines skipped.
- `.parquet`: the document in the string column `text_field`, read in record batches (pyarrow).

Empty documents (and Parquet nulls) are skipped. `batches` groups pieces into batches of about
`batch_bytes` of text, the unit of work of the encoder. Nothing here holds more than one batch.
`read_records` reads whole JSON objects of .jsonl files instead: the conversations of
`prepare --sft` (data/chat.py), batched the same way.
Errors the user can fix raise `FlagError`: one line naming the flag, the problem and the fix.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import json
import os
from typing import Any, Iterable, Iterator

from jaxfrontier.errors import FlagError


PIECE_BYTES = 1 << 20  # a .txt file is encoded in pieces of about this size
FORMATS = {'.txt': 'text', '.jsonl': 'jsonl', '.parquet': 'parquet'}


@dataclasses.dataclass(frozen=True)
class Piece:
    """A piece of a document: the whole document, or a part of a large .txt file."""

    text: str
    end_of_document: bool  # the last piece of its document: an end-of-text token follows it
    num_bytes: int  # input-file bytes this piece accounts for (progress)


def expand_inputs(patterns: Iterable[str]) -> list[str]:
    """Expands comma-separated paths and globs into an ordered list of files, without repeats.

    Each pattern's matches are sorted, patterns keep their order; a directory is an error.

    Raises:
      FlagError: a pattern matches no file, names a directory or a file of unknown format.
    """
    paths: list[str] = []
    for pattern in (p.strip() for item in patterns for p in item.split(',')):
        if not pattern:
            continue
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if not os.path.isdir(m)] if glob.has_magic(pattern) else matches
        if not matches or not os.path.exists(matches[0]):
            raise FlagError('input', pattern, 'no such file' if not glob.has_magic(pattern)
                            else 'the glob matches no file', 'check the path (globs are expanded '
                            'by prepare: quote them, e.g. --input="data/*.jsonl")')
        for path in matches:
            if os.path.isdir(path):
                raise FlagError('input', path, 'is a directory', f'name its files, e.g. --input="{path}/*.txt"')
            if file_format(path) is None:
                raise FlagError('input', path, 'unknown format', f'use files ending in {", ".join(FORMATS)}')
            if path not in paths:
                paths.append(path)
    if not paths:
        raise FlagError('input', '', 'no input files', 'pass --input=FILE_OR_GLOB[,...]')
    return paths


def file_format(path: str) -> str | None:
    """'text', 'jsonl' or 'parquet' from the extension; None when unknown."""
    return FORMATS.get(os.path.splitext(path)[1].lower())


def read_pieces(paths: list[str], text_field: str) -> Iterator[Piece]:
    """Every piece of every file, in order (see the module docstring)."""
    readers = {'text': _text_pieces, 'jsonl': _jsonl_pieces, 'parquet': _parquet_pieces}
    for path in paths:
        yield from readers[file_format(path)](path, text_field)


def batches(pieces: Iterable[Any], batch_bytes: int) -> Iterator[list[Any]]:
    """Groups pieces (or records: anything with `num_bytes`) into lists holding about batch_bytes of
    input each (at least one)."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece.num_bytes
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _decode_error(path: str, offset: int, e: UnicodeDecodeError) -> FlagError:
    return FlagError('input', path, f'is not UTF-8 text (byte {offset + e.start:,}: {e.reason})',
                     'convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)')


def _text_pieces(path: str, text_field: str) -> Iterator[Piece]:
    """A .txt file as one document, in pieces cut after the last line end of each read."""
    del text_field
    decoder = codecs.getincrementaldecoder('utf-8')('strict')
    carry, unaccounted_bytes, offset = '', 0, 0  # text after the last cut; bytes read since
    with open(path, 'rb') as f:
        while chunk := f.read(PIECE_BYTES):
            try:
                text = carry + decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise _decode_error(path, offset, e) from None
            offset += len(chunk)
            unaccounted_bytes += len(chunk)
            cut = text.rfind('\n') + 1
            if not cut and len(text) >= PIECE_BYTES:  # a line longer than a piece: cut anywhere
                cut = len(text)
            if cut:
                yield Piece(text[:cut], False, unaccounted_bytes)
                unaccounted_bytes = 0
            carry = text[cut:]
    try:
        carry += decoder.decode(b'', final=True)
    except UnicodeDecodeError as e:
        raise _decode_error(path, offset, e) from None
    if offset:  # an empty file is no document
        yield Piece(carry, True, unaccounted_bytes)


@dataclasses.dataclass(frozen=True)
class Record:
    """One JSON object of a .jsonl file (a conversation for `prepare --sft`), and where it is."""

    value: dict[str, Any]
    path: str
    line: int  # 1-based line number in path
    num_bytes: int  # input-file bytes this record accounts for (progress, batches)


def read_records(paths: list[str]) -> Iterator[Record]:
    """Every JSON object of every .jsonl file, in order; blank lines skipped.

    Raises:
      FlagError: a file is not .jsonl, a line is not JSON or not an object.
    """
    require_jsonl(paths)
    for path in paths:
        for line_number, record, num_bytes in _jsonl_objects(path):
            yield Record(record, path, line_number, num_bytes)


def require_jsonl(paths: list[str]) -> None:
    """Raises FlagError naming the first file that is not .jsonl (conversations are JSON objects)."""
    for path in paths:
        if file_format(path) != 'jsonl':
            raise FlagError('input', path, 'conversations are read from .jsonl files (one JSON object per line)',
                            'convert the file to JSONL, e.g. {"messages": [{"role": "user", "content": "..."}, ...]}')


def _jsonl_objects(path: str) -> Iterator[tuple[int, dict[str, Any], int]]:
    """(line number, object, bytes) of each non-blank line of a .jsonl file."""
    with open(path, 'rb') as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than json's limit
                raise FlagError('input', path, f'line {line_number} is not JSON ({" ".join(str(e).split())[:200]})',
                                'fix the line, or convert the file to one JSON object per line') from None
            if not isinstance(record, dict):
                raise FlagError('input', path, f'line {line_number} is a JSON {type(record).__name__}, not an '
                                'object', 'write one JSON object per line, e.g. {"text": "..."}')
            yield line_number, record, len(line)


def _jsonl_pieces(path: str, text_field: str) -> Iterator[Piece]:
    """One document per JSON line, from its field text_field."""
    for line_number, record, num_bytes in _jsonl_objects(path):
        if text_field not in record:
            fields = sorted(record)
            raise FlagError('text_field', text_field, f'line {line_number} of {path} has no field '
                            f'{text_field!r} (its fields: {fields})',
                            'pass --text_field=<the field holding the text>')
        text = record[text_field]
        if not isinstance(text, str):
            raise FlagError('text_field', text_field, f'line {line_number} of {path}: the field is '
                            f'{type(text).__name__}, not a string', 'pass --text_field=<a text field>')
        if text:
            yield Piece(text, True, num_bytes)


def _parquet_batches(parquet: Any, text_field: str, path: str) -> Iterator[list[Any]]:
    """The column's values, a record batch at a time; a damaged page or invalid UTF-8 is one FlagError."""
    import pyarrow as pa  # pylint: disable=g-import-not-at-top
    batches = parquet.iter_batches(batch_size=1024, columns=[text_field])
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            values = batch.column(0).to_pylist()
        except (OSError, pa.ArrowException, UnicodeDecodeError) as e:
            raise FlagError('input', path, f'cannot read it as Parquet ({" ".join(str(e).split())[:200]})',
                            'check the file (a .parquet file written by pyarrow, pandas or datasets)') from None
        yield values


def _parquet_pieces(path: str, text_field: str) -> Iterator[Piece]:
    """One document per row of the string column text_field, read a record batch at a time."""
    import pyarrow as pa  # pylint: disable=g-import-not-at-top  (only Parquet needs it)
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

    try:
        parquet = pq.ParquetFile(path)
        parquet.schema_arrow  # pylint: disable=pointless-statement  (its strings are decoded here)
    except (OSError, pa.ArrowException, UnicodeDecodeError) as e:  # UnicodeDecodeError: tests/fuzz
        raise FlagError('input', path, f'cannot read it as Parquet ({" ".join(str(e).split())})',
                        'check the file (a .parquet file written by pyarrow, pandas or datasets)') from None
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise FlagError('text_field', text_field, f'{path} has no column {text_field!r} (its columns: '
                        f'{names})', 'pass --text_field=<the column holding the text>')
    column_type = parquet.schema_arrow.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise FlagError('text_field', text_field, f'column {text_field!r} of {path} is {column_type}, '
                        'not a string', 'pass --text_field=<a string column>')
    num_rows = max(parquet.metadata.num_rows, 1)
    file_bytes, done_bytes, done_rows = os.path.getsize(path), 0, 0
    for record_batch in _parquet_batches(parquet, text_field, path):
        for text in record_batch:
            done_rows += 1
            now_bytes = file_bytes * done_rows // num_rows  # progress: the file's share of rows
            if text:
                yield Piece(text, True, now_bytes - done_bytes)
                done_bytes = now_bytes
