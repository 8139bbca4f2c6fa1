"""The veosnap pytest plugin: `pytest` checks backends against goldens, `pytest --snapshot-update` records them.

Registered through the `pytest11` entry point, built on syrupy (see `golden_snapshot`):

    def test_my_moe(veosnap_check):
        veosnap_check("qwen3_moe", backend="mypkg.kernels:patch", dtype="float32")

Every `veosnap_check` is a syrupy assertion against the golden for (hardware class, model, scenario,
dtype). Under `--snapshot-update` the golden is first re-recorded from the HF eager reference, in a fresh
process (the tests of this session may have patched anything), and written only when its bytes change
(a golden with an approval trail keeps it, or is refused); the backend is then still checked and its
output is never written. Unused goldens (in the selected goldens directory, of the hardware class,
scenarios and dtypes the run used, used by no test of a full run) are reported the way syrupy reports
unused snapshots, and deleted only with `--snapshot-update --veosnap-delete-unused`, each one listed.

The project's directories default to `<root>/goldens` etc. where present (goldens: also when `<root>`
has its own toy_configs/, and whenever recording), else veosnap's bundled zoo; `<root>` is pytest's
rootdir as it would be without veosnap's own options: pytest settles its rootdir before this plugin is
loaded, so `--veosnap-configs DIR` (space-separated) would otherwise make DIR's tree the project.
`--veosnap-html DIR` writes one HTML page per failing check.

Nothing here imports torch until a test asks for veosnap, so the plugin costs nothing to projects
that merely have veosnap installed.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

from .golden_snapshot import CandidateCheck, GoldenExtension, Recording

if TYPE_CHECKING:
    from syrupy.assertion import SnapshotAssertion

    from ..golden.key import GoldenKey
    from ..reference.zoo import Project
    from ..runs.verdict import CheckReport

FIXTURES = ("veosnap_check",)
REFERENCE_BACKEND = "eager"
_MATRIX_MARK = "veosnap_matrix"
_WORKER_KEY = "veosnap"
_EXIT_UNUSED = 1  # syrupy's EXIT_STATUS_FAIL_UNUSED


class GoldenMismatch(AssertionError):
    """A check failed; `report` is veosnap's CheckReport (None when the golden does not exist)."""

    def __init__(self, message: str, report: CheckReport | None = None) -> None:
        super().__init__(message)
        self.report = report


def matrix(models: list[str] | None = None, dtypes: list[str] | None = None, backends: list[str] | None = None,
           layouts: list[str] | None = None, tier: str = "toy") -> pytest.MarkDecorator:
    """Parametrize a test's `model`, `dtype`, `backend` (and `layout`) arguments over every combination.

    `models=None`: every model of `tier` in the configs directory (`toy`, the default; `real`: the
    real-shape configs; `all`); `dtypes=None`: float32 and bfloat16; `backends=None`: the reference
    (`eager`). Only the arguments the test names are parametrized.
    """
    return getattr(pytest.mark, _MATRIX_MARK)(models=models, dtypes=dtypes, backends=backends, layouts=layouts,
                                              tier=tier)


# --- options -----------------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("veosnap", "veosnap goldens (pytest --snapshot-update records them)")
    group.addoption("--veosnap-hardware-class", metavar="CLASS", default=None,
                    help="hardware class whose goldens are checked: cpu or cuda-sm<NN> "
                         "(default: $VEOSNAP_HARDWARE_CLASS, else this machine's)")
    for kind, what in (("goldens", "goldens"), ("configs", "toy configs"), ("testdata", "test data")):
        group.addoption(f"--veosnap-{kind}", metavar="DIR", default=None,
                        help=f"{what} directory (default: ini veosnap_{kind}, else <rootdir>/"
                             f"{'toy_configs' if kind == 'configs' else kind} if present, else veosnap's bundled zoo)")
        parser.addini(f"veosnap_{kind}", f"veosnap {what} directory, relative to the ini file", default=None)
    group.addoption("--veosnap-delete-unused", action="store_true", default=False,
                    help="with --snapshot-update: delete unused goldens (of the hardware class, scenarios and dtypes "
                         "the run used), listing each one")
    group.addoption("--veosnap-html", metavar="DIR", default=None,
                    help="write one self-contained HTML page per failing veosnap check into DIR, named after the "
                         "test's node id")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{_MATRIX_MARK}(models, dtypes, backends, layouts): veosnap check matrix "
                                       "(use veosnap.surfaces.pytest_plugin.matrix)")
    if config.getoption("veosnap_delete_unused") and not getattr(config.option, "update_snapshots", False):
        raise pytest.UsageError("veosnap: --veosnap-delete-unused goes with --snapshot-update")
    html = config.getoption("veosnap_html", None)
    if html and (config.invocation_params.dir / html).exists() and not (config.invocation_params.dir / html).is_dir():
        raise pytest.UsageError(f"veosnap: --veosnap-html {html}: not a directory")
    state = VeosnapSession(config)
    config.stash[_STATE] = state
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistController(state), "veosnap-xdist")


