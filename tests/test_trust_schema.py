"""Completeness by construction (issue 35 item 1): every stored field a verdict reads is in one schema
(`veosnap.golden.schema`), and `veosnap diff` judges each by it.

Every forgery here goes through veosnap's own writer (`codec.encode`), so every hash matches: only the
schema's rules stand between it and a check. For each schema field and each kind of golden that holds it
(whole, sketched, routes, train, multimodal, aux loss), the field is forged in its loosening direction and

- a field the reader can recompute from others (`derived`) is refused when the golden is read, in one line
  naming it (`diff` exits 2);
- any other field is material: `diff --fail-on-change` exits 1 and names it (`material_fields`, the schema
  paths of every material change);
- metadata (provenance, the sketch planner's figures) stays metadata: exit 0.

A manifest field or tensor kind added without a schema entry, or a schema entry without a forgery here,
fails the first tests. Attacks 1 and 2 of issue 35 are the last two tests.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zstandard
from golden_repo import CLASS, REPO, WHY_ABSENT
from safetensors.torch import save as st_save

from veosnap.golden import codec, names, schema
from veosnap.golden.codec import Golden
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import SCALE_ALPHA, SCALE_FLOOR, Absence, Approval, Excuse, Manifest, Tolerance, config_hash
from veosnap.golden.sketches import tau_of
from veosnap.surfaces.cli import main

# One committed golden per kind, of this machine's class. A diff runs no model, so the cuda-sm90 real-shape
# golden (sketched) serves on any machine that holds it.
REPRESENTATIVES = {
    schema.WHOLE: GoldenKey(CLASS, "llama", "step", "float32"),
    schema.SKETCHED: GoldenKey("cuda-sm90", "llama-real", "step", "float32"),
    schema.ROUTES: GoldenKey(CLASS, "qwen3_moe", "step", "float32"),
    schema.TRAIN: GoldenKey(CLASS, "llama", "train", "float32"),
    schema.MULTIMODAL: GoldenKey(CLASS, "qwen2_5_omni", "audio", "float32"),
    schema.AUX: GoldenKey(CLASS, "qwen3_moe_aux", "step", "float32"),
    schema.LOW: GoldenKey(CLASS, "llama", "step", "bfloat16"),
}


@functools.cache
def committed_bytes(key: GoldenKey) -> bytes:
    path = REPO / "goldens" / key.relpath
    if not path.is_file():
        pytest.skip(f"this checkout lacks the committed golden {key}: {WHY_ABSENT}")
    return path.read_bytes()


def fresh(key: GoldenKey) -> Golden:
    """The committed golden for `key`, decoded anew (a forgery edits it in place)."""
    g = codec.decode(committed_bytes(key), key)
    g.manifest = Manifest.from_json(g.manifest.to_json(), key)
    return g


class NotHeld(Exception):
    """The golden holds nothing this forgery can edit (a tensor pattern it has no tensor of)."""


# --- forgeries, by schema path: each edits a golden in place, in the field's loosening direction ------------


def _remake_bounds(g: Golden) -> None:
    m = g.manifest
    m.tolerance = {n: replace(t, bound=float(m.alpha * t.noise + m.floor)) for n, t in m.tolerance.items()}


def _scale_noise(g: Golden) -> None:
    g.manifest.tolerance = {n: replace(t, noise=t.noise * 1000) for n, t in g.manifest.tolerance.items()}
    _remake_bounds(g)


def _projected(g: Golden) -> dict[str, Tolerance]:
    held = {n: t for n, t in g.manifest.tolerance.items() if t.scale_bound is not None}
    if not held:
        raise NotHeld  # recorded before projection bounds (the cuda-sm90 goldens)
    return held


def _projection_noise_grown(g: Golden) -> None:
    for name, t in _projected(g).items():
        grown = t.scale_noise * 1000
        g.manifest.tolerance[name] = replace(t, scale_noise=grown, scale_bound=float(SCALE_ALPHA * grown + SCALE_FLOOR))


def _projection_removed(g: Golden) -> None:
    for name, t in _projected(g).items():
        g.manifest.tolerance[name] = replace(t, scale_noise=None, scale_bound=None)


def _rule(field: str, factor: float) -> Callable[[Golden], None]:
    def edit(g: Golden) -> None:
        setattr(g.manifest, field, getattr(g.manifest, field) * factor)
        _remake_bounds(g)
    return edit


def _reference(**changes: object) -> Callable[[Golden], None]:
    def edit(g: Golden) -> None:
        g.manifest.reference = replace(g.manifest.reference, **changes)
    return edit


def _sketched(g: Golden, support: bool = False) -> str:
    for name, sketch in sorted(g.sketches.items()):
        if not support or sketch.support is not None:
            return name
    raise NotHeld


def _set_sketch(g: Golden, name: str, **changes: object) -> None:
    g.sketches[name] = replace(g.sketches[name], **changes)
    g.manifest.sketch = replace(g.manifest.sketch, tensors={n: s.entry for n, s in g.sketches.items()})


def _tau_grown(g: Golden) -> None:
    name = _sketched(g)
    s = g.sketches[name]
    _set_sketch(g, name, norms=s.norms * 1e6, tau=tau_of(s.norms * 1e6, s.rows_counted))


def _rows_counted(g: Golden) -> None:
    name = _sketched(g)
    s = g.sketches[name]
    _set_sketch(g, name, rows_counted=s.rows_counted - 1, tau=tau_of(s.norms, s.rows_counted - 1))


def _norms_alone(g: Golden) -> None:
    name = _sketched(g)
    _set_sketch(g, name, norms=g.sketches[name].norms * 1e6)


def _support_moved(g: Golden) -> None:
    name = _sketched(g, support=True)
    support = g.sketches[name].support.clone()
    support[-1] += 1  # still sorted, distinct and in range: other rows
    _set_sketch(g, name, support=support)


def _spec_seed(g: Golden) -> None:
    name = _sketched(g)
    s = g.sketches[name]
    _set_sketch(g, name, spec=replace(s.spec, seed=s.spec.seed + 1))


def _moved(pattern: str) -> Callable[[Golden], None]:
    """A whole tensor matching `pattern` moved far beyond its bound."""
    def edit(g: Golden) -> None:
        name = next((n for n in sorted(g.tensors) if _entry_of(n) == pattern), None)
        if name is None:
            raise NotHeld
        t = g.tensors[name]
        g.tensors[name] = (t.double() * 1.5 + 0.1).to(t.dtype)
    return edit


def _entry_of(name: str) -> str | None:
    """The schema path a tensor name falls under."""
    entry = schema.field_of(name, tensor=True)
    return entry.path if entry is not None else None


def _input(g: Golden) -> None:
    ids = g.tensors["inputs.input_ids"].clone()
    ids[0, -1] ^= 1  # another token, still in the vocabulary
    g.tensors["inputs.input_ids"] = ids
    g.manifest.inputs_hash = codec.tensors_hash(g.input_tensors())


def _experts(g: Golden) -> None:
    if not g.route_layers():
        raise NotHeld
    layer = g.route_layers()[0]
    experts = g.tensors[f"routes.{layer}.experts"].clone()
    real = g.tensors["inputs.attention_mask"].reshape(-1).bool().nonzero().flatten()[:3]
    experts[real] = experts[real] + 1
    g.tensors[f"routes.{layer}.experts"] = experts


def _margins(g: Golden) -> None:
    """Attack 1: every margin 0 (and min_margin with it, as the reader requires): every token a near-tie."""
    if not g.route_layers():
        raise NotHeld
    for layer in g.route_layers():
        g.tensors[f"routes.{layer}.margin"] = torch.zeros_like(g.tensors[f"routes.{layer}.margin"])
    g.manifest.min_margin = {layer: 0.0 for layer in g.manifest.min_margin}


def _min_margin_alone(g: Golden) -> None:
    if not g.manifest.min_margin:
        raise NotHeld
    g.manifest.min_margin = {layer: 0.0 for layer in g.manifest.min_margin}


def _train(g: Golden) -> None:
    if g.manifest.reference.train is None:
        raise NotHeld
    _reference(train=replace(g.manifest.reference.train, lr=g.manifest.reference.train.lr * 10))(g)


def _trail(g: Golden) -> None:
    trail = g.manifest.approvals
    g.manifest.approvals = trail[:-1] if trail else [Approval("forged", "sha256:" + "9" * 64)]


def _excuse(g: Golden) -> None:
    g.manifest.excused = {**g.manifest.excused, "sdpa": Excuse("forged", sorted(g.manifest.tolerance)[0], 2.0)}


def _sketch_plan(g: Golden) -> None:
    if g.manifest.sketch is None:
        raise NotHeld
    g.manifest.sketch = replace(g.manifest.sketch, budget=g.manifest.sketch.budget * 2)


def _config(g: Golden) -> None:
    g.manifest.config = {**g.manifest.config, "forged": 1}
    g.manifest.config_hash = config_hash(g.manifest.config)


def _key(g: Golden) -> None:
    g.manifest.key = replace(g.manifest.key, model=g.manifest.key.model + "_other")


def _padding(g: Golden) -> None:
    batch = g.manifest.reference.batch
    _reference(batch=replace(batch, padding_side="right" if batch.padding_side == "left" else "left"))(g)


# Forgeries that edit the manifest's JSON after the writer (what the typed manifest cannot express): each
# recomputes the manifest hash over its edit, as a forger would, unless the hash is the forged field.
class _json:  # noqa: N801 - reads as the other forgeries' helpers
    def __init__(self, edit: Callable[[dict], None], rehash: bool = True) -> None:
        self.edit, self.rehash = edit, rehash

    def __call__(self, doc: dict) -> None:
        self.edit(doc)
        if self.rehash:
            doc["manifest_hash"] = ""
            blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
            doc["manifest_hash"] = "sha256:" + hashlib.sha256(blob).hexdigest()


def _spec_rows(doc: dict) -> None:
    if "sketch" not in doc:
        raise NotHeld
    entry = next(iter(doc["sketch"]["tensors"].values()))
    entry["spec"]["rows"] += 1


def _spec_columns(doc: dict) -> None:
    if "sketch" not in doc:
        raise NotHeld
    entry = next(iter(doc["sketch"]["tensors"].values()))
    entry["spec"]["columns"] += 1


def _schema_version(doc: dict) -> None:
    doc["schema_version"] = 1 if "sketch" in doc else 2


# schema path -> (the forgery: of the golden, or of its manifest JSON (`_json`); for a derived field, what the
# reader's one-line refusal names, else "")
FORGERIES: dict[str, tuple[Callable, str]] = {
    "key.*": (_key, "key"),
    "config": (_config, ""),
    "config_hash": (lambda g: setattr(g.manifest, "config_hash", "sha256:" + "0" * 64), "config hash"),
    "inputs_hash": (lambda g: setattr(g.manifest, "inputs_hash", "sha256:" + "0" * 64), "inputs hash"),
    "reference.attn_implementation": (_reference(attn_implementation="sdpa"), ""),
    "reference.experts_implementation": (_reference(experts_implementation="grouped_mm"), ""),
    "reference.seed": (lambda g: _reference(seed=g.manifest.reference.seed + 1)(g), ""),
    "reference.noise_run": (_reference(noise_run="float32"), ""),
    "reference.batch.*": (_padding, ""),
    "reference.train.*": (_train, ""),
    "reference.random_off*": (_reference(random_off={"attention_dropout": 0.5}), ""),
    "reference.sensitivity*": (_reference(sensitivity={"layer_output@0.001": 1e6}), ""),
    "tolerance.*.noise": (_scale_noise, ""),
    "tolerance.*.bound": (_scale_noise, ""),
    "tolerance.*.scale_noise": (_projection_noise_grown, ""),
    "tolerance.*.scale_bound": (_projection_removed, ""),
    "alpha": (_rule("alpha", 2.0), ""),
    "floor": (_rule("floor", 2.0), ""),
    "tie_epsilon": (_rule("tie_epsilon", 1000.0), ""),
    "min_margin.*": (_min_margin_alone, "min_margin"),
    "payload_hash": (_json(lambda d: d.update(payload_hash="sha256:" + "0" * 64)), "payload hash"),
    "manifest_hash": (_json(lambda d: d.update(manifest_hash="sha256:" + "0" * 64), rehash=False), "manifest hash"),
    "schema_version": (_json(_schema_version), "schema"),
    "approvals[].*": (_trail, ""),
    "provenance.*": (lambda g: setattr(g.manifest, "provenance", replace(g.manifest.provenance, torch="0.0")), ""),
    "absent[].*": (lambda g: g.manifest.absent.append(Absence("forward_only", (), "forged")), ""),
    "excused.*.*": (_excuse, ""),
    "sketch.mode": (_sketch_plan, ""),
    "sketch.budget": (_sketch_plan, ""),
    "sketch.hard_limit": (_sketch_plan, ""),
    "sketch.planned_bytes": (_sketch_plan, ""),
    "sketch.tensors.*.spec.rows": (_json(_spec_rows), "rows/columns"),
    "sketch.tensors.*.spec.columns": (_json(_spec_columns), "rows/columns"),
    "sketch.tensors.*.spec.*": (_spec_seed, ""),
    "sketch.tensors.*.tau": (_tau_grown, ""),
    "sketch.tensors.*.rows_counted": (_rows_counted, "rows_counted"),
    "sketch.tensors.*.dtype": (lambda g: _set_sketch(g, _sketched(g), dtype="bfloat16"), ""),
    "*#sketch": (lambda g: _set_sketch(g, (n := _sketched(g)), values=g.sketches[n].values * 1.5), ""),
    "*#norms": (_norms_alone, "tau"),
    "*#support": (_support_moved, ""),
    "inputs.*": (_input, ""),
    "routes.*.experts": (_experts, ""),
    "routes.*.margin": (_margins, ""),
    **{f.path: (_moved(f.path), "") for f in schema.FIELDS if f.tensor and f.rule == "moved" and "#" not in f.path},
}


def write_forged(key: GoldenKey, forge: Callable, root: Path) -> Path:
    """The committed golden for `key` after `forge`, written by veosnap's own writer under `root`."""
    g = fresh(key)
    path = root / key.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    if not isinstance(forge, _json):  # edits the golden: the writer recomputes every hash
        forge(g)
        path.write_bytes(codec.encode(g))
        return path
    codec.encode(g)  # sets the hashes; the edit below is of the manifest JSON as written
    doc = json.loads(g.manifest.to_json())
    forge(doc)
    raw = st_save({n: t.contiguous() for n, t in g.stored_tensors().items()},
                  metadata={codec.METADATA_KEY: json.dumps(doc, sort_keys=True, separators=(",", ":"))})
    path.write_bytes(zstandard.ZstdCompressor(write_checksum=True, write_content_size=True).compress(raw))
    return path


