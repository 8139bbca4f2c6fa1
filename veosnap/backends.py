"""Backends: how a candidate model is made from the reference one.

A backend is a callable that receives the built reference model (in the golden's dtype, on the
device) and returns the model to run; it may patch the model in place and return it. SPEC is:

- a registered name: `eager`, `sdpa`, `grouped_mm`, `batched_mm`, or one added with `register`;
- `path/to/file.py:function` or `package.module:function`;
- the name of a `veosnap.backends` entry point;
- several of these joined by `+` (`sdpa+grouped_mm`), applied left to right.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable

from torch import nn

from .errors import VeosnapError

BackendFn = Callable[[nn.Module], "nn.Module | None"]
ENTRY_POINT_GROUP = "veosnap.backends"
_REGISTRY: dict[str, BackendFn] = {}


def register(name: str) -> Callable[[BackendFn], BackendFn]:
    """Decorator: register a backend under `name`."""

    def wrap(fn: BackendFn) -> BackendFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


@register("eager")
def eager(model: nn.Module) -> nn.Module:
    """The reference itself (eager attention, eager experts)."""
    return model


class Unsupported(Exception):
    """Raised by a backend that does not apply to this model; the check is reported as skipped."""


def attention(implementation: str) -> BackendFn:
    """A backend that switches the model to transformers' attention `implementation`."""

    def apply(model: nn.Module) -> nn.Module:
        try:
            model.set_attn_implementation(implementation)
        except (ValueError, ImportError) as exc:  # transformers refuses models it has no support for
            raise Unsupported(str(exc).split(". ")[0].strip()) from None
        return model

    apply.__doc__ = f"transformers' `{implementation}` attention."
    return apply


register("sdpa")(attention("sdpa"))


def _experts(implementation: str) -> BackendFn:
    def apply(model: nn.Module) -> nn.Module:
        if type(model)._can_set_experts_implementation():  # dense models have no experts to swap
            model.set_experts_implementation(implementation)
        return model

    apply.__doc__ = f"transformers' `{implementation}` experts kernel (dense models: unchanged)."
    return apply


register("grouped_mm")(_experts("grouped_mm"))
register("batched_mm")(_experts("batched_mm"))


def builtin_names() -> list[str]:
    return sorted(_REGISTRY)


@dataclass(frozen=True)
class Backend:
    """A resolved backend spec: its display name and the functions applied in order."""

    spec: str
    steps: tuple[BackendFn, ...]

    def apply(self, model: nn.Module) -> nn.Module:
        for step in self.steps:
            result = step(model)
            model = model if result is None else result
        return model


def resolve(spec: str) -> Backend:
    """Turn a SPEC into a Backend, with a one-line error naming what could not be found."""
    if not spec or not spec.strip():
        raise VeosnapError("empty backend spec")
    return Backend(spec=spec, steps=tuple(_resolve_one(part.strip()) for part in spec.split("+")))


def _resolve_one(spec: str) -> BackendFn:
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
        module = _load_file(target) if target.endswith(".py") or "/" in target else _import(target, spec)
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise VeosnapError(f"backend {spec!r}: {target} has no callable {attr!r}")
        return fn
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == spec:
            try:
                return ep.load()
            except Exception as exc:  # noqa: BLE001 - a broken plugin package, reported in one line
                raise VeosnapError(f"backend {spec!r}: entry point {ep.value} fails to load "
                                   f"({type(exc).__name__}: {exc})") from None
    known = ", ".join(builtin_names())
    raise VeosnapError(f"unknown backend {spec!r} (built in: {known}; or path/to/file.py:function, module:function)")


def _import(module_name: str, spec: str) -> object:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise VeosnapError(f"backend {spec!r}: cannot import {module_name} ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise VeosnapError(f"backend {spec!r}: error while importing {module_name} ({type(exc).__name__}: {exc})") from None


def _load_file(path_text: str) -> object:
    path = Path(path_text)
    if not path.is_file():
        raise VeosnapError(f"{path}: backend file not found")
    name = f"veosnap_user_backend_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise VeosnapError(f"{path}: cannot load as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file, reported in one line
        del sys.modules[name]
        raise VeosnapError(f"{path}: error while importing backend file ({type(exc).__name__}: {exc})") from None
    return module
