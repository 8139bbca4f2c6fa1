"""`python -m veosnap ...` is the `veosnap` command."""

import sys

from .surfaces.cli import main

sys.exit(main())