def base_and_head(tmp_path: Path, key: GoldenKey, forge: Callable) -> tuple[Path, Path]:
    base, head = tmp_path / "base", tmp_path / "head"
    (base / key.relpath).parent.mkdir(parents=True)
    (base / key.relpath).write_bytes(committed_bytes(key))
    try:
        write_forged(key, forge, head)
    except NotHeld:
        pytest.skip(f"{key} holds nothing this forgery edits")
    return base, head


# --- completeness ---------------------------------------------------------------------------------------


def test_every_manifest_field_has_a_schema_entry():
    assert schema.unlisted() == []
    for key in REPRESENTATIVES.values():
        flat = schema.flatten(json.loads(fresh(key).manifest.to_json()))
        assert [where for where, (pattern, _) in flat.items() if schema.field_of(pattern) is None] == [], key


EXAMPLES = (names.Input("input_ids"), names.LOSS, names.LOGITS, names.LayerOutput(0),
            names.EncoderOutput("vision", "0"), names.EncoderOutput("audio", "proj"), names.Grad("model.x.weight"),
            names.Update("model.x.weight"), *(names.Route(0, part) for part in names.ROUTE_PARTS),
            names.TRAIN_LOSS, names.TRAIN_GRAD_NORM)


def test_every_tensor_kind_and_sketch_part_has_a_schema_entry():
    assert {type(n) for n in EXAMPLES} == set(names._KINDS), "a new tensor kind: add an example and a schema entry"
    for name in EXAMPLES:
        assert schema.field_of(str(name), tensor=True) is not None, name
    for suffix in ("#sketch", "#norms", "#support"):
        assert schema.field_of(f"grad.model.x.weight{suffix}", tensor=True).path == f"*{suffix}"
    for key in REPRESENTATIVES.values():
        g = fresh(key)
        assert [n for n in g.stored_tensors() if schema.field_of(n, tensor=True) is None] == [], key


