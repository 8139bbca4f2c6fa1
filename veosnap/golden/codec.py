"""A golden in memory (`Golden`) and its bytes: one zstd frame around a safetensors file whose metadata
holds the JSON manifest.

`zstd -d` yields a file any safetensors reader opens. Nothing is ever unpickled or executed; sizes
are capped before anything is decompressed or parsed (`limits`); every tensor the payload holds must
be one a golden holds (see `names`), with its tolerance, and the stored inputs must be the ones the
manifest describes. A sketched tensor is stored as its parts (`sketches`) and read back as a
`GoldenSketch`, validated against its manifest entry. Same golden, same bytes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import BinaryIO

import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import GoldenError, VeosnapError
from . import names
from .key import GoldenKey
from .limits import MAX_COMPRESSED, MAX_DECOMPRESSED, MAX_HEADER, MAX_RATIO, RATIO_SLACK, check_limits  # noqa: F401
from .manifest import Manifest
from .sketches import GoldenSketch, split_name

METADATA_KEY = "veosnap"
# What each scenario's golden must hold besides its inputs (train: per-step loss and gradient norm).
REQUIRED = {"step": (names.LOSS, names.LOGITS), "train": (names.TRAIN_LOSS, names.TRAIN_GRAD_NORM)}
ZSTD_LEVEL = 12
# The kinds of tensor a golden may store as a sketch; the loss, routes and inputs are always whole.
SKETCHABLE = (names.Logits, names.LayerOutput, names.Grad, names.Update)


@dataclass
class Golden:
    """A golden in memory: its manifest and its tensors (CPU), by name."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]  # whole tensors (inputs, routes, and every tensor not sketched)
    path: Path | None = None
    sketches: dict[str, GoldenSketch] = dataclass_field(default_factory=dict)  # sketched tensors (schema 2)

    @property
    def key(self) -> GoldenKey:
        return self.manifest.key

    def inputs(self) -> dict[str, torch.Tensor]:
        """The stored batch, by input field (`input_ids`, `attention_mask`, ...)."""
        return {parsed.field: t for name, t in self.tensors.items()
                if isinstance(parsed := names.try_parse(name), names.Input)}

    def input_tensors(self) -> dict[str, torch.Tensor]:
        """The stored batch under its golden names (`inputs.<field>`): what the inputs hash covers."""
        return {f"inputs.{field}": t for field, t in self.inputs().items()}

    def compared_names(self) -> list[str]:
        """Tensors a check compares numerically (inputs, route ids and margins are not), whole or sketched."""
        return sorted(self.manifest.tolerance)

    def held_names(self) -> set[str]:
        """The names of the tensors the golden holds, whole or sketched."""
        return set(self.tensors) | set(self.sketches)

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the file holds: the whole ones and each sketched tensor's parts (`N#sketch`, ...)."""
        stored = dict(self.tensors)
        for name, sketch in self.sketches.items():
            stored.update(sketch.tensors(name))
        return stored

    def route_layers(self) -> list[int]:
        """The MoE layers whose routes the golden holds."""
        return sorted(parsed.layer for name in self.tensors
                      if isinstance(parsed := names.try_parse(name), names.Route) and parsed.part == "experts")

    def experts(self) -> dict[int, torch.Tensor]:
        """The golden's expert ids per MoE layer: [tokens of the batch, top_k] int64, sorted per token."""
        return {layer: self.tensors[str(names.Route(layer, "experts"))].long() for layer in self.route_layers()}

    @property
    def is_moe(self) -> bool:
        return bool(self.route_layers())


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode())
        h.update(tensor_bytes(t))
    return "sha256:" + h.hexdigest()


def encode(golden: Golden) -> bytes:
    """The golden's file bytes (its payload and manifest hashes are set first). Same golden, same bytes."""
    manifest = golden.manifest
    _check_sketch_entries(golden)
    stored = golden.stored_tensors()
    manifest.payload_hash = tensors_hash(stored)
    manifest.manifest_hash = manifest.own_hash()
    tensors = {name: t.detach().cpu().contiguous() for name, t in stored.items()}
    raw = st_save(tensors, metadata={METADATA_KEY: manifest.to_json()})
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True, threads=0)
    return compressor.compress(raw)


