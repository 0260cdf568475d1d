"""A run's data: the data config checked, split into (train, validation) sources, and each step's global batch.

A batch is a pure function of (seed, split, step): row r of step s is the source's window
k = step * global_batch + r (sources.py); `data.blend` mixes several files with fixed rows per
step (sampling.py). Any process can read any subset of rows and get the same values however
many processes or devices there are; `make_global_batch` relies on that to read only the rows
of the shards a process holds.

JAX is imported only inside `make_global_batch`: importing this module starts nothing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import ml_collections
import numpy as np

from jaxfrontier.config import DATA_KINDS
from jaxfrontier.data import loss_mask, sampling
from jaxfrontier.data.builtin import BYTE_VOCAB, builtin_corpus
from jaxfrontier.data.sources import TRAIN, VAL, Source, SyntheticSource, TokenSource
from jaxfrontier.data.token_files import (KINDS, OBJECTIVE_KINDS, TokenFile, file_kind, open_token_file, read_header,
                                          run_token_path, token_paths, tokenizer_path)
from jaxfrontier.errors import ConfigError, UserError


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What the data needs of the run besides its own `data` section: every step reads `global_batch`
    windows of `seq_len + 1` token ids below `vocab_size`, in the order `seed` draws."""

    seq_len: int
    vocab_size: int
    global_batch: int
    seed: int

    @classmethod
    def of(cls, c: ml_collections.ConfigDict) -> BatchSpec:
        """From a run's config: model.seq_len, model.vocab_size (resolved), train.global_batch, seed."""
        return cls(c.model.seq_len, c.model.vocab_size, c.train.global_batch, c.seed)


def _split_boundary(d: ml_collections.ConfigDict, spec: BatchSpec, token_file: TokenFile) -> int:
    """First validation token: the last data.val_fraction of the stream is validation (all trains with data.val_path)."""
    num_tokens, needed = token_file.num_tokens, spec.seq_len + 1
    if d.get('val_path', ''):
        return num_tokens
    num_val = int(num_tokens * d.val_fraction)
    if num_val < needed:
        problem = (f'the validation split gets {num_val:,} of the {num_tokens:,} tokens of '
                   f'{token_file.path}, fewer than one sequence (model.seq_len + 1 = {needed})')
        if num_tokens <= 2 * needed:  # no val_fraction < 0.5 can help
            raise ConfigError('data.path', token_file.path, problem,
                              'use a longer token file or a smaller model.seq_len')
        raise ConfigError('data.val_fraction', d.val_fraction, problem,
                          f'raise data.val_fraction to at least {needed / num_tokens:.4g}, use a '
                          'longer token file, or lower model.seq_len')
    return num_tokens - num_val


def _open_checked(d: ml_collections.ConfigDict, spec: BatchSpec, path: str) -> tuple[TokenFile, int]:
    token_file = open_token_file(path, spec.vocab_size, seq_len=spec.seq_len)
    return token_file, _split_boundary(d, spec, token_file)


def _as_blend_error(value: str, e: ConfigError, path: str, field: str = 'data.blend') -> ConfigError:
    """A data.path error about one file of data.blend (or of `field`, e.g. data.val_path, whose value is
    `value`), renamed to it."""
    problem = str(e).split('. Fix: ')[0][len(f'config.{e.field} = {e.value!r}: '):]
    fix = str(e).split('. Fix: ', 1)[1] if '. Fix: ' in str(e) else 'check the path'
    problem = f'{path}: {problem}' if path not in problem else problem
    return ConfigError(field, value, problem, fix)


def _blend_files(d: ml_collections.ConfigDict,
                 spec: BatchSpec) -> tuple[list[int], list[str], list[tuple[TokenFile, int]]]:
    """Parses data.blend, opens and checks every file: (rows per step of each, paths, [(file, boundary)])."""
    entries = sampling.parse_blend(d.blend)
    weights, paths = [w for w, _ in entries], [p for _, p in entries]
    opened = []
    for path in paths:
        try:
            opened.append(_open_checked(d, spec, path))
        except ConfigError as e:
            if e.field != 'data.path':
                raise
            raise _as_blend_error(d.blend, e, path) from None
    _check_same_tokenizer(d.blend, [f for f, _ in opened])
    return sampling.check_blend_counts(d.blend, paths, weights, spec.global_batch), paths, opened


def _tokenizer_bytes(token_file: TokenFile) -> bytes | None:
    path = tokenizer_path(token_file)
    if path is None or not os.path.isfile(path):
        return None
    with open(path, 'rb') as f:
        return f.read()