# --- session state -----------------------------------------------------------------------------

@dataclass
class _Outcome:
    """What this process (or, merged, the whole run) did with goldens."""

    used: set[str] = field(default_factory=set)  # golden keys some check asked for
    reached: set[str] = field(default_factory=set)  # node ids whose veosnap check ran
    items: set[str] = field(default_factory=set)  # selected node ids that request a veosnap fixture
    recorded: set[str] = field(default_factory=set)  # goldens recorded from the reference (in a fresh process)
    written: set[str] = field(default_factory=set)  # ... of which the bytes changed (created or updated)
    candidates: int = 0  # candidate checks run under --snapshot-update
    not_recordable: str = ""
    checks: int = 0  # candidate checks that ran to a report
    drifted: int = 0  # ... on other versions than their golden's provenance
    versions: set[str] = field(default_factory=set)  # those differences, said once at the end

    def to_wire(self) -> dict[str, Any]:
        return {"used": sorted(self.used), "reached": sorted(self.reached), "items": sorted(self.items),
                "recorded": sorted(self.recorded), "written": sorted(self.written),
                "candidates": self.candidates, "not_recordable": self.not_recordable,
                "checks": self.checks, "drifted": self.drifted, "versions": sorted(self.versions)}

    def merge_wire(self, data: dict[str, Any]) -> None:
        for name in ("used", "reached", "items", "recorded", "written", "versions"):
            getattr(self, name).update(data.get(name, ()))
        for name in ("candidates", "checks", "drifted"):
            setattr(self, name, getattr(self, name) + int(data.get(name, 0)))
        self.not_recordable = self.not_recordable or data.get("not_recordable", "")


@dataclass
class Unused:
    """The verdict on unused goldens at the end of a run."""

    goldens: list[tuple[str, Path]]  # (key, path) of goldens no check used
    deleted: bool = False
    kept: bool = False  # under --snapshot-update without --veosnap-delete-unused
    undecided: str = ""  # why unused goldens could not be told apart from goldens of tests that did not run


