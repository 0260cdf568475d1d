"""Every error that ends a command with an exit code of its own: shown as one line, no traceback.

Layer 0: imports nothing from jaxfrontier (and no JAX), so every module can raise these.

An entry point catches them and returns `cli.exit_code(e)`: it prints `error: <message>` and
returns the class's `exit_code` (main.py catches UserError, NonFiniteLossError and
DistributedError around its modes; calibrate likewise; prepare and the sweep / scaling entry
points print the UserError themselves and return 2). Anything else is a bug: absl prints the
traceback, exit 1. A malformed flag or `--config.*` override is `cli.fail`: one line, exit 2.
0 is success.

| class              | subclass of           | exit | raised when                                                         |
|--------------------|-----------------------|-----:|---------------------------------------------------------------------|
| UserError          | Exception             |    2 | a mistake the user can fix (config, data, workdir, flags)           |
| ConfigError        | UserError, ValueError |    2 | a config value breaks a rule (`config.validate`, data checks): names field, value, fix |
| FlagError          | UserError             |    2 | a command-line value breaks a rule (prepare: data/corpus.py, data/encode.py) |
| SpaceError         | UserError             |    2 | a sweep's search space cannot be run (sweep/space.py)               |
| DiskFullError      | UserError             |    2 | a write failed for lack of space; the process ends without joining Orbax's writer threads (`abandon_threads`, run/control/disk.py) |
| CheckpointError    | UserError             |    2 | a checkpoint cannot be used: corrupted, incomplete or from another model (checkpoint/) |
| NonFiniteParamsError | UserError           |    2 | parameters read from a file hold NaN or Inf; names the tensor (checkpoint/finite.py) |
| NonFiniteLossError | RuntimeError          |    3 | the training loss became NaN or Inf (run/observe/metrics.py, checkpoint/restore.py) |
| LossSpikeError     | NonFiniteLossError    |    3 | loss spikes outlasted every roll-back allowed, or there was no checkpoint to roll back to (training/spikes.py) |
| DistributedError   | RuntimeError          |    4 | the processes of a job could not start together, or lost one another (distributed.py) |
| HangError          | RuntimeError          |    5 | no step finished within the hang limit: stacks written, restart from the newest checkpoint (run/control/watchdog.py) |

Exit codes 4 and 5, and a task killed by a signal, are what launch/restarts.sh restarts inside the
allocation; 2 and 3 would fail again and are not restarted.
"""

from __future__ import annotations

import errno
import re
from typing import Any


class UserError(Exception):
    """A mistake the user can fix (bad config, data or workdir): shown without a traceback, exit 2."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config value breaks a rule. The message names the field, the value and the fix."""

    def __init__(self, field: str, value: Any, problem: str, fix: str):
        self.field, self.value = field, value
        super().__init__(f'config.{field} = {value!r}: {problem}. Fix: {fix}')


class FlagError(UserError):
    """A command-line value breaks a rule: names the flag, the value, the problem and the fix."""

    def __init__(self, flag: str, value: Any, problem: str, fix: str):
        self.flag, self.value = flag, value
        super().__init__(f'--{flag}={value}: {problem}. Fix: {fix}')


class SpaceError(UserError):
    """A search space that cannot be run; the message names the parameter and the fix."""

    def __init__(self, name: str, values: Any, problem: str, fix: str):
        super().__init__(f'--space {name}={values}: {problem}. Fix: {fix}')


class DiskFullError(UserError):
    """A write failed for lack of space. Orbax's failed writer threads would print tracebacks at
    interpreter exit, after the one line: the process leaves without waiting for them
    (`cli.exit_code`'s `abandon_threads`); what was committed before is on disk already."""

    abandon_threads = True


# The texts a full disk or quota leaves in an exception that only says it: strerror(ENOSPC) and
# strerror(EDQUOT) on Linux, which TensorStore's RESOURCE_EXHAUSTED status quotes (followed by
# [os_error_code='28'] or '122'), and Orbax passes on as a ValueError or RuntimeError.
DISK_FULL_TEXTS = ('No space left on device', 'Disk quota exceeded')


def disk_full(e: BaseException | None) -> OSError | None:
    """The OSError(ENOSPC / EDQUOT) behind `e` (Orbax and TensorStore wrap it, or only say it), if any.

    Of several in the chain (`__cause__`, else `__context__`), the first that names a file. Here,
    below every layer, because the trainer turns it into DiskFullError and the checkpoint manager
    silences Orbax's logged tracebacks of the same failure (checkpoint/manager.py).
    """
    seen, found = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            found.append(e)
        elif any(text in str(e) for text in DISK_FULL_TEXTS):
            named = re.search(r'local file "(/[^"]+)"|"(/[^"]+)"', str(e))  # TensorStore names the file
            path = getattr(e, 'filename', None) or (named and (named.group(1) or named.group(2)))
            found.append(OSError(errno.ENOSPC, 'No space left on device', path or None))
        e = e.__cause__ or e.__context__
    return next((f for f in found if f.filename), found[0] if found else None)


class CheckpointError(UserError):
    """A checkpoint cannot be used (corrupted, incomplete or from another model)."""


class NonFiniteParamsError(UserError):
    """Parameters read from a file hold NaN or Inf (exit 2: the input is the user's to fix)."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf."""

    exit_code = 3


class LossSpikeError(NonFiniteLossError):
    """Loss spikes persisted through every roll-back allowed (exit 3, like a NaN loss); the message
    names the steps, the skipped data and the fix, so no resume hint is added to it."""

    names_checkpoint = True


class DistributedError(RuntimeError):
    """The processes of a job could not start together, or lost one another."""

    exit_code = 4


class HangError(RuntimeError):
    """No step finished within the hang limit (run/control/watchdog.py). Never raised: the stuck main
    thread cannot catch it, so the watchdog thread prints `describe(...)` and exits with this code."""

    exit_code = 5

    @staticmethod
    def describe(reason: str) -> str:
        return f'hang: {reason}. Fix: restart from the newest checkpoint (the sbatch scripts do, launch/restarts.sh)'
