"""How goldens moved between two trees (git revisions or directories): `veosnap diff`.

A golden whose bytes are the same on both sides is unchanged and never decoded. For a changed one,
every tensor that moved is measured with the check's own metric (row error, tolerance.py) in units of
the old golden's bound, so "0.3x" reads as noise and "40x" as a real change. A tensor sketched alike on
both sides is compared sketch to sketch (an estimate, and said so); one whose form changed (whole to
sketched, another width, group, seed or support) cannot be measured and is a material change,
"re-sketched". Routes are compared per MoE layer, and tolerance, config, inputs, provenance and the
approval trail are listed field by field.

Review of this diff is what a golden's integrity rests on (its hashes are unkeyed, see docs/trust.md), so
anything that could let a bug pass is material, not "metadata": a bound that grows, a changed tolerance
rule (alpha, floor, tie epsilon), an absence newly excused, and any change to the approval trail but
appending an approval that names the golden it replaced.

Git revisions are read with `git ls-tree` and one `git cat-file --batch`; the tree is never checked out.
"""

from __future__ import annotations

import difflib
import io
import json
import math
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch

from ..errors import VeosnapError
from ..golden import codec, names, schema, store
from ..golden.codec import Golden
from ..golden.key import GoldenKey
from ..golden.manifest import Approval, json_object
from ..golden.sketches import GoldenSketch
from ..numerics.metric import is_token_tensor, row_error
from ..numerics.routes import compare_routes
from ..numerics.sketch import compare_golden_sketches
from ..reference.determinism import one_thread
from ..reference.inputs import Batch

WORKING_TREE = "working tree"


# --------------------------------------------------------------------------------------------
# What changed


@dataclass(frozen=True)
class TensorMove:
    """One tensor that is not bit-identical: its row error against the old golden, in old bounds."""

    name: str
    error: float
    bound: float  # the old golden's bound for this tensor
    problem: str = ""  # shape or dtype changed, non-finite values, re-sketched: not measurable
    width: int = 0  # compared sketch to sketch: the sketch's width and rows per group (0: whole)
    group: int = 0

    @property
    def estimate(self) -> bool:
        """The error is an estimate from the two goldens' sketches."""
        return self.width > 0 and not self.problem

    @property
    def ratio(self) -> float:
        if self.problem:
            return math.inf
        return self.error / self.bound if self.bound > 0 else math.inf

    @property
    def material(self) -> bool:
        return self.ratio > 1.0


@dataclass(frozen=True)
class RouteChange:
    """One MoE layer whose routes differ: tokens sent to other experts (or a layer added/removed)."""

    layer: int
    tokens: int
    flipped: int  # tokens whose expert set differs
    near_tie: int = 0  # of those, tokens the old golden marked as near-ties
    status: str = "changed"  # changed | added | removed | reshaped

    def message(self) -> str:
        if self.status != "changed":
            return f"layer {self.layer}: MoE layer {self.status}"
        ties = f" ({self.near_tie} near-tie)" if self.near_tie else ""
        return f"layer {self.layer}: {self.flipped} of {self.tokens} tokens routed to other experts{ties}"


@dataclass(frozen=True)
class ToleranceChange:
    """A tensor whose stored bound (or noise) differs."""

    name: str
    old_bound: float
    new_bound: float
    old_noise: float
    new_noise: float
    # a low-precision gradient's projection bound and its noise (`numerics.projection`); inf: none (not judged)
    old_scale_bound: float = math.inf
    new_scale_bound: float = math.inf
    old_scale_noise: float = math.inf
    new_scale_noise: float = math.inf

    @property
    def factor(self) -> float:
        return self.new_bound / self.old_bound if self.old_bound > 0 else math.inf

    @property
    def loosened_fields(self) -> set[str]:
        """The schema fields of this change that grew (a projection bound removed grows to inf)."""
        grew = {"tolerance.*.bound": self.new_bound > self.old_bound, "tolerance.*.noise": self.new_noise > self.old_noise,
                "tolerance.*.scale_bound": self.new_scale_bound > self.old_scale_bound,
                "tolerance.*.scale_noise": self.new_scale_noise > self.old_scale_noise}
        return {name for name, yes in grew.items() if yes}