def _check_same_tokenizer(blend: str, files: list[TokenFile], field: str = 'data.blend',
                          fix: str = 'blend only files written with the same tokenizer') -> None:
    """All files share vocab_size, eot_id and (where recorded) the tokenizer file; files[0] is the reference."""
    first = files[0]
    for other in files[1:]:
        for key in ('vocab_size', 'eot_id'):
            a, b = first.header.get(key), other.header.get(key)
            if key == 'vocab_size' or (a is not None and b is not None):
                if a != b:
                    raise ConfigError(field, blend, f'{first.path} has {key} {a} but {other.path} has {b}: '
                                      f'the files were tokenised differently', f'{fix} (re-run python -m '
                                      'jaxfrontier.prepare --tokenizer=...)')
        a, b = _tokenizer_bytes(first), _tokenizer_bytes(other)
        if a is not None and b is not None and a != b:
            raise ConfigError(field, blend, f'{first.path} and {other.path} name different tokenizer files', fix)



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
            vocabs.append(read_header(p, header_path)['vocab_size'])
        except ConfigError as e:
            raise (_as_blend_error(blend, e, p) if blend else e) from None
    if len(set(vocabs)) > 1:
        i = next(i for i, v in enumerate(vocabs) if v != vocabs[0])
        raise ConfigError('data.blend', blend, f'{paths[0]} has vocab_size {vocabs[0]} but {paths[i]} has '
                          f'{vocabs[i]}: the files were tokenised differently',
                          'blend only files written with the same tokenizer')
    c.model.vocab_size = int(vocabs[0])


def resolve_eot(c: ml_collections.ConfigDict) -> None:
    """`data.pack_documents`: sets `data.eot_id = -1` to the token file header's `eot_id` (the token
    `python -m jaxfrontier.prepare` writes after every document; the files of a blend share it).

    Raises:
      ConfigError: the data has no documents (builtin, synthetic), the header names no end-of-text
        token and data.eot_id is unset, or data.eot_id disagrees with the header.
    """
    if not c.data.pack_documents:
        return
    path = run_token_path(c.data)
    if c.data.kind != 'tokens' or not path:
        raise ConfigError('data.pack_documents', True, f'data.kind={c.data.kind!r} has no documents to keep apart '
                          '(no end-of-text token between them)', 'use data.kind=tokens with a file from python -m '
                          'jaxfrontier.prepare, or data.pack_documents=false')
    bin_path, header_path = token_paths(path)
    if not os.path.isfile(bin_path):
        return  # check_data names the missing file
    header_eot = read_header(path, header_path).get('eot_id')
    if header_eot is None and c.data.eot_id < 0:
        raise ConfigError('data.pack_documents', True, f'the header of {bin_path} names no end-of-text token '
                          '("eot_id"), so its document boundaries are unknown',
                          'set data.eot_id to the token that ends each document, or re-tokenize with python -m '
                          'jaxfrontier.prepare')
    if header_eot is not None and c.data.eot_id >= 0 and c.data.eot_id != header_eot:
        raise ConfigError('data.eot_id', c.data.eot_id, f'the header of {bin_path} says the end-of-text token '
                          f'is {header_eot}', "set data.eot_id=-1 (the header's) or to the header's id")
    if c.data.eot_id < 0:
        if not (isinstance(header_eot, int) and not isinstance(header_eot, bool) and header_eot >= 0):
            raise ConfigError('data.pack_documents', True, f'the header of {bin_path} has eot_id {header_eot!r}, '
                              'not a token id', 'set data.eot_id to the token that ends each document')
        c.data.eot_id = int(header_eot)


def _run_token_files(c: ml_collections.ConfigDict) -> list[tuple[str, str]]:
    """(field, path) of every token file the run reads: data.path or the files of data.blend, then
    those of data.val_path."""
    blend, val_path = c.data.get('blend', ''), c.data.get('val_path', '')
    files = ([('data.blend', p) for _, p in sampling.parse_blend(blend)] if blend else
             [('data.path', c.data.path)] if c.data.path else []) if c.data.kind == 'tokens' else []
    return files + ([('data.val_path', p) for _, p in val_entries(val_path)] if val_path else [])


