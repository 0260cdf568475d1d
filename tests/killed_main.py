"""`python tests/killed_main.py <jaxfrontier.main flags>`: the trainer with one process killed at a set step, for a test.

JF_TEST_KILL_AT=P:S makes process P kill itself (SIGKILL: no handler, no final save) when it
assembles the batch of step S + 1, once its fast-tier step S is on disk (both parts' manifests under
$JF_NODE_LOCAL/process_P/S/) and the path JF_TEST_KILL_AFTER names, if any, exists (a persistent
step committed in the background): a node lost right after a fast save, at a step the test chooses
rather than one a timer lands on. Put there by the test and read only here, never by jaxfrontier.
"""

import functools
import os
import signal
import time

import jax

from jaxfrontier import main
from jaxfrontier.data import loader


def killed(make_global_batch, process: int, step: int, paths: list[str]):
    @functools.wraps(make_global_batch)
    def assemble(source, data_step, *args, **kwargs):
        if jax.process_index() == process and data_step == step:
            deadline = time.monotonic() + 120
            while not all(os.path.exists(p) for p in paths):
                assert time.monotonic() < deadline, f'never appeared: {[p for p in paths if not os.path.exists(p)]}'
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return make_global_batch(source, data_step, *args, **kwargs)
    return assemble


if __name__ == '__main__':
    process, step = map(int, os.environ['JF_TEST_KILL_AT'].split(':'))
    step_dir = os.path.join(os.environ['JF_NODE_LOCAL'], f'process_{process}', str(step))
    paths = [os.path.join(step_dir, part, 'manifest.json') for part in ('own', 'peer')]
    paths += [os.environ['JF_TEST_KILL_AFTER']] if os.environ.get('JF_TEST_KILL_AFTER') else []
    loader.make_global_batch = killed(loader.make_global_batch, process, step, paths)
    main.run()