@dataclass(frozen=True)
class TrailChange:
    """One change to the approval trail. Only `added` (appended, naming the golden it replaced) is metadata."""

    kind: str  # added | removed | edited | inserted | moved | forged
    approval: Approval
    old: Approval | None = None  # edited: the entry before
    why: str = ""  # forged: what does not add up

    @property
    def material(self) -> bool:
        return self.kind != "added"


@dataclass(frozen=True)
class FieldChange:
    """A manifest field (flattened, e.g. `config.hidden_size`) that differs; None: absent on that side."""

    field: str
    old: str | None
    new: str | None


@dataclass(frozen=True)
class FieldLoosening:
    """A stored field whose change could let a bug pass, found by walking the schema (`golden.schema`)."""

    field: str  # the schema path (`routes.*.margin`, `sketch.tensors.*.tau`, `reference.seed`)
    where: str  # the concrete one (`routes.0.margin`, `sketch.tensors.logits.tau`)
    detail: str  # what changed, and why it matters


@dataclass
class GoldenDiff:
    """How one golden present on both sides changed."""

    key: GoldenKey
    tensors: list[TensorMove] = field(default_factory=list)  # only tensors that moved
    compared: int = 0  # tensors with a tolerance on both sides
    tensors_added: list[str] = field(default_factory=list)
    tensors_removed: list[str] = field(default_factory=list)
    routes: list[RouteChange] = field(default_factory=list)  # only layers that changed
    route_layers: int = 0
    tolerance: list[ToleranceChange] = field(default_factory=list)
    tolerance_rule: list[FieldChange] = field(default_factory=list)  # alpha, floor, tie epsilon
    manifest: list[FieldChange] = field(default_factory=list)  # config, inputs, reference, schema, margins
    provenance: list[FieldChange] = field(default_factory=list)
    approvals: list[Approval] = field(default_factory=list)  # approvals the new side appended
    trail: list[TrailChange] = field(default_factory=list)  # every change to the approval trail
    absent: list[FieldChange] = field(default_factory=list)  # tensors the golden says it leaves out, and why
    fields: list[FieldLoosening] = field(default_factory=list)  # schema fields loosened (or identity changed)

    def ranked(self) -> list[TensorMove]:
        """Moved tensors, largest move first."""
        return sorted(self.tensors, key=lambda t: (-t.ratio, t.name))

    @property
    def worst(self) -> TensorMove | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    @property
    def identity_changed(self) -> list[FieldChange]:
        """Config or inputs hash changes: the golden now describes another function or batch."""
        return [c for c in self.manifest if c.field in ("config_hash", "inputs_hash")]

    @property
    def loosened(self) -> list[ToleranceChange]:
        """Bounds (or the noise they are made of) that grew: each would let a larger error pass."""
        return [t for t in self.tolerance if t.loosened_fields]

    @property
    def trail_rewritten(self) -> list[TrailChange]:
        """Trail changes beyond appending a sound approval."""
        return [c for c in self.trail if c.material]

    def why_material(self) -> list[str]:
        """Each reason this change is material (empty: it is noise or metadata)."""
        why = []
        over = [t for t in self.tensors if t.material]
        if over:
            why.append(f"{len(over)} tensor(s) moved beyond 1x bound")
        if self.tensors_added or self.tensors_removed:
            why.append(f"tensor set changed (+{len(self.tensors_added)} -{len(self.tensors_removed)})")
        if self.routes:
            why.append(f"routes changed in {len(self.routes)} MoE layer(s)")
        if self.identity_changed:
            why.append(" and ".join(c.field.removesuffix("_hash") for c in self.identity_changed) + " changed")
        if self.loosened:
            why.append(f"{len(self.loosened)} bound{'s' if len(self.loosened) > 1 else ''} loosened")
        if self.tolerance_rule:
            why.append("tolerance rule changed (" + ", ".join(c.field for c in self.tolerance_rule) + ")")
        if self.absent:
            why.append("absences changed (what the golden says it leaves out)")
        if self.trail_rewritten:
            kinds = ", ".join(dict.fromkeys(c.kind for c in self.trail_rewritten))
            why.append(f"approval trail rewritten ({kinds})")
        if self.fields:
            wheres = list(dict.fromkeys(f.where for f in self.fields))
            more = f" and {len(wheres) - 3} more" if len(wheres) > 3 else ""
            why.append("loosened or changed: " + ", ".join(wheres[:3]) + more)
        return why

    def material_fields(self) -> set[str]:
        """The schema paths (`golden.schema.FIELDS`) of every material change: which stored field moved."""
        found = {f.field for f in self.fields}
        for t in self.tensors:
            if t.material:
                found.add("*#support" if "(other support rows)" in t.problem else "sketch.tensors.*.spec.*"
                          if t.problem.startswith("re-sketched") else "*#sketch" if t.width else _tensor_field(t.name))
        found |= {_tensor_field(name) for name in (*self.tensors_added, *self.tensors_removed)}
        if self.routes:
            found.add("routes.*.experts")
        found |= {"config" if c.field == "config_hash" else "inputs.*" for c in self.identity_changed}
        for t in self.loosened:
            found |= t.loosened_fields
        found |= {c.field for c in self.tolerance_rule}
        if self.absent:
            found.add("absent[].*")
        if self.trail_rewritten:
            found.add("approvals[].*")
        return found

    @property
    def material(self) -> bool:
        """Anything a check, or the review of a change, would see: see `why_material`."""
        return bool(self.why_material())

    @property
    def verdict(self) -> str:
        if self.material:
            return "material"
        if self.tensors:
            return "noise"  # moved, all within bound
        return "metadata"  # tensors bit-identical; only the manifest differs