class VeosnapSession:
    """Per pytest session: resolved directories, recordings made, goldens used."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.outcome = _Outcome()
        self.worker_reports: list[dict[str, Any]] = []
        self.workers_down = 0
        self.unused: Unused | None = None
        self._project: Project | None = None
        self._extension: type[GoldenExtension] | None = None
        self._recordings: dict[str, bytes] = {}
        self._recorder: Any = None  # runs.isolated.FreshRecorder, started on the first recording
        self._root: Path | None = None

    # directories and hardware class, resolved on first use (resolving the class imports torch)
    @property
    def update(self) -> bool:
        return bool(getattr(self.config.option, "update_snapshots", False))

    @property
    def update_new_only(self) -> bool:
        return bool(getattr(self.config.option, "update_new_snapshots_only", False))

    @property
    def root(self) -> Path:
        """The project's root: pytest's rootdir, unless pytest took it from a veosnap option's value."""
        if self._root is None:
            self._root = _project_root(self.config)
        return self._root

    def directory(self, kind: str) -> Path | None:
        """The flag, else the ini value, else `<root>/<kind>` if it exists; None: veosnap's default."""
        flag = self.config.getoption(f"veosnap_{kind}")
        if flag:
            return (self.config.invocation_params.dir / flag).resolve()
        ini = self.config.getini(f"veosnap_{kind}")
        if ini:
            base = self.config.inipath.parent if self.config.inipath and self.root == self.config.rootpath \
                else self.root
            return (base / str(ini)).resolve()
        local = self.root / ("toy_configs" if kind == "configs" else kind)
        # The goldens rule of `zoo.default_goldens`, from the root: a project's goldens are its own (it has
        # goldens/ or toy_configs/), and --snapshot-update records into the project, never the bundled zoo.
        project = (self.root / "toy_configs").is_dir()
        if local.is_dir() or (kind == "goldens" and (self.update or self.update_new_only or project)):
            return local
        return None

    @property
    def project(self) -> Project:
        if self._project is None:
            from ..errors import VeosnapError
            from ..reference.zoo import Project

            try:
                self._project = Project.resolve(
                    goldens=self.directory("goldens"), configs=self.directory("configs"),
                    testdata=self.directory("testdata"),
                    hardware_class=self.config.getoption("veosnap_hardware_class"),
                )
            except VeosnapError as exc:
                raise pytest.UsageError(f"veosnap: {exc}") from None
        return self._project

    @property
    def extension(self) -> type[GoldenExtension]:
        if self._extension is None:
            self._extension = GoldenExtension.at(self.project.goldens)
        return self._extension

    def class_has_goldens(self) -> bool:
        root = self.project.goldens / self.project.hardware_class
        return root.is_dir() and any(root.glob("*/*.safetensors.zst"))

    def recording(self, key: GoldenKey) -> bytes:
        """The golden for `key` as the reference records it now, in a fresh process (once per process and
        key), carrying the stored golden's approval trail (refused if it would change a trailed golden)."""
        from dataclasses import replace

        from ..golden import codec
        from ..runs.isolated import FreshRecorder
        from ..runs.record import stored_bytes

        name = str(key)
        if name not in self._recordings:
            if self._recorder is None:
                self._recorder = FreshRecorder()
            # Sketch mode auto (large models' goldens stay bounded), certified as `veosnap record` certifies
            # (in the same fresh process); stored_bytes runs the reader's checks.
            fresh = codec.decode(self._recorder.record(self.project, key, sketch="auto"),
                                 f"the fresh recording of {key}")
            fresh.manifest = replace(fresh.manifest, reference=replace(
                fresh.manifest.reference, sensitivity=self._recorder.certify(self.project, fresh)))
            self._recordings[name], _ = stored_bytes(self.project, fresh)
        return self._recordings[name]

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None

    def assertion(self, request: pytest.FixtureRequest, update: bool) -> SnapshotAssertion:
        from syrupy.assertion import SnapshotAssertion
        from syrupy.location import PyTestLocation

        syrupy_session = getattr(self.config, "_syrupy", None)
        if syrupy_session is None:
            raise pytest.UsageError("veosnap: the syrupy plugin is not active (was it disabled with -p no:syrupy?)")
        return SnapshotAssertion(update_snapshots=update, extension_class=self.extension,
                                 test_location=PyTestLocation(request.node), session=syrupy_session)

    # --- the check -----------------------------------------------------------------------------
    def check(self, request: pytest.FixtureRequest, model: str, backend: str = REFERENCE_BACKEND,
              dtype: str = "float32", *, layout: str | None = None, scenario: str = "step",
              isolate: bool = False) -> CheckReport:
        """Check `backend` under `layout` on `model` in `dtype` against its golden; see `veosnap_check`."""
        __tracebackhide__ = True
        from ..candidates import backends, specs
        from ..candidates.layouts import registry
        from ..errors import VeosnapError
        from ..golden import store
        from ..golden.key import DTYPE_NAMES, SCENARIOS, GoldenKey
        from ..reference import hardware
        from ..reference.zoo import load_config

        project = self.project
        # A file path in a test is the project's, relative to the rootdir wherever pytest was started.
        backend = specs.anchored(backend, self.config.rootpath)
        layout = None if layout is None else specs.anchored(layout, self.config.rootpath)
        try:
            # What `veosnap record` would refuse is said here, not advised as a record command later.
            for value, known, what in ((dtype, DTYPE_NAMES, "dtype"), (scenario, SCENARIOS, "scenario")):
                if value not in known:
                    raise VeosnapError(f"{what} {value!r}: goldens are recorded for {', '.join(known)}")
            key = GoldenKey(project.hardware_class, model, scenario, dtype)
            load_config(project.configs, model)  # a misspelt model is no such config, not a missing golden
            resolved = backends.resolve(backend)
            registry.resolve(layout or "single")
        except VeosnapError as exc:
            pytest.fail(f"veosnap: {exc}", pytrace=False)
        name = str(key.recorded)  # the golden file (a frozen_vision check reads the vision golden)
        self.outcome.used.add(name)
        self.outcome.reached.add(request.node.nodeid)
        path = store.path_for(project.goldens, key.recorded)

        record = self.update or (self.update_new_only and not path.is_file())
        if record and project.hardware_class != hardware.detect():
            self.outcome.not_recordable = (f"goldens of hardware class {project.hardware_class} are not recorded on "
                                           f"this machine ({hardware.detect()}); they were only checked")
            record = False
        if record:
            try:
                recording = Recording(key.recorded, self.recording(key.recorded))
            except VeosnapError as exc:
                pytest.fail(f"veosnap: cannot record {name}: {exc}", pytrace=False)
            snapshot = self.assertion(request, update=True)
            if not snapshot(name=name) == recording:
                _raise_for(snapshot)
            self.outcome.recorded.add(name)
            result = snapshot.executions[snapshot.num_executions - 1]
            if result.created or result.updated:
                self.outcome.written.add(name)
        elif not path.is_file() and not self.class_has_goldens():
            pytest.skip(f"veosnap: no goldens for hardware class {project.hardware_class} in {project.goldens}; "
                        f"record them on {project.hardware_class} hardware with `pytest --snapshot-update`")

        if self.update and backend != REFERENCE_BACKEND:
            self.outcome.candidates += 1
        candidate = CandidateCheck(project, key, resolved, layout, missing=self._missing_message(request, key, path),
                                   isolate=isolate)
        snapshot = self.assertion(request, update=False)  # a candidate never writes
        matched = snapshot(name=name) == candidate
        self._count(candidate.report)
        if matched:
            assert candidate.report is not None
            if candidate.report.skipped:
                pytest.skip(f"veosnap: {backend} on {model}: {candidate.report.skipped}")
            return candidate.report
        _raise_for(snapshot)
        if candidate.report is None:
            raise GoldenMismatch(candidate.missing)
        message = "\n" + "\n".join(candidate.diff_lines(None)) + self._write_html(request, candidate.report)
        if self.update:
            message += ("\n(--snapshot-update records goldens from the HF eager reference only; "
                        "this candidate was checked, not written)")
        raise GoldenMismatch(message, candidate.report)

    def _count(self, report: CheckReport | None) -> None:
        """A check that ran: counted, and its version differences kept for the run's one note."""
        if report is None or report.skipped:
            return
        self.outcome.checks += 1
        if report.versions:
            self.outcome.drifted += 1
            self.outcome.versions.update(str(v) for v in report.versions)

    def _write_html(self, request: pytest.FixtureRequest, report: CheckReport) -> str:
        """With --veosnap-html DIR: the failing check's page, written to DIR/<node id>.html; the line saying so."""
        html = self.config.getoption("veosnap_html")
        if not html:
            return ""
        from ..errors import VeosnapError
        from ..golden import store
        from ..render import html as render_html

        path = (self.config.invocation_params.dir / html).resolve() / html_name(request.node.nodeid)
        try:
            store.write_bytes(render_html.checks([report]).encode(), path)
        except (OSError, VeosnapError) as exc:
            return f"\nveosnap: HTML report not written: {exc}"
        return f"\nHTML report: {_shown(path)}"

    def _missing_message(self, request: pytest.FixtureRequest, key: GoldenKey, path: Path) -> str:
        project = self.project
        flags = [f"--veosnap-{kind.replace('_', '-')}" + f"={value}" for kind in
                 ("goldens", "configs", "testdata", "hardware_class")
                 if (value := self.config.getoption(f"veosnap_{kind}"))]
        from ..runs.record import refusal

        refused = refusal(project, key)
        bundled = project.bundled_hint(key.model, key.scenario, key.dtype)
        bundled = f"\n  ({bundled})" if bundled else ""
        if refused:
            return f"veosnap: no golden for {key} (expected {_shown(path)}); this machine cannot record it: {refused}"
        pytest_cmd = shlex.join(["pytest", "--snapshot-update", *flags, request.node.nodeid])
        cli = project.recording_command("record", key)  # with the project's flags as seen from here
        return (f"veosnap: no golden for {key} (expected {_shown(path)}); record it on {key.hardware_class} "
                f"hardware with:\n    {pytest_cmd}\n  or\n    {cli}{bundled}")

    # --- end of session ------------------------------------------------------------------------
    def finish(self, session: pytest.Session) -> None:
        self.close()
        worker_output = getattr(self.config, "workeroutput", None)
        if worker_output is not None:  # an xdist worker: the controller decides
            worker_output[_WORKER_KEY] = self.outcome.to_wire()
            return
        for report in self.worker_reports:
            self.outcome.merge_wire(report)
        if (not self.outcome.items and not self.outcome.used) or self.config.option.collectonly:
            return  # no veosnap test ran in this session
        self.unused = self._find_unused()
        if self.unused is None or not self.unused.goldens or self.unused.undecided:
            return
        syrupy_report = getattr(getattr(self.config, "_syrupy", None), "report", None)
        cleanup = syrupy_report is not None and syrupy_report.should_delete_unused_snapshots
        if cleanup and self.config.getoption("veosnap_delete_unused"):
            from ..golden import store

            for _, path in self.unused.goldens:
                store.remove(path, self.project.goldens)
            self.unused.deleted = True
        elif self.update:
            self.unused.kept = True
        elif not self.config.option.warn_unused_snapshots:
            session.exitstatus = int(session.exitstatus) | _EXIT_UNUSED

    def _find_unused(self) -> Unused | None:
        """Goldens of this hardware class no check used, if this was a full run (syrupy's rules); else None."""
        from ..golden import store
        from ..golden.key import GoldenKey

        syrupy_report = getattr(getattr(self.config, "_syrupy", None), "report", None)
        if syrupy_report is None or syrupy_report.disable_unused_snapshots:
            return None  # --snapshot-disable-unused, or an xdist worker's report went missing
        if self.workers_down > len(self.worker_reports):
            return None
        if not syrupy_report.selected_all_collected_items:
            return None  # -k, -m, --deselect, --lf: a golden is shared, so a partial run cannot own one
        if self.directory("goldens") is None:
            return None  # checked against veosnap's bundled goldens: this project owns none of them
        project = self.project
        if not self._paths_cover(project.goldens):
            return None
        # Only goldens this run could have used: its hardware class, the scenarios and dtypes it checked, and
        # the zoo tiers its models belong to (a suite of toy checks does not own the real-shape goldens); a
        # golden of a model the zoo no longer has is unused whatever the tier.
        from ..reference.zoo import TIERS, list_models

        used = [GoldenKey.from_name(name) for name in self.outcome.used]
        kinds = {(key.scenario, key.dtype) for key in used}
        tiers = {tier: set(list_models(project.configs, tier)) for tier in TIERS}
        zoo = set().union(*tiers.values())
        models = set().union(*(members for members in tiers.values() if any(k.model in members for k in used)))
        goldens = [(str(key), path) for key, path in store.scan(project.goldens).goldens
                   if key.hardware_class == project.hardware_class and (key.scenario, key.dtype) in kinds
                   and (key.model in models or key.model not in zoo) and str(key) not in self.outcome.used]
        unused = Unused(goldens=goldens)
        missed = sorted(self.outcome.items - self.outcome.reached)
        if missed and goldens:
            shown = ", ".join(missed[:3]) + (f" and {len(missed) - 3} more" if len(missed) > 3 else "")
            unused.undecided = (f"{len(missed)} selected veosnap test(s) did not reach their check (skipped or failed "
                                f"before it: {shown}), so goldens they would use cannot be told apart; kept")
        return unused

    def _paths_cover(self, goldens: Path) -> bool:
        """syrupy's rule for paths given on the command line: only a directory argument containing the
        snapshot (here, the goldens directory) lets an unused one count; test files and node ids do not."""
        args = list(self.config.option.file_or_dir or [])
        if not args:
            return True
        base = self.config.invocation_params.dir
        goldens = goldens.resolve()
        for arg in args:
            path = (base / arg).resolve()
            if "::" not in arg and path.is_dir() and goldens.is_relative_to(path):
                return True
        return False

    def summary_lines(self) -> list[str]:
        lines = []
        out = self.outcome
        if self.root != self.config.rootpath:
            lines.append(f"pytest took {self.config.rootpath} as its rootdir from a veosnap option's value (given "
                         f"space-separated); veosnap's project is {self.root} "
                         "(write --veosnap-<dir>=DIR to avoid this).")
        if out.recorded:
            lines.append(f"{len(out.recorded)} golden(s) recorded from the HF eager reference in a fresh process: "
                         f"{len(out.written)} written, {len(out.recorded) - len(out.written)} unchanged.")
        if out.not_recordable:
            lines.append(out.not_recordable + ".")
        if out.drifted:
            from ..render.view import versions_line

            lines.append(versions_line(out.drifted, out.checks, sorted(out.versions)))
        if self.update and out.candidates:
            lines.append(f"{out.candidates} candidate check(s) ran under --snapshot-update: checked against the "
                         "goldens, never written (goldens are recorded from the HF eager reference only).")
        unused = self.unused
        if unused and unused.goldens:
            count = len(unused.goldens)
            if unused.undecided:
                lines.append(f"{count} golden(s) look unused, but {unused.undecided}.")
            else:
                if unused.deleted:
                    lines.append(f"{count} unused golden(s) deleted.")
                elif unused.kept:
                    lines.append(f"{count} golden(s) unused (kept: pass --veosnap-delete-unused with --snapshot-update "
                                 "to delete them).")
                else:
                    lines.append(f"{count} golden(s) unused.")
                verb = "Deleted" if unused.deleted else "Unused"
                lines += [f"{verb} {key} ({_shown(path)})" for key, path in unused.goldens]
                if not self.update:
                    lines.append("Re-run pytest with --snapshot-update --veosnap-delete-unused to delete unused "
                                 "goldens.")
        return lines


