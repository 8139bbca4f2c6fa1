"""The manifest: everything about a golden besides its tensors, typed, and its canonical JSON.

The JSON is sorted, compact and NaN-free, so a manifest always serializes to the same bytes, and
re-encoding a golden read from disk reproduces its file byte for byte. Parsing is strict: a field of
the wrong type, an unknown or missing field, a non-finite number or a bound that would pass anything
is refused, so a golden that reads never crashes a check halfway or passes everything.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..errors import GoldenError, VeosnapError
from . import names
from .key import GoldenKey
from .sketches import SketchPlan

# Schema 1: every tensor stored whole. Schema 2: some tensors stored as sketches (the `sketch` section).
# A golden with nothing sketched is written as schema 1, byte for byte as before sketches existed.
SCHEMA_VERSION = 1
SKETCHED_SCHEMA = 2
READABLE_SCHEMAS = (1, 2)


def config_hash(config: dict) -> str:
    """A stable hash of a model config dict (canonical JSON)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()


# The rule of a projection bound (`numerics.projection`): scale_bound = SCALE_ALPHA x scale_noise + SCALE_FLOOR.
# Part of the format, as alpha and floor are: the reader recomputes every stored scale bound from it.
SCALE_ALPHA = 3.0
SCALE_FLOOR = 5e-4


@dataclass(frozen=True)
class Tolerance:
    """One tensor's tolerance: the reference's measured noise and the bound a candidate must meet; in low
    precision, a whole gradient's projection bound too (`numerics.projection`: the reference's own rounding
    bias along itself, and the bound a candidate's projection onto the golden must meet; None: not judged)."""

    noise: float
    bound: float
    scale_noise: float | None = None
    scale_bound: float | None = None

    def stored(self) -> list[float]:
        """As the manifest keeps it: [noise, bound], or [noise, bound, scale_noise, scale_bound]."""
        if self.scale_bound is None:
            return [self.noise, self.bound]
        return [self.noise, self.bound, self.scale_noise, self.scale_bound]


@dataclass(frozen=True)
class BatchSpec:
    """How the reference's batch was made from the test data."""

    layout: str  # "padded" (one sequence per row) or "packed-rows" (rows of packed sequences)
    padding_side: str  # "left" (DeepSeek-V4: "right")
    sequences: tuple[int, ...]  # ids of the test data's sequences, in row order
    source: str  # the test data file
    rows: tuple[str, ...] | None = None  # a multimodal batch: per row "text N" or its sample's name
    media_family: str | None = None  # a multimodal batch: the test data family its placeholders fit


@dataclass(frozen=True)
class TrainHyper:
    """The optimizer steps a `train` golden records (and every check replays)."""

    steps: int
    lr: float
    beta1: float
    beta2: float
    weight_decay: float
    eps: float
    max_norm: float
    optimizer: str = "torch.optim.AdamW"
    clip: str = "torch.nn.utils.clip_grad_norm_"


@dataclass(frozen=True)
class Reference:
    """How the reference ran: its implementations, weight seed, batch, the noise run, the train steps."""

    attn_implementation: str
    experts_implementation: str
    seed: int
    batch: BatchSpec
    noise_run: str  # "float64": the precision the reference's noise is measured against
    train: TrainHyper | None = None  # the train scenario only
    # The config's random settings the reference ran without (dropout and the like: `reference.determinism`), with
    # their configured values; None when the config has none.
    random_off: dict[str, float] | None = None
    # What the golden was shown to catch at record time (`runs/canaries.py`): each canary, a 1e-3 error planted in
    # one place, by the worst error/bound ratio it reached (each over 1: it failed). None: not certified.
    sensitivity: dict[str, float] | None = None


@dataclass(frozen=True)
class Provenance:
    """Where and with what the golden was recorded: versions, device, determinism settings."""

    veosnap: str
    torch: str
    transformers: str
    python: str
    device: str
    capability: str
    deterministic_algorithms: bool
    cpu_threads: int
    tf32: bool
    cuda: str | None = None  # CUDA devices only
    driver: str | None = None


@dataclass(frozen=True)
class Approval:
    """One entry of a golden's refresh trail."""

    reason: str
    previous_payload_hash: str | None  # None: the refresh created the golden