@dataclass
class DiffReport:
    """Goldens added, removed and changed between `base` and `head`."""

    base: str
    head: str
    added: list[GoldenKey] = field(default_factory=list)
    removed: list[GoldenKey] = field(default_factory=list)
    changed: list[GoldenDiff] = field(default_factory=list)
    unchanged: list[GoldenKey] = field(default_factory=list)
    # Unchanged goldens of a model whose other goldens moved to another config: still recorded from the old one
    # (a refresh of some scenarios or dtypes only). Each with the changed golden that says so.
    stale: list[tuple[GoldenKey, GoldenKey]] = field(default_factory=list)

    @property
    def material(self) -> bool:
        return bool(self.added or self.removed or self.stale) or any(d.material for d in self.changed)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.changed)


# --------------------------------------------------------------------------------------------
# Comparing two goldens


def _or_inf(value: float | None) -> float:
    return math.inf if value is None else value


def diff_goldens(old: Golden, new: Golden) -> GoldenDiff:
    """Every way `new` differs from `old` (same key), measured against `old`'s bounds."""
    om, nm = old.manifest, new.manifest
    out = GoldenDiff(key=nm.key)
    mask = Batch.from_golden(old).token_mask
    old_names, new_names = set(om.tolerance), set(nm.tolerance)
    out.tensors_added = sorted(new_names - old_names)
    out.tensors_removed = sorted(old_names - new_names)
    common = sorted(old_names & new_names)
    out.compared = len(common)
    for name in common:
        move = _form_move(name, old, new, om.tolerance[name].bound, mask)
        if move is not None:
            out.tensors.append(move)
        ot, nt = om.tolerance[name], nm.tolerance[name]
        if ot != nt:
            out.tolerance.append(ToleranceChange(name, ot.bound, nt.bound, ot.noise, nt.noise,
                                                 *(_or_inf(v) for v in (ot.scale_bound, nt.scale_bound,
                                                                        ot.scale_noise, nt.scale_noise))))
    out.routes, out.route_layers = _route_changes(old, new, mask)
    out.tolerance_rule = [c for c in (_field("alpha", om.alpha, nm.alpha), _field("floor", om.floor, nm.floor),
                                      _field("tie_epsilon", om.tie_epsilon, nm.tie_epsilon)) if c]
    out.manifest = [c for c in (_field("schema_version", om.schema_version, nm.schema_version),
                                _field("config_hash", om.config_hash, nm.config_hash),
                                _field("inputs_hash", om.inputs_hash, nm.inputs_hash)) if c]
    out.manifest += _dict_changes("config", om.config, nm.config)
    out.manifest += _dict_changes("reference", json_object(om.reference), json_object(nm.reference))
    out.manifest += _dict_changes("min_margin", _layers(om.min_margin), _layers(nm.min_margin))
    out.manifest += _dict_changes("sketch", _sketch_plan(om), _sketch_plan(nm))
    out.manifest += _dict_changes("excused", {v: e.reason for v, e in om.excused.items()},  # record --excuse
                                  {v: e.reason for v, e in nm.excused.items()})
    out.provenance = _dict_changes("", json_object(om.provenance), json_object(nm.provenance))
    out.absent = _dict_changes("absent", _absences(om), _absences(nm))
    out.trail = trail_changes(om.approvals, nm.approvals, om.payload_hash)
    out.approvals = [c.approval for c in out.trail if c.kind in ("added", "forged", "inserted")]
    out.fields = schema_changes(old, new, mask)
    return out


