"""Where an export may write, and writing it whole or not at all (issue 48: exports).

`--export_path` set to the run's base (`checkpoint.init_params_from`) replaced the pretrained
model.safetensors and config.json (a LoRA run on it could not resume; a PEFT export made
transformers load the base with the adapter applied), and an export into
`<workdir>/checkpoints/<step>` was deleted by the next run's checkpoint rotation; both exited 0.

`check_dir` (Hugging Face and PEFT directories) refuses, with one line and before anything is
written, a target that is
- a run's input: the base (`init_params_from` of the command's config, of the source run's
  resolved config.json or checkpoint meta, the base a LoRA checkpoint recorded) or a path inside
  it; the fast tier or data cache the run writes (or a path inside them); a data file the config
  names, or its directory (symlinks resolved);
- a training workdir, or inside one's run-owned directories (`RUN_SUBDIRS`: `checkpoints/`, ...):
  the source's workdir and any directory above the target that looks like one
  (`run_files.is_training_workdir`); `<workdir>/hf` (the default) is no such directory;
- a directory holding another model's files (`_FOREIGN`: for a Hugging Face export weights, shards,
  an index, adapters; for PEFT model weights or another adapter);
- any other non-empty directory, unless it holds only a previous export of ours of the same kind
  (this module's MARKER lists its kind, step and files) and `force` is set;
- below a file, or on a file system it cannot write.
`check_file` holds a safetensors file to the first two rules (a file directly in a workdir may not
take the name of one of the run's own files).

`staged` writes the export into `<target>.export-tmp<pid>/` beside the target and swaps it in with
one rename (Linux: renameat2's RENAME_EXCHANGE for a replaced export; elsewhere two renames, the old
one kept as `<target>.export-old<pid>` between them), so a kill leaves the old export or the new
one, never a mix; what a killed writer left is removed (or put back) by the next export. A full
disk, a quota or a read-only file system is one line (DiskFullError, UserError), and nothing is
left behind. No JAX here: main calls `check_dir` before JAX starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import sys
from typing import Any, Iterable, Iterator

from jaxfrontier import files
from jaxfrontier.distributed import pid_alive
from jaxfrontier.errors import DiskFullError, UserError, disk_full
from jaxfrontier.checkpoint import run_files
from jaxfrontier.data import token_files

MARKER = 'jaxfrontier_export.json'  # {"format", "kind", "step", "files"}: what an export of ours wrote
MARKER_FORMAT = 'jaxfrontier-export'
KIND_NAMES = {'hf': 'Hugging Face', 'peft': 'PEFT adapter'}
# What a run writes or rotates below its workdir (checkpoint/format.py's CHECKPOINT_SUBDIR and SUPERSEDED_SUBDIR,
# data/loader.py's data_cache, the watchdog's hang/, profile/, tensorboard/): spelled here to keep JAX out.
RUN_SUBDIRS = ('checkpoints', 'checkpoints.superseded', 'data_cache', 'hang', 'profile', 'tensorboard')
RUN_FILES = ('config.json', 'metrics.jsonl', 'goodput.json', 'workdir.lock')  # a workdir's own files
# The saved config's fields that name what a run reads or writes: (section, key, what). `dir`: nothing may be
# written in it; `data`: a token file (its .bin and .json), neither it nor its directory may be the target.
PATH_FIELDS = (('checkpoint', 'init_params_from', 'base'), ('checkpoint', 'fast_dir', 'dir'),
               ('data', 'cache_dir', 'dir'), ('data', 'path', 'data'), ('data', 'val_path', 'data'))
NOT_PATHS = ('', 'auto', 'workdir', 'off')  # settings of those fields that name no path
_FOREIGN = {  # another model's files, by export kind: an export there would mix with them or replace them
    'hf': re.compile(r'model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin'
                     r'|tf_model\.h5|flax_model\.msgpack|adapter_config\.json|adapter_model\..*'),
    'peft': re.compile(r'model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin'
                       r'|tf_model\.h5|flax_model\.msgpack|adapter_config\.json|adapter_model\..*'),
}
_TEMPORARY = re.compile(r'.*\.tmp(\d+)')  # files.write_atomic's `<file>.tmp<pid>` (an export killed mid-file)
STAGING, OLD = '.export-tmp', '.export-old'  # `<target>.export-tmp<pid>`, `<target>.export-old<pid>` (staged)


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, directory: str) -> bool:
    """Whether real path `path` is `directory` or below it."""
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _json(path: str) -> Any:
    try:
        with open(path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError, RecursionError):
        return None


def run_root(source: str) -> str:
    """The workdir of an export's source: a workdir, its checkpoints/ directory or one step directory."""
    source = os.path.abspath(source)
    if os.path.isdir(os.path.join(source, 'state')):  # a step directory: <workdir>/checkpoints/<step>
        source = os.path.dirname(source)
    return os.path.dirname(source) if os.path.basename(source) == RUN_SUBDIRS[0] else source


