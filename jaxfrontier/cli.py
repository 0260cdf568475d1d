"""What every command-line entry point shares: flag parsing with one-line errors, exit codes.

`python -m jaxfrontier.main`, `.sweep` and `.scaling` parse absl flags with a `--config`
config file (`ml_collections.config_flags`, locked). A mistake in a flag, the config file or
a `--config.*` override is one line `error: ...` and exit 2, never a traceback; `--help`
prints the flags without needing any other flag. No JAX import here.

Exit codes: 0 done, 2 a mistake the user can fix (`errors.UserError`), 3 a non-finite loss,
4 the process group could not be formed, 5 a hang (the watchdog's own exit, run/control/watchdog.py).
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from typing import NoReturn

from absl import app, flags

from jaxfrontier import errors

HELP_FLAGS = ('-h', '--help', '-help', '--helpshort', '--helpfull', '--helpxml', '-?')


def run_app(main, flags_parser=None) -> None:
    """`absl.app.run(main)`, where a reader that closes the pipe early (`--help | head`) ends it quietly.

    Python's advice (the `signal` module's notes on SIGPIPE): point stdout at /dev/null, so the
    interpreter's final flush cannot raise again, and exit 1. SIGPIPE itself is left ignored
    (Python's default), so a socket or file whose reader goes away is an error, not a kill.

    Ctrl-C that reaches here (the training loop handles its own from validation on and stops
    with a checkpoint) ends the command with one line and the shell's 130, not a traceback:
    every writer here commits by rename, so an interrupted one leaves no half-written result.
    """
    parser = {'flags_parser': flags_parser or parse_flags}
    try:
        app.run(lambda argv: sys.exit(main(argv)), **parser)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except KeyboardInterrupt:
        print('interrupted (Ctrl-C): stopped before finishing; nothing half-written was committed', file=sys.stderr)
        sys.exit(130)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing (a bad flag: its usage line, exit 1), where asking for --help exits 0, not absl's 1."""
    try:
        return app.parse_flags_with_usage(argv)
    except SystemExit as e:
        if wants_help(argv) and e.code == 1:
            sys.exit(0)
        raise


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 2."""
    print(f'error: {" ".join(str(message).split())}', file=sys.stderr)
    sys.exit(2)


def user_error_in_chain(e: BaseException | None) -> errors.UserError | None:
    """The UserError that (indirectly) caused `e`, if any (config_flags and absl re-wrap errors)."""
    while e is not None and not isinstance(e, errors.UserError):
        e = e.__cause__ or e.__context__
    return e


def exit_code(e: Exception) -> int:
    """Prints a user-facing error as one line; returns 2 (bad input), 3 (NaN/Inf loss) or 4 (process group).

    An error marked `abandon_threads` (a full disk under Orbax's writer threads) ends the
    process here, so their shutdown noise cannot follow the one line.
    """
    code = getattr(e, 'exit_code', 2 if isinstance(e, errors.UserError) else 3)
    if getattr(e, 'abandon_threads', False):
        _last_words(f'error: {e}\n', code)
    print(f'error: {e}', file=sys.stderr)
    return code


def _last_words(line: str, code: int) -> NoReturn:
    """Writes `line` as the last thing on stderr and ends the process without joining threads.

    Failed writer threads may still be printing tracebacks (Python's and the C++ libraries',
    straight to file descriptor 2): point descriptor 2 at /dev/null first, so nothing they
    write can split or follow the line, then write it to a copy of the real stderr in one call,
    after a newline (a thread may have been cut off in the middle of one of its lines).
    """
    sys.stdout.flush()
    real = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    time.sleep(0.1)  # a write a thread began on the old descriptor 2 lands before the line
    os.write(real, ('\n' + line).encode())
    os._exit(code)  # pylint: disable=protected-access  (skip joining the failed writer threads)


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS or a.startswith('--helpfull') for a in argv[1:])


def config_path(argv: list[str]) -> str | None:
    """The file of `--config=path[:arg]` (or `--config path[:arg]`) in argv, if any."""
    for i, a in enumerate(argv[1:], 1):
        m = re.match(r'^--?config(?:=(.*))?$', a)
        if m:
            value = m.group(1) if m.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else '')
            return value.split(':', 1)[0]
    return None


def config_file_problem(e: BaseException, path: str | None) -> str | None:
    """`<file>, line N: <problem>` when `e` (or what caused it) comes from the config file itself.

    A syntax error, an exception raised while the file runs or inside its get_config(), or a
    file without get_config(); None for anything else (e.g. an override naming no field).
    """
    if not path:
        return None
    target = os.path.realpath(path)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, SyntaxError) and e.filename and os.path.realpath(e.filename) == target:
            return f'{path}, line {e.lineno}: {type(e).__name__}: {e.msg}. Fix: correct the config file'
        if isinstance(e, AttributeError) and "attribute 'get_config'" in str(e):
            return (f'{path}: the config file defines no get_config() function. Fix: define '
                    'get_config(arg=None) returning an ml_collections.ConfigDict (see configs/tiny.py)')
        frames = [f for f in traceback.extract_tb(e.__traceback__) if os.path.realpath(f.filename) == target]
        if frames:
            message = ' '.join(str(e).split()) or '(no message)'
            return (f'{path}, line {frames[-1].lineno}: {type(e).__name__}: {message}. Fix: correct the config '
                    f'file (the line reads: {frames[-1].line})')
        e = e.__cause__ or e.__context__
    return None


def parse_config_flags(argv: list[str], config_flag, *, default_config: str | None = None,
                       required: str = '') -> list[str]:
    """absl flag parsing of a command with a `--config` file; every mistake is one line, exit 2.

    Args:
      argv: sys.argv.
      config_flag: the `config_flags.DEFINE_config_file` holder.
      default_config: added as `--config=` when absent (and help is not asked for).
      required: when there is no default, the message for a missing --config.

    Returns:
      The arguments absl leaves over.
    """
    has_config = any(re.match(r'^--?config(=|$)', a) for a in argv[1:])
    if not has_config and not wants_help(argv):
        if default_config is None:
            fail(required)
        argv = [argv[0], f'--config={default_config}', *argv[1:]]
    try:
        rest = flags.FLAGS(argv)
    except SystemExit as e:  # absl's --help prints the flags, then exits 1: asking for help is no failure
        if wants_help(argv) and e.code == 1:
            sys.exit(0)
        raise
    except Exception as e:  # pylint: disable=broad-except  (the config file runs inside absl's parsing)
        problem = user_error_in_chain(e) or config_file_problem(e, config_path(argv))
        if problem is not None:
            fail(str(problem))
        if 'FrozenConfigDict is immutable' in str(e):  # config_flags locks what get_config() returned
            fail(f'--config={config_path(argv) or default_config}: get_config() returned a FrozenConfigDict, which '
                 '--config.* overrides cannot set. Fix: return an ml_collections.ConfigDict (configs/tiny.py)')
        if not isinstance(e, (AttributeError, KeyError, flags.Error)):
            raise
        _fail_flag(e, argv)
    if config_flag.value is not None:
        try:
            if not wants_help(argv):
                check_config_type(config_flag.value, config_path(argv) or default_config or '')
            config_flag.value.get('mesh')  # a config file that failed to load raises only when used
        except OSError as e:
            fail(f'--config: {e}')
        except Exception as e:  # pylint: disable=broad-except
            problem = config_file_problem(e, config_path(argv))
            if problem is None:
                raise
            fail(problem)
    if not wants_help(argv):
        check_config_type(config_flag.value, config_path(argv) or default_config or '')
    return rest


def check_config_type(value, path: str) -> None:
    """One line when a config file's get_config() returned no ml_collections.ConfigDict, or one without the
    sections of config.base_config() (every reader of the config would fail on the first it lacks)."""
    import ml_collections  # pylint: disable=g-import-not-at-top  (no JAX)
    from jaxfrontier.config import schema  # pylint: disable=g-import-not-at-top  (no JAX; imports no cli)
    shape = 'configs/tiny.py shows the shape: c = config_lib.base_config(); ...; return c'
    if not isinstance(value, ml_collections.ConfigDict):
        fail(f'--config={path}: get_config() returned {type(value).__name__}, not an ml_collections.ConfigDict. '
             f'Fix: return the config ({shape})')
    missing = [name for name in schema.base_config() if name not in value]
    if missing:
        fail(f'--config={path}: get_config() returned a ConfigDict without the top-level field(s) {", ".join(missing)} '
             f'of config_lib.base_config(). Fix: start from the base config ({shape})')


def _fail_flag(e: Exception, argv: list[str]) -> NoReturn:
    """One line for a flag mistake: an override naming no field of the locked config, or absl's message."""
    if isinstance(e, (AttributeError, KeyError)):  # an override naming no field: the config is locked
        message = e
        while isinstance(message, BaseException) and message.args:
            message = message.args[0]  # AttributeError(KeyError("'stepz'\nDid you mean ..."))
        key, _, hint = str(message).partition('\n')  # "'stepz'", 'Did you mean "steps" ...?'
        overrides = [a.split('=', 1)[0] for a in argv[1:] if re.match(r'^--?config\.', a)]
        named = [o for o in overrides if key.strip("'") in o.split('.')[1:]] or overrides
        fail(f'{", ".join(named) or "--config"}: the config has no field {key}. {hint + " " if hint else ""}Fix: '
             'correct the key; --config.* overrides can only set fields the config file defines')
    fail(str(e))
