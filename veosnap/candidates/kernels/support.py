"""What the kernel-library backends share: whether this machine can run a library, and an account of
what its kernels ran during a check.

`gpu_library(...)` builds a backend's `requires()`: a CUDA GPU of at least a compute capability and an
installed distribution, checked without importing the library (the support matrix asks every
backend, on every machine); `decline(reason)` skips the check with it. `Ran` counts, per module of the
model, which kernel entry points ran; its `line()` is the report's note ("fa4 ran for 4 attention
modules (model.layers.{0-3}.self_attn): flash_attn_varlen_func 8x") and `require_some()` fails a
check in which the library ran nothing; `candidate(...)` yields the candidate and does both after.
`restoring_modules(...)` undoes a library's process-wide patches when the check is done.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata

import torch
from torch import nn

from ...errors import Unsupported
from .. import pristine
from ..candidate import Candidate


def gpu_library(what: str, distribution: str, install: str, capability: tuple[int, int] = (0, 0)
                ) -> Callable[[], str | None]:
    """A `requires()`: `what` needs a CUDA GPU of at least `capability` and the `distribution` installed."""

    def requires() -> str | None:
        if not torch.cuda.is_available():
            return f"{what} needs a CUDA GPU"
        have = torch.cuda.get_device_capability()
        if have < capability:
            return (f"{what} needs a CUDA GPU of compute capability {capability[0]}.{capability[1]} or newer "
                    f"(this one: {have[0]}.{have[1]})")
        try:
            metadata.version(distribution)
        except metadata.PackageNotFoundError:
            return f"{what}: {distribution} is not installed ({install})"
        return None

    return requires


def decline(reason: str | None) -> None:
    """Skip the check (`Unsupported`) when there is a `reason`: the machine or the model has no use for the library."""
    if reason:
        raise Unsupported(reason)


@contextmanager
def restoring_modules(*module_names: str) -> Iterator[None]:
    """Within the block, module attributes and the classes they define may be patched; then restored.

    `pristine.kept` on just these modules (and transformers' registries): what every check does after
    its candidate anyway, done here by a backend that patches on purpose, so its own patches are undone
    as part of it and not reported as left behind.
    """
    with pristine.kept(*module_names, watched=False):
        yield


def installed(distribution: str) -> str:
    """The installed version of `distribution`, or '' when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return ""


class Ran:
    """Which kernel entry points ran for which of a model's modules, counted while a check runs."""

    def __init__(self, library: str, model: nn.Module, kind: str) -> None:
        self.library, self.kind = library, kind  # kind: what the modules are ("attention modules")
        self._names = {id(module): name for name, module in model.named_modules()}
        self.modules: dict[str, None] = {}  # in first-call order
        self.entries: Counter[str] = Counter()

    def call(self, module: nn.Module | None, entry: str) -> None:
        """Record one call of the library's `entry` on behalf of `module` (None: not known)."""
        if module is not None:
            self.modules.setdefault(self._names.get(id(module), type(module).__name__), None)
        self.entries[entry] += 1

    @property
    def calls(self) -> int:
        return sum(self.entries.values())

    def line(self, extra: str = "") -> str:
        """The report's note: what ran, for which modules, how often (over every pass of the check)."""
        entries = ", ".join(f"{entry} {count}x" for entry, count in sorted(self.entries.items()))
        where = f" ({compact(self.modules)})" if self.modules else ""
        count = f"{len(self.modules)} " if self.modules else ""
        return f"{self.library} ran for {count}{self.kind}{where}: {entries}{extra}"

    def candidate(self, model: nn.Module, note: str, forward_only: str = "") -> Generator[Candidate, None, list[str]]:
        """Yield `model` as the candidate, its report's notes saying `note`; once the check has run, fail it where
        the library ran nothing, else add what ran to the notes (`line`), and return the notes."""
        notes = [note]
        yield Candidate(model, forward_only=forward_only, notes=notes)
        self.require_some()
        notes.append(self.line())
        return notes

    def require_some(self) -> None:
        """Fail the check when the library's kernels never ran: the candidate was the reference."""
        if not self.calls:
            raise RuntimeError(f"{self.library} was switched on but none of its kernels ran: no {self.kind} "
                               f"of this model called it, so the check would have compared the reference with itself")


_NUMBERED = re.compile(r"^(.*?\.)(\d+)(\..*|)$")


def compact(names: Iterable[str]) -> str:
    """Module names with one varying index folded: `model.layers.{0-3,5}.self_attn`."""
    groups: dict[tuple[str, str], list[int]] = {}
    singles = []
    for name in names:
        match = _NUMBERED.match(name)
        if match:
            groups.setdefault((match.group(1), match.group(3)), []).append(int(match.group(2)))
        else:
            singles.append(name)
    folded = [f"{head}{_ranges(indices)}{tail}" if len(indices) > 1 else f"{head}{indices[0]}{tail}"
              for (head, tail), indices in groups.items()]
    return ", ".join(folded + singles)


def _ranges(indices: list[int]) -> str:
    spans: list[list[int]] = []
    for index in sorted(set(indices)):
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return "{" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) + "}"
