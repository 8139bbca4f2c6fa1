"""Module paths of earlier releases that moved into the subpackages: each still imports, for one release, as
an alias of its new home that warns (DeprecationWarning) naming it, so a plugin written against the old
path keeps working while its author moves the import.

Only paths that are not also names of the package face: `veosnap.record` and `veosnap.check` are the API's
functions (docs/api.md), not these modules.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module -> new module (0.1.0 restructuring, 2026-11-30)
MOVED = {
    "veosnap.backends": "veosnap.candidates.backends",
    "veosnap.layouts": "veosnap.candidates.layouts",
    "veosnap.cli": "veosnap.surfaces.cli",
    "veosnap.pytest_plugin": "veosnap.surfaces.pytest_plugin",
    "veosnap.golden_snapshot": "veosnap.surfaces.golden_snapshot",
    "veosnap.diff": "veosnap.runs.diff",
    "veosnap.matrix": "veosnap.runs.matrix",
    "veosnap.refresh": "veosnap.runs.refresh",
    "veosnap.verify": "veosnap.runs.verify",
    "veosnap.compare": "veosnap.numerics.compare",
    "veosnap.tolerance": "veosnap.numerics.tolerance",
    "veosnap.capture": "veosnap.reference.capture",
    "veosnap.hardware": "veosnap.reference.hardware",
    "veosnap.inputs": "veosnap.reference.inputs",
    "veosnap.models": "veosnap.reference.models",
    "veosnap.routing": "veosnap.reference.probes",
    "veosnap.train": "veosnap.reference.train",
    "veosnap.weights": "veosnap.reference.weights",
    "veosnap.zoo": "veosnap.reference.zoo",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _AliasModule(spec.name, self.new)

    def exec_module(self, module: types.ModuleType) -> None:
        warnings.warn(f"{module.__name__} moved to {self.new}: import it from there ({module.__name__} goes away "
                      "in the next release)", DeprecationWarning, stacklevel=2)


class _AliasModule(types.ModuleType):
    """A module whose every attribute is its new home's (the new module itself stays the only one)."""

    def __init__(self, name: str, new: str) -> None:
        super().__init__(name, f"moved to {new}")
        self._veosnap_new = new

    def __getattr__(self, name: str) -> object:
        return getattr(importlib.import_module(self._veosnap_new), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._veosnap_new))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return importlib.util.spec_from_loader(fullname, _Alias(new)) if new else None


def install() -> None:
    """Answer the old paths (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