def _source_records(source: str) -> list[dict[str, Any]]:
    """The source run's saved config and its step directories' metas (JSON, read without Orbax), best effort."""
    root, found = run_root(source), []
    step_dirs = [os.path.abspath(source)] if os.path.isdir(os.path.join(source, 'state')) else []
    checkpoints = os.path.join(root, RUN_SUBDIRS[0])
    with contextlib.suppress(OSError):
        step_dirs += [os.path.join(checkpoints, n) for n in sorted(os.listdir(checkpoints)) if n.isdigit()]
    for path in [os.path.join(root, 'config.json')] + [os.path.join(s, 'meta', 'metadata') for s in step_dirs]:
        record = _json(path)
        if isinstance(record, dict):
            found.append(record)
    return found


def _named_paths(record: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, what, path) of what a saved config (or a checkpoint's meta around one) names (PATH_FIELDS)."""
    config = record.get('config') if isinstance(record.get('config'), dict) else record
    named = []
    for section, key, what in PATH_FIELDS:
        value = config.get(section).get(key) if isinstance(config.get(section), dict) else None
        if isinstance(value, str) and value.strip() not in NOT_PATHS:
            named.append((f'{section}.{key}', what, value))
    blend = config.get('data').get('blend') if isinstance(config.get('data'), dict) else None
    if isinstance(blend, str):
        named += [('data.blend', 'data', part.partition(':')[2].strip()) for part in blend.split(',') if ':' in part]
    base = record.get('lora_base')
    if isinstance(base, dict) and isinstance(base.get('path'), str) and base['path']:
        named.append(('checkpoint.init_params_from', 'base', base['path']))
    return named


def _protected(source: str, bases: Iterable[str]) -> list[tuple[str, str, str]]:
    """(field, what, real path) of every existing file or directory an export must not write over."""
    named = [('checkpoint.init_params_from', 'base', b) for b in bases if b]
    for record in _source_records(source):
        named += _named_paths(record)
    out = []
    for field, what, path in named:
        paths = token_files.token_paths(path) if what == 'data' and not os.path.isdir(path) else (path,)
        out += [(field, what, _real(p)) for p in paths if os.path.exists(p)]
    return out


def _check_not_an_input(out: str, flag: str, source: str, bases: Iterable[str], fix: str) -> None:
    """A target that is, or lies in, what the run reads (its base above all) or writes beside it: one line."""
    real = _real(out)
    for field, what, path in _protected(source, bases):
        is_dir = os.path.isdir(path)
        if what == 'base' and (_inside(real, path) if is_dir else real == path):
            inside = (f'lies inside {path}, which is', 'change it')
            where, harm = ('is', 'replace its files') if real == path else inside
            raise UserError(f'{flag}={out} {where} the base model this run started from ({field}): exporting there '
                            f'would {harm}, and a LoRA run on it could no longer resume. '
                            f'Fix: export elsewhere, e.g. {fix}')
        if _inside(real, path) if is_dir else real in (path, os.path.dirname(path)):
            how = 'is' if real == path else ('lies inside' if is_dir else 'is the directory of')
            raise UserError(f'{flag}={out} {how} {path}, which the run\'s config names ({field}): an export there '
                            f'would write over the run\'s own files. Fix: export elsewhere, e.g. {fix}')


def _workdirs(real: str, source: str) -> list[str]:
    """The source's workdir and every training workdir above real path `real`."""
    found, probe = {_real(run_root(source))}, os.path.dirname(real)
    while probe != os.path.dirname(probe):
        if run_files.is_training_workdir(probe):
            found.add(probe)
        probe = os.path.dirname(probe)
    return sorted(found)


def _check_not_in_a_workdir(out: str, flag: str, source: str, fix: str, *, is_file: bool = False) -> None:
    """A target that is a training workdir, a run's own file, or inside what a run writes and rotates: one line."""
    real = _real(out)
    workdirs = _workdirs(real, source)
    for workdir in workdirs:
        below = os.path.relpath(real, workdir).split(os.sep)[0] if _inside(real, workdir) and real != workdir else None
        if below in RUN_SUBDIRS:
            harm = ('the next run\'s checkpoint rotation would delete the export' if below.startswith(RUN_SUBDIRS[0])
                    else 'the run writes and clears it, with the export inside')
            raise UserError(f'{flag}={out} is inside {os.path.join(workdir, below)}, which a training run writes '
                            f'and rotates ({harm}). Fix: name a path outside it, e.g. {fix}')
        if is_file and os.path.dirname(real) == workdir and (os.path.basename(real) in RUN_FILES or (
                os.path.lexists(real) and not real.endswith('.safetensors'))):
            raise UserError(f'{flag}={out} is one of the files of the training workdir {workdir}: exporting there '
                            f'would replace it. Fix: name a file of its own, e.g. {fix}')
    if not is_file and (real in workdirs or run_files.is_training_workdir(real)):
        raise UserError(f'{flag}={out} is a training workdir: exporting there would replace its config.json '
                        '(and resuming would write it back over the export). Fix: name a directory of its own, '
                        f'e.g. {fix}')


def _check_parent(out: str, flag: str) -> None:
    """The nearest existing directory above `out` is a directory this process may write in."""
    probe = os.path.dirname(_real(out))
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UserError(f'{flag}={out} lies below {probe}, which is a file, not a directory. Fix: name a path in a '
                        'directory')
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f'{flag}={out} cannot be written ({probe} is read-only or not ours). Fix: choose a '
                        'directory you can write to')


