"""Approved re-recording of goldens (`veosnap refresh`).

A refresh re-runs the reference on this machine and rewrites a golden only when its content moved
beyond the reference's noise, so an unchanged model keeps a byte-identical file and a pull request
touches only the goldens that really changed. Each rewrite appends {reason, previous_payload_hash}
to the manifest's approval trail, so the history of why a golden changed travels with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import GoldenError, VeosnapError
from ..golden import codec, store
from ..golden.codec import Golden
from ..golden.key import GoldenKey
from ..golden.manifest import Approval
from ..numerics import fmt
from ..reference import hardware
from ..reference.zoo import Project
from .diff import GoldenDiff, diff_goldens
from .record import build_golden

# Manifest fields whose change alone makes a refresh rewrite: the golden would describe another
# function, batch, tolerance rule or format than the one on disk.
REWRITE_FIELDS = ("config_hash", "inputs_hash", "schema_version")


@dataclass(frozen=True)
class RefreshOutcome:
    """What `refresh` did for one key, and why."""

    key: GoldenKey
    path: Path
    action: str  # "rewrote" | "created" | "unchanged"
    why: str
    diff: GoldenDiff | None = None  # old golden -> new golden (rewrote only)

    @property
    def written(self) -> bool:
        return self.action != "unchanged"


def reasons_to_rewrite(d: GoldenDiff) -> list[str]:
    """Why a freshly recorded golden must replace the old one; empty: the difference is noise."""
    why = []
    over = [t for t in d.tensors if t.material]
    if over:
        worst = max(over, key=lambda t: t.ratio)
        why.append(f"{len(over)} tensor(s) moved beyond 1x bound (largest {worst.name} {fmt.times(worst.ratio)})")
    if d.tensors_added or d.tensors_removed:
        why.append(f"tensor set changed (+{len(d.tensors_added)} -{len(d.tensors_removed)})")
    if d.routes:
        why.append(f"routes changed in {len(d.routes)} MoE layer(s)")
    why += [f"{c.field} changed" for c in d.manifest if c.field in REWRITE_FIELDS]
    if d.tolerance_rule:
        why.append("tolerance rule changed (" + ", ".join(c.field for c in d.tolerance_rule) + ")")
    return why


def refresh(project: Project, model: str, dtype: str, reason: str, force: bool = False,
            scenario: str = "step", seed: int | None = None, allow_near_ties: bool = False) -> RefreshOutcome:
    """Re-record one golden from the reference; rewrite it only if it moved beyond noise (or `force`)."""
    reason = reason.strip()
    if not reason:
        raise VeosnapError("--reason: give the reason for this refresh (it is stored in the golden's approval trail)")
    here = hardware.detect()
    if project.hardware_class != here:
        raise VeosnapError(
            f"cannot refresh hardware class {project.hardware_class} on this machine ({here}): goldens are "
            f"re-recorded only on the hardware they describe; run `veosnap refresh` on a {project.hardware_class} machine"
        )
    key = GoldenKey(project.hardware_class, model, scenario, dtype).recorded
    path = store.path_for(project.goldens, key)
    old = _read_old(path, project.goldens, force)
    if seed is None:  # keep the weights the old golden was recorded with
        seed = old.manifest.reference.seed if old is not None else 0
    new = build_golden(project, key, seed=seed, allow_near_ties=allow_near_ties)
    if old is None:
        why = "replaced an unreadable golden (--force)" if path.exists() else "no golden before"
        new.manifest.approvals = [Approval(reason, previous_payload_hash=None)]
        store.write_bytes(codec.encode(new), path)
        return RefreshOutcome(key, path, "created", why)
    why = reasons_to_rewrite(diff_goldens(old, new))
    if not why and not force:
        return RefreshOutcome(key, path, "unchanged", "within noise of the recorded golden")
    new.manifest.approvals = [*old.manifest.approvals, Approval(reason, old.manifest.payload_hash)]
    store.write_bytes(codec.encode(new), path)
    return RefreshOutcome(key, path, "rewrote", "; ".join(why) or "forced (--force)", diff_goldens(old, new))


def _read_old(path: Path, root: Path, force: bool) -> Golden | None:
    if not path.exists():
        return None
    try:
        return store.read(path, root=root)
    except GoldenError as exc:
        if force:
            return None  # --force replaces an unreadable golden; its trail is lost with it
        raise GoldenError(path, f"cannot refresh over an unreadable golden ({exc.cause}); "
                                "check it with `veosnap verify`, or pass --force to replace it") from None