# --------------------------------------------------------------------------------------------
# Walking the schema


def schema_changes(old: Golden, new: Golden, mask: torch.Tensor) -> list[FieldLoosening]:
    """Every stored field (`golden.schema`) whose change could let a bug pass, judged by its rule. The rules
    `moved`, `routes`, `grows` (bounds), `rule`, `form` and `trail` are the structured comparisons above
    (tensors, routes, tolerance, the trail); `changes`, `added`, `tau` and `near_ties` are judged here;
    `derived` fields never change alone (the reader cross-checks them) and `metadata` never counts."""
    a, b = schema.flatten(json.loads(old.manifest.to_json())), schema.flatten(json.loads(new.manifest.to_json()))
    found: list[FieldLoosening] = []
    for where in sorted(a.keys() | b.keys()):
        pattern = (b.get(where) or a[where])[0]
        entry = schema.field_of(pattern)
        if entry is None:
            # A field the schema does not know cannot be judged: material, so it is reviewed (and a test fails).
            found.append(FieldLoosening(pattern, where, "a field the schema does not list"))
            continue
        before, after = a.get(where, (None, None))[1], b.get(where, (None, None))[1]
        if before == after or entry.path in ("config", "absent[].*"):  # config and absences: their own lines
            continue
        if entry.rule == "changes":
            found.append(FieldLoosening(entry.path, where, f"{_show(before)} -> {_show(after)}"))
        elif entry.rule == "added" and after is not None:
            found.append(FieldLoosening(entry.path, where, f"{_show(before) if before is not None else '(absent)'} -> "
                                                           f"{_show(after)}"))
    found += _tau_changes(old, new)
    found += _near_tie_changes(old, new, mask)
    return found


def _tau_changes(old: Golden, new: Golden) -> list[FieldLoosening]:
    """Sketched tensors whose tau grew by more than their bound: a sketch's errors are in units of tau, so a
    grown tau reads every candidate's error that many times smaller."""
    found = []
    for name in sorted(old.sketches.keys() & new.sketches.keys()):
        before, after = old.sketches[name].tau, new.sketches[name].tau
        bound = old.manifest.tolerance[name].bound
        if after > before * (1 + bound) if before > 0 else after > 0:
            factor = after / before if before > 0 else math.inf
            found.append(FieldLoosening("sketch.tensors.*.tau", f"sketch.tensors.{name}.tau",
                                        f"{before:.6g} -> {after:.6g} ({factor:.3g}x, beyond its bound {bound:.2g}): "
                                        "errors read that much smaller"))
    return found