def resolve_loss_mask(c: ml_collections.ConfigDict) -> None:
    """`data.loss_mask='auto'`: 'on' when a token file of the run carries a loss mask (its header's
    `loss_mask`: python -m jaxfrontier.prepare --sft), else 'off'; 'on' needs such a file.

    With 'on' the loader flags the tokens whose prediction does not count (data/loss_mask.py) and
    the steps count them out; a file without a mask counts every prediction.

    Raises:
      ConfigError: 'on' but no file of the run has a mask, or the vocabulary reaches the flag bit.
    """
    setting = c.data.get('loss_mask', 'off')
    if setting not in ('auto', 'on'):
        return  # 'off', or a value config.validate names
    masked = []
    for field, path in _run_token_files(c):
        bin_path, header_path = token_paths(path)
        if not (os.path.isfile(bin_path) and os.path.isfile(header_path)):
            continue  # check_data names what is missing
        try:
            header = read_header(path, header_path)
        except ConfigError as e:
            value = c.data[field.split('.')[1]]
            raise (e if field == 'data.path' else _as_blend_error(value, e, path, field)) from None
        masked += [bin_path] if header.get('loss_mask') is not None else []
    if setting == 'on' and not masked:
        raise ConfigError('data.loss_mask', 'on', "none of the run's token files carries a loss mask (a header "
                          '"loss_mask")', "set data.loss_mask='auto' (use a file's mask if it has one) or 'off', or "
                          'write the data with python -m jaxfrontier.prepare --sft')
    c.data.loss_mask = 'on' if masked else 'off'
    if masked and c.model.vocab_size > loss_mask.MAX_VOCAB:
        raise ConfigError('model.vocab_size', c.model.vocab_size, f'a loss mask ({masked[0]}) travels as bit 30 of '
                          f'each token, so the vocabulary must stay below {loss_mask.MAX_VOCAB:,}',
                          "set data.loss_mask='off' to train on every token, or use a smaller vocabulary")


def resolve_headers(c: ml_collections.ConfigDict) -> None:
    """What the config takes from the token file headers: `model.vocab_size=0`, packing's
    `data.eot_id=-1` and `data.loss_mask='auto'` (resolve_vocab, resolve_eot, resolve_loss_mask)."""
    resolve_vocab(c)
    resolve_eot(c)
    resolve_loss_mask(c)


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
    d, spec = c.data, BatchSpec.of(c)
    if d.kind == 'tokens' and d.get('blend', ''):
        train = [('data.blend', d.blend, f) for f, _ in _blend_files(d, spec)[2]]
    elif d.kind == 'tokens':
        train = [('data.path', d.path, _open_checked(d, spec, d.path)[0])]
    else:
        train = []
    val = [('data.val_path', d.val_path, f) for f in _val_files(d, spec, [f for _, _, f in train[:1]])] if d.get(
        'val_path', '') else []
    objective = c.train.get('objective', 'lm')
    if d.kind != 'tokens':  # builtin, synthetic: a plain stream
        check_kind('data.kind', d.kind, f'data.kind={d.kind!r}', {}, objective)
    for field, value, token_file in train + val:
        check_kind(field, value, token_file.path, token_file.header, objective)


# What each train.objective wants, for the fix; what reading a kind it does not read would do, where that is worse
# than a refusal. _SCORES, _SCORING: the same for --mode=eval of a run of that objective (check_scored_kind).
_WANTS = {'lm': 'a file of python -m jaxfrontier.prepare (--sft for conversations)',
          'dpo': 'preference pairs of python -m jaxfrontier.prepare --dpo (data.kind=tokens)'}
_WOULD = {('lm', 'dpo'): ': it would train on every row as text, the chosen and the rejected answers alike'}
_SCORES = {'lm': 'text or conversations (python -m jaxfrontier.prepare, --sft for conversations)',
           'dpo': 'preference pairs (python -m jaxfrontier.prepare --dpo)'}
_SCORING = {('lm', 'dpo'): ': its perplexity would score every row as text, the chosen and the rejected answers '
                           'alike'}


def kind_mismatch(header: dict[str, Any], objective: str) -> tuple[str, str] | None:
    """(the file's kind, the objective that reads it) when `objective` does not read the kind of a token file
    with `header` (token_files.file_kind, OBJECTIVE_KINDS), else None; an unknown objective is dpo.check_run's
    to name."""
    kind = file_kind(header)
    if objective not in OBJECTIVE_KINDS or kind in OBJECTIVE_KINDS[objective]:
        return None
    return kind, next(o for o, kinds in OBJECTIVE_KINDS.items() if kind in kinds)


def check_kind(field: str, value: str, path: str, header: dict[str, Any], objective: str) -> None:
    """The kind of the token file at `path` (token_files.file_kind of its header) must be one `objective` reads
    (kind_mismatch).

    Raises:
      ConfigError: naming `field` (data.path, data.blend, data.val_path or data.kind), the file, its kind and
        the fix.
    """
    mismatch = kind_mismatch(header, objective)
    if mismatch is None:
        return
    kind, reader = mismatch
    raise ConfigError(field, value, f'{path} holds {KINDS[kind]} (kind {kind}), which train.objective={objective!r} '
                      f'does not read{_WOULD.get((objective, kind), "")}',
                      f'set train.objective={reader} to train on it, or pass '
                      f'{_WANTS.get(objective, "a file it reads")}')


