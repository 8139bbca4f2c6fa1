"""SPEC strings: how a user names an extension (a backend, a layout) on the command line or in code.

A SPEC is a name registered in this process, `path/to/file.py:obj`, `package.module:obj`, or the name
of an entry point in the extension's group (`veosnap.backends`, `veosnap.layouts`). Every way a SPEC
can fail is a one-line `VeosnapError` naming the SPEC and the cause.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from ..errors import VeosnapError
from . import guard


def load(spec: str, what: str, registry: dict[str, Any], group: str, accept: Callable[[object], bool],
         expected: str) -> object:
    """The object `spec` names: from `registry`, a file, a module, or an entry point of `group`.

    `what` names the kind in messages ("backend", "layout"); `accept` tells whether a loaded object is
    one (`expected` says what it should be).
    """
    if spec in registry:
        return registry[spec]
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        module = _load_file(target, what) if is_file_spec(spec) else _import(target, spec, what)
        obj = getattr(module, attr, None)
        if obj is None or not accept(obj):
            raise VeosnapError(f"{what} {spec!r}: {target} has no {expected} {attr!r}")
        return obj
    for ep in entry_points(group=group):
        if ep.name == spec:
            try:
                obj = ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin, reported in one line
                raise VeosnapError(f"{what} {spec!r}: entry point {ep.value} failed to load "
                                   f"({type(exc).__name__}: {exc})") from None
            if not accept(obj):
                raise VeosnapError(f"{what} {spec!r}: entry point {ep.value} is not {expected}")
            return obj
    raise KeyError(spec)


def is_file_spec(spec: str) -> bool:
    """`path/to/file.py:obj` (a file), as opposed to a registered name or `package.module:obj`."""
    target = spec.rpartition(":")[0]
    return ":" in spec and (target.endswith(".py") or "/" in target)


def anchored(spec: str, root: Path) -> str:
    """`spec` (parts joined with `+`) with each relative file path taken from `root` instead of the current
    directory: what a path written in a test means whichever directory pytest was started from."""
    here = Path.cwd().resolve()
    if Path(root).resolve() == here:
        return spec
    parts = []
    for part in spec.split("+"):
        target, _, attr = part.strip().rpartition(":")
        if is_file_spec(part.strip()) and not Path(target).is_absolute():
            part = f"{Path(root).resolve() / target}:{attr}"
        parts.append(part)
    return "+".join(parts)


def _import(module_name: str, spec: str, what: str) -> object:
    try:
        with guard.running():  # importing the user's module runs its code: it may not end the process either
            return importlib.import_module(module_name)
    except ImportError as exc:
        raise VeosnapError(f"{what} {spec!r}: cannot import {module_name} ({exc})") from None
    except guard.CandidateError as exc:
        raise VeosnapError(f"{what} {spec!r}: error while importing {module_name} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        cause = f"{type(exc).__name__}: {exc}"
        raise VeosnapError(f"{what} {spec!r}: error while importing {module_name} ({cause})") from None


def _load_file(path_text: str, what: str) -> object:
    """The module of a Python file, loaded once per process (a second SPEC into it reuses it)."""
    path = Path(path_text)
    if not path.is_file():
        raise VeosnapError(f"{path}: {what} file not found")
    name = f"veosnap_user_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise VeosnapError(f"{path}: cannot load as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with guard.running():  # importing the user's file runs its code: it may not end the process either
            spec.loader.exec_module(module)
    except guard.CandidateError as exc:
        del sys.modules[name]
        raise VeosnapError(f"{path}: error while importing {what} file ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's file, reported in one line
        del sys.modules[name]
        raise VeosnapError(f"{path}: error while importing {what} file ({type(exc).__name__}: {exc})") from None
    return module
