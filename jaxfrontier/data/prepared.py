"""prepare's output: the files of DIR/NAME, written as temporaries and published atomically.

Output `DIR/NAME` is `NAME.tokenizer.json` and, per part, tokens and a header: `NAME.bin` /
`NAME.json`, or with a split by documents `NAME_train.*` and `NAME_val.*` (documents.py). With
a loss mask (`prepare --sft`) each part also has its mask, `NAME.mask.bin` (`NAME_train.mask.bin`,
...), one uint8 per token, which the header names (token_files.py).

Everything is written to `*.tmp-<pid>` files first and renamed into place at the end, the
headers last (the old headers are removed first), so a crash or kill leaves the previous output
(or none) and never a header describing a partial .bin or mask; a rerun simply starts over and
removes the stale `*.tmp-<pid>` files of dead runs. With a split or a shuffle the encoder writes
the corpus in order to stream temporaries (tokens, and mask), which `split_streams` then copies
into the parts document by document.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
from typing import Any, BinaryIO

import numpy as np

from jaxfrontier import distributed
from jaxfrontier.data import documents, token_files
from jaxfrontier.errors import FlagError

TOKENIZER_SUFFIX = '.tokenizer.json'


def part_key(part: str) -> str:
    """The key prefix of a part's files in `output_paths`: '' for the one file, 'train_', 'val_'."""
    return f'{part}_' if part else ''


def output_paths(output: str, parts: tuple[str, ...] = ('',)) -> dict[str, str]:
    """The files of output DIR/NAME: tokenizer, and bin, header and mask of each part.

    Part '' is NAME.bin / NAME.json / NAME.mask.bin (keys 'bin', 'header', 'mask'); a split's
    parts 'train' and 'val' are NAME_train.bin ('train_bin', ...) and NAME_val.*, sharing
    NAME.tokenizer.json.
    """
    root = token_files.token_paths(output)[0][:-len('.bin')]
    paths = {'tokenizer': root + TOKENIZER_SUFFIX}
    for part in parts:
        key, name = part_key(part), (f'{root}_{part}' if part else root)
        paths.update({key + 'bin': name + '.bin', key + 'header': name + '.json',
                      key + 'mask': name + token_files.MASK_SUFFIX})
    return paths


def remove_stale_temporaries(paths: dict[str, str]) -> None:
    """Deletes `*.tmp-<pid>` files of these outputs left by runs that are no longer alive."""
    for final in paths.values():
        for tmp in glob.glob(glob.escape(final) + '.tmp-*'):
            match = re.fullmatch(r'.*\.tmp-(\d+)', tmp)
            if match and not distributed.pid_alive(int(match.group(1))):
                with contextlib.suppress(OSError):
                    os.remove(tmp)


def write_small(path: str, text: str) -> None:
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclasses.dataclass(frozen=True)
class Output:
    """Where one prepare run writes: final and temporary paths, and what it writes."""

    paths: dict[str, str]  # output_paths
    tmp: dict[str, str]  # the same keys, plus 'stream' and 'stream_mask': `*.tmp-<pid>`
    parts: tuple[str, ...]  # ('',) or ('train', 'val')
    streamed: bool  # split or shuffle: the corpus goes to the stream temporaries first
    masks: bool  # a loss mask beside every .bin


def open_output(output: str, parts: tuple[str, ...], streamed: bool,
                masks: bool = False) -> tuple[Output, BinaryIO, BinaryIO | None]:
    """(the Output, the open temporary .bin, the open temporary mask or None); checks DIR is writable."""
    if os.path.isdir(output) or output.endswith(os.sep):  # NAME.bin would land beside the directory
        raise FlagError('output', output, 'is a directory; --output is DIR/NAME (writes NAME.bin, NAME.json and '
                        'NAME.tokenizer.json in DIR)', f'pass --output={os.path.join(output, "NAME")}')
    paths = output_paths(output, parts)
    directory = os.path.dirname(os.path.abspath(paths['tokenizer']))
    stream = paths['tokenizer'][:-len(TOKENIZER_SUFFIX)] + '.stream.bin'  # split or shuffle: the corpus in order
    streams = {'stream': stream, 'stream_mask': stream[:-len('.bin')] + token_files.MASK_SUFFIX}
    tmp = {key: f'{path}.tmp-{os.getpid()}' for key, path in {**paths, **streams}.items()}
    out = Output(paths, tmp, parts, streamed, masks)
    files: list[BinaryIO] = []
    try:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries({**paths, **streams})
        files.append(open(tmp['stream'] if streamed else tmp['bin'], 'wb'))
        if masks:
            files.append(open(tmp['stream_mask'] if streamed else tmp['mask'], 'wb'))
        return out, files[0], files[1] if masks else None
    except OSError as e:
        for f in files:
            f.close()
        discard(out)
        raise FlagError('output', output, f'cannot write in {directory} ({e.strerror or e})',
                        'pass an --output=DIR/NAME whose DIR you can write') from None


def discard(out: Output) -> None:
    """Removes every temporary of this run (after a failure)."""
    for path in out.tmp.values():
        with contextlib.suppress(OSError):
            os.remove(path)


def split_streams(out: Output, dtype: str, lengths: np.ndarray,
                  split: documents.Split) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Copies the in-order stream temporaries (tokens, and mask) into each part's (documents.plan);
    removes them. Returns (each part's document ids, its tokens)."""
    parts = documents.plan(len(lengths), split)
    streams = [('stream', 'bin', np.dtype(token_files.NUMPY_DTYPES[dtype]))]
    streams += [('stream_mask', 'mask', np.dtype(np.uint8))] if out.masks else []
    written: dict[str, int] = {}
    for stream, kind, np_dtype in streams:
        files = {part: open(out.tmp[part_key(part) + kind], 'wb') for part in parts}
        try:
            tokens = np.memmap(out.tmp[stream], dtype=np_dtype, mode='r')
            written = documents.write_parts(tokens, lengths, parts, files)
            del tokens
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in files.values():
                f.close()
        os.remove(out.tmp[stream])
    return parts, written


def publish(out: Output, tokenizer_json: str, headers: dict[str, Any]) -> None:
    """Renames the temporaries into place: the old headers go first (and an old mask this output
    does not replace), the new headers come last."""
    write_small(out.tmp['tokenizer'], tokenizer_json)
    keys = [part_key(part) for part in headers]
    for key, header in zip(keys, headers.values()):
        write_small(out.tmp[key + 'header'], json.dumps(header, indent=1) + '\n')
        with contextlib.suppress(FileNotFoundError):
            os.remove(out.paths[key + 'header'])
        if not out.masks:
            with contextlib.suppress(FileNotFoundError):
                os.remove(out.paths[key + 'mask'])
    data = [k + 'bin' for k in keys] + ([k + 'mask' for k in keys] if out.masks else [])
    for key in data + ['tokenizer'] + [k + 'header' for k in keys]:
        os.chmod(out.tmp[key], 0o644)
        os.replace(out.tmp[key], out.paths[key])