def check_scored_kind(where: str, header: dict[str, Any], objective: str) -> None:
    """check_kind for --mode=eval (inference/evaluate.py): the file `where` names (its flag or the run's field and
    its path) must be of a kind a run of `objective` (the run's saved train.objective) reads.

    Raises:
      UserError: one line naming the file, its kind and the fix.
    """
    mismatch = kind_mismatch(header, objective)
    if mismatch is None:
        return
    kind, reader = mismatch
    raise UserError(f'{where}: holds {KINDS[kind]} (kind {kind}), which a run of train.objective={objective!r} does '
                    f'not score{_SCORING.get((objective, kind), "")}. Fix: pass --eval_path=FILE.bin of '
                    f'{_SCORES.get(objective, "a file it reads")}, or evaluate it with the --workdir of a '
                    f'train.objective={reader} run.')


def val_entries(val_path: str) -> list[tuple[float, str]]:
    """data.val_path as [(weight, path)]: a blend 'W:PATH,W:PATH' (it starts with a number and ':'),
    else one file of weight 1."""
    weight, sep, _ = val_path.partition(':')
    try:
        float(weight)
    except ValueError:
        return [(1.0, val_path)]
    if not sep:
        return [(1.0, val_path)]
    try:
        return sampling.parse_blend(val_path)
    except ConfigError as e:
        raise ConfigError('data.val_path', val_path, str(e).split(': ', 1)[1].split('. Fix: ')[0],
                          "write data.val_path as a .bin path or 'WEIGHT:PATH,WEIGHT:PATH'") from None


def _val_files(d: ml_collections.ConfigDict, spec: BatchSpec, train: list[TokenFile]) -> list[TokenFile]:
    """Opens and checks the files of data.val_path: each a sequence long, each the training tokenizer's.

    `train`: the training data's first file (its tokenizer is the blend's), none for builtin.
    """
    val_path, opened = d.val_path, []
    for _, path in val_entries(val_path):
        try:
            opened.append(open_token_file(path, spec.vocab_size, seq_len=spec.seq_len))
        except ConfigError as e:
            problem = str(e).split('. Fix: ')[0][len(f'config.{e.field} = {e.value!r}: '):]
            fix = str(e).split('. Fix: ', 1)[1].replace('data.path', 'data.val_path') if '. Fix: ' in str(e) else ''
            raise ConfigError('data.val_path', val_path, problem if path in problem else f'{path}: {problem}',
                              fix or 'check the path') from None
        if not train and opened[-1].header['vocab_size'] != BYTE_VOCAB:  # builtin: bytes
            raise ConfigError('data.val_path', val_path, f'{path} has vocab_size {opened[-1].header["vocab_size"]} '
                              f'but the built-in corpus is bytes ({BYTE_VOCAB})',
                              'evaluate on a file of the training data\'s tokenizer')
    _check_same_tokenizer(val_path, train + opened, 'data.val_path',
                          "evaluate on files written with the training data's tokenizer")
    return opened


def _mask(d: ml_collections.ConfigDict, token_file: TokenFile):
    """The file's loss mask when the run uses masks (data.loss_mask resolved to 'on'), else None."""
    return token_file.mask if d.get('loss_mask', 'off') == 'on' else None


def _splits(d: ml_collections.ConfigDict, spec: BatchSpec, token_file: TokenFile, boundary: int,
            name: str) -> tuple[TokenSource, TokenSource]:
    mask = _mask(d, token_file)
    return (TokenSource(token_file.tokens, 0, boundary, spec.seq_len, spec.seed, TRAIN, f'{name} train', mask),
            TokenSource(token_file.tokens, boundary, token_file.num_tokens, spec.seq_len, spec.seed, VAL,
                        f'{name} val', mask))


def builtin_cache_dir(d: Mapping[str, Any], workdir: str) -> str:
    """Where the built-in corpus is cached: `d.cache_dir` as an entry point resolved it (an absolute
    path, config.data_cache_dir), else (`workdir`, or `auto` that nothing resolved) `<workdir>/data_cache`."""
    setting = d.get('cache_dir', 'workdir')
    return setting if os.path.isabs(setting) else os.path.join(workdir, 'data_cache')


