"""Layouts by name, and how a layout SPEC resolves (the same way a backend SPEC does).

A layout SPEC is a registered name (the built-ins, or one added with `register`), `path/to/file.py:obj`,
`package.module:obj`, or the name of a `veosnap.layouts` entry point; `obj` is a `Layout` instance.
Torchrun ranks resolve the SPEC again in their own process: a layout registered at run time in the
parent is not there, so a multi-process one must be given by file, module or entry point.
"""

from __future__ import annotations

import importlib

from ...errors import VeosnapError
from .. import specs
from .protocol import Layout

ENTRY_POINT_GROUP = "veosnap.layouts"
# One module per built-in layout, each holding `LAYOUT` (or its variants, `LAYOUTS`); in this order in
# help texts and tables.
BUILTIN = ("single", "packed", "microbatch", "ddp", "fsdp2", "hsdp", "tp", "ep", "sp", "cp")


def _shipped() -> dict[str, Layout]:
    found = {}
    for module_name in BUILTIN:
        module = importlib.import_module(f"{__package__}.{module_name}")
        for layout in getattr(module, "LAYOUTS", (module.LAYOUT,)):
            found[layout.name] = layout
    return found


LAYOUTS: dict[str, Layout] = _shipped()
_SHIPPED = dict(LAYOUTS)


def names() -> list[str]:
    """Every registered layout's name, the reference `single` first."""
    return list(LAYOUTS)


def register(layout: Layout) -> Layout:
    """Add a layout (in process or multi-process) under its name."""
    if not isinstance(layout, Layout) or not layout.name:
        raise VeosnapError(f"{layout!r}: a registered layout is a Layout instance with a name")
    LAYOUTS[layout.name] = layout
    return layout


def resolve(spec: str) -> Layout:
    """The layout a SPEC names; a one-line error naming the known ones otherwise."""
    if not spec or not spec.strip():
        raise VeosnapError("empty layout spec")
    try:
        return specs.load(spec, "layout", LAYOUTS, ENTRY_POINT_GROUP, lambda obj: isinstance(obj, Layout),
                          "Layout instance")  # type: ignore[return-value]
    except KeyError:
        raise VeosnapError(f"unknown layout {spec!r} (known: {', '.join(LAYOUTS)}; "
                           "or path/to/file.py:layout, module:layout)") from None


def check_reachable(spec: str) -> None:
    """Refuse a SPEC torchrun ranks could not resolve: a name registered at run time in this process."""
    if spec in LAYOUTS and LAYOUTS[spec] is not _SHIPPED.get(spec):
        raise VeosnapError(f"layout {spec!r} was registered in this process, which torchrun ranks cannot see; "
                           "give it as path/to/file.py:layout or module:layout, or as a veosnap.layouts entry point")
