"""The reference stays pristine: what a candidate patches in this process is put back after it runs.

A backend or layout may patch process-wide state: the model family's modeling module and its classes,
transformers' attention, mask and experts registries, its loss functions, torch.nn.functional. `kept`
snapshots all of it before a candidate runs and restores it after, returning what the candidate left
behind, so the report can say "candidate X left patches behind (restored): ..." and a later `eager`
cell of a matrix runs the real reference.

`touched()` says whether any candidate has run in this process: recording then moves to a fresh
process (`runs/isolated.py`), since a snapshot cannot see what was patched before it was taken (a
backend's module patches when it is imported) nor outside what it watches. Veosnap's own variants of
the reference (the recorder's fragility check: eager, sdpa, grouped_mm, batched_mm, as shipped) import
nothing of the user's and only choose the model instance's implementations; run within `own_variants`,
they leave the process as pristine as it was, unless `kept` finds they left patches behind after all.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from . import guard, threads

# Modules whose attributes, and whose classes' attributes, a candidate might patch, in report order;
# the model family's modeling module is added per check.
WATCHED = ("torch.nn.functional", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.loss.loss_utils", "transformers.integrations.sdpa_attention", "transformers.integrations.moe")
# Registries: instances whose `_local_mapping` and classes whose `_global_mapping` a candidate might fill.
_REGISTRY_INSTANCES = (("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
                       ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS"),
                       ("transformers.integrations.moe", "ALL_EXPERTS_FUNCTIONS"))

_touched = False
_left_behind = 0  # how many times a candidate left patches behind (restored) in this process
_MISSING = object()
_last: list = []  # the last snapshot restored: the reference as an earlier candidate's threads found it


def touched() -> bool:
    """Whether a candidate has run in this process (so it may no longer be pristine)."""
    return _touched


def _module(name: str) -> object | None:
    try:
        return sys.modules.get(name) or importlib.import_module(name)
    except ImportError:
        return None


def _kept_name(name: str) -> bool:
    # Python and ABCs add these themselves (warnings registries, ABC caches); they are not patches.
    return name.startswith("__") or name.startswith("_abc")


class _Owner:
    """A module or class and its attributes as they were."""

    def __init__(self, obj: object, label: str) -> None:
        self.obj, self.label = obj, label
        self.attrs = {k: v for k, v in vars(obj).items() if not _kept_name(k)}

    def restore(self) -> list[str]:
        changed = []
        now = {k: v for k, v in vars(self.obj).items() if not _kept_name(k)}
        for key, value in now.items():
            # A function or class patched in; values added lazily (transformers caches answers on its
            # classes, `_can_set_attn_implementation_cached_value`) are left alone.
            if key not in self.attrs and callable(value):
                changed.append(key)
                _delete(self.obj, key)
        for key, value in self.attrs.items():
            if now.get(key, _MISSING) is not value:
                changed.append(key)
                _set(self.obj, key, value)
        return [f"{self.label}.{key}" for key in sorted(changed)]


def _delete(obj: object, key: str) -> None:
    try:
        delattr(obj, key)
    except (AttributeError, TypeError):
        pass


def _set(obj: object, key: str, value: object) -> None:
    try:
        setattr(obj, key, value)
    except (AttributeError, TypeError):  # read-only slots of builtin types
        pass


class _Mapping:
    """A registry's dict, as it was (restored in place: other modules hold the same dict)."""

    def __init__(self, mapping: dict, label: str) -> None:
        self.mapping, self.label, self.saved = mapping, label, dict(mapping)

    def restore(self) -> list[str]:
        keys = {k for k in self.mapping.keys() | self.saved.keys()
                if self.mapping.get(k, _MISSING) is not self.saved.get(k, _MISSING)}
        if keys:
            self.mapping.clear()
            self.mapping.update(self.saved)
        return [f"{self.label}[{key!r}]" for key in sorted(keys)]


def _snapshot(module_names: tuple[str, ...]) -> list:
    saved: list = []
    for name in module_names:
        module = _module(name)
        if module is None:
            continue
        saved.append(_Owner(module, name))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                saved.append(_Owner(value, f"{name}.{value.__name__}"))
    try:
        from transformers.utils.generic import GeneralInterface
    except ImportError:
        return saved
    classes, todo = [], [GeneralInterface]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for cls in sorted(classes, key=lambda c: c.__name__):
        if isinstance(cls.__dict__.get("_global_mapping"), dict):
            saved.append(_Mapping(cls.__dict__["_global_mapping"], cls.__name__))
    for module_name, attr in _REGISTRY_INSTANCES:
        instance = getattr(_module(module_name), attr, None)
        if isinstance(getattr(instance, "_local_mapping", None), dict):
            saved.append(_Mapping(instance._local_mapping, attr))
    return saved


@dataclass
class Leftovers:
    """What a candidate left behind: the patches restored (`module.attr`, `module.Class.attr`,
    `AttentionInterface['name']`), and the threads it left running that veosnap stopped."""

    candidate: str = ""
    patches: list[str] = field(default_factory=list)
    stopped: threads.Stopped | None = None
    tainted: str = ""  # why the run is void: another candidate's thread patched the reference around it

    def __bool__(self) -> bool:
        return bool(self.patches or self.stopped)

    def notes(self) -> list[str]:
        """The report's notes on them, naming the candidate."""
        found = [self.stopped.note()] if self.stopped else []
        if self.patches:
            found.append(f"candidate {self.candidate} left patches behind (restored): {', '.join(self.patches)}")
        return found


@contextmanager
def kept(*modules: str, watched: bool = True, candidate: str = "") -> Iterator[Leftovers]:
    """Within the block a candidate may patch; after it, everything is restored and the yielded `Leftovers`
    holds what it left behind.

    `modules`: more modules to watch (the model family's modeling module); `watched=False` watches only those.
    `candidate`: the candidate's name, when the block runs one: the threads it starts and leaves running
    Python are stopped (`threads.stop`) before its patches are restored, which they could otherwise re-apply.
    """
    global _touched, _left_behind, _last
    _touched = True
    suspects = threads.defiant() if candidate else []  # an earlier candidate's threads that would not stop
    # What they changed since the last restore is put back first: the snapshot must be the reference's.
    meddled = [name for owner in _last for name in owner.restore()] if suspects else []
    names = tuple(dict.fromkeys((*(WATCHED if watched else ()), *modules)))
    saved = _snapshot(names)
    before = threads.alive() if candidate else set()
    left = Leftovers(candidate)
    try:
        yield left
    finally:
        if candidate:
            left.stopped = threads.stop(candidate, threads.started(before, exclude=(guard.watchdog(),)))
        for owner in saved:
            left.patches.extend(owner.restore())
        if candidate:
            _last = saved
        if suspects and (meddled or left.patches):
            who = ", ".join(f"{t.name!r} of candidate {c}" for t, c in suspects)
            left.tainted = (f"the reference was not pristine: {', '.join(dict.fromkeys(meddled + left.patches))} "
                            f"patched while a thread that would not stop ran ({who}); restored")
            left.patches = []
        _left_behind += bool(left.patches)


@contextmanager
def own_variants() -> Iterator[None]:
    """Within the block only veosnap's own shipped variants of the reference run (`backends.shipped`);
    after it, `touched()` is what it was before, unless one of them left patches behind."""
    global _touched
    before, left_before = _touched, _left_behind
    try:
        yield
    finally:
        if _left_behind == left_before:
            _touched = before