def previous_export(out_dir: str) -> dict[str, Any] | None:
    """The marker of a directory that holds an export of ours (MARKER), else None (extra files or not)."""
    marker = _json(os.path.join(out_dir, MARKER))
    if not (isinstance(marker, dict) and marker.get('format') == MARKER_FORMAT and isinstance(marker.get('files'), list)
            and marker.get('kind') in KIND_NAMES):
        return None
    return marker


def _not_of(out_dir: str, marker: dict[str, Any], entries: list[str]) -> list[str]:
    """The entries of a previous export's directory that it did not write (a model card added, a subdirectory)."""
    return [n for n in entries if n != MARKER and (n not in marker['files'] or os.path.islink(os.path.join(out_dir, n))
                                                   or not os.path.isfile(os.path.join(out_dir, n)))]


def _entries(out_dir: str, flag: str) -> list[str]:
    """A directory's entries less the temporaries of writers that no longer run."""
    try:
        listed = sorted(os.listdir(out_dir))
    except OSError as e:
        raise UserError(f'{flag}={out_dir} cannot be read ({e.strerror}). Fix: name a new directory, or one you '
                        'can read') from None
    return [n for n in listed if not ((m := _TEMPORARY.fullmatch(n)) and not pid_alive(int(m.group(1))))]