# Why a golden may leave out tensors the model produces (see `Absence`), by kind.
ABSENCE_KINDS = {
    "frozen": "parameters that do not train: no gradient and no update (names: parameter names)",
    "forward_only": "the reference ran forward only: no gradients (names: none)",
    "router_unread": "routers veosnap cannot read: no routes (names: the routers' module paths, or an MoE "
                     "block's where veosnap finds no router in it; reason: what they return)",
}


@dataclass(frozen=True)
class Absence:
    """Tensors a golden leaves out on purpose, and why; a check asks for everything else the model produces."""

    kind: str  # one of ABSENCE_KINDS
    names: tuple[str, ...]
    reason: str


# The recorder's fragility variants a golden may be recorded despite (`veosnap record --excuse`): eager is
# the reference itself, run again, and a golden it fails does not reproduce itself, so it is never excusable.
EXCUSABLE = ("sdpa", "grouped_mm", "batched_mm")


@dataclass(frozen=True)
class Excuse:
    """A legitimate variant that fails the golden for a known reason outside veosnap (a library bug), recorded
    explicitly: checks of it still fail, and their reports carry `reason`."""

    reason: str
    tensor: str  # its worst tensor over the bound when recorded (a route name: its routing differed)
    ratio: float | None = None  # that tensor's error/bound ratio then (None: not finite, or a routing difference)


@dataclass
class Manifest:
    """Everything about a golden besides its tensors."""

    key: GoldenKey
    config: dict  # the model's transformers config, as recorded
    config_hash: str
    inputs_hash: str
    reference: Reference
    provenance: Provenance
    tolerance: dict[str, Tolerance]
    alpha: float
    floor: float
    tie_epsilon: float
    min_margin: dict[int, float]  # per MoE layer, the router's smallest margin over the batch
    payload_hash: str = ""
    approvals: list[Approval] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    # SHA-256 of this manifest's JSON with this field empty, so a hand-edited bound or seed is caught
    # like a hand-edited tensor. Required: a golden without one is refused (it cannot be trusted).
    manifest_hash: str = ""
    absent: list[Absence] = field(default_factory=list)  # left out of the JSON when empty
    # Schema 2 only: how the golden chose whole or sketched tensors, and each sketched tensor's entry.
    sketch: SketchPlan | None = None
    # Variants of the fragility check known to fail this golden, by name (`Excuse`); left out of the JSON
    # when empty, so a golden without one keeps the bytes it always had.
    excused: dict[str, Excuse] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sketch is not None:
            self.schema_version = SKETCHED_SCHEMA

    def own_hash(self) -> str:
        """What `manifest_hash` should be for the manifest as it stands."""
        return "sha256:" + hashlib.sha256(replace(self, manifest_hash="").to_json().encode()).hexdigest()

    def to_json(self) -> str:
        if self.sketch is not None:
            self.schema_version = SKETCHED_SCHEMA
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data.update(key=asdict(self.key), reference=json_object(self.reference), provenance=json_object(self.provenance),
                    tolerance={name: t.stored() for name, t in sorted(self.tolerance.items())},
                    min_margin={str(layer): value for layer, value in self.min_margin.items()},
                    approvals=[asdict(a) for a in self.approvals],
                    absent=[{"kind": a.kind, "names": list(a.names), "reason": a.reason} for a in self.absent],
                    excused={variant: json_object(e) for variant, e in sorted(self.excused.items())})
        if not self.excused:
            del data["excused"]
        if not self.absent:
            del data["absent"]  # goldens that leave nothing out keep the bytes they always had
        if self.sketch is None:
            del data["sketch"]  # schema 1: no such field, so an all-whole golden keeps its old bytes
        else:
            data["sketch"] = self.sketch.to_dict()
        return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str, source: object) -> Manifest:
        try:
            data = json.loads(text, parse_constant=_refuse_constant)
            if not isinstance(data, dict):
                raise TypeError("the manifest is not a JSON object")
            version = data.get("schema_version")
            if type(version) is not int or version not in READABLE_SCHEMAS:
                readable = ", ".join(map(str, READABLE_SCHEMAS))
                raise GoldenError(source, f"schema version {version!r} is not one this veosnap reads "
                                          f"(it reads {readable}); upgrade veosnap")
            manifest = _parse(data)
        except GoldenError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, VeosnapError) as exc:
            raise GoldenError(source, f"malformed manifest ({type(exc).__name__}: {exc})") from None
        if config_hash(manifest.config) != manifest.config_hash:
            raise GoldenError(source, "manifest config hash does not match its config (corrupt or edited)")
        if not manifest.manifest_hash:
            raise GoldenError(source, "no manifest hash: its bounds and trail cannot be trusted (written before "
                                      "veosnap hashed its manifests, or the hash was removed)",
                              rerecord(manifest.key))
        if manifest.manifest_hash != manifest.own_hash():
            raise GoldenError(source, "manifest hash mismatch: the manifest was edited after recording "
                                      "(corrupt or edited)")
        for name, tol in sorted(manifest.tolerance.items()):
            # A bound is made from its noise and the rule (`numerics.tolerance.tolerance_for`, `schema`): one
            # that is not was edited apart from them, hashes recomputed.
            made = float(manifest.alpha * tol.noise + manifest.floor)
            if tol.bound != made:
                raise GoldenError(source, f"tolerance of {name!r}: bound {tol.bound!r} is not alpha x noise + floor "
                                          f"({made!r}): edited apart from its noise")
            if tol.scale_bound is not None and tol.scale_bound != float(SCALE_ALPHA * tol.scale_noise + SCALE_FLOOR):
                raise GoldenError(source, f"tolerance of {name!r}: projection bound {tol.scale_bound!r} is not "
                                          f"{SCALE_ALPHA:g} x its noise + {SCALE_FLOOR:g}: edited apart from its noise")
        return manifest


