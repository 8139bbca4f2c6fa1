"""A syrupy extension whose snapshot is a golden file.

syrupy stores a snapshot next to the test that asserts it; a golden is shared by every test that
checks a backend on that (hardware class, model, scenario, dtype), so it lives in the goldens
directory under the path `veosnap record` writes. The pieces, in syrupy's terms:

- storage: the snapshot named `cpu/llama/step-float32` is `<goldens>/cpu/llama/step-float32.safetensors.zst`,
  read and written through veosnap's one reader and writer (`golden.store`: a regular file only, the key
  from its path, atomic writes never through a directory linked out of the goldens), never syrupy's;
- serializer: the asserted value is a `Recording` (golden bytes just built from the HF eager
  reference) or a `CandidateCheck` (a backend under a layout, to check), passed through as is;
- comparator: a recording matches when its bytes are the stored bytes; a candidate matches when
  veosnap's tolerance-aware check against the stored golden passes;
- reporter: the diff lines are veosnap's report rows.

Unused goldens are not discovered through syrupy (its rules tie a snapshot to the test file that
owns it); the pytest plugin accounts for them itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from syrupy.data import Snapshot, SnapshotCollection, SnapshotCollections
from syrupy.extensions.base import AbstractSyrupyExtension

from ..golden.key import SUFFIX, GoldenKey  # no torch: the plugin stays cheap to load

if TYPE_CHECKING:
    from syrupy.location import PyTestLocation

    from ..candidates.backends import Backend
    from ..reference.zoo import Project
    from ..runs.verdict import CheckReport

REPORT_WIDTH = 200  # wide enough that pytest's "E   " prefix does not fold the table's rows


@dataclass
class Recording:
    """The golden for `key` as just recorded from the reference: its file bytes."""

    key: GoldenKey
    data: bytes

    def matches(self, stored: bytes, path: Path) -> bool:
        return stored == self.data

    def diff_lines(self, stored: bytes | None) -> Iterator[str]:
        yield f"the reference run for {self.key} does not reproduce the stored golden byte for byte"


@dataclass
class CandidateCheck:
    """A backend under a layout (a SPEC; None: single) to check against the golden for `key`; holds the
    report once checked."""

    project: Project
    key: GoldenKey
    backend: Backend
    layout: str | None = None
    report: CheckReport | None = field(default=None, repr=False)
    missing: str = ""  # set by the plugin: how to record the golden when it does not exist
    isolate: bool = False  # a low-precision real-shape golden's layers checked in isolation too (`check`)

    def matches(self, stored: bytes, path: Path) -> bool:
        from ..golden import store
        from ..runs.check import check

        gold = store.decode_at(stored, path, self.project.goldens)
        self.report = check(self.project, self.key, self.backend, self.layout or "single", gold=gold,
                            isolate=self.isolate)
        return self.report.passed

    def diff_lines(self, stored: bytes | None) -> Iterator[str]:
        from ..render.text import checks

        if self.report is None:
            yield self.missing or f"no golden for {self.key}"
            return
        yield from checks([self.report], width=REPORT_WIDTH).rstrip("\n").splitlines()


class GoldenExtension(AbstractSyrupyExtension):
    """Snapshots are golden files under `goldens`; bind a directory with `GoldenExtension.at(dir)`."""

    goldens: ClassVar[Path] = Path("goldens")
    file_extension = SUFFIX.lstrip(".")
    # One golden per file, written as soon as it is recorded: buffering whole goldens until the
    # session ends would only hold them in memory.
    write_immediately = True

    @classmethod
    def at(cls, goldens: Path) -> type[GoldenExtension]:
        """This extension bound to a goldens directory (syrupy instantiates extension classes itself)."""
        return type(cls.__name__, (cls,), {"goldens": Path(goldens), "__module__": cls.__module__})

    # serializer: the asserted object carries everything the comparison needs
    def serialize(self, data: Any, **_: Any) -> Any:
        if not isinstance(data, (Recording, CandidateCheck)):
            raise TypeError(f"a golden is compared with a Recording or a CandidateCheck, not {type(data).__name__}")
        return data

    # storage
    @classmethod
    def get_snapshot_name(cls, *, test_location: PyTestLocation, index: Any = 0) -> str:
        return str(index)

    @classmethod
    def get_location(cls, *, test_location: PyTestLocation, index: Any) -> str:
        return str(cls.goldens / GoldenKey.from_name(str(index)).relpath)

    @classmethod
    def dirname(cls, *, test_location: PyTestLocation) -> str:
        return str(cls.goldens)

    def discover_snapshots(self, *, test_location: PyTestLocation, ignore_extensions: list[str] | None = None
                           ) -> SnapshotCollections:
        # A golden belongs to no single test file; the plugin reports unused goldens itself.
        return SnapshotCollections()

    def read_snapshot_collection(self, *, snapshot_location: str) -> SnapshotCollection:
        collection = SnapshotCollection(location=snapshot_location)
        relpath = Path(snapshot_location).relative_to(self.goldens)
        collection.add(Snapshot(name=str(GoldenKey.from_relpath(relpath))))
        return collection

    def read_snapshot_data_from_location(self, *, snapshot_location: str, snapshot_name: str, session_id: str
                                         ) -> bytes | None:
        import os

        from ..golden import store

        if not os.path.lexists(snapshot_location):
            return None
        return store.load(Path(snapshot_location), self.goldens)

    @classmethod
    def write_snapshot(cls, *, snapshot_location: str, snapshots: list[tuple[Any, Any, Any]],
                       name_order: dict[str, int] | None = None) -> None:
        # syrupy's version warns when a snapshot's name does not relate to the test that wrote it;
        # a golden's name is its key, shared by many tests, so that check does not apply.
        collection = SnapshotCollection(location=snapshot_location)
        for data, _test_location, index in snapshots:
            collection.add(Snapshot(name=str(index), data=data))
        cls.write_snapshot_collection(snapshot_collection=collection, name_order=name_order)

    @classmethod
    def write_snapshot_collection(cls, *, snapshot_collection: SnapshotCollection,
                                  name_order: dict[str, int] | None = None) -> None:
        from ..golden import store

        for snapshot in snapshot_collection:
            data = snapshot.data.data if isinstance(snapshot.data, Recording) else snapshot.data
            if not isinstance(data, bytes):  # only the reference's recording is ever written
                raise TypeError(f"refusing to write {type(snapshot.data).__name__} as a golden")
            store.write_bytes(data, Path(snapshot_collection.location), cls.goldens)

    def delete_snapshots(self, *, snapshot_location: str, snapshot_names: set[str]) -> None:
        from ..golden import store

        store.remove(Path(snapshot_location), self.goldens)

    # comparator and reporter
    def matches(self, *, serialized_data: Any, snapshot_data: Any) -> bool:
        return bool(serialized_data.matches(snapshot_data, Path(self.get_location_for(serialized_data))))

    def get_location_for(self, data: Recording | CandidateCheck) -> str:
        return str(self.goldens / data.key.recorded.relpath)

    def diff_lines(self, serialized_data: Any, snapshot_data: Any) -> Iterator[str]:
        yield from serialized_data.diff_lines(snapshot_data or None)