def _ours(path: str, pattern: str) -> int | None:
    """The pid of `<target><pattern><pid>` if that process no longer runs, else None."""
    match = re.fullmatch(r'.*' + re.escape(pattern) + r'(\d+)', path)
    return int(match.group(1)) if match and not pid_alive(int(match.group(1))) else None


def _recover(out: str) -> None:
    """What a killed export left beside real path `out`: its staging directory removed; the old export put back
    (a kill between the two renames of a replacement without RENAME_EXCHANGE) or, once replaced, removed."""
    for stale in glob.glob(glob.escape(out) + STAGING + '*'):
        if _ours(stale, STAGING) is not None and os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
    for old in glob.glob(glob.escape(out) + OLD + '*'):
        if _ours(old, OLD) is None or not os.path.isdir(old) or os.path.islink(old):
            continue
        with contextlib.suppress(OSError):  # left as it is where it cannot be moved: the export then says why
            if not os.path.lexists(out):
                os.rename(old, out)
            elif previous_export(old) is not None or not os.listdir(old):
                shutil.rmtree(old, ignore_errors=True)


def check_dir(out_dir: str, kind: str, *, source: str, force: bool = False, bases: Iterable[str] = (),
              flag: str = '--export_path') -> None:
    """Raises UserError (one line, naming the fix) when export `kind` ('hf', 'peft') may not write `out_dir`.

    Args:
      out_dir: the export's directory.
      kind: 'hf' or 'peft'.
      source: the export's source (a workdir, its checkpoints/ directory or a step directory).
      force: a directory holding only a previous export of ours of the same kind may be replaced.
      bases: more base models that must not be written (the command's `checkpoint.init_params_from`).
      flag: the flag that named `out_dir`, for the message.
    """
    name, fix = KIND_NAMES[kind], f'{flag}={os.path.join(run_root(source), kind)}'
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f'{flag}={out_dir} is an existing file; a {name} export is a directory. '
                        f'Fix: name a new directory, e.g. {flag}={out_dir}.{kind}')
    _check_not_an_input(out_dir, flag, source, bases, fix)
    _check_not_in_a_workdir(out_dir, flag, source, fix)
    _check_parent(out_dir, flag)
    _recover(_real(out_dir))
    if not os.path.isdir(out_dir):
        return
    entries = _entries(out_dir, flag)
    if not entries:
        return
    absolute, previous = os.path.abspath(out_dir), previous_export(out_dir)
    new = f'{flag}={absolute}-{kind}' if os.path.dirname(absolute) != absolute else fix
    extra = _not_of(out_dir, previous, entries) if previous else entries
    if previous and previous['kind'] == kind and not extra:
        if not force:
            raise UserError(f'{flag}={out_dir} holds a previous {name} export of ours (step {previous.get("step")}). '
                            'Fix: pass --force to replace it (all its files at once), or name a new directory')
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise UserError(f'{flag}={out_dir} cannot be written (read-only or not ours). Fix: choose a '
                            'directory you can write to')
        return
    foreign = [n for n in extra if _FOREIGN[kind].fullmatch(n)]
    if foreign:
        raise UserError(f'{flag}={out_dir} holds another model\'s files ({", ".join(foreign[:3])}): a {name} export '
                        f'there would mix with them. Fix: name a new or empty directory, e.g. {new}')
    if previous and previous['kind'] != kind:
        raise UserError(f'{flag}={out_dir} holds a {KIND_NAMES[previous["kind"]]} export of ours, not a {name} one; '
                        f'--force replaces only an export of the same kind. Fix: name a new directory, e.g. {new}')
    what = f'files its export did not write ({", ".join(extra[:3])})' if previous else (
        f'files of no export of ours ({", ".join(extra[:3])})')
    raise UserError(f'{flag}={out_dir} is not empty: it holds {what}, and --force replaces only a directory '
                    f'holding just a previous export (with its {MARKER}). Fix: name a new or empty directory, '
                    f'e.g. {new}')


