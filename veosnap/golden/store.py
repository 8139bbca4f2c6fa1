"""Where goldens live, and reading and writing them safely.

A goldens directory holds `<class>/<model>/<scenario>-<dtype>.safetensors.zst`. Writes are atomic
(temp file, fsync, rename), so a crash leaves the previous golden whole; reads are capped, and a
golden read under a goldens directory must lie inside it and carry the key its path names.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..errors import GoldenError, VeosnapError
from .codec import MAX_COMPRESSED, Golden, decode, encode
from .key import SUFFIX, GoldenKey

try:
    import fcntl
except ImportError:  # Windows: no stale-temp cleanup, writes are still atomic
    fcntl = None  # type: ignore[assignment]

STALE_TMP_SECONDS = 60


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
