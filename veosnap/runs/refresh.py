"""Approved re-recording of goldens (`veosnap refresh`).

A refresh re-runs the reference on this machine and rewrites a golden only when its content moved
beyond the reference's noise, so an unchanged model keeps a byte-identical file and a pull request
touches only the goldens that really changed. It compares bounds too: a golden whose bounds are looser
than the reference now measures (loosened by hand, say) is rewritten, never kept as "within noise".
Each rewrite appends {reason, previous_payload_hash} to the manifest's approval trail (which `diff`
shows), so the history of why a golden changed travels with it. The new golden is recorded as `record`
records it: from a pristine process, and refused when fragile unless `allow_fragile` or its failing variants
are excused (`record.settle`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import GoldenError, VeosnapError
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import SCENARIOS, GoldenKey
from ..golden.manifest import Approval
from ..numerics import fmt
from ..reference import hardware
from ..reference.zoo import Project, load_config, writable
from .diff import GoldenDiff, diff_goldens
from .record import certified, encode_checked, recorded, settle

# Manifest fields whose change alone makes a refresh rewrite: the golden would describe another
# function, batch, tolerance rule or format than the one on disk.
REWRITE_FIELDS = ("config_hash", "inputs_hash", "schema_version")
# A stored bound more than this many times the one the reference measures now was loosened: rewritten.
# (Not 1: another CPU of the same class measures a slightly different noise; `diff` flags any growth.)
LOOSER_THAN_MEASURED = 2.0


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
    resketched = [t for t in d.tensors if t.problem.startswith("re-sketched")]
    over = [t for t in d.tensors if t.material and t not in resketched]
    if over:
        worst = max(over, key=lambda t: t.ratio)
        why.append(f"{len(over)} tensor(s) moved beyond 1x bound (largest {worst.name} {fmt.times(worst.ratio)})")
    if d.tensors_added or d.tensors_removed:
        why.append(f"tensor set changed (+{len(d.tensors_added)} -{len(d.tensors_removed)})")
    if d.routes:
        why.append(f"routes changed in {len(d.routes)} MoE layer(s)")
    why += [f"{c.field} changed" for c in d.manifest if c.field in REWRITE_FIELDS]
    if resketched:
        why.append(f"{len(resketched)} tensor(s) re-sketched (another form, width, group, seed or support)")
    if any(c.field == "sketch.mode" for c in d.manifest):
        why.append("sketch mode changed")
    if d.tolerance_rule:
        why.append("tolerance rule changed (" + ", ".join(c.field for c in d.tolerance_rule) + ")")
    looser = [t for t in d.tolerance if t.old_bound > LOOSER_THAN_MEASURED * t.new_bound]
    if looser:
        worst = max(looser, key=lambda t: t.old_bound / t.new_bound)
        why.append(f"{len(looser)} bound(s) looser than the reference measures (largest {worst.name} "
                   f"{fmt.times(worst.old_bound / worst.new_bound)})")
    added = [t for t in d.tolerance if math.isinf(t.old_scale_bound) and not math.isinf(t.new_scale_bound)]
    if added:  # recorded before gradients had projection bounds (`numerics.projection`)
        why.append(f"{len(added)} gradient projection bound(s) added")
    if d.absent:
        why.append("absences changed")
    return why


def refresh(project: Project, model: str, dtype: str, reason: str, force: bool = False,
            scenario: str = "step", seed: int | None = None, allow_near_ties: bool = False,
            allow_fragile: bool = False, sketch: str | None = None,
            excuses: dict[str, str] | None = None, certify: bool = True) -> RefreshOutcome:
    """Re-record one golden from the reference; rewrite it only if it moved beyond noise (or `force`).

    A new golden that cheap legitimate variants fail is refused, as `record` refuses it, unless
    `allow_fragile` or its failing variants are excused (`excuses`, as `record` takes them; None keeps the
    old golden's, dropping one whose variant passes now; a change of the excused variants or their reasons
    is a reason to rewrite). `sketch` (auto, always, never): None keeps the mode the old golden was recorded
    with (auto when it has no sketched tensor, or there is none). `certify` (the default) plants the canaries
    as `record` does; a certificate that changes is a reason to rewrite."""
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
    writable(project.goldens)
    path = store.path_for(project.goldens, key)
    store.check_writable(path, project.goldens)
    with store.locked(project.goldens):  # from reading the old golden to writing the new one
        return _refresh(project, key, path, reason, force, seed, allow_near_ties, allow_fragile, sketch, excuses,
                        certify)


def _refresh(project: Project, key: GoldenKey, path: Path, reason: str, force: bool, seed: int | None,
             allow_near_ties: bool, allow_fragile: bool, sketch: str | None,
             excuses: dict[str, str] | None, certify: bool) -> RefreshOutcome:
    old = _read_old(project, key, force, reason)
    if seed is None:  # keep the weights the old golden was recorded with
        seed = old.manifest.reference.seed if old is not None else 0
    if sketch is None:  # and the way it chose its forms
        sketch = old.manifest.sketch.mode if old is not None and old.manifest.sketch is not None else "auto"
    fresh = recorded(project, key, seed=seed, allow_near_ties=allow_near_ties, sketch=sketch)
    new = fresh.golden
    command = project.recording_command("refresh", key, "--reason", reason)
    dropped = []
    if excuses is None and old is not None and old.manifest.excused:
        # Kept from the old golden, as its seed and sketch mode are; one its variant now passes is dropped.
        excuses = _reasons(old)
        failing = {j.variant for j in fresh.judge(project) if j.failed}
        dropped = sorted(set(excuses) - failing)
        excuses = {v: r for v, r in excuses.items() if v in failing}
    if excuses:  # judged first: a stale excuse is refused even where nothing else changed
        settle(key, new, fresh.judge(project), excuses, allow_fragile, command)
    if old is not None:  # the certificate is decided below, from whether the tensors move
        new.manifest = replace(new.manifest, reference=replace(new.manifest.reference,
                                                               sensitivity=old.manifest.reference.sensitivity))
    why = reasons_to_rewrite(diff_goldens(old, new)) if old is not None else []
    if old is not None and _reasons(old) != _reasons(new):
        why.append(f"excuse for {', '.join(dropped)} dropped (it no longer fails)" if dropped
                   else "excused variants changed")
    if (old is None or why or force) and not excuses:
        settle(key, new, fresh.judge(project), {}, allow_fragile, command)
    if old is None:
        why = "replaced an unreadable golden (--force)" if os.path.lexists(path) else "no golden before"
        if certify:
            certified(project, new)
        new.manifest.approvals = [Approval(reason, previous_payload_hash=None)]
        store.write_bytes(encode_checked(new, path), path, project.goldens)
        return RefreshOutcome(key, path, "created", why)
    if not why and not force:
        if not certify or old.manifest.reference.sensitivity:
            return RefreshOutcome(key, path, "unchanged", "within noise of the recorded golden")
        # Within noise and not certified: the old golden itself is certified, its tensors kept (a refresh on
        # another CPU of the class must not churn them to add a certificate).
        new = Golden(replace(old.manifest), dict(old.tensors), sketches=dict(old.sketches))
        why = ["certified (its tensors kept: within noise of the reference)"]
    if certify:
        certified(project, new)
        if not old.manifest.reference.sensitivity and not (why and why[-1].startswith("certified")):
            why.append("certified")
    else:
        new.manifest = replace(new.manifest, reference=replace(new.manifest.reference, sensitivity=None))
        if old.manifest.reference.sensitivity:
            why.append("not certified (--no-certify)")
    new.manifest.approvals = [*old.manifest.approvals, Approval(reason, old.manifest.payload_hash)]
    store.write_bytes(encode_checked(new, path), path, project.goldens)
    return RefreshOutcome(key, path, "rewrote", "; ".join(why) or "forced (--force)", diff_goldens(old, new))


def stale(project: Project, model: str, dtypes: list[str]) -> list[GoldenKey]:
    """The goldens of `model` (of `dtypes`, every scenario, this project's class) recorded from another config
    than the model's config today: a refresh of the model rewrites them all, or they stay stale."""
    toy = load_config(project.configs, model)
    found = []
    for scenario in SCENARIOS:
        for dtype in dtypes:
            key = GoldenKey(project.hardware_class, model, scenario, dtype)
            path = store.path_for(project.goldens, key)
            if key.recorded != key or not path.is_file():
                continue
            try:
                manifest = store.read_manifest(path, project.goldens)
            except GoldenError:
                continue  # unreadable: a refresh of it says so, verify too
            if manifest.config_hash != toy.hash:
                found.append(key)
    return found


def _reasons(golden: Golden) -> dict[str, str]:
    return {variant: excuse.reason for variant, excuse in golden.manifest.excused.items()}


def _read_old(project: Project, key: GoldenKey, force: bool, reason: str) -> Golden | None:
    path = store.path_for(project.goldens, key)
    if not os.path.lexists(path):
        return None
    try:
        return store.read(path, root=project.goldens)
    except GoldenError as exc:
        if force:
            return None  # --force replaces an unreadable golden; its trail is lost with it
        replace = project.recording_command("refresh", key, "--force", "--reason", reason)
        raise GoldenError(path, f"cannot refresh over an unreadable golden ({exc.problem}); check it with "
                                f"`veosnap verify`, or pass --force to replace it: `{replace}`") from None