def check_file(out_path: str, *, source: str, bases: Iterable[str] = (), flag: str = '--export_path') -> None:
    """check_dir's first two rules for a safetensors file: not the run's base or inputs, not in what a run writes
    and rotates, not one of a workdir's own files (UserError, one line)."""
    fix = f'{flag}={os.path.join(run_root(source), "params.safetensors")}'
    _check_not_an_input(out_path, flag, source, bases, fix)
    _check_not_in_a_workdir(out_path, flag, source, fix, is_file=True)


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where not supported."""
    if not sys.platform.startswith('linux'):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # a file system without it (NFS): two renames instead
    raise OSError(code, os.strerror(code), b)


def _swap_in(staging: str, out: str) -> None:
    """`staging` becomes `out`; an old `out` (an empty directory or a previous export) is removed."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return
    if _exchange(staging, out):  # staging now holds the old export (a kill here: the next export removes it)
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = f'{out}{OLD}{os.getpid()}'  # a kill between these two renames: _recover puts the old one back
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _size(n: int) -> str:
    return f'{n / 2**30:.2f} GiB' if n >= 2**30 else f'{n / 2**20:.1f} MiB'


def write_error(e: BaseException, out: str, flag: str = '--export_path') -> UserError | None:
    """One line for a full disk, a quota or a read-only target; None for anything else."""
    full = disk_full(e)
    if full is not None:
        probe = os.path.dirname(os.path.abspath(out))
        while not os.path.isdir(probe) and probe != os.path.dirname(probe):
            probe = os.path.dirname(probe)
        try:
            usage = shutil.disk_usage(probe)
            free = f'{_size(usage.free)} free of {_size(usage.total)}'
        except OSError:
            free = 'free space unknown'
        return DiskFullError(f'{flag}={out}: no space left for the export ({free}; {full.strerror}); nothing was '
                             'written there. Fix: free space on that file system, or name a path on one with room')
    if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UserError(f'{flag}={out} cannot be written ({e.strerror}); nothing was written there. Fix: choose a '
                         'path on a file system you can write to')
    return None


def _missing_top(path: str) -> str | None:
    """The highest directory above `path` (itself excluded) that does not exist yet, or None."""
    top, probe = None, os.path.dirname(path)
    while not os.path.lexists(probe):
        top, probe = probe, os.path.dirname(probe)
    return top


@contextlib.contextmanager
def staged(out_dir: str, kind: str, *, step: Any, flag: str = '--export_path') -> Iterator[str]:
    """Yields an empty directory to write export `kind` into; on success it replaces `out_dir` at once (module
    docstring), with MARKER added. Call `check_dir` first. A failure removes it (and the directories made for it):
    DiskFullError for a full disk, UserError for a read-only target, anything else as raised."""
    out = _real(out_dir)
    _recover(out)
    staging, created = f'{out}{STAGING}{os.getpid()}', _missing_top(out)
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        os.mkdir(staging)
    except OSError as e:
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise (write_error(e, out_dir, flag) or UserError(
            f'{flag}={out_dir} cannot be written (cannot create {e.filename or staging}: {e.strerror}). Fix: choose '
            'a path on a file system you can write to')) from None
    try:
        yield staging
        names = sorted(os.listdir(staging))
        files.write_atomic(os.path.join(staging, MARKER), json.dumps(
            {'format': MARKER_FORMAT, 'kind': kind, 'step': step, 'files': names}, indent=1) + '\n')
        _swap_in(staging, out)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not os.path.lexists(out):
            shutil.rmtree(created, ignore_errors=True)
        error = write_error(e, out_dir, flag)
        if error is not None:
            raise error from None
        raise