def _near_tie_changes(old: Golden, new: Golden, mask: torch.Tensor) -> list[FieldLoosening]:
    """MoE layers where real tokens the old golden routed clearly are near-ties in the new one (margin under
    its tie epsilon): a candidate's flip of them would pass as a near-tie."""
    found = []
    for layer in sorted(set(old.route_layers()) & set(new.route_layers())):
        name = str(names.Route(layer, "margin"))
        a, b = old.tensors[name].reshape(-1), new.tensors[name].reshape(-1)
        if a.shape != b.shape or a.numel() != mask.numel():
            continue  # routes reshaped: the routes rule says so
        newly = mask & (a >= old.manifest.tie_epsilon) & (b < new.manifest.tie_epsilon)
        if bool(newly.any()):
            found.append(FieldLoosening("routes.*.margin", name,
                                        f"{int(newly.sum())} of {int(mask.sum())} real tokens routed clearly before "
                                        f"are near-ties now (margin under {new.manifest.tie_epsilon:g}): their flips "
                                        "would pass"))
    return found


def _tensor_field(name: str) -> str:
    entry = schema.field_of(name, tensor=True)
    return entry.path if entry is not None else name


def _form(golden: Golden, name: str) -> str:
    sketch = golden.sketches.get(name)
    return "whole" if sketch is None else f"sketch {sketch.spec.describe()}"


def _form_move(name: str, old: Golden, new: Golden, bound: float, mask: torch.Tensor) -> TensorMove | None:
    """A tensor held whole or sketched on either side."""
    a, b = old.sketches.get(name), new.sketches.get(name)
    if a is None and b is None:
        return _tensor_move(name, old.tensors[name], new.tensors[name], bound, mask)
    if a is not None and b is not None:
        return _sketch_move(name, a, b, bound, mask)
    return TensorMove(name, math.inf, bound, problem=f"re-sketched: {_form(old, name)} -> {_form(new, name)}")


def _sketch_move(name: str, old: GoldenSketch, new: GoldenSketch, bound: float,
                 mask: torch.Tensor) -> TensorMove | None:
    if old.spec == new.spec and torch.equal(old.values, new.values) and torch.equal(old.norms, new.norms) \
            and old.tau == new.tau and (old.support is None or torch.equal(old.support, new.support)):
        return None
    err = compare_golden_sketches(old, new, row_mask=mask if is_token_tensor(name) else None, name=name)
    if err is None:
        what = f"re-sketched: sketch {old.spec.describe()} -> sketch {new.spec.describe()}"
        if old.spec.seed != new.spec.seed:
            what += f" (seed {old.spec.seed} -> {new.spec.seed})"
        elif old.spec == new.spec:
            what += " (other support rows)"
        return TensorMove(name, math.inf, bound, problem=what)
    return TensorMove(name, err.error, bound, width=old.spec.width, group=old.spec.group)


def _absences(manifest: object) -> dict[str, str]:
    return {f"{a.kind}:{name}": a.reason for a in manifest.absent for name in (a.names or ("*",))}  # type: ignore[attr-defined]


def trail_changes(old: list[Approval], new: list[Approval], old_payload: str) -> list[TrailChange]:
    """How the approval trail changed: appended entries are `added` (metadata) when the first names the
    golden it replaced; anything else (removed, edited, inserted, moved, or appended naming another
    golden: `forged`) is material."""
    changes: list[TrailChange] = []
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        gone, came = old[i1:i2], new[j1:j2]
        if op == "replace":
            for before, after in zip(gone, came):
                changes.append(TrailChange("edited", after, old=before))
            gone, came = gone[len(came):], came[len(gone):]
        changes += [TrailChange("removed", a) for a in gone]
        appended = i1 == len(old) and j2 == len(new)
        for k, a in enumerate(came):
            if not appended:
                changes.append(TrailChange("inserted", a))
            elif j1 + k == len(old) and a.previous_payload_hash != old_payload:
                changes.append(TrailChange("forged", a, why=f"it says it replaced {a.previous_payload_hash}, but the "
                                                          f"golden before it was {old_payload}"))
            else:
                changes.append(TrailChange("added", a))
    # An entry removed in one place and inserted in another was moved.
    removed = {c.approval for c in changes if c.kind == "removed"}
    inserted = {c.approval for c in changes if c.kind in ("inserted", "added", "forged")}
    moved = removed & inserted
    if moved:
        changes = [c for c in changes if c.approval not in moved] + \
                  [TrailChange("moved", a) for a in new if a in moved]
    return changes


