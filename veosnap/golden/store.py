"""Where goldens live, and reading and writing them safely: the one reader and the one writer of golden files.

A goldens directory holds `<class>/<model>/<scenario>-<dtype>.safetensors.zst`. Every command (check,
verify, diff, show, ls, the pytest plugin) reads through `read` (or `load` for the bytes), which:

- never reads anything but a regular file (a FIFO, a device, a socket or a directory named like a golden
  is refused without blocking: opened with O_NONBLOCK, then fstat), and no more than the size cap;
- takes the key from the path as given (under `root`, or its last three parts), never from where a symlink
  leads: a symlink to another golden (cpu -> cuda-sm90, step -> train) is refused naming both, and under a
  goldens root nothing resolving outside it is read;
- checks the manifest's key against that key.

`scan` lists a root's goldens and reports (never reads) what is named like a golden but is not one.
Writes are atomic (temp file, fsync, rename), so a crash leaves the previous golden whole, and a write
under a goldens root never goes through a directory symlinked out of it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import GoldenError, VeosnapError
from .codec import MAX_COMPRESSED, Golden, decode, encode
from .codec import read_manifest as codec_read_manifest
from .manifest import Manifest
from .key import SUFFIX, GoldenKey

try:
    import fcntl
except ImportError:  # Windows: no stale-temp cleanup, writes are still atomic
    fcntl = None  # type: ignore[assignment]

STALE_TMP_SECONDS = 60
_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
          stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink"}


def not_regular(mode: int) -> str:
    """Why a file of this mode is never read as a golden ('' for a regular file)."""
    if stat.S_ISREG(mode):
        return ""
    return f"not a regular file ({_KINDS.get(stat.S_IFMT(mode), 'special file')}); a golden is a regular file"


def write(golden: Golden, path: Path, root: Path | None = None) -> None:
    """Write a golden atomically: a reader sees the old file or the new one, never a torn one."""
    write_bytes(encode(golden), path, root)


def write_bytes(data: bytes, path: Path, root: Path | None = None) -> None:
    """Atomically replace `path` with `data` (temp file in the same directory, fsync, rename).

    With `root` (the goldens directory), `path` must lie under it and no directory between them may be a
    symlink: nothing is ever written through a link out of the goldens directory, or into another model's.
    The temp file is locked while it is written, so the next writer can tell a temp file left by a
    killed writer (unlocked, old) from one still being written, and removes only the former.
    """
    path = Path(path)
    if root is not None:
        check_writable(path, Path(root))
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


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """An exclusive lock on a goldens directory for a read-change-write of a golden in it (`refresh`): a second
    refresh waits for the first, then reads what it wrote and appends its own approval, instead of both
    reading the old golden and the last write dropping the other's approval. An advisory lock on the
    directory itself (no lock file is left behind); without fcntl (Windows), no lock."""
    if fcntl is None:
        yield
        return
    try:
        Path(root).mkdir(parents=True, exist_ok=True)  # a first refresh creates it, as its write would
        fd = os.open(root, os.O_RDONLY)
    except OSError as exc:
        raise GoldenError(root, f"cannot lock the goldens directory ({exc.strerror or exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def check_writable(path: Path, root: Path) -> None:
    """Refuse to write `path` unless it lies under `root` with no directory between them a symlink."""
    try:
        rel = path.parent.relative_to(root)
    except ValueError:
        raise GoldenError(path, f"not under the goldens directory {root}") from None
    here = root
    for part in rel.parts:
        here = here / part
        if here.is_symlink():
            target = here.resolve()
            where = (f"outside the goldens directory {root}" if not _inside(target, root)
                     else "another directory of the goldens directory")
            raise GoldenError(path, f"cannot write through {here.relative_to(root)}, a symlink to {target} {where}")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(Path(root).resolve())
        return True
    except ValueError:
        return False


def remove(path: Path, root: Path) -> None:
    """Delete a golden under `root` (never through a directory symlinked out of it)."""
    check_writable(Path(path), Path(root))
    Path(path).unlink(missing_ok=True)
    try:
        Path(path).parent.rmdir()  # the model's directory, once it holds no golden
    except OSError:
        pass


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


def _open_regular(path: Path) -> int:
    """A read-only descriptor of `path` when it is a regular file; anything else is refused without blocking.

    Opened with O_NONBLOCK (a FIFO without a writer does not hang the open) and checked with fstat on
    the open descriptor, so what is read is what was checked.
    """
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):  # opening a socket fails with an unhelpful ENXIO
            raise GoldenError(path, not_regular(stat.S_IFSOCK))
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise GoldenError(path, "no such file") from None
    except OSError as exc:
        cause = not_regular(stat.S_IFSOCK) if exc.errno == errno.ENXIO else f"cannot read ({exc.strerror or exc})"
        raise GoldenError(path, cause) from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise GoldenError(path, f"cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise GoldenError(path, not_regular(mode))
    return fd


def read_file(path: Path, cap: int = MAX_COMPRESSED) -> bytes:
    """A regular file's bytes, at most `cap` + 1 of them; anything else is refused without blocking
    (`_open_regular`)."""
    fd = _open_regular(path)
    try:
        info = os.fstat(fd)
        if info.st_size > cap:
            raise GoldenError(path, f"file is over the {cap} byte cap")
        chunks, size = [], 0
        # The whole file in one read (one copy out of the page cache, and no join of chunks: a golden
        # is read on a check's critical path), then 1 MiB at a time for anything beyond the size seen.
        want = info.st_size + 1
        while size <= cap:
            chunk = os.read(fd, min(want, cap + 1 - size))
            want = 1 << 20
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise GoldenError(path, f"cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def key_of(path: Path, root: Path | None = None) -> GoldenKey | None:
    """The key a path names, as given (symlinks not followed): under `root`, else its last three parts;
    None when it names none."""
    path = Path(path)
    try:
        if root is not None:
            return GoldenKey.from_relpath(Path(os.path.normpath(path)).relative_to(os.path.normpath(root)))
        return GoldenKey.from_relpath(Path(*path.parts[-3:])) if len(path.parts) >= 3 else None
    except (ValueError, VeosnapError):
        return None


def problem(path: Path, root: Path | None = None) -> str:
    """Why the file at `path` is not the golden its path names, before reading it ('' when nothing is wrong).

    Under `root`: it must name a key there and resolve inside it, to the file of that same key. Anywhere:
    a symlink leading to a file named as another golden is refused.
    """
    path = Path(path)
    expected = key_of(path, root)
    target = path.resolve()
    linked = "is a symlink to" if path.is_symlink() else "resolves to"
    if root is not None:
        if expected is None:
            return f"not a golden path under {root} (<class>/<model>/<scenario>-<dtype>{SUFFIX})"
        if not _inside(target, root):
            return f"resolves to {target}, outside the goldens directory {root}"
        landed = key_of(target, Path(root).resolve())
    else:
        landed = key_of(target)
        if expected is None or landed is None:
            return ""
    if landed != expected:
        named = f" ({landed})" if landed is not None else ""
        return f"{linked} {target}{named}, another golden than its path names ({expected})"
    return ""


def load(path: Path, root: Path | None = None) -> bytes:
    """The bytes of the golden at `path` (see `problem`), refusing anything that is not one without reading it."""
    why = problem(path, root)
    if why:
        raise GoldenError(path, why)
    return read_file(path)


def read_manifest(path: Path, root: Path | None = None) -> Manifest:
    """The manifest of the golden at `path`, reading only the head of the file (`codec.read_manifest`): for
    listings. The same refusals as `load` before anything is read; its key is checked against the path's."""
    why = problem(path, root)
    if why:
        raise GoldenError(path, why)
    with os.fdopen(_open_regular(path), "rb") as fh:
        manifest = codec_read_manifest(fh, path)
    expected = key_of(path, root)
    if expected is not None and manifest.key != expected:
        raise GoldenError(path, f"manifest key {manifest.key} disagrees with its path ({expected})")
    return manifest


