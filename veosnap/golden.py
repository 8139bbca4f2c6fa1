"""The golden file: one zstd frame around a safetensors file whose metadata holds a JSON manifest.

`zstd -d` yields a file any safetensors reader opens. Nothing is ever unpickled or executed; sizes
are capped before anything is decompressed or parsed; writes are atomic (temp file, fsync, rename),
so a crash leaves the previous golden whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import GoldenError, VeosnapError
from .inputs import Batch
from .tolerance import Tolerance
from .zoo import check_name, config_hash

try:
    import fcntl
except ImportError:  # Windows: no stale-temp cleanup, writes are still atomic
    fcntl = None  # type: ignore[assignment]

SCHEMA_VERSION = 1
READABLE_SCHEMAS = (1,)
SUFFIX = ".safetensors.zst"
METADATA_KEY = "veosnap"
SCENARIOS = ("step", "train")
# What each scenario's golden must hold besides its inputs (train: per-step loss and gradient norm).
REQUIRED = {"step": ("loss", "logits"), "train": ("train.loss", "train.grad_norm")}
DTYPE_NAMES = ("float32", "bfloat16")
MAX_COMPRESSED = 256 << 20
MAX_DECOMPRESSED = 1 << 30
MAX_HEADER = 16 << 20
# Goldens compress about 1.2-1.5x (float tensors); a frame declaring far more content than its size
# could hold is a decompression bomb, refused before anything is allocated.
MAX_RATIO = 64
RATIO_SLACK = 1 << 20
STALE_TMP_SECONDS = 60
INPUT_NAMES = ("inputs.input_ids", "inputs.attention_mask", "inputs.position_ids", "inputs.labels")
ZSTD_LEVEL = 12


@dataclass(frozen=True, order=True)
class GoldenKey:
    """What a golden is the reference for: (hardware class, model, scenario, dtype)."""

    hardware_class: str
    model: str
    scenario: str = "step"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_name(self.hardware_class, "hardware class")
        check_name(self.model, "model")
        check_name(self.scenario, "scenario")
        check_name(self.dtype, "dtype")

    @property
    def relpath(self) -> Path:
        return Path(self.hardware_class) / self.model / f"{self.scenario}-{self.dtype}{SUFFIX}"

    def __str__(self) -> str:
        return f"{self.hardware_class}/{self.model}/{self.scenario}-{self.dtype}"

    @classmethod
    def from_relpath(cls, relpath: Path) -> GoldenKey:
        """Parse `<class>/<model>/<scenario>-<dtype>.safetensors.zst`."""
        parts = relpath.parts
        if len(parts) != 3 or not parts[2].endswith(SUFFIX) or "-" not in parts[2]:
            raise VeosnapError(f"{relpath}: not a golden path (<class>/<model>/<scenario>-<dtype>{SUFFIX})")
        scenario, dtype = parts[2][: -len(SUFFIX)].rsplit("-", 1)
        return cls(hardware_class=parts[0], model=parts[1], scenario=scenario, dtype=dtype)


@dataclass
class Manifest:
    """Everything about a golden besides its tensors. Serialized as sorted JSON."""

    key: GoldenKey
    config: dict
    config_hash: str
    inputs_hash: str
    reference: dict  # how the reference ran: implementations, seed, batch, precision of the noise run
    provenance: dict  # versions, device, determinism settings
    tolerance: dict[str, Tolerance]
    alpha: float
    floor: float
    tie_epsilon: float
    min_margin: dict[str, float]  # per MoE layer (as a string), smallest router margin
    payload_hash: str = ""
    approvals: list[dict] = field(default_factory=list)  # refresh trail: reason, previous payload hash
    schema_version: int = SCHEMA_VERSION
    # SHA-256 of this manifest's JSON with this field empty, so a hand-edited bound or seed is caught
    # like a hand-edited tensor. Goldens written before it have none and are read without the check.
    manifest_hash: str = ""

    def own_hash(self) -> str:
        """What `manifest_hash` should be for the manifest as it stands."""
        return "sha256:" + hashlib.sha256(replace(self, manifest_hash="").to_json().encode()).hexdigest()

    def to_json(self) -> str:
        data = asdict(self)
        data["tolerance"] = {name: [tol.noise, tol.bound] for name, tol in sorted(self.tolerance.items())}
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
            _check_manifest_types(data)
            data["key"] = GoldenKey(**data["key"])
            data["tolerance"] = {n: Tolerance(float(v[0]), float(v[1])) for n, v in data["tolerance"].items()}
            manifest = cls(**data)
        except GoldenError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, VeosnapError) as exc:
            raise GoldenError(source, f"malformed manifest ({type(exc).__name__}: {exc})") from None
        if config_hash(manifest.config) != manifest.config_hash:
            raise GoldenError(source, "manifest config hash does not match its config (corrupt or edited)")
        if manifest.manifest_hash and manifest.manifest_hash != manifest.own_hash():
            raise GoldenError(source, "manifest hash mismatch: the manifest was edited after recording (corrupt or edited)")
        return manifest


def _refuse_constant(name: str) -> float:
    # json.loads accepts NaN and Infinity; an infinite bound would pass any candidate.
    raise ValueError(f"{name} is not allowed in a manifest")


_MANIFEST_TYPES: dict[str, type | tuple[type, ...]] = {
    "key": dict, "config": dict, "config_hash": str, "inputs_hash": str, "reference": dict, "provenance": dict,
    "tolerance": dict, "alpha": (int, float), "floor": (int, float), "tie_epsilon": (int, float),
    "min_margin": dict, "payload_hash": str, "approvals": list, "schema_version": int, "manifest_hash": str,
}


def _finite_non_negative(value: object) -> bool:
    # 1e400 parses as inf, and bool is an int: both refused
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_manifest_types(data: dict) -> None:
    """Refuse fields of the wrong type or non-finite numbers, so a checked golden never crashes a check
    halfway or passes everything (a negative or infinite bound)."""
    for name, expected in _MANIFEST_TYPES.items():
        if name in data and (not isinstance(data[name], expected) or isinstance(data[name], bool)):
            raise TypeError(f"field {name!r} is {type(data[name]).__name__}")
    for name in ("alpha", "floor", "tie_epsilon"):
        if name in data and not _finite_non_negative(data[name]):
            raise ValueError(f"field {name!r} is not a finite non-negative number")
    for name, value in data.get("tolerance", {}).items():
        if not isinstance(value, list) or len(value) != 2 or not all(map(_finite_non_negative, value)) or value[1] <= 0:
            # every bound has a positive floor: a zero one was written by hand
            raise ValueError(f"tolerance of {name!r} is not [noise, bound] with finite numbers, noise >= 0 and bound > 0")
    for name, value in data.get("min_margin", {}).items():
        if not _finite_non_negative(value):
            raise ValueError(f"min_margin of layer {name!r} is not a finite non-negative number")
    seed = data.get("reference", {}).get("seed", 0)
    if type(seed) is not int:
        raise TypeError(f"reference seed is {type(seed).__name__}")
    if not all(isinstance(a, dict) for a in data.get("approvals", [])):
        raise TypeError("an approval is not an object")


@dataclass
class Golden:
    """A golden in memory: its manifest and its tensors (CPU)."""

    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def key(self) -> GoldenKey:
        return self.manifest.key

    @property
    def batch(self) -> Batch:
        return Batch.from_tensors(self.tensors)

    def compared_names(self) -> list[str]:
        """Tensors a check compares numerically (inputs, route ids and margins are not)."""
        return sorted(self.manifest.tolerance)


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
    """The golden's file bytes. Same golden, same bytes."""
    manifest = golden.manifest
    manifest.payload_hash = tensors_hash(golden.tensors)
    manifest.manifest_hash = manifest.own_hash()
    tensors = {name: t.detach().cpu().contiguous() for name, t in golden.tensors.items()}
    raw = st_save(tensors, metadata={METADATA_KEY: manifest.to_json()})
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True, threads=0)
    return compressor.compress(raw)


