"""Reading a golden on a thread while a check gets ready (issue 10: veosnap's fixed host cost).

A check needs little of its golden before the candidate has run: the manifest (key, config hash, seed,
tolerances, sketch specs) and the batch. `read(path, root)` reads the file, decodes that head at once
(the safetensors header, which holds the manifest, and the `inputs.*` tensors, which the writer puts
first: safetensors stores int64 tensors before floats), and hands the full decode (`store.decode_at`:
decompress, parse, hashes, every validation) to a thread. zstd and hashlib release the GIL, so the
decode runs while the model is built and the candidate runs. The result is a `PendingGolden`: a
`Golden` whose manifest and inputs are there now, and whose `tensors` and `sketches` wait for the
thread on first use (`result()` waits explicitly).

Nothing is trusted early that the reader has not checked: the head's manifest passes `Manifest.from_json`
(its own hash) and the path's key, the stored tensor names the reader's checks on names
(`codec.check_stored_names`: no tensor missing or extra, sketch parts as listed), and its inputs the
reader's input checks (`codec.check_inputs`, which include the manifest's inputs hash). Any problem with the head, of any kind, is not reported
from the head: the caller gets the full decode (waited for), so every error is the reader's own
one-line `GoldenError` naming the file. A failure in the thread surfaces on the waiting thread: a
`GoldenError` as it is (through `advise`, which lets the caller add its project's fix), any other
exception as a `GoldenError` naming the file and the exception; the thread always ends, so waiting
never hangs.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard

from ..errors import GoldenError, VeosnapError, describe
from . import names, store
from .codec import METADATA_KEY, Golden, check_inputs, check_stored_names
from .limits import MAX_HEADER, check_limits
from .manifest import Manifest
from .sketches import split_name

# safetensors dtypes an input tensor may have (the token grids are int64; anything else waits for the decode).
_DTYPES = {"I64": torch.int64, "I32": torch.int32, "F32": torch.float32, "BF16": torch.bfloat16,
           "F16": torch.float16, "BOOL": torch.bool, "U8": torch.uint8}


class _Decode:
    """The full decode of one golden's bytes on a daemon thread; `result()` waits for it."""

    def __init__(self, data: bytes, path: Path, root: Path | None, advise: Callable[[GoldenError], GoldenError]):
        self.path, self.advise = path, advise
        self.golden: Golden | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(data, root), name=f"veosnap-decode {path.name}",
                                       daemon=True)
        self.started = False

    def start(self) -> None:
        """Start the decode (once); `result` starts one not started yet."""
        if not self.started:
            self.started = True
            self.thread.start()

    def _run(self, data: bytes, root: Path | None) -> None:
        try:
            self.golden = store.decode_at(data, self.path, root)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the waiting thread, never lost
            self.error = exc

    def result(self) -> Golden:
        self.start()
        self.thread.join()
        if isinstance(self.error, GoldenError):
            raise self.advise(self.error) from None
        if self.error is not None:
            raise GoldenError(self.path, f"cannot be decoded ({describe(self.error)})") from None
        assert self.golden is not None
        return self.golden