def test_every_schema_entry_is_forged_here_and_every_kind_is_exercised():
    assert set(FORGERIES) == {f.path for f in schema.FIELDS}
    derived = {f.path for f in schema.FIELDS if f.rule == "derived"}
    assert {path for path, (_, refusal) in FORGERIES.items() if refusal} == derived


CASES = [(f.path, kind) for f in schema.FIELDS for kind in schema.KINDS if kind in f.kinds]


@pytest.mark.parametrize("path, kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_a_forged_field_is_material_refused_or_metadata_as_the_schema_says(tmp_path, capsys, path, kind):
    entry = next(f for f in schema.FIELDS if f.path == path)
    forge, refusal = FORGERIES[path]
    key = REPRESENTATIVES[kind]
    base, head = base_and_head(tmp_path, key, forge)

    code = main(["diff", str(base), str(head), "--fail-on-change", "--format", "json"])
    out, err = capsys.readouterr()

    if entry.rule == "derived":  # the reader recomputes it: refused in one line naming it
        assert code == 2 and out == "" and err.count("\n") == 1 and refusal in err, err
        return
    (changed,) = json.loads(out)["changed"]
    if entry.rule == "metadata":
        assert code == 0 and not changed["material"], changed["why"]
        return
    assert code == 1 and changed["material"], changed["why"]
    assert path in changed["material_fields"], changed["material_fields"]


# --- the attacks of issue 35 ----------------------------------------------------------------------------


def test_attack1_margins_zeroed_are_material_naming_each_layer(tmp_path, capsys):
    """Every routes.N.margin set to 0 (min_margin with them): every token a near-tie, so a router sending every
    token elsewhere would pass. Was "1 changed (0 material) ... metadata", exit 0."""
    key = REPRESENTATIVES[schema.ROUTES]
    base, head = base_and_head(tmp_path, key, _margins)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    out = capsys.readouterr().out
    assert "1 changed (1 material)" in out
    tokens = int(fresh(key).tensors["inputs.attention_mask"].sum())
    for layer in fresh(key).route_layers():
        assert (f"  material    routes.{layer}.margin: {tokens} of {tokens} real tokens routed clearly before are "
                "near-ties now") in out


def test_attack1_margins_zeroed_alone_are_refused_by_the_reader(tmp_path, capsys):
    key = REPRESENTATIVES[schema.ROUTES]

    def margins_only(g: Golden) -> None:
        for layer in g.route_layers():
            g.tensors[f"routes.{layer}.margin"] = torch.zeros_like(g.tensors[f"routes.{layer}.margin"])

    base, head = base_and_head(tmp_path, key, margins_only)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "min_margin of layer 0 is" in err and "routes.0.margin is 0.0" in err


def test_attack2_sketch_tau_times_1e6_is_refused_and_with_its_norms_material(tmp_path, capsys):
    """Every sketch's tau x1e6: errors read a million times smaller (dropped_norm_gradient passed at 0.16x).
    Was "noise; 24 of 25 tensors moved (0 over 1x bound)", exit 0."""
    key = REPRESENTATIVES[schema.SKETCHED]

    def tau(g: Golden, with_norms: bool) -> None:
        for name in list(g.sketches):
            s = g.sketches[name]
            _set_sketch(g, name, tau=s.tau * 1e6, **({"norms": s.norms * 1e6} if with_norms else {}))

    base, head = base_and_head(tmp_path, key, lambda g: tau(g, with_norms=False))
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tau" in err and "is not the RMS of its #norms" in err

    shutil.rmtree(tmp_path / "head")
    base, head = tmp_path / "base", tmp_path / "head"
    write_forged(key, lambda g: tau(g, with_norms=True), head)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    out = capsys.readouterr().out
    sketched = len(fresh(key).sketches)
    assert out.count("  material    sketch.tensors.") == sketched and "(1e+06x, beyond its bound" in out


def test_a_bound_edited_apart_from_its_noise_is_refused_in_one_line(tmp_path, capsys):
    """Every bound is alpha x noise + floor: one loosened alone (hashes recomputed) is refused when read."""
    key = REPRESENTATIVES[schema.WHOLE]

    def bound_alone(g: Golden) -> None:
        logits = g.manifest.tolerance["logits"]
        g.manifest.tolerance = {**g.manifest.tolerance, "logits": replace(logits, bound=logits.bound * 1000)}

    base, head = base_and_head(tmp_path, key, bound_alone)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tolerance of 'logits': bound" in err and "is not alpha x noise + floor" in err