def make_datasets(d: ml_collections.ConfigDict, workdir: str, spec: BatchSpec) -> tuple[Source, Source]:
    """Returns (train, validation) sources of the run's `data` section `d` (`d.kind`).

    builtin: the stdlib corpus, cached in `builtin_cache_dir`; tokens: `d.path`, or
    the files of `d.blend` mixed with their weights (each split per file);
    synthetic: random tokens, no file. Token files split into train (first part) and
    validation (the last `d.val_fraction`); no window crosses the boundary. The config has passed
    `check_data` (run/validation.py runs it once per run, before anything is written).
    """
    if d.kind == 'synthetic':
        return (SyntheticSource(spec.vocab_size, spec.seq_len, spec.seed, TRAIN),
                SyntheticSource(spec.vocab_size, spec.seq_len, spec.seed, VAL))
    if d.kind == 'tokens' and d.get('blend', ''):
        counts, paths, opened = _blend_files(d, spec)
        splits = [_splits(d, spec, f, boundary, f'tokens {f.path} (kind {file_kind(f.header)})')
                  for f, boundary in opened]
        names = tuple(sampling.source_names(paths))
        weights = tuple(w for w, _ in sampling.parse_blend(d.blend))
        train, val = (sampling.BlendSource(tuple(s[i] for s in splits), tuple(counts), names, weights, spec.seed, i)
                      for i in (TRAIN, VAL))
        first = opened[0][0]
    else:
        path = builtin_corpus(builtin_cache_dir(d, workdir)) if d.kind == 'builtin' else d.path
        first, boundary = _open_checked(d, spec, path)
        train, val = _splits(d, spec, first, boundary, f'{d.kind} {first.path} (kind {file_kind(first.header)})')
    if d.get('val_path', ''):
        val = _val_source(d, spec, [first] if d.kind == 'tokens' else [])
    return train, val


def _val_source(d: ml_collections.ConfigDict, spec: BatchSpec, train: list[TokenFile]) -> Source:
    """The held-out files of data.val_path, each read whole: one TokenSource, or a BlendSource of them."""
    files, entries = _val_files(d, spec, train), val_entries(d.val_path)
    sources = tuple(TokenSource(f.tokens, 0, f.num_tokens, spec.seq_len, spec.seed, VAL,
                                f'held-out {f.path} (kind {file_kind(f.header)})',
                                _mask(d, f)) for f in files)
    if len(sources) == 1 and entries[0][0] == 1.0 and d.val_path == entries[0][1]:
        return sources[0]
    weights = tuple(w for w, _ in entries)
    counts = tuple(sampling.blend_counts(list(weights), spec.global_batch))
    return sampling.BlendSource(sources, counts, tuple(sampling.source_names([p for _, p in entries])), weights,
                                spec.seed, VAL)


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


def tail_split_warning(d: ml_collections.ConfigDict) -> str | None:
    """A warning when evaluation reads the tail of token files whose documents were not shuffled, else None.

    The last data.val_fraction of a stream in corpus order (files sorted by name, a crawl site by
    site) holds documents unlike the rest, so its loss says little about held-out text. prepare
    records `documents_shuffled` in the header; a file without it (older, hand-written) is
    unknown and warned about too. The built-in corpus (a fixed smoke-test stream) is not.
    """
    if d.kind != 'tokens' or d.get('val_path', ''):
        return None
    blend = d.get('blend', '')
    paths = [p for _, p in sampling.parse_blend(blend)] if blend else [d.path]
    unshuffled, sibling = [], None
    for path in paths:
        header = read_header(path, token_paths(path)[1])
        if header.get('documents_shuffled') is True:
            continue
        order = 'in corpus order' if header.get('documents_shuffled') is False else 'of unknown order'
        unshuffled.append(f'{token_paths(path)[0]} (documents {order})')
        split = header.get('split')
        if isinstance(split, dict) and split.get('part') == 'train' and token_paths(path)[0].endswith('_train.bin'):
            candidate = token_paths(path)[0][:-len('_train.bin')] + '_val.bin'
            sibling = sibling or (candidate if os.path.isfile(candidate) else None)
    if not unshuffled:
        return None
    fix = (f'set data.val_path={sibling} (the held-out documents prepare wrote)' if sibling else
           'split held-out documents at random with python -m jaxfrontier.prepare ... --val_fraction=0.01 '
           '(or --val_documents=N) and train with data.path=NAME_train.bin data.val_path=NAME_val.bin, '
           'or set data.val_path to held-out text')
    return (f'the validation split is the last {d.val_fraction:g} of {", ".join(unshuffled)}: a tail of '
            f'an unshuffled stream, whose eval loss may say little about held-out text. Fix: {fix}')
