"""veosnap: golden-reference snapshot regression for ML model implementations.

The public API (see docs/api.md); everything else is reached through the subpackages:

    record(model, dtype="float32", ...)               record a golden from the HF eager reference
    check(model, backend="eager", dtype="float32", layouts=("single",), ...) -> [CheckReport, ...]
    register_backend(name, fn)                        a backend under a short name (also a decorator)
    register_layout(layout)                           a Layout instance under its name
    Unsupported, forward_only                         what a backend or layout returns or raises
    NothingToChange                                   what a backend raises that has nothing to change here
    Candidate, Adapted, parallelizes                  what a framework's backend may say about its candidate
    context(), Context                                where a candidate runs (layout, rank, world, mesh, device)
    GoldenKey, Project                                what a golden is for, where goldens and configs live

Importing veosnap is cheap: torch and transformers load when one of these is first used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import _moved
from .about import __version__
from .errors import NothingToChange, Unsupported, VeosnapError

_moved.install()  # module paths of the last release still import, warning where they moved

__all__ = ["record", "check", "register_backend", "register_layout", "Unsupported", "NothingToChange", "forward_only", "Candidate",
           "Adapted", "parallelizes", "context", "Context", "GoldenKey", "Project", "VeosnapError", "__version__"]

if TYPE_CHECKING:
    from .candidates.backends import parallelizes
    from .candidates.candidate import Adapted, Candidate, forward_only
    from .candidates.context import Context
    from .candidates.layouts.protocol import Layout
    from .golden.key import GoldenKey
    from .reference.zoo import Project
    from .runs.record import RecordOutcome
    from .runs.verdict import CheckReport

_LAZY = {"forward_only": ".candidates.candidate", "Candidate": ".candidates.candidate",
         "Adapted": ".candidates.candidate",
         "parallelizes": ".candidates.backends", "Context": ".candidates.context", "GoldenKey": ".golden.key",
         "Project": ".reference.zoo"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'veosnap' has no attribute {name!r}")


def _key(project: Project | None, model: str, dtype: str, scenario: str,
         recording: bool = False) -> tuple[Project, GoldenKey]:
    from .golden.key import GoldenKey
    from .reference.zoo import Project

    project = project or (Project.for_recording() if recording else Project.resolve())
    return project, GoldenKey(project.hardware_class, model, scenario, dtype)


def record(model: str, dtype: str = "float32", scenario: str = "step", *, project: Project | None = None,
           seed: int = 0, allow_near_ties: bool = False, allow_fragile: bool = False,
           sketch: str = "auto", excuses: dict[str, str] | None = None, certify: bool = True) -> RecordOutcome:
    """Record the golden of `model` in `dtype` for `scenario` on this machine (as `veosnap record` does).

    `project` says where the goldens, configs and test data are (default: `Project.for_recording()`:
    `./goldens`, created if need be; configs and test data the current directory's, else veosnap's
    bundled zoo). An identical golden is left untouched; a golden with an approval trail keeps it; one
    that cheap legitimate variants (sdpa, grouped_mm, batched_mm) fail is refused unless `allow_fragile`, or
    unless each failing variant is excused (`excuses`: {variant: reason}, kept in the golden; checks of that
    variant still fail and say the reason). `sketch`: `auto` stores large tensors as sketches only when the
    golden would not fit its target size, `always` sketches every sketchable tensor, `never` none (docs/scale.md).
    `certify`: plant veosnap's canaries and keep the sensitivity they certify (docs/trust.md); a golden one
    passes is refused.
    """
    from .runs.record import parse_excuses
    from .runs.record import record as record_one

    project, key = _key(project, model, dtype, scenario, recording=True)
    return record_one(project, key.model, key.dtype, scenario=key.scenario, seed=seed, allow_near_ties=allow_near_ties,
                      allow_fragile=allow_fragile, sketch=sketch,
                      excuses=parse_excuses(f"{v}={r}" for v, r in (excuses or {}).items()), certify=certify)


def check(model: str, backend: str = "eager", dtype: str = "float32", *, layouts: Sequence[str] = ("single",),
          scenario: str = "step", project: Project | None = None, nproc: int = 2, timeout_s: float | None = None,
          cross_class: bool = False, isolate: bool = False) -> list[CheckReport]:
    """Check `backend` (a SPEC) on `model` in `dtype` under each of `layouts` (SPECs): one report each.

    Multi-process layouts run on `nproc` torchrun ranks (one torchrun for all of them), ended after
    `timeout_s` seconds. `isolate`: a bfloat16 real-shape golden's layers are also checked in isolation
    (`veosnap check --isolate`; the toys' always are). A report's `passed`, `status`, `worst`, `first_divergence` and `tensors` say how
    it went; `render.text.checks(reports)` draws them as `veosnap check` does.
    """
    from .candidates.backends import resolve
    from .runs.check import DEFAULT_TIMEOUT_S, check_layouts

    project, key = _key(project, model, dtype, scenario)
    return check_layouts(project, key, resolve(backend), list(layouts), nproc=nproc,
                         timeout_s=DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s, cross_class=cross_class,
                         isolate=isolate)


def context() -> Context:
    """Where the candidate running now runs: layout, rank, world, data-parallel share, device mesh, device.

    Available in a backend, its hooks and its layout's run (in process and on torchrun ranks); a
    backend may also take it as a second parameter, `def my_backend(model, ctx)`.
    """
    from .candidates.context import current

    return current()


def register_backend(name: str, fn: Callable | None = None, *, requires: Callable[[], str | None] | None = None) -> Any:
    """Register backend `fn` under `name` (`register_backend("mine", patch)`, or `@register_backend("mine")`)."""
    from .candidates.backends import register

    return register(name, fn, requires=requires)


def register_layout(layout: Layout) -> Layout:
    """Register a `Layout` instance under its name, in process or multi-process (`veosnap.candidates.layouts`)."""
    from .candidates.layouts.registry import register

    return register(layout)