class PendingGolden(Golden):
    """A golden whose manifest and inputs are read and whose other tensors are still being decoded.

    Everything a `Golden` answers it answers; `tensors`, `sketches` (and what reads them) wait for the
    decode and raise its error, if any. Not a dataclass instance of its own: it is never written.
    """

    def __init__(self, manifest: Manifest, path: Path, inputs: dict[str, torch.Tensor], stored: frozenset[str],
                 decode: _Decode) -> None:
        # The dataclass __init__ is not called: `tensors` and `sketches` are the decode's.
        self.manifest, self.path = manifest, path
        self._inputs, self._stored, self._decode = inputs, stored, decode
        self._decoded: Golden | None = None  # once the thread has given it: a check reads its tensors hundreds of times

    def start(self) -> None:
        """Start decoding the tensors on the thread, now (the first use of them starts it otherwise)."""
        self._decode.start()

    def result(self) -> Golden:
        """The decoded golden (waits for the thread, started if it was not); raises its `GoldenError`."""
        if self._decoded is None:
            self._decoded = self._decode.result()
        return self._decoded

    @property
    def tensors(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self.result().tensors

    @property
    def sketches(self) -> dict:  # type: ignore[override]
        return self.result().sketches

    def inputs(self) -> dict[str, torch.Tensor]:
        return {names.parse(name).field: t for name, t in self._inputs.items()}

    def held_names(self) -> set[str]:
        sketched = set() if self.manifest.sketch is None else set(self.manifest.sketch.tensors)
        return {name for name in self._stored if split_name(name) is None} | sketched

    def route_layers(self) -> list[int]:
        return sorted(parsed.layer for name in self._stored
                      if isinstance(parsed := names.try_parse(name), names.Route) and parsed.part == "experts")


@contextmanager
def errors_after(golden: Golden) -> Iterator[None]:
    """Inside: a `VeosnapError` raised while `golden` may still be decoding waits for the decode, and
    the decode's own error, if any, is raised instead (a corrupt golden is refused as corrupt, as the
    serial reader would have refused it first, whatever else was found meanwhile)."""
    try:
        yield
    except VeosnapError:
        if isinstance(golden, PendingGolden):
            golden.result()
        raise


def read(path: Path, root: Path | None = None,
         advise: Callable[[GoldenError], GoldenError] = lambda exc: exc, start: bool = True) -> Golden:
    """The golden at `path` as `store.read` gives it, decoded on a thread: a `PendingGolden` when its
    head is sound, else the decoded golden (or the reader's error). `advise` maps the reader's errors
    (the caller's fix added), here and from the thread alike. `start=False`: the thread starts at
    `PendingGolden.start()` or the first use of the tensors (a check starts it once its own setup is done:
    the decode's Python parse would otherwise take the GIL from that setup, and the decode has the whole
    model build to run in)."""
    path = Path(path)
    try:
        data = store.load(path, root)
    except GoldenError as exc:
        raise advise(exc) from None
    decode = _Decode(data, path, root, advise)
    head = _head(data, path, root)
    if head is None:
        return decode.result()
    manifest, inputs, stored = head
    pending = PendingGolden(manifest, path, inputs, stored, decode)
    if start:
        pending.start()
    return pending


Head = tuple[Manifest, dict[str, torch.Tensor], frozenset[str]]  # the manifest, the inputs, the stored names


def _head(data: bytes, path: Path, root: Path | None) -> Head | None:
    """The manifest, the input tensors and the stored tensor names, decompressing only up to the inputs'
    end; None on any problem (the full decode then says what it is)."""
    try:
        check_limits(data, path)
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        header = _header(reader)
        if header is None:
            return None
        manifest = Manifest.from_json(header["__metadata__"][METADATA_KEY], path)
        expected = store.key_of(path, root)
        if expected is not None and manifest.key != expected:
            return None
        entries = {name: info for name, info in header.items() if name != "__metadata__"}
        wanted = {name: info for name, info in entries.items() if isinstance(names.try_parse(name), names.Input)}
        if not wanted:
            return None
        body = _read_exact(reader, max(info["data_offsets"][1] for info in wanted.values()))
        inputs = {}
        for name, info in wanted.items():
            start, end = info["data_offsets"]
            tensor = torch.frombuffer(bytearray(body[start:end]), dtype=_DTYPES[info["dtype"]]) if end > start \
                else torch.empty(0, dtype=_DTYPES[info["dtype"]])
            inputs[name] = tensor.reshape(info["shape"])
        check_stored_names(manifest, set(entries), path)
        check_inputs(inputs, manifest, path)
        return manifest, inputs, frozenset(entries)
    except Exception:  # noqa: BLE001 - the head is a shortcut: the full decode names any problem
        return None


@dataclass(frozen=True)
class Peek:
    """What a golden's header declares about the model to build for it: a hint (see `peek`)."""

    seed: int  # the reference's weight seed
    config_hash: str
    tokens: int  # the batch's token slots, rows x positions


# Peeks by the path asked, the goldens directory and the file's identity (device, inode, size, modification and
# change times): a pytest session checks one golden under many backends and layouts, and each check's peek read
# and parsed its header again, a millisecond on the build's path. A kept peek is found by a stat alone, before the
# path's checks (`store.problem`, 0.3-0.7 ms): the same path to the same unchanged file passed them when it was
# kept (a rename or a new link changes the file's change time). A file written since is another key; a few
# goldens a session, so the table stays small.
_PEEKED: dict[tuple, Peek] = {}
_PEEKED_MAX = 256


def peek(path: Path, root: Path | None = None) -> Peek | None:
    """The weight seed, config hash and batch size the golden at `path` declares, from its header alone, or None
    when they cannot be read. Only a hint for work started early (a check builds its model while the golden is
    read: `reference.prebuild`): nothing is checked, not even the manifest's own hash (parsing and hashing
    the whole manifest took milliseconds at 1B parameters, before the build could start), and a check
    still reads and validates the golden in full, in its turn, before anything it built is used. The same file,
    unchanged, is read once a process."""
    try:
        kept = _PEEKED.get(_identity(path, root, os.stat(path)))
        if kept is not None:
            return kept
        if store.problem(path, root):
            return None
        with os.fdopen(store._open_regular(path), "rb") as fh:  # a FIFO or device is refused, never waited on
            identity = _identity(path, root, os.fstat(fh.fileno()))
            header = _header(zstandard.ZstdDecompressor().stream_reader(fh))
        if header is None:
            return None
        manifest = json.loads(header["__metadata__"][METADATA_KEY])
        seed, config_hash = manifest["reference"]["seed"], manifest["config_hash"]
        rows, width = header[str(names.Input("input_ids"))]["shape"]
        if type(seed) is not int or not isinstance(config_hash, str):
            return None
        peeked = Peek(seed, config_hash, int(rows) * int(width))
        if len(_PEEKED) >= _PEEKED_MAX:
            _PEEKED.clear()
        _PEEKED[identity] = peeked
        return peeked
    except Exception:  # noqa: BLE001 - a hint: the full read names any problem
        return None


def _identity(path: Path, root: Path | None, st: os.stat_result) -> tuple:
    return str(path), str(root), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _header(reader: zstandard.ZstdDecompressionReader) -> dict | None:
    """The safetensors header (JSON) a golden's decompressed bytes start with; None over the reader's cap."""
    (header_len,) = struct.unpack("<Q", _read_exact(reader, 8))
    if header_len > MAX_HEADER:
        return None
    return json.loads(_read_exact(reader, header_len))


def _read_exact(reader: zstandard.ZstdDecompressionReader, n: int) -> bytes:
    out = reader.read(n)
    while len(out) < n:
        more = reader.read(n - len(out))
        if not more:
            raise ValueError("the payload ends early")
        out += more
    return out