def _tensor_move(name: str, old: torch.Tensor, new: torch.Tensor, bound: float,
                 mask: torch.Tensor) -> TensorMove | None:
    if tuple(old.shape) != tuple(new.shape):
        return TensorMove(name, math.inf, bound, problem=f"shape {list(old.shape)} -> {list(new.shape)}")
    if old.dtype != new.dtype:
        return TensorMove(name, math.inf, bound, problem=f"dtype {_dt(old)} -> {_dt(new)}")
    if torch.equal(old, new):
        return None
    bad = int((~torch.isfinite(new.double())).sum())
    if bad:
        return TensorMove(name, math.inf, bound, problem=f"{bad} non-finite value(s)")
    err = row_error(name, new, old, mask if is_token_tensor(name) else None)
    return TensorMove(name, err.error, bound)


def _route_changes(old: Golden, new: Golden, mask: torch.Tensor) -> tuple[list[RouteChange], int]:
    old_experts, new_experts = old.experts(), new.experts()
    tokens = int(mask.sum())
    changes = []
    for layer in sorted(old_experts.keys() | new_experts.keys()):
        if layer not in new_experts or layer not in old_experts:
            status = "removed" if layer not in new_experts else "added"
            changes.append(RouteChange(layer, tokens, tokens, status=status))
            continue
        a, b = old_experts[layer], new_experts[layer]
        if a.shape != b.shape or a.shape[0] != mask.numel():
            changes.append(RouteChange(layer, tokens, tokens, status="reshaped"))
            continue
        margin = old.tensors[str(names.Route(layer, "margin"))]
        diff = compare_routes(layer, a, margin, b, mask, old.manifest.tie_epsilon)
        flipped = diff.clear_flips + diff.near_tie_flips
        if flipped:
            changes.append(RouteChange(layer, diff.tokens, flipped, diff.near_tie_flips))
    return changes, len(old_experts.keys() | new_experts.keys())


def _sketch_plan(manifest: object) -> dict[str, object]:
    """How a golden chose its forms (each tensor's own form is compared as a tensor)."""
    plan = manifest.sketch
    if plan is None:
        return {}
    return {"mode": plan.mode, "budget": plan.budget, "hard_limit": plan.hard_limit, "sketched": len(plan.tensors)}