def rerecord(key: GoldenKey, command: str = "") -> str:
    """How to replace a golden that cannot be trusted (a clause of an error message): `command`, else the
    refresh that does it in the current directory's project."""
    scenario = "" if key.scenario == "step" else f" --scenario {key.scenario}"
    command = command or (f"veosnap refresh --force --reason \"...\" --model {key.model} --dtype {key.dtype}"
                          f"{scenario}")
    return f"re-record it on {key.hardware_class} hardware with `{command}`"


def json_object(section: object) -> dict[str, Any]:
    """A typed section as its JSON object: optional fields that are None are left out."""
    return {k: json_object(v) if hasattr(v, "__dataclass_fields__") else list(v) if isinstance(v, tuple) else v
            for k, v in ((f.name, getattr(section, f.name)) for f in fields(section)) if v is not None}


# --- strict parsing ---------------------------------------------------------------------------------

def _refuse_constant(name: str) -> float:
    # json.loads accepts NaN and Infinity; an infinite bound would pass any candidate.
    raise ValueError(f"{name} is not allowed in a manifest")


_NUMBER = (int, float)
_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "key": dict, "config": dict, "config_hash": str, "inputs_hash": str, "reference": dict, "provenance": dict,
    "tolerance": dict, "alpha": _NUMBER, "floor": _NUMBER, "tie_epsilon": _NUMBER,
    "min_margin": dict, "payload_hash": str, "approvals": list, "schema_version": int, "manifest_hash": str,
    "absent": list, "sketch": dict, "excused": dict,
}
_OPTIONAL = {"payload_hash", "approvals", "manifest_hash", "absent", "sketch", "excused"}


def _finite_non_negative(value: object) -> bool:
    # 1e400 parses as inf, and bool is an int: both refused
    return isinstance(value, _NUMBER) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_type(where: str, value: object, expected: type | tuple[type, ...]) -> None:
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in _as_tuple(expected)):
        raise TypeError(f"field {where!r} is {type(value).__name__}")


def _as_tuple(expected: type | tuple[type, ...]) -> tuple[type, ...]:
    return expected if isinstance(expected, tuple) else (expected,)


def _section(cls: type, data: object, where: str, types: dict[str, Any]) -> Any:
    """`data` (a JSON object) as `cls`: every required field present, no unknown one, each of its type."""
    if not isinstance(data, dict):
        raise TypeError(f"field {where!r} is {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where} has an unknown field {unknown[0]!r}")
    values = {}
    for name, spec in known.items():
        if name not in data:
            if spec.default is spec.default_factory:  # both MISSING: a required field
                raise ValueError(f"{where} has no field {name!r}")
            continue
        parse = types[name]
        values[name] = parse(data[name], f"{where}.{name}") if callable(parse) and not isinstance(parse, type) \
            else _typed(data[name], f"{where}.{name}", parse)
    return cls(**values)