def write(golden: Golden, path: Path) -> None:
    """Write a golden atomically: a reader sees the old file or the new one, never a torn one."""
    write_bytes(encode(golden), path)


def write_bytes(data: bytes, path: Path) -> None:
    """Atomically replace `path` with `data` (temp file in the same directory, fsync, rename).

    The temp file is locked while it is written, so the next writer can tell a temp file left by a
    killed writer (unlocked, old) from one still being written, and removes only the former.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise GoldenError(path, f"cannot write ({exc.strerror or exc})") from None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a golden is an ordinary shared file
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
            os.replace(tmp, path)  # still locked: nobody may take it for stale before it is renamed
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise GoldenError(path, f"cannot write ({exc.strerror or exc})") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def temp_files(path: Path) -> list[Path]:
    """Temp files of writes to `path` (in progress, or left by a killed writer)."""
    return sorted(Path(path).parent.glob(f".{Path(path).name}.*.tmp"))


def _remove_stale_temps(path: Path) -> None:
    if fcntl is None:
        return
    now = time.time()
    for tmp in temp_files(path):
        try:
            with open(tmp, "rb") as fh:
                if now - os.fstat(fh.fileno()).st_mtime < STALE_TMP_SECONDS:
                    continue  # young: its writer may not have locked it yet
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer holds it
                tmp.unlink(missing_ok=True)
        except OSError:
            continue  # another writer removed it first, or it is not ours to touch


def decode(data: bytes, source: object) -> Golden:
    """Parse golden bytes, refusing anything oversized, corrupt or inconsistent with one line.

    Raises only `GoldenError`; nothing is allocated beyond the capped, declared content size.
    """
    if len(data) > MAX_COMPRESSED:
        raise GoldenError(source, f"file is over the {MAX_COMPRESSED} byte cap")
    raw = _decompress(data, source)
    metadata = _safetensors_metadata(raw, source)
    if METADATA_KEY not in metadata:
        raise GoldenError(source, f"safetensors metadata has no '{METADATA_KEY}' manifest (not a veosnap golden)")
    manifest = Manifest.from_json(metadata[METADATA_KEY], source)
    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise GoldenError(source, f"malformed safetensors payload ({_first_line(exc)})") from None
    golden = Golden(manifest=manifest, tensors=tensors)
    if tensors_hash(tensors) != manifest.payload_hash:
        raise GoldenError(source, "payload hash mismatch: the tensors are not the ones recorded (corrupt or edited)")
    _check_tensor_set(golden, source)
    return golden


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _decompress(data: bytes, source: object) -> bytes:
    if len(data) < 4 or data[:4] != b"\x28\xb5\x2f\xfd":
        hint = " (this looks like an uncompressed safetensors file)" if data[8:10] == b'{"' else ""
        raise GoldenError(source, f"not a zstd frame; a golden is zstd-compressed safetensors{hint}")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise GoldenError(source, "truncated or corrupt zstd frame header") from None
    size = params.content_size
    if size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        raise GoldenError(source, "zstd frame does not declare its content size; refusing (veosnap always writes it)")
    if size == 0:
        raise GoldenError(source, "zstd frame is empty")
    if size > MAX_DECOMPRESSED:
        raise GoldenError(source, f"zstd frame declares {size} bytes of content, over the {MAX_DECOMPRESSED} byte cap; "
                                  "refusing (decompression bomb?)")
    if size > MAX_RATIO * len(data) + RATIO_SLACK:
        raise GoldenError(source, f"zstd frame declares {size} bytes of content from {len(data)} compressed bytes "
                                  f"(over {MAX_RATIO}x); refusing (decompression bomb?)")
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
    """The payload holds exactly what a golden holds: the inputs, every toleranced tensor, and each MoE
    layer's expert ids and margins; an extra or missing tensor would blame the candidate for it."""
    names = set(golden.tensors)
    tolerance = golden.manifest.tolerance
    for name in sorted(tolerance):
        if name not in names:
            raise GoldenError(source, f"tensor {name!r} has a tolerance but is missing from the payload")
    for required in (*REQUIRED.get(golden.key.scenario, REQUIRED["step"]), *INPUT_NAMES):
        if required not in names:
            raise GoldenError(source, f"required tensor {required!r} is missing")
    route_layers = {name.split(".")[1] for name in tolerance if _is_route(name, "weights")}
    for layer in sorted(route_layers):
        for part in ("experts", "margin"):
            if f"routes.{layer}.{part}" not in names:
                raise GoldenError(source, f"tensor 'routes.{layer}.{part}' is missing (layer {layer} has routes)")
    for name in sorted(names):
        expected = name in tolerance or name in INPUT_NAMES or (
            (_is_route(name, "experts") or _is_route(name, "margin")) and name.split(".")[1] in route_layers)
        if not expected:
            raise GoldenError(source, f"tensor {name!r} is not part of a golden (extra or hand-added)")
    if set(golden.manifest.min_margin) != route_layers:
        raise GoldenError(source, "manifest router margins do not match the MoE layers in the payload")
    shape = golden.tensors["inputs.input_ids"].shape
    for name in INPUT_NAMES:
        t = golden.tensors[name]
        if t.dtype != torch.int64 or t.ndim != 2 or t.shape != shape:
            raise GoldenError(source, f"tensor {name!r} is {_describe(t)}, expected int64 {list(shape)} (2-D)")
    if tensors_hash(golden.batch.tensors()) != golden.manifest.inputs_hash:
        raise GoldenError(source, "inputs hash mismatch: the stored batch is not the one the manifest describes")