def _layers(margins: dict[int, float]) -> dict[str, float]:
    return {str(layer): value for layer, value in margins.items()}


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _show(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _field(name: str, old: object, new: object) -> FieldChange | None:
    return None if old == new else FieldChange(name, _show(old), _show(new))


def _flatten(prefix: str, value: object, out: dict[str, object]) -> dict[str, object]:
    if isinstance(value, dict) and (value or prefix.count(".") == 0):
        # An empty map is no field (a golden without excuses has none): not "{} -> (absent)".
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value
    return out


def _dict_changes(prefix: str, old: dict, new: dict) -> list[FieldChange]:
    a, b = _flatten(prefix, old, {}), _flatten(prefix, new, {})
    return [FieldChange(k, _show(a[k]) if k in a else None, _show(b[k]) if k in b else None)
            for k in sorted(a.keys() | b.keys()) if a.get(k, ...) != b.get(k, ...)]


# --------------------------------------------------------------------------------------------
# Where goldens come from: a directory or a git revision


class Tree(Protocol):
    """A set of goldens by key, readable as bytes."""

    label: str

    def entries(self) -> dict[GoldenKey, str]:
        """Each golden's key and a cheap identity (git blob id; '' when there is none)."""

    def read(self, key: GoldenKey) -> bytes: ...

    def source(self, key: GoldenKey) -> str:
        """How error messages name this golden."""


class DirTree:
    """Goldens under a directory (`<class>/<model>/<scenario>-<dtype>.safetensors.zst`)."""

    def __init__(self, root: Path, label: str | None = None) -> None:
        self.root = Path(root)
        self.label = label or str(root)

    def entries(self) -> dict[GoldenKey, str]:
        # Entries that are not goldens (a FIFO, a link to another key) are listed too: reading them is refused.
        return {entry.key: "" for entry in store.scan(self.root).entries}

    def read(self, key: GoldenKey) -> bytes:
        return store.load(store.path_for(self.root, key), self.root)

    def source(self, key: GoldenKey) -> str:
        return str(store.path_for(self.root, key))


class GitTree:
    """Goldens under `prefix` at a git revision, read from the object store (nothing is checked out)."""

    def __init__(self, repo: Path, rev: str, prefix: PurePosixPath) -> None:
        self.repo, self.rev, self.prefix = repo, rev, prefix
        self.label = rev
        self._oids: dict[GoldenKey, str] | None = None
        self._blobs: _CatFile | None = None

    @classmethod
    def at(cls, goldens_dir: Path, rev: str) -> GitTree:
        """The goldens directory `goldens_dir` (of a git working tree) as it was at `rev`."""
        anchor = Path(goldens_dir).resolve()
        while not anchor.is_dir():  # the goldens directory may be gone from the working tree
            anchor = anchor.parent
        top = _git(anchor, "rev-parse", "--show-toplevel", what=f"{goldens_dir}: not inside a git repository "
                   "(give two directories instead of revisions)").strip()
        repo = Path(top)
        try:
            prefix = PurePosixPath(Path(goldens_dir).resolve().relative_to(repo.resolve()).as_posix())
        except ValueError:
            raise VeosnapError(f"{goldens_dir}: resolves outside its git repository {repo}") from None
        if rev.startswith("-"):
            raise VeosnapError(f"{rev!r}: not a directory nor a git revision")
        _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}",
             what=f"{rev}: neither a directory nor a git revision of {repo}")
        return cls(repo, rev, prefix)

    def entries(self) -> dict[GoldenKey, str]:
        if self._oids is None:
            listing = _git(self.repo, "ls-tree", "-r", "-z", "--full-tree", self.rev, "--", str(self.prefix),
                           what=f"{self.rev}: cannot list {self.prefix}")
            oids = {}
            for item in filter(None, listing.split("\0")):
                meta, path = item.split("\t", 1)
                mode, kind, oid = meta.split()
                rel = PurePosixPath(path).relative_to(self.prefix) if str(self.prefix) != "." else PurePosixPath(path)
                if kind != "blob":
                    continue
                if mode == "120000":  # a symlink: its blob is the target's path, never a golden
                    oid = f"symlink:{oid}"
                try:
                    oids[GoldenKey.from_relpath(Path(rel))] = oid
                except VeosnapError:
                    continue  # not a golden (README, stray file)
            self._oids = oids
        return self._oids

    def read(self, key: GoldenKey) -> bytes:
        oid = self.entries()[key]
        if oid.startswith("symlink:"):
            raise VeosnapError(f"{self.source(key)}: a symlink in git; a golden is a regular file")
        if self._blobs is None:
            self._blobs = _CatFile(self.repo)
        return self._blobs.read(oid, self.source(key))

    def source(self, key: GoldenKey) -> str:
        return f"{self.rev}:{self.prefix / key.relpath.as_posix()}"

    def close(self) -> None:
        if self._blobs is not None:
            self._blobs.close()
            self._blobs = None