def _typed(value: object, where: str, expected: type | tuple[type, ...]) -> object:
    _check_type(where, value, expected)
    if _NUMBER == _as_tuple(expected) and not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(f"field {where!r} is not a finite number")
    return value


def _int_list(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError(f"field {where!r} is not a list of integers")
    return tuple(value)


def _str_tuple(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"field {where!r} is not a list of strings")
    return tuple(value)


def _optional_str(value: object, where: str) -> str | None:
    return None if value is None else _typed(value, where, str)  # type: ignore[return-value]


def _train(value: object, where: str) -> TrainHyper:
    hyper = _section(TrainHyper, value, where, {
        "steps": int, "lr": _NUMBER, "beta1": _NUMBER, "beta2": _NUMBER, "weight_decay": _NUMBER, "eps": _NUMBER,
        "max_norm": _NUMBER, "optimizer": str, "clip": str})
    numbers = [getattr(hyper, f) for f in ("lr", "beta1", "beta2", "weight_decay", "eps", "max_norm")]
    if not 1 <= hyper.steps <= 100 or not all(map(_finite_non_negative, numbers)):
        raise ValueError(f"{where} holds an unusable value ({value})")
    return hyper


def _reference(value: object, where: str) -> Reference:
    return _section(Reference, value, where, {
        "attn_implementation": str, "experts_implementation": str, "seed": int, "noise_run": str,
        "batch": lambda v, w: _section(BatchSpec, v, w, {"layout": str, "padding_side": str, "sequences": _int_list,
                                                           "source": str, "rows": _str_tuple,
                                                           "media_family": _optional_str}),
        "train": _train, "random_off": _random_off, "sensitivity": _sensitivity})


def _sensitivity(value: object, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or not value or not all(
            isinstance(k, str) and _finite_non_negative(v) and v > 1 for k, v in value.items()):
        raise ValueError(f"field {where!r} is not a non-empty map of canary to a ratio over 1")
    return dict(value)


def _random_off(value: object, where: str) -> dict[str, float]:
    if not isinstance(value, dict) or not value or not all(
            isinstance(k, str) and _finite_non_negative(v) and v > 0 for k, v in value.items()):
        raise ValueError(f"field {where!r} is not a non-empty map of setting to its configured value")
    return dict(value)


def _provenance(value: object, where: str) -> Provenance:
    return _section(Provenance, value, where, {
        "veosnap": str, "torch": str, "transformers": str, "python": str, "device": str, "capability": str,
        "deterministic_algorithms": bool, "cpu_threads": int, "tf32": bool, "cuda": _optional_str,
        "driver": _optional_str})


def _approval(value: object, where: str) -> Approval:
    if not isinstance(value, dict):
        raise TypeError("an approval is not an object")
    approval = _section(Approval, value, where, {"reason": str, "previous_payload_hash": _optional_str})
    if not approval.reason.strip():
        raise ValueError(f"{where} has an empty reason (every refresh states one)")
    return approval


def _approvals(values: list) -> list[Approval]:
    trail = [_approval(a, f"approvals[{i}]") for i, a in enumerate(values)]
    for i, approval in enumerate(trail[1:], 1):
        if approval.previous_payload_hash is None:  # only the refresh that created a golden replaced nothing
            raise ValueError(f"approvals[{i}] says it created the golden, but it is not the first approval")
    return trail


def _absence(value: object, where: str) -> Absence:
    absence = _section(Absence, value, where, {"kind": str, "names": _str_list, "reason": str})
    if absence.kind not in ABSENCE_KINDS:
        raise ValueError(f"{where}.kind {absence.kind!r} is not one of {', '.join(ABSENCE_KINDS)}")
    if not absence.reason.strip():
        raise ValueError(f"{where} has an empty reason (an absence says why)")
    return absence


def _excused(data: dict, tolerance: dict[str, Tolerance], route_layers: set[int]) -> dict[str, Excuse]:
    """The `excused` section: present only when it names a variant, each with a reason and the figures of a
    tensor the golden holds."""
    if not data:
        raise ValueError("excused is empty (a golden without excuses has no 'excused' field)")
    excused = {}
    for variant, value in data.items():
        where = f"excused.{variant}"
        if variant not in EXCUSABLE:
            raise ValueError(f"{where}: {variant!r} is not an excusable variant ({', '.join(EXCUSABLE)})")
        excuse = _section(Excuse, value, where, {"reason": str, "tensor": str, "ratio": _optional_ratio})
        if not excuse.reason.strip():
            raise ValueError(f"{where} has an empty reason (an excuse says why)")
        if excuse.ratio is not None and excuse.ratio <= 1:
            raise ValueError(f"{where}: ratio {excuse.ratio!r} says {variant} passed (within 1x bound); an excuse is "
                             "only for a variant that fails")
        route = names.try_parse(excuse.tensor)
        if excuse.tensor not in tolerance and not (isinstance(route, names.Route) and route.layer in route_layers):
            raise ValueError(f"{where}.tensor {excuse.tensor!r} is not a tensor or route of this golden")
        excused[variant] = excuse
    return excused


def _optional_ratio(value: object, where: str) -> float | None:
    if value is None:
        return None
    if not _finite_non_negative(value) or value == 0:
        raise ValueError(f"field {where!r} is not a finite positive number or null")
    return value  # type: ignore[return-value]


def _str_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"field {where!r} is not a list of strings")
    return tuple(value)


def _parse(data: dict) -> Manifest:
    """Refuse fields of the wrong type or non-finite numbers, then build the typed manifest."""
    for name, expected in _MANIFEST_TYPES.items():
        if name not in data:
            if name in _OPTIONAL:
                continue
            raise KeyError(name)
        if not isinstance(data[name], expected) or isinstance(data[name], bool):
            raise TypeError(f"field {name!r} is {type(data[name]).__name__}")
    unknown = sorted(set(data) - set(_MANIFEST_TYPES))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    for name in ("alpha", "floor", "tie_epsilon"):
        if not _finite_non_negative(data[name]):
            raise ValueError(f"field {name!r} is not a finite non-negative number")
    tolerance = {}
    for name, value in data["tolerance"].items():
        if not isinstance(value, list) or len(value) not in (2, 4) or not all(map(_finite_non_negative, value)) \
                or value[1] <= 0 or (len(value) == 4 and value[3] <= 0):
            # every bound has a positive floor: a zero one was written by hand
            raise ValueError(f"tolerance of {name!r} is not [noise, bound] (or [noise, bound, projection noise, "
                             "projection bound]) with finite numbers, noises >= 0 and bounds > 0")
        tolerance[name] = Tolerance(*map(float, value))
    min_margin = {}
    for layer, value in data["min_margin"].items():
        if not _finite_non_negative(value):
            raise ValueError(f"min_margin of layer {layer!r} is not a finite non-negative number")
        if not layer.isdigit() or str(int(layer)) != layer:
            raise ValueError(f"min_margin has layer {layer!r}, not a layer number")
        min_margin[int(layer)] = value
    sketch = None
    if data["schema_version"] == SKETCHED_SCHEMA:
        if "sketch" not in data:
            raise ValueError("a schema 2 manifest has no 'sketch' section")
        sketch = SketchPlan.from_dict(data["sketch"])
        unknown = sorted(set(sketch.tensors) - set(tolerance))
        if unknown:
            raise ValueError(f"sketched tensor {unknown[0]!r} has no tolerance")
    elif "sketch" in data:
        raise ValueError(f"a schema {data['schema_version']} manifest has a 'sketch' section (only schema 2 has one)")
    return Manifest(
        key=GoldenKey(**data["key"]), config=data["config"], config_hash=data["config_hash"],
        inputs_hash=data["inputs_hash"], reference=_reference(data["reference"], "reference"),
        provenance=_provenance(data["provenance"], "provenance"), tolerance=tolerance, alpha=data["alpha"],
        floor=data["floor"], tie_epsilon=data["tie_epsilon"], min_margin=min_margin,
        payload_hash=data.get("payload_hash", ""),
        approvals=_approvals(data.get("approvals", [])),
        schema_version=data["schema_version"], manifest_hash=data.get("manifest_hash", ""),
        absent=[_absence(a, f"absent[{i}]") for i, a in enumerate(data.get("absent", []))], sketch=sketch,
        excused=_excused(data["excused"], tolerance, set(min_margin)) if "excused" in data else {},
    )