def decode(data: bytes, source: object) -> Golden:
    """Parse golden bytes, refusing anything oversized, corrupt or inconsistent with one line.

    Raises only `GoldenError`; nothing is allocated beyond the capped, declared content size.
    """
    raw = _decompress(data, source)
    metadata = _safetensors_metadata(raw, source)
    if METADATA_KEY not in metadata:
        raise GoldenError(source, f"safetensors metadata has no '{METADATA_KEY}' manifest (not a veosnap golden)")
    manifest = Manifest.from_json(metadata[METADATA_KEY], source)
    if manifest.key.scenario == "train" and manifest.reference.train is None:
        raise GoldenError(source, "a train golden's manifest has no reference.train hyper-parameters")
    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise GoldenError(source, f"malformed safetensors payload ({_first_line(exc)})") from None
    if tensors_hash(tensors) != manifest.payload_hash:
        raise GoldenError(source, "payload hash mismatch: the tensors are not the ones recorded (corrupt or edited)")
    golden = _split_sketches(manifest, tensors, source)
    _check_tensor_set(golden, source)
    return golden


def _check_sketch_entries(golden: Golden) -> None:
    """The manifest's sketch entries are the golden's sketches (a recorder bug otherwise, not a user's)."""
    entries = {} if golden.manifest.sketch is None else golden.manifest.sketch.tensors
    ours = {name: sketch.entry for name, sketch in golden.sketches.items()}
    if entries != ours:
        raise VeosnapError(f"{golden.key}: the manifest's sketch entries do not match the golden's sketched tensors")


def _split_sketches(manifest: Manifest, stored: dict[str, torch.Tensor], source: object) -> Golden:
    """The payload as whole tensors and `GoldenSketch`es (validated against their manifest entries)."""
    entries = {} if manifest.sketch is None else manifest.sketch.tensors
    whole, parts = {}, {}
    for name, t in stored.items():
        split = split_name(name)
        if split is None:
            whole[name] = t
            continue
        if split[0] not in entries:
            raise GoldenError(source, f"tensor {name!r} is not part of a golden (a sketch part of a tensor the "
                                      "manifest does not list as sketched)")
        parts[name] = t
    sketches = {}
    for name, entry in sorted(entries.items()):
        if not isinstance(names.try_parse(name), SKETCHABLE):
            raise GoldenError(source, f"tensor {name!r} is listed as sketched, but only logits, layer outputs, "
                                      "gradients and updates are ever sketched")
        try:
            sketches[name] = GoldenSketch.from_entry(name, entry, parts, source)
        except GoldenError:
            raise
        except VeosnapError as exc:
            raise GoldenError(source, str(exc).removeprefix(f"{source}: ")) from None
        if name in whole:
            raise GoldenError(source, f"tensor {name!r} is stored both whole and sketched")
    expected = {part for name, s in sketches.items() for part in s.tensors(name)}
    extra = sorted(set(parts) - expected)
    if extra:
        raise GoldenError(source, f"tensor {extra[0]!r} is not part of a golden (extra or hand-added)")
    return Golden(manifest=manifest, tensors=whole, sketches=sketches)


def read_manifest(stream: BinaryIO, source: object) -> Manifest:
    """The manifest of the golden whose file `stream` reads, decompressing only up to the end of the
    safetensors header (`veosnap ls`: a look at many goldens). Its own hash is checked; the tensors and the
    payload hash are not (`decode` does that)."""
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stream)
        head = reader.read(8)
        if len(head) < 8:
            raise GoldenError(source, "truncated: the safetensors header ends early")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER:
            raise GoldenError(source, f"safetensors header declares {header_len} bytes, over the {MAX_HEADER} byte cap")
        header = b""
        while len(header) < header_len:
            more = reader.read(header_len - len(header))
            if not more:
                raise GoldenError(source, "truncated: the safetensors header ends early")
            header += more
    except zstandard.ZstdError as exc:
        raise GoldenError(source, _zstd_cause(str(exc))) from None
    metadata = _safetensors_metadata(head + header, source)
    if METADATA_KEY not in metadata:
        raise GoldenError(source, f"safetensors metadata has no '{METADATA_KEY}' manifest (not a veosnap golden)")
    return Manifest.from_json(metadata[METADATA_KEY], source)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _decompress(data: bytes, source: object) -> bytes:
    size = check_limits(data, source)
    # Streaming: memory grows with the content actually decoded (a lying header costs nothing), and
    # zstd stops with an error as soon as the content outgrows the declared size.
    decoder = zstandard.ZstdDecompressor().decompressobj()
    try:
        raw = decoder.decompress(data)
    except zstandard.ZstdError as exc:
        raise GoldenError(source, _zstd_cause(str(exc))) from None
    if not decoder.eof:
        raise GoldenError(source, _zstd_cause("did not decompress full frame"))
    if decoder.unused_data:
        raise GoldenError(source, _zstd_cause("unused data"))
    if len(raw) != size:
        raise GoldenError(source, f"decompressed {len(raw)} bytes but the frame declares {size}")
    return raw


