"""`python tests/counting_main.py <jaxfrontier.main flags>`: the trainer with `config.validate` counted.

At exit the number of calls goes to the file named by JF_TEST_VALIDATE_COUNT: the test's own
instrument (patched into the config package, where every caller looks `validate` up), read only
here, never by jaxfrontier.
"""

import atexit
import os

from jaxfrontier import config as config_lib
from jaxfrontier import main

calls = []


def counted(validate):
    def count(*args, **kwargs):
        calls.append(1)
        return validate(*args, **kwargs)
    return count


def write_count() -> None:
    with open(os.environ['JF_TEST_VALIDATE_COUNT'], 'w', encoding='utf-8') as f:
        f.write(f'{len(calls)}\n')


if __name__ == '__main__':
    config_lib.validate = counted(config_lib.validate)
    atexit.register(write_count)
    main.run()
