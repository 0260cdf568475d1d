"""`python -m jaxfrontier.sweep`: see `jaxfrontier.sweep.cli`."""

from absl import flags

from jaxfrontier.sweep import cli
from jaxfrontier.sweep import flags as sweep_flags

__doc__ = cli.__doc__  # what --help prints  # pylint: disable=redefined-builtin
flags.adopt_module_key_flags(cli)
flags.adopt_module_key_flags(sweep_flags)
cli.run()
