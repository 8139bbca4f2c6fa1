"""The drift report: what the versions installed here (a new transformers, a new torch) change in a project's
goldens, before anyone adopts them.

Each selected golden is recorded again from the HF eager reference, here and now, in memory (nothing is
written), and measured against the stored golden the way `veosnap diff` measures a change: every tensor's
row error in units of the stored bound, the routes, the tensor set. A golden whose every tensor stays within
its bound is noise: checks against it still mean what they meant. One that moved beyond a bound, routes
differently or records other tensors is moved: a candidate failing there may be failing on the upstream
change, not on its kernel. Adopting the versions is then a reviewed `veosnap refresh --reason ...`
(docs/versions.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import VeosnapError
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import GoldenKey
from ..reference.zoo import Project
from .check import version_drift
from .diff import GoldenDiff, TensorMove, diff_goldens
from .record import recorded
from .verdict import VersionDrift, first_diverging

SAME, NOISE, MOVED, NOT_RECORDED = "same", "noise", "moved", "not recorded"


@dataclass(frozen=True)
class Drift:
    """One golden recorded again under this machine's versions, against the stored one."""

    key: GoldenKey
    versions: list[VersionDrift] = field(default_factory=list)  # the stored golden's versions vs here
    diff: GoldenDiff | None = None
    problem: str = ""  # why it could not be recorded here

    @property
    def moved(self) -> list[TensorMove]:
        """Tensors beyond their stored bound, worst first."""
        return [t for t in self.diff.ranked() if t.material] if self.diff else []

    @property
    def status(self) -> str:
        if self.problem:
            return NOT_RECORDED
        d = self.diff
        assert d is not None
        if self.moved or d.routes or d.tensors_added or d.tensors_removed:
            return MOVED
        return NOISE if d.tensors else SAME

    @property
    def worst(self) -> TensorMove | None:
        return self.diff.worst if self.diff else None

    @property
    def first_layer(self) -> str | None:
        """The earliest decoder layer (or encoder block) whose output moved beyond its bound."""
        return first_diverging([(t.name, t.ratio) for t in self.moved])


@dataclass
class DriftReport:
    """Every selected golden's drift under the versions installed here."""

    drifts: list[Drift]

    @property
    def moved(self) -> list[Drift]:
        return [d for d in self.drifts if d.status == MOVED]

    @property
    def versions(self) -> list[VersionDrift]:
        """The distinct version differences between the stored goldens and here."""
        return list(dict.fromkeys(v for d in self.drifts for v in d.versions))

    @property
    def devices(self) -> list[tuple[str, str]]:
        """(recorded on, here) where the goldens came from another device model of the class: its rounding
        differs, so their tensors move within noise even under the same versions."""
        return list(dict.fromkeys((c.old or "", c.new or "") for d in self.drifts if d.diff
                                  for c in d.diff.provenance if c.field == "device"))


def drift(project: Project, keys: list[GoldenKey],
          progress: Callable[[int, int, GoldenKey], None] | None = None) -> DriftReport:
    """Record each of `keys` again here (in memory, same seed and sketch plan) and measure it against the
    project's stored golden. A golden that cannot be recorded here is a row that says why."""
    drifts = []
    for i, key in enumerate(keys):
        if progress is not None:
            progress(i, len(keys), key)
        stored = store.read(store.path_for(project.goldens, key), project.goldens)
        versions = version_drift(stored)
        try:
            fresh = recorded(project, key, seed=stored.manifest.reference.seed, allow_near_ties=True,
                             sketch=_sketch_mode(stored)).golden
        except VeosnapError as exc:
            drifts.append(Drift(key, versions, problem=str(exc)))
            continue
        drifts.append(Drift(key, versions, diff_goldens(stored, fresh)))
    return DriftReport(drifts)


def _sketch_mode(golden: Golden) -> str:
    """Record the way the stored golden was planned: its mode where it sketched anything; else whole (an
    all-whole golden stores no plan, and `auto` on other versions must not pick another form)."""
    plan = golden.manifest.sketch
    return plan.mode if plan is not None else "never"
