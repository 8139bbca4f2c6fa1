"""What every part of the package may know about veosnap itself: its version, and where it is imported from.

Here and not in the package face (`veosnap/__init__.py`), which re-exports the subpackages: a module
inside that imported the face would depend on all of them.
"""

from pathlib import Path

__version__ = "0.1.0"

# The directory that holds the `veosnap` package: what a child process (a torchrun rank, the fresh
# recorder) puts first on its path to import this very veosnap.
IMPORT_ROOT = Path(__file__).resolve().parent.parent