def check_key(golden: Golden, expected: GoldenKey | None, source: object) -> Golden:
    """`golden`, if its manifest's key is the one its place names."""
    if expected is not None and golden.key != expected:
        raise GoldenError(source, f"manifest key {golden.key} disagrees with its path ({expected})")
    return golden


def decode_at(data: bytes, path: Path, root: Path | None = None) -> Golden:
    """Golden bytes read from `path`, decoded, with the manifest's key checked against the path's."""
    golden = check_key(decode(data, path), key_of(path, root), path)
    golden.path = Path(path)
    return golden


def read(path: Path, root: Path | None = None) -> Golden:
    """Read and validate the golden at `path`: the one reader (see the module docstring)."""
    return decode_at(load(path, root), path, root)


def path_for(root: Path, key: GoldenKey) -> Path:
    """Where the golden for `key` lives under `root` (always inside `root`)."""
    return Path(root) / key.relpath


@dataclass(frozen=True)
class Entry:
    """A file named like a golden under a goldens root; `problem` says why it is not one ('' when it is)."""

    key: GoldenKey
    path: Path
    problem: str = ""


@dataclass(frozen=True)
class Scan:
    """What a goldens root holds: goldens, and entries named like goldens that are not (never read)."""

    entries: list[Entry]

    @property
    def goldens(self) -> list[tuple[GoldenKey, Path]]:
        return [(e.key, e.path) for e in self.entries if not e.problem]

    @property
    def skipped(self) -> list[tuple[Path, str]]:
        return [(e.path, e.problem) for e in self.entries if e.problem]


def _listdir(path: Path, strict: bool) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError as exc:
        if strict:
            raise VeosnapError(f"{path}: cannot read ({exc.strerror or exc})") from None
        return []


def scan(root: Path, strict: bool = False) -> Scan:
    """Every file named `<class>/<model>/<scenario>-<dtype>.safetensors.zst` under `root`, without reading any.

    A golden is a regular file whose path resolves inside `root` to itself (no link to another key or out
    of the root). With `strict`, an unreadable root is an error instead of an empty scan.
    """
    root = Path(root)
    entries = []
    for cls in _listdir(root, strict):
        if not cls.is_dir():
            continue
        for model in _listdir(root / cls.name, False):
            if not model.is_dir():
                continue
            for file in _listdir(root / cls.name / model.name, False):
                path = root / cls.name / model.name / file.name
                key = key_of(path, root)
                if key is None:
                    continue  # not named like a golden (a README, a temp file)
                why = problem(path, root)
                if not why:
                    try:
                        why = not_regular(os.stat(path).st_mode)
                    except OSError as exc:
                        why = f"cannot read ({exc.strerror or exc})"
                entries.append(Entry(key, path, why))
    return Scan(entries)


def list_goldens(root: Path) -> list[tuple[GoldenKey, Path]]:
    """Every golden file under `root`, by key (entries that are not goldens left out: see `scan`)."""
    return scan(root).goldens
