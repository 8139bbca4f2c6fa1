"""Every stored field of a golden that a verdict reads: where it is, who reads it, which way loosens it.

A golden's hashes are unkeyed (docs/trust.md): what stops a forged or careless change is `veosnap diff`,
so every field whose change could let a bug pass must be material there. Rather than trusting each
comparison to remember its fields, this module lists them all, manifest fields by their JSON path
(`*`: any key of a map, `[]`: any entry of a list) and tensors by their name pattern, each with

- `rule`: how `veosnap diff` judges a change of it (`runs.diff.schema_changes` walks the manifest's fields
  and judges `changes`, `added`, `tau` and `near_ties`; the others are its structured comparisons):
  `moved` (a tensor measured in its old bound), `routes` (tokens sent to other experts), `near_ties`
  (tokens whose margin fell under the tie epsilon), `grows` (a larger value is material), `tau` (grows
  beyond the tensor's own bound), `rule` (alpha, floor, tie epsilon: any change), `changes` (identity:
  any change is material), `form` (a sketch's spec or support: re-sketched), `added` (an entry added or
  edited is material, one dropped is not), `trail` (append-only), `derived` (recomputed from other
  fields and cross-checked by the reader, so it never changes alone), `metadata` (no verdict reads it);
- `loosens`: the direction that lets a bug pass (what a forger would do);
- `reader`: the comparator that reads it;
- `check`: for a derived field, what the reader recomputes it from;
- `kinds`: the kinds of golden that hold it (`KINDS`).

A field added to the manifest or a tensor kind added to `names` without an entry here fails
tests/test_trust_schema.py, which also forges every entry in its loosening direction.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import typing
from dataclasses import dataclass

WHOLE, SKETCHED, ROUTES, TRAIN, MULTIMODAL, AUX = "whole", "sketched", "routes", "train", "multimodal", "aux"
LOW = "low precision"  # a bfloat16 golden: its whole gradients carry projection bounds
KINDS = (WHOLE, SKETCHED, ROUTES, TRAIN, MULTIMODAL, AUX, LOW)
RULES = ("moved", "routes", "near_ties", "grows", "tau", "rule", "changes", "form", "added", "trail", "derived",
         "metadata")
_ALL = frozenset(KINDS)


@dataclass(frozen=True)
class Field:
    """One stored field (a manifest JSON path, or a tensor name pattern)."""

    path: str
    rule: str
    loosens: str
    reader: str
    kinds: frozenset[str] = _ALL
    check: str = ""  # derived fields: what the reader recomputes and compares
    tensor: bool = False

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"schema field {self.path}: unknown rule {self.rule!r}")
        if (self.rule == "derived") != bool(self.check):
            raise ValueError(f"schema field {self.path}: a derived field says what it is checked against, no other")

    def matches(self, path: str) -> bool:
        return fnmatch.fnmatchcase(path, self.path.replace("[]", "[[][]]"))


def _f(path: str, rule: str, loosens: str, reader: str, kinds: frozenset[str] = _ALL, check: str = "") -> Field:
    return Field(path, rule, loosens, reader, kinds, check)


def _t(path: str, rule: str, loosens: str, reader: str, kinds: frozenset[str] = _ALL, check: str = "") -> Field:
    return Field(path, rule, loosens, reader, kinds, check, tensor=True)


_CHECK = "runs.check (the candidate is built and run from it)"
_TENSORS = "numerics.compare.compare_tensors (row error against the bound)"
_SKETCH = "numerics.sketch.compare_sketches (the candidate is sketched with this spec)"
_PROJECTION = "numerics.projection (a low-precision gradient's projection onto the golden, against this bound)"
_MM = frozenset({MULTIMODAL})
_SK = frozenset({SKETCHED})
_MOE = frozenset({ROUTES, AUX})
_TR = frozenset({TRAIN})
_LOW = frozenset({LOW})

FIELDS: tuple[Field, ...] = (
    # --- identity: the golden describes another function or batch when any of these changes
    _f("key.*", "derived", "another key", "golden.store.read", check="the key its path names"),
    _f("config", "changes", "any change", _CHECK),
    _f("config_hash", "derived", "any change", "golden.manifest", check="the hash of `config`"),
    _f("inputs_hash", "derived", "any change", "golden.codec", check="the hash of the inputs.* tensors"),
    _f("reference.attn_implementation", "changes", "any change", "reference.models (what the reference ran)"),
    _f("reference.experts_implementation", "changes", "any change", "reference.models (what the reference ran)"),
    _f("reference.seed", "changes", "any change", "reference.weights (the candidate's weights)"),
    _f("reference.noise_run", "changes", "any change", "numerics.tolerance (what the noise is measured against)"),
    _f("reference.batch.*", "changes", "any change", "reference.inputs (how the batch is laid out)"),
    _f("reference.train.*", "changes", "any change", "reference.train (the optimizer steps a check replays)", _TR),
    _f("reference.random_off*", "changes", "a setting declared off that the config keeps (bounds measure its noise)",
       "runs.check (refuses a golden whose random_off disagrees with its config)"),
    _f("reference.sensitivity*", "changes", "a certificate added or raised (overstates what the golden catches)",
       "runs.check (the sensitivity every report shows)"),
    # --- the tolerance: bounds and the rule that made them
    _f("tolerance.*.noise", "grows", "up", _TENSORS),
    _f("tolerance.*.bound", "grows", "up", _TENSORS),
    _f("tolerance.*.scale_noise", "grows", "up (or removed)", _PROJECTION, _LOW),
    _f("tolerance.*.scale_bound", "grows", "up (or removed)", _PROJECTION, _LOW),
    _f("alpha", "rule", "up", "numerics.tolerance (bound = alpha x noise + floor)"),
    _f("floor", "rule", "up", "numerics.tolerance (bound = alpha x noise + floor)"),
    _f("tie_epsilon", "rule", "up", "numerics.routes.compare_routes (a flip under it is a near-tie)", _MOE),
    _f("min_margin.*", "derived", "down", "record, show", _MOE,
       check="the smallest routes.N.margin over the real tokens (train: at most it)"),
    # --- integrity and history
    _f("payload_hash", "derived", "any change", "golden.codec", check="the hash of the stored tensors"),
    _f("manifest_hash", "derived", "any change", "golden.manifest", check="the hash of the manifest"),
    _f("schema_version", "derived", "any change", "golden.manifest", check="2 when a sketch section exists, else 1"),
    _f("approvals[].*", "trail", "removed, edited, moved or forged", "review (runs.diff.trail_changes)"),
    _f("provenance.*", "metadata", "none", "check's version notes"),
    # --- what a golden says it leaves out, and the variants it was recorded despite
    _f("absent[].*", "changes", "an absence added", "reference.coverage.require (what a check asks for)"),
    _f("excused.*.*", "added", "an excuse added or edited", "runs.check (excused_notes, and a passing excused "
       "variant is refused)"),
    # --- sketched tensors
    _f("sketch.mode", "metadata", "none", "record (the planner)", _SK),
    _f("sketch.budget", "metadata", "none", "record (the planner)", _SK),
    _f("sketch.hard_limit", "metadata", "none", "record (the planner)", _SK),
    _f("sketch.planned_bytes", "metadata", "none", "record (the planner)", _SK),
    _f("sketch.tensors.*.spec.rows", "derived", "any change", "golden.sketches", _SK, check="the spec's shape"),
    _f("sketch.tensors.*.spec.columns", "derived", "any change", "golden.sketches", _SK, check="the spec's shape"),
    _f("sketch.tensors.*.spec.*", "form", "a coarser group or narrower width", _SKETCH, _SK),
    _f("sketch.tensors.*.tau", "tau", "up", _SKETCH + " (errors are in units of tau)", _SK),
    _f("sketch.tensors.*.rows_counted", "derived", "any change", _SKETCH, _SK,
       check="the real tokens for a token tensor, else the rows sketched"),
    _f("sketch.tensors.*.dtype", "changes", "any change", _SKETCH, _SK),
    # --- tensors
    # a sketched tensor's parts first: `grad.x#sketch` is a part, not a gradient
    _t("*#sketch", "moved", "any move", _SKETCH, _SK),
    _t("*#norms", "derived", "up", "golden.sketches", _SK, check="their RMS is the entry's tau"),
    _t("*#support", "form", "other rows", _SKETCH, _SK),
    _t("inputs.*", "changes", "any change", "reference.inputs (the batch every candidate runs)"),
    _t("loss", "moved", "any move", _TENSORS, _ALL - _TR),
    _t("logits", "moved", "any move", _TENSORS, _ALL - _TR),
    _t("layers.*.output", "moved", "any move", _TENSORS, _ALL - _TR),
    _t("vision.*.output", "moved", "any move", _TENSORS, _MM),
    _t("audio.*.output", "moved", "any move", _TENSORS, _MM),
    _t("grad.*", "moved", "any move", _TENSORS, _ALL - _TR),
    _t("update.*", "moved", "any move", _TENSORS, _TR),
    _t("train.loss", "moved", "any move", _TENSORS, _TR),
    _t("train.grad_norm", "moved", "any move", _TENSORS, _TR),
    _t("routes.*.weights", "moved", "any move", _TENSORS, _MOE),
    _t("routes.*.experts", "routes", "any flip", "numerics.routes.compare_routes", _MOE),
    _t("routes.*.margin", "near_ties", "down (under the tie epsilon)", "numerics.routes.compare_routes", _MOE),
)


def field_of(path: str, tensor: bool = False) -> Field | None:
    """The schema entry of a manifest field's JSON path (or, with `tensor`, of a tensor name); None: unlisted.
    The first entry that matches wins (a specific path is listed before the wildcard over its siblings)."""
    for f in FIELDS:
        if f.tensor == tensor and f.matches(path):
            return f
    return None


def json_paths(value: object, prefix: str = "") -> list[str]:
    """Every leaf of a manifest's JSON as a schema path: map keys become `*` below the fields whose keys are
    names (tolerance, min_margin, excused, sketch.tensors, config), list entries `[]`."""
    out: list[str] = []
    if prefix == "config":
        return [prefix]  # the model's config is one field: its hash covers it whole
    if prefix == "tolerance.*":  # stored as [noise, bound] or [noise, bound, scale_noise, scale_bound]
        scale = ["tolerance.*.scale_noise", "tolerance.*.scale_bound"] if isinstance(value, list) and len(value) == 4 \
            else []
        return ["tolerance.*.noise", "tolerance.*.bound", *scale]
    if isinstance(value, dict) and value:
        named = prefix in ("tolerance", "min_margin", "excused", "sketch.tensors")
        for k, v in value.items():
            out += json_paths(v, f"{prefix}.{'*' if named else k}" if prefix else str(k))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        for v in value:
            out += json_paths(v, f"{prefix}[]")
    else:
        out.append(prefix)
    return sorted(set(out))


def dataclass_paths() -> list[str]:
    """Every field of the typed manifest (`Manifest` and the sections it holds) as a schema path, with the
    fields its JSON adds (a sketch spec's rows and columns): what `unlisted` holds against the schema."""
    from . import key, manifest, sketches

    scope = vars(key) | vars(manifest) | vars(sketches)

    def walk(cls: type, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls, scope)
        out = []
        for f in dataclasses.fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            hint = hints[f.name]
            origin, args = typing.get_origin(hint), typing.get_args(hint)
            if origin is dict and args:
                inner = _dataclass_in(args[1])
                out += walk(inner, f"{path}.*") if inner else [f"{path}.*"]
            elif origin is list and args and _dataclass_in(args[0]):
                out += walk(_dataclass_in(args[0]), f"{path}[]")  # type: ignore[arg-type]
            elif (inner := _dataclass_in(hint)) is not None:
                out += walk(inner, path)
            else:
                out.append(path)
        return out

    return sorted(set(walk(manifest.Manifest, "")) | {"sketch.tensors.*.spec.rows", "sketch.tensors.*.spec.columns"})


def _dataclass_in(hint: object) -> type | None:
    """The dataclass a type names (`X` or `X | None`), or None."""
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def unlisted() -> list[str]:
    """Fields of the typed manifest with no schema entry (a test keeps this empty)."""
    return [path for path in dataclass_paths() if field_of(path) is None]


# Maps of the manifest JSON whose keys are names (a tensor's, a layer's, a variant's): one schema `*`.
_NAMED_MAPS = ("tolerance", "min_margin", "excused", "sketch.tensors")


def flatten(value: object, prefix: str = "", pattern: str = "") -> dict[str, tuple[str, object]]:
    """A manifest's JSON as {concrete path: (schema path, value)}: `tolerance.logits.bound` is
    `tolerance.*.bound`, the n-th approval's reason `approvals[n].reason` is `approvals[].reason`; the
    model's config is one leaf (its hash covers it whole)."""
    out: dict[str, tuple[str, object]] = {}
    if prefix == "config" or not isinstance(value, (dict, list)):
        out[prefix] = (pattern, value)
    elif pattern == "tolerance.*" and isinstance(value, list):  # stored as [noise, bound]
        out[f"{prefix}.noise"], out[f"{prefix}.bound"] = (f"{pattern}.noise", value[0]), (f"{pattern}.bound", value[1])
    elif isinstance(value, dict):
        for k, v in value.items():
            concrete = f"{prefix}.{k}" if prefix else str(k)
            out.update(flatten(v, concrete, f"{pattern}.*" if pattern in _NAMED_MAPS else
                               f"{pattern}.{k}" if pattern else str(k)))
    elif not value:
        pass  # an empty list: nothing stored (a golden without approvals)
    elif isinstance(value[0], dict):
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}[{i}]", f"{pattern}[]"))
    else:
        out[prefix] = (pattern, value)
    return out