class _CatFile:
    """One long-lived `git cat-file --batch`: blobs by id without a process per file."""

    def __init__(self, repo: Path) -> None:
        self.proc = subprocess.Popen(["git", "-C", str(repo), "cat-file", "--batch"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def read(self, oid: str, source: str) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{oid}\n".encode())
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().split()
        if len(header) != 3 or header[1] != b"blob":
            raise VeosnapError(f"{source}: git cannot read blob {oid}")
        size = int(header[2])
        if size > codec.MAX_COMPRESSED:
            raise VeosnapError(f"{source}: blob is {size} bytes, over the {codec.MAX_COMPRESSED} byte cap")
        data = self.proc.stdout.read(size)
        self.proc.stdout.read(1)  # the newline after each object
        return data

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


def _git(cwd: Path, *args: str, what: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise VeosnapError("git: not found on PATH (needed to read goldens at a revision)") from None
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()
        raise VeosnapError(what + (f" ({detail[-1]})" if detail else ""))
    return done.stdout


def open_tree(spec: str | None, goldens_dir: Path) -> Tree:
    """`spec` as a tree of goldens: None is the working tree's goldens directory; an existing directory
    is a goldens root (or a checkout holding `goldens/`); anything else is a git revision."""
    if spec is None:
        return DirTree(goldens_dir, label=WORKING_TREE)
    path = Path(spec)
    if path.is_dir():
        nested = path / "goldens"
        if not store.list_goldens(path) and nested.is_dir():
            return DirTree(nested, label=spec)
        return DirTree(path, label=spec)
    return GitTree.at(goldens_dir, spec)


# --------------------------------------------------------------------------------------------
# Comparing two trees


def diff_trees(base: Tree, head: Tree) -> DiffReport:
    """Goldens added, removed, changed (decoded and measured) and unchanged (same bytes) from base to head."""
    with one_thread():
        return _diff_trees(base, head)


def _diff_trees(base: Tree, head: Tree) -> DiffReport:
    try:
        old, new = base.entries(), head.entries()
        report = DiffReport(base=base.label, head=head.label)
        report.added = sorted(new.keys() - old.keys())
        report.removed = sorted(old.keys() - new.keys())
        for key in sorted(old.keys() & new.keys()):
            if old[key] and old[key] == new[key]:  # same git blob: same bytes, nothing to read
                report.unchanged.append(key)
                continue
            old_bytes, new_bytes = base.read(key), head.read(key)
            if old_bytes == new_bytes:
                report.unchanged.append(key)
                continue
            old_golden = store.check_key(codec.decode(old_bytes, base.source(key)), key, base.source(key))
            new_golden = store.check_key(codec.decode(new_bytes, head.source(key)), key, head.source(key))
            report.changed.append(diff_goldens(old_golden, new_golden))
        report.stale = _stale(report, head)
        return report
    finally:
        for tree in (base, head):
            close = getattr(tree, "close", None)
            if close:
                close()


def _stale(report: DiffReport, head: Tree) -> list[tuple[GoldenKey, GoldenKey]]:
    """Unchanged goldens still recorded from a config that a changed golden of the same model (and class) moved
    away from: the config changed, and these were not recorded again."""
    moved: dict[tuple[str, str], tuple[str, GoldenKey]] = {}  # (class, model) -> (old config hash, changed golden)
    for d in report.changed:
        change = next((c for c in d.manifest if c.field == "config_hash"), None)
        if change is not None and change.old is not None:
            moved.setdefault((d.key.hardware_class, d.key.model), (change.old, d.key))
    stale = []
    for key in report.unchanged:
        if (key.hardware_class, key.model) not in moved:
            continue
        old_hash, by = moved[(key.hardware_class, key.model)]
        manifest = codec.read_manifest(io.BytesIO(head.read(key)), head.source(key))
        if manifest.config_hash == old_hash:
            stale.append((key, by))
    return stale


def diff(base: str | None, head: str | None, goldens_dir: Path) -> DiffReport:
    """`veosnap diff BASE [HEAD]`: each side a git revision, a directory, or (None) the working tree."""
    if base is None:
        raise VeosnapError("diff: BASE is required (a git revision such as HEAD~1, or a directory)")
    return diff_trees(open_tree(base, goldens_dir), open_tree(head, goldens_dir))
