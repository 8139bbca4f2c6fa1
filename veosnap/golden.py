"""The golden file: one zstd frame around a safetensors file whose metadata holds a JSON manifest.

`zstd -d` yields a file any safetensors reader opens. Nothing is ever unpickled or executed; sizes
are capped before anything is decompressed or parsed; writes are atomic (temp file, fsync, rename),
so a crash leaves the previous golden whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import GoldenError, VeosnapError
from .inputs import Batch
from .tolerance import Tolerance
from .zoo import check_name

SCHEMA_VERSION = 1
READABLE_SCHEMAS = (1,)
SUFFIX = ".safetensors.zst"
METADATA_KEY = "veosnap"
SCENARIOS = ("step",)
DTYPE_NAMES = ("float32", "bfloat16")
MAX_COMPRESSED = 256 << 20
MAX_DECOMPRESSED = 1 << 30
MAX_HEADER = 16 << 20
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

    def to_json(self) -> str:
        data = asdict(self)
        data["tolerance"] = {name: [tol.noise, tol.bound] for name, tol in sorted(self.tolerance.items())}
        return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str, source: object) -> Manifest:
        try:
            data = json.loads(text)
            version = data.get("schema_version")
            if version not in READABLE_SCHEMAS:
                readable = ", ".join(map(str, READABLE_SCHEMAS))
                raise GoldenError(source, f"schema version {version!r} is not one this veosnap reads ({readable}); upgrade veosnap")
            data["key"] = GoldenKey(**data["key"])
            data["tolerance"] = {n: Tolerance(float(v[0]), float(v[1])) for n, v in data["tolerance"].items()}
            return cls(**data)
        except GoldenError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, VeosnapError) as exc:
            raise GoldenError(source, f"malformed manifest ({type(exc).__name__}: {exc})") from None


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
    tensors = {name: t.detach().cpu().contiguous() for name, t in golden.tensors.items()}
    raw = st_save(tensors, metadata={METADATA_KEY: manifest.to_json()})
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True, threads=0)
    return compressor.compress(raw)


def write(golden: Golden, path: Path) -> None:
    """Write a golden atomically: a reader sees the old file or the new one, never a torn one."""
    write_bytes(encode(golden), path)


def write_bytes(data: bytes, path: Path) -> None:
    """Atomically replace `path` with `data` (temp file in the same directory, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a golden is an ordinary shared file
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def decode(data: bytes, source: object) -> Golden:
    """Parse golden bytes, refusing anything oversized, corrupt or inconsistent with one line."""
    if len(data) > MAX_COMPRESSED:
        raise GoldenError(source, f"file is {len(data)} bytes, over the {MAX_COMPRESSED} byte cap")
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise GoldenError(source, "not a zstd frame (a golden is zstd-compressed safetensors)") from None
    size = params.content_size
    if size in (0, zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) or size > MAX_DECOMPRESSED:
        raise GoldenError(source, f"zstd frame declares {size} bytes of content; refusing (cap {MAX_DECOMPRESSED}, must be known)")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=MAX_DECOMPRESSED)
    except zstandard.ZstdError as exc:
        raise GoldenError(source, f"corrupt or truncated zstd data ({exc})") from None
    if len(raw) != size:
        raise GoldenError(source, f"decompressed {len(raw)} bytes but the frame declares {size}")
    metadata = _safetensors_metadata(raw, source)
    if METADATA_KEY not in metadata:
        raise GoldenError(source, f"safetensors metadata has no '{METADATA_KEY}' manifest")
    manifest = Manifest.from_json(metadata[METADATA_KEY], source)
    try:
        tensors = st_load(raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise GoldenError(source, f"malformed safetensors payload ({exc})") from None
    golden = Golden(manifest=manifest, tensors=tensors)
    if tensors_hash(tensors) != manifest.payload_hash:
        raise GoldenError(source, "payload hash mismatch: the tensors are not the ones recorded (corrupt or edited)")
    _check_tensor_set(golden, source)
    return golden


def _safetensors_metadata(raw: bytes, source: object) -> dict[str, str]:
    if len(raw) < 8:
        raise GoldenError(source, "safetensors payload shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > MAX_HEADER or 8 + header_len > len(raw):
        raise GoldenError(source, f"safetensors header of {header_len} bytes is oversized or past the end of the file")
    try:
        header = json.loads(raw[8 : 8 + header_len])
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise TypeError("__metadata__ is not an object")
    except (ValueError, TypeError, AttributeError) as exc:
        raise GoldenError(source, f"malformed safetensors header ({exc})") from None
    return metadata


def _check_tensor_set(golden: Golden, source: object) -> None:
    names = set(golden.tensors)
    for name in golden.manifest.tolerance:
        if name not in names:
            raise GoldenError(source, f"tensor {name!r} has a tolerance but is missing from the payload")
    for required in ("loss", "logits", "inputs.input_ids", "inputs.attention_mask", "inputs.position_ids", "inputs.labels"):
        if required not in names:
            raise GoldenError(source, f"required tensor {required!r} is missing")
    for name in names:
        if name.startswith("inputs.") or name.endswith((".experts", ".margin")):
            continue
        if name not in golden.manifest.tolerance:
            raise GoldenError(source, f"tensor {name!r} has no tolerance in the manifest (extra or hand-added)")
    if tensors_hash(golden.batch.tensors()) != golden.manifest.inputs_hash:
        raise GoldenError(source, "inputs hash mismatch: the stored batch is not the one the manifest describes")


def read(path: Path, root: Path | None = None) -> Golden:
    """Read and validate a golden file; if `root` is given, its key must match its path under root."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_COMPRESSED:
            raise GoldenError(path, f"file is {size} bytes, over the {MAX_COMPRESSED} byte cap")
        data = path.read_bytes()
    except FileNotFoundError:
        raise GoldenError(path, "no such file") from None
    except OSError as exc:
        raise GoldenError(path, f"cannot read ({exc.strerror})") from None
    golden = decode(data, path)
    golden.path = path
    if root is not None:
        try:
            relpath = path.resolve().relative_to(Path(root).resolve())
        except ValueError:
            raise GoldenError(path, f"not inside the goldens directory {root}") from None
        expected = GoldenKey.from_relpath(relpath)
        if golden.key != expected:
            raise GoldenError(path, f"manifest key {golden.key} disagrees with its path ({expected})")
    return golden


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