_STATE = pytest.StashKey[VeosnapSession]()


def html_name(nodeid: str) -> str:
    """The file name of a test's HTML report: its node id with only letters, digits, '.', '-' and '_'."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("._") or "check"
    if len(stem) > 200:  # file names end at 255 bytes; the digest keeps long parametrized ids apart
        stem = stem[:190] + "-" + hashlib.sha256(nodeid.encode()).hexdigest()[:8]
    return stem + ".html"


def _raise_for(snapshot: SnapshotAssertion) -> None:
    """Re-raise what went wrong inside syrupy's assertion as a one-line failure, if anything did."""
    __tracebackhide__ = True
    from ..errors import VeosnapError

    result = snapshot.executions[snapshot.num_executions - 1]
    if isinstance(result.exception, VeosnapError):
        pytest.fail(f"veosnap: {result.exception}", pytrace=False)
    if result.exception is not None:
        raise result.exception


_DIR_OPTIONS = ("--veosnap-goldens", "--veosnap-configs", "--veosnap-testdata", "--veosnap-hardware-class")


def _project_root(config: pytest.Config) -> Path:
    """pytest's rootdir as it would be had it known veosnap's options.

    pytest settles its rootdir before plugins load, so `--veosnap-configs DIR` (space-separated) reads to it
    as an unknown flag and a test path DIR, and DIR's tree (its ini file) can become the rootdir. When that
    may have happened, the rootdir is worked out again from the arguments without those values.
    """
    args = [str(a) for a in config.invocation_params.args]
    if not any(a in _DIR_OPTIONS for a in args[:-1]):
        return config.rootpath
    try:
        import inspect

        from _pytest.config.findpaths import determine_setup

        given = {"inifile": config.option.inifilename, "args": [str(a) for a in config.option.file_or_dir or []],
                 "rootdir_cmd_arg": config.option.rootdir or None, "invocation_dir": config.invocation_params.dir,
                 "override_ini": getattr(config.option, "override_ini", None), "config": config}
        accepted = inspect.signature(determine_setup).parameters
        return Path(determine_setup(**{k: v for k, v in given.items() if k in accepted})[0])
    except Exception:  # noqa: BLE001 - pytest's internals moved: the invocation directory is the safe answer
        return Path(config.invocation_params.dir)


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# --- hooks and fixtures ------------------------------------------------------------------------

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(_MATRIX_MARK)
    if marker is None:
        return
    state = metafunc.config.stash[_STATE]
    given = {"model": marker.kwargs.get("models"), "dtype": marker.kwargs.get("dtypes"),
             "backend": marker.kwargs.get("backends"), "layout": marker.kwargs.get("layouts")}
    defaults: dict[str, Callable[[], list[str]]] = {
        "model": lambda: _models(state, marker.kwargs.get("tier", "toy")), "dtype": lambda: ["float32", "bfloat16"], "backend": lambda: [REFERENCE_BACKEND],
    }
    axes = []
    for name, values in given.items():
        if name not in metafunc.fixturenames:
            if values is not None:
                raise pytest.UsageError(f"{metafunc.definition.nodeid}: matrix({name}s=...) given, "
                                        f"but the test has no {name!r} argument")
            continue
        if values is None and name in defaults:
            values = defaults[name]()
        if values is not None:
            axes.append((name, list(values)))
    if axes:
        names = [name for name, _ in axes]
        metafunc.parametrize(names, list(product(*(values for _, values in axes))),
                             ids=lambda value: str(value))