def _is_route(name: str, part: str) -> bool:
    pieces = name.split(".")
    return len(pieces) == 3 and pieces[0] == "routes" and pieces[1].isdigit() and pieces[2] == part


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def read(path: Path, root: Path | None = None) -> Golden:
    """Read and validate a golden file; if `root` is given, it must lie inside root (symlinks
    resolved, checked before reading) and its key must match its path under root."""
    path = Path(path)
    expected = _key_from_path(path, root) if root is not None else None
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_COMPRESSED + 1)  # read no more than the cap, however large the file
    except FileNotFoundError:
        raise GoldenError(path, "no such file") from None
    except OSError as exc:
        raise GoldenError(path, f"cannot read ({exc.strerror or exc})") from None
    golden = decode(data, path)
    golden.path = path
    if expected is not None and golden.key != expected:
        raise GoldenError(path, f"manifest key {golden.key} disagrees with its path ({expected})")
    return golden


def _key_from_path(path: Path, root: Path) -> GoldenKey:
    try:
        relpath = path.resolve().relative_to(Path(root).resolve())
    except ValueError:  # a symlink out of the goldens directory
        raise GoldenError(path, f"resolves to {path.resolve()}, outside the goldens directory {root}") from None
    try:
        return GoldenKey.from_relpath(relpath)
    except VeosnapError:
        raise GoldenError(path, f"not a golden path under {root} (<class>/<model>/<scenario>-<dtype>{SUFFIX})") from None


def path_for(root: Path, key: GoldenKey) -> Path:
    """Where the golden for `key` lives under `root` (always inside `root`)."""
    return Path(root) / key.relpath


def list_goldens(root: Path) -> list[tuple[GoldenKey, Path]]:
    """Every golden file under `root`, by key."""
    root = Path(root)
    found = []
    for path in sorted(root.glob(f"*/*/*{SUFFIX}")):
        try:
            found.append((GoldenKey.from_relpath(path.relative_to(root)), path))
        except VeosnapError:
            continue
    return found
