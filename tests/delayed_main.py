"""`python tests/delayed_main.py <jaxfrontier.main flags>`: the trainer with one process made slow, for a test.

JF_TEST_STEP_DELAY_PROCESS=P:S makes process P sleep S seconds in every training batch's assembly
(`data.loader.make_global_batch`, as a slow file system or data shard would): a deterministic
delay of that process's host work, put there by the test and read only here, never by jaxfrontier.
"""

import functools
import os
import time

import jax

from jaxfrontier import main
from jaxfrontier.data import loader


def delayed(make_global_batch, process: int, seconds: float):
    @functools.wraps(make_global_batch)
    def slow(*args, **kwargs):
        if jax.process_index() == process:
            time.sleep(seconds)
        return make_global_batch(*args, **kwargs)
    return slow


if __name__ == '__main__':
    process, seconds = os.environ['JF_TEST_STEP_DELAY_PROCESS'].split(':')
    loader.make_global_batch = delayed(loader.make_global_batch, int(process), float(seconds))
    main.run()
