"""`python -m veosnap ...` is the `veosnap` command."""

import sys

from .surfaces.cli import command

sys.exit(command())