def _models(state: VeosnapSession, tier: str = "toy") -> list[str]:
    from ..reference.zoo import list_models, resolve_dir

    return list_models(state.directory("configs") or resolve_dir("toy_configs"), tier)


def pytest_collection_finish(session: pytest.Session) -> None:
    state = session.config.stash[_STATE]
    state.outcome.items = {item.nodeid for item in session.items
                           if any(name in getattr(item, "fixturenames", ()) for name in FIXTURES)}


@pytest.hookimpl(trylast=True)  # after syrupy has built (and, under xdist, merged) its report
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_STATE].finish(session)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workeroutput"):
        return
    lines = config.stash[_STATE].summary_lines()
    if lines:
        terminalreporter.write_sep("-", "veosnap golden report")
        for line in lines:
            terminalreporter.write_line(line)


class _XdistController:
    """Collects each xdist worker's goldens outcome as it shuts down (registered only with xdist)."""

    def __init__(self, state: VeosnapSession) -> None:
        self.state = state

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        self.state.workers_down += 1
        report = (getattr(node, "workeroutput", None) or {}).get(_WORKER_KEY)
        if report is not None:
            self.state.worker_reports.append(report)


@pytest.fixture(scope="session")
def veosnap_project(request: pytest.FixtureRequest) -> Project:
    """The goldens, configs and test data directories and the hardware class this run checks."""
    return request.config.stash[_STATE].project


@pytest.fixture
def veosnap_check(request: pytest.FixtureRequest) -> Callable[..., CheckReport]:
    """`veosnap_check(model, backend="eager", dtype="float32", *, layout=None, scenario="step", isolate=False)`.

    Checks the backend under the layout (any layout SPEC `veosnap check --layout` takes; None: single)
    on the model against its golden and returns veosnap's CheckReport. A failed check raises
    `GoldenMismatch` (an AssertionError) carrying the report; a backend or layout that does not apply
    to the model skips the test; so does a hardware class with no goldens at all. `isolate`: a bfloat16
    real-shape golden's layers are checked in isolation too (`veosnap check --isolate`). Under
    `--snapshot-update` the golden is re-recorded from the reference first.
    """
    state = request.config.stash[_STATE]

    def veosnap_check(model: str, backend: str = REFERENCE_BACKEND, dtype: str = "float32", *,
                      layout: str | None = None, scenario: str = "step", isolate: bool = False) -> CheckReport:
        __tracebackhide__ = True
        return state.check(request, model, backend, dtype, layout=layout, scenario=scenario, isolate=isolate)

    return veosnap_check