def _zstd_cause(message: str) -> str:
    if "did not decompress full frame" in message:
        return "truncated: the zstd frame ends early (an interrupted copy or download?)"
    if "unused data" in message:
        return "trailing bytes after the zstd frame (a golden is exactly one frame)"
    # A flipped bit breaks decoding or the checksum depending on where it lands: one cause either way.
    return "corrupt: the zstd data does not decode or fails its checksum (the file's bytes changed after it was written)"


def _safetensors_metadata(raw: bytes, source: object) -> dict[str, str]:
    if len(raw) < 8:
        raise GoldenError(source, "safetensors payload shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > MAX_HEADER:
        raise GoldenError(source, f"safetensors header declares {header_len} bytes, over the {MAX_HEADER} byte cap")
    if 8 + header_len > len(raw):
        raise GoldenError(source, f"safetensors header declares {header_len} bytes, past the end of the payload")
    try:
        header = json.loads(raw[8 : 8 + header_len])
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise TypeError("__metadata__ is not an object of strings")
    except (ValueError, TypeError, RecursionError) as exc:
        raise GoldenError(source, f"malformed safetensors header ({type(exc).__name__}: {_first_line(exc)})") from None
    return metadata


def _check_tensor_set(golden: Golden, source: object) -> None:
    """The payload holds exactly what a golden holds: its known inputs, every toleranced tensor, and each
    MoE layer's expert ids and margins; an extra or missing tensor would blame the candidate for it."""
    check_tensor_names(golden.manifest, set(golden.tensors), set(golden.sketches), source)
    check_inputs(golden.input_tensors(), golden.manifest, source)
    check_derived(golden, source)


def check_derived(golden: Golden, source: object) -> None:
    """Fields the manifest stores that other stored fields determine agree with them (`schema`'s derived
    fields): each MoE layer's `min_margin` is its margin tensor's smallest over the real tokens (a train
    golden's may be smaller: it is over every step, the tensor the first's), and a sketched tensor counts
    the rows its kind counts. A forger who moves one without the other is refused here, not in review."""
    real = golden.tensors["inputs.attention_mask"].reshape(-1).bool()
    for layer, stored in golden.manifest.min_margin.items():
        margin = golden.tensors[str(names.Route(layer, "margin"))].reshape(-1)
        if margin.numel() != real.numel():
            raise GoldenError(source, f"tensor 'routes.{layer}.margin' has {margin.numel()} values for "
                                      f"{real.numel()} token positions")
        smallest = float(margin[real].min()) if bool(real.any()) else stored
        train = golden.key.scenario == "train"
        if stored > smallest or (stored != smallest and not train):
            raise GoldenError(source, f"min_margin of layer {layer} is {stored!r}, but its routes.{layer}.margin "
                                      f"is {smallest!r} at least over the real tokens (edited apart from it)")
    for name, sketch in golden.sketches.items():
        counted = int(real.sum()) if names.parse(name).token_rows else sketch.spec.sketched_rows
        if sketch.rows_counted != counted:
            raise GoldenError(source, f"sketched tensor {name!r}: rows_counted {sketch.rows_counted} but it counts "
                                      f"{counted} rows (edited apart from its inputs)")


def check_stored_names(manifest: Manifest, stored: set[str], source: object) -> None:
    """What the reader's checks on names say of a payload's tensor names alone (`stored`: as in the file,
    sketch parts included), before any tensor is read; the reader itself says it with more detail."""
    entries = {} if manifest.sketch is None else manifest.sketch.tensors
    whole = {name for name in stored if split_name(name) is None}
    expected = set()
    for name, entry in entries.items():
        if not isinstance(names.try_parse(name), SKETCHABLE) or name in whole:
            raise GoldenError(source, f"tensor {name!r} cannot be stored sketched as it is")
        expected |= {f"{name}#sketch", f"{name}#norms"} | ({f"{name}#support"} if entry.spec.support is not None
                                                           else set())
    if stored - whole != expected:
        raise GoldenError(source, "the sketch parts stored are not the ones the manifest lists")
    check_tensor_names(manifest, whole, set(entries), source)


def check_tensor_names(manifest: Manifest, present: set[str], sketched: set[str], source: object) -> None:
    """The names of the tensors stored whole (`present`) and sketched are the ones a golden holds."""
    held = present | sketched  # what the golden holds, whole or sketched
    tolerance = manifest.tolerance
    for name in sorted(tolerance):
        if name not in held:
            raise GoldenError(source, f"tensor {name!r} has a tolerance but is missing from the payload")
    required_inputs = [f"inputs.{f.name}" for f in names.INPUT_FIELDS.values() if f.required]
    for required in (*map(str, REQUIRED.get(manifest.key.scenario, REQUIRED["step"])), *required_inputs):
        if required not in held:
            raise GoldenError(source, f"tensor {required!r} is missing")
    route_layers = {parsed.layer for name in tolerance
                    if isinstance(parsed := names.try_parse(name), names.Route) and parsed.part == "weights"}
    for layer in sorted(route_layers):
        for part in ("experts", "margin"):
            if str(names.Route(layer, part)) not in present:
                raise GoldenError(source, f"tensor 'routes.{layer}.{part}' is missing (layer {layer} has routes)")
    for name in sorted(present):
        if not _belongs(name, tolerance, route_layers):
            raise GoldenError(source, f"tensor {name!r} is not part of a golden (extra or hand-added)")
    if set(manifest.min_margin) != route_layers:
        raise GoldenError(source, "manifest router margins do not match the MoE layers in the payload")


def check_inputs(inputs: dict[str, torch.Tensor], manifest: Manifest, source: object) -> None:
    """The stored batch (`inputs.<field>` tensors) is well formed and the one the manifest describes."""
    for required in (f"inputs.{f.name}" for f in names.INPUT_FIELDS.values() if f.required):
        if required not in inputs:
            raise GoldenError(source, f"tensor {required!r} is missing")
    shape = inputs["inputs.input_ids"].shape
    for field in (f for f in names.INPUT_FIELDS.values() if f.token_grid and f"inputs.{f.name}" in inputs):
        t = inputs[f"inputs.{field.name}"]
        if t.dtype != torch.int64 or t.ndim != 2 or t.shape != shape:
            raise GoldenError(source, f"tensor 'inputs.{field.name}' is {_describe(t)}, expected int64 {list(shape)} (2-D)")
    _check_media({name.removeprefix("inputs."): t for name, t in inputs.items()}, source, shape)
    if tensors_hash(inputs) != manifest.inputs_hash:
        raise GoldenError(source, "inputs hash mismatch: the stored batch is not the one the manifest describes")


def _check_media(stored: dict[str, torch.Tensor], source: object, grid: torch.Size) -> None:
    """A multimodal batch's inputs agree with each other and with the token grids: each kind complete, of
    its dtype and rank, its items' sizes adding up, each item in a row of the batch (rows in order)."""
    rows = grid[0]
    rope = stored.get("mrope_position_ids")
    if rope is not None and (rope.dtype != torch.int64 or tuple(rope.shape) != (3, *grid)):
        raise GoldenError(source, f"tensor 'inputs.mrope_position_ids' is {_describe(rope)}, expected int64 "
                                  f"{[3, *grid]}")
    for kind in names.MEDIA_KINDS:
        fields = [f for f in names.INPUT_FIELDS.values() if f.media == kind]
        present = [f for f in fields if f.name in stored]
        if not present:
            continue
        if len(present) != len(fields):
            missing = next(f.name for f in fields if f.name not in stored)
            raise GoldenError(source, f"tensor 'inputs.{missing}' is missing (the batch has {kind} inputs)")
        for f in fields:
            t = stored[f.name]
            if str(t.dtype).removeprefix("torch.") != f.dtype or t.ndim != f.ndim or not t.shape[0]:
                raise GoldenError(source, f"tensor 'inputs.{f.name}' is {_describe(t)}, expected a non-empty "
                                          f"{f.dtype} tensor of {f.ndim} dimensions")
        item_rows = stored[f"{kind}_rows"]
        items = item_rows.shape[0]
        if kind == "audio":
            values, mask = stored["input_features"], stored["feature_attention_mask"]
            consistent = values.shape[0] == items and tuple(mask.shape) == (items, values.shape[-1])
        else:
            prefix = "pixel_values" if kind == "image" else "pixel_values_videos"
            grid_thw = stored[f"{kind}_grid_thw"]
            consistent = (tuple(grid_thw.shape) == (items, 3) and bool((grid_thw > 0).all())
                          and int(grid_thw.prod(dim=-1).sum()) == stored[prefix].shape[0])
            if kind == "video":
                consistent = consistent and stored["second_per_grid"].shape[0] == items
        in_rows = bool(((item_rows >= 0) & (item_rows < rows)).all()) and bool((item_rows.diff() >= 0).all())
        if not consistent or not in_rows:
            raise GoldenError(source, f"the {kind} inputs disagree with each other or with the batch's {rows} rows "
                                      f"(item counts, sizes or rows)")


def _belongs(name: str, tolerance: dict, route_layers: set[int]) -> bool:
    """Whether a golden holds a tensor of this name (given its tolerances and MoE layers)."""
    if name in tolerance:
        return True
    parsed = names.try_parse(name)
    if isinstance(parsed, names.Input):
        return parsed.known is not None
    return isinstance(parsed, names.Route) and parsed.part in ("experts", "margin") and parsed.layer in route_layers


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
