"""Test helpers: this machine's hardware class and its committed goldens; a throwaway project (goldens +
toy configs) in a temp dir, optionally a git repo; what this machine records and checks itself.

The suite records and checks goldens of the class this machine has (`CLASS`: `cpu` here, `cuda-sm90`
on an H100/H200), so it passes on either. A test that means the cpu goldens in particular says so
(`needs_cpu`).

Two machines of one class need not compute the reference in the same bits: the committed cpu goldens
were recorded on a CPU whose torch kernels (AVX-512, most likely) round differently from an AVX2 one's.
veosnap is built for that (an eager check there passes at a ratio of a few hundredths, not 0), so a test
whose point is not the committed bytes compares with what this machine does (`recorded_here`,
`eager_figures`); one whose point is the committed bytes checks them where this machine reproduces them
(`skip_unless_reproduced`), and what every machine records alike (`alike_everywhere`) everywhere.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from veosnap.golden import codec, store
from veosnap.golden.codec import Golden
from veosnap.golden.key import GoldenKey
from veosnap.reference import hardware
from veosnap.reference.zoo import Project
from veosnap.runs.verdict import CheckReport

try:
    import fcntl
except ImportError:  # not POSIX: each xdist worker builds its own copy, as before
    fcntl = None

REPO = Path(__file__).resolve().parents[1]
CLASS = hardware.detect()  # this machine's hardware class: the goldens the suite records and checks
ON_CUDA = CLASS != "cpu"
# A test that re-records or forges the committed cpu goldens in particular runs on a cpu machine only.
needs_cpu = pytest.mark.skipif(ON_CUDA, reason="re-records cpu goldens; this machine is not cpu")


def golden_path(model: str, dtype: str = "float32", scenario: str = "step", hardware_class: str = CLASS) -> Path:
    """A committed golden of this repository (of this machine's class unless said otherwise)."""
    return store.path_for(REPO / "goldens", GoldenKey(hardware_class, model, scenario, dtype))


def committed_golden(model: str, dtype: str = "float32", scenario: str = "step") -> Path:
    """This machine's class's committed golden, or the test skips saying how to record it."""
    path = golden_path(model, dtype, scenario)
    if not path.is_file():
        pytest.skip(f"no committed {CLASS} golden {path.relative_to(REPO)}: record this class's goldens on this "
                    "hardware (python tools/gpu/gpu_session.py record, or tools/gpu/gpu_pytest.sh --record)")
    return path


WHY_ABSENT = ("a device call carries this class's toy goldens only (docs/gpu.md, 'Fitting a device call'); CI's "
              "checkout holds them all")


def has_goldens(hardware_class: str, model: str | None = None) -> bool:
    """Whether this checkout holds committed goldens of `hardware_class` (of `model`, when given)."""
    return any((REPO / "goldens" / hardware_class / (model or "")).glob("**/*.safetensors.zst"))


def needs_goldens(hardware_class: str, *models: str) -> pytest.MarkDecorator:
    """Skip a test that reads the committed goldens of `hardware_class` (of `models`, when given: else any) where
    this checkout lacks them, saying why. Decided from the files' presence alone (nothing is read at import)."""
    if models:
        missing = [m for m in models if not has_goldens(hardware_class, m)]
    else:
        missing = [] if has_goldens(hardware_class) else ["any"]
    return pytest.mark.skipif(bool(missing), reason=f"needs the committed {hardware_class} goldens "
                              f"({', '.join(missing)}), which this checkout lacks: {WHY_ABSENT}")


def left_out(hardware_class: str, model: str) -> bool:
    """Whether this checkout holds no goldens of `hardware_class` of `model`'s whole tier: a device call's tree
    (tools/gpu/device_tree.py), not a golden missing from a full checkout."""
    from veosnap.reference.zoo import read_sidecar

    configs = REPO / "toy_configs"
    tier = read_sidecar(configs / model)[0] if (configs / model).is_dir() else "toy"
    return not any(read_sidecar(configs / p.name)[0] == tier for p in (REPO / "goldens" / hardware_class).glob("*")
                   if (configs / p.name).is_dir() and has_goldens(hardware_class, p.name))


def committed_tier(hardware_class: str, tier: str) -> list[Path]:
    """The golden files of `hardware_class`'s `tier` (`toy` or `real`) in this checkout, or the test skips
    saying why (a test of the whole committed set checks each class and tier the checkout holds)."""
    from veosnap.reference.zoo import read_sidecar

    files = sorted(p for p in (REPO / "goldens" / hardware_class).glob("*/*.safetensors.zst")
                   if (REPO / "toy_configs" / p.parent.name).is_dir()
                   and read_sidecar(REPO / "toy_configs" / p.parent.name)[0] == tier)
    if not files:
        pytest.skip(f"this checkout holds no committed {hardware_class} goldens of the {tier} tier: {WHY_ABSENT}")
    return files


def gpus_for(nproc: int) -> pytest.MarkDecorator:
    """Multi-process layouts run one rank per GPU on CUDA: skip where fewer are visible."""
    import torch

    visible = torch.cuda.device_count() if ON_CUDA else nproc
    return pytest.mark.skipif(visible < nproc, reason=f"needs {nproc} GPUs for {nproc} NCCL ranks; {visible} visible")


def copy_zoo(dest: Path, hardware_class: str = CLASS) -> Project:
    """Copy a class's committed goldens (this machine's by default) and the toy configs under `dest`; a
    Project working there."""
    shutil.copytree(REPO / "goldens" / hardware_class, dest / "goldens" / hardware_class)
    shutil.copytree(REPO / "toy_configs", dest / "toy_configs")
    return Project.resolve(goldens=dest / "goldens", configs=dest / "toy_configs", testdata=REPO / "testdata",
                           hardware_class=hardware_class)


def git(cwd: Path, *args: str) -> str:
    """Run git in `cwd` with a fixed identity and no signing; its stdout. Skips the test where git is missing."""
    if shutil.which("git") is None:
        pytest.skip("needs git, which is not installed here")
    cmd = ["git", "-c", "user.name=veosnap-test", "-c", "user.email=test@veosnap.invalid",
           "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def git_repo(dest: Path, hardware_class: str = CLASS) -> Project:
    """`copy_zoo` in a fresh git repository with everything committed."""
    project = copy_zoo(dest, hardware_class)
    git(dest, "init", "-q")
    commit(dest, "goldens as committed")
    return project


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory `build(path)` fills once per pytest run, for a module- or session-scoped fixture whose
    tests only read it (a project with goldens it recorded). Under pytest-xdist each worker runs such a
    fixture itself, so the recording happened once per worker: here the first worker to get there builds it
    in the run's temp root while the others wait on a lock, then every worker uses it. A build that raises
    leaves nothing behind, so a worker after it builds (and fails) on its own."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or fcntl is None:  # one process: the fixture's scope is once
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    root = tmp_path_factory.getbasetemp().parent  # the run's own temp root, shared by its workers (xdist's recipe)
    path, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


# --- what this machine records and checks ----------------------------------------------------------


@functools.cache
def recorded_here(model: str, dtype: str = "float32", scenario: str = "step") -> bytes:
    """The bytes `record` writes for this class's golden of `model` on this machine, from the repository's
    toy configs and test data into a project of its own (no committed golden, so no approval trail, in
    play). Recorded once per test process; like `record`, in this process while no candidate has run here,
    so a test calls it before it patches anything itself."""
    from veosnap.runs.record import record

    with tempfile.TemporaryDirectory(prefix="veosnap-recorded-here-") as root:
        project = Project.resolve(goldens=Path(root) / "goldens", configs=REPO / "toy_configs",
                                  testdata=REPO / "testdata", hardware_class=CLASS)
        return record(project, model, dtype, scenario).path.read_bytes()


# The golden that tells whether this machine reproduces the committed ones: it has no excuse, which a fresh
# recording would lack, so a recording here, given the committed approval trail (as `record` over it does),
# holds every byte of it.
PROBE = ("llama", "float32", "step")


@functools.cache
def reproduces_committed() -> bool:
    """Whether a fresh recording of this class's probe golden on this machine is the committed file, byte
    for byte: the machine computes the reference in the bits of the one that recorded `goldens/CLASS`."""
    committed = committed_golden(*PROBE)
    kept = store.read(committed).manifest
    assert not kept.excused, f"{committed.relative_to(REPO)} has an excuse: pick a probe golden without one"
    fresh = codec.decode(recorded_here(*PROBE), "the probe recorded here")
    fresh.manifest.approvals = list(kept.approvals)  # and the certificate approved with them, as `record` keeps it
    if set(fresh.manifest.reference.sensitivity or {}) == set(kept.reference.sensitivity or {}):
        fresh.manifest = replace(fresh.manifest, reference=replace(fresh.manifest.reference,
                                                                   sensitivity=kept.reference.sensitivity))
    return codec.encode(fresh) == committed.read_bytes()


def skip_on_other_versions() -> None:
    """Skip a test that holds what the recorder writes against the committed goldens where torch or transformers
    here is not what recorded them (the pinned set, constraints/tested.txt): a new transformers may add config
    fields or move the reference's numbers. `veosnap drift` measures what it moves (docs/versions.md)."""
    import transformers

    kept = store.read_manifest(committed_golden(*PROBE)).provenance
    here = {"torch": torch.__version__, "transformers": transformers.__version__}
    other = [f"{name} {getattr(kept, name)} ({version} here)" for name, version in here.items()
             if getattr(kept, name) != version]
    if other:
        pytest.skip(f"goldens/{CLASS} were recorded with {', '.join(other)}: what the recorder writes is held "
                    "against them on the tested versions only (constraints/tested.txt; `veosnap drift` shows what "
                    "these versions move)")


def skip_unless_reproduced() -> None:
    """Skip the rest of a test that compares with the committed goldens' bytes where this machine does
    not reproduce them, naming why: other versions, other bits, another device. Fail where none of those
    explains it: then the recorder's output changed, not the machine."""
    if reproduces_committed():
        return
    here, kept = codec.decode(recorded_here(*PROBE), "the probe recorded here"), store.read(committed_golden(*PROBE))
    ours, theirs = here.manifest.provenance, kept.manifest.provenance
    versions = [f"{name} {getattr(theirs, name)} ({getattr(ours, name)} here)"
                for name in ("veosnap", "torch", "transformers", "python")
                if getattr(ours, name) != getattr(theirs, name)]
    if versions:
        pytest.skip(f"goldens/{CLASS} were recorded with {', '.join(versions)}: byte identity with them holds with "
                    "the recorder's versions only")
    probe = committed_golden(*PROBE).relative_to(REPO)
    if alike_everywhere(here) != alike_everywhere(kept):
        pytest.fail(f"the recorder writes another golden for {probe} than the committed one, beyond the figures "
                    "a machine measures: its output changed")
    stored, committed = here.stored_tensors(), kept.stored_tensors()
    if any(not torch.equal(stored[name], committed[name]) for name in stored):
        pytest.skip(f"this machine computes the reference in other bits than the one that recorded goldens/{CLASS} "
                    f"({_this_machine()} here): byte identity with the committed goldens holds on the recording "
                    "machine; tests/test_determinism.py checks it on this one")
    if ours != theirs:
        pytest.skip(f"goldens/{CLASS} were recorded on {theirs.device} (driver {theirs.driver}), this machine is "
                    f"{ours.device} (driver {ours.driver}): byte identity holds on the recording machine")
    pytest.fail(f"this machine records the reference of {probe} bit for bit, on the recorder's device and "
                "versions, yet writes other bytes for it: the recorder's output changed")


def _this_machine() -> str:
    if ON_CUDA:
        return torch.cuda.get_device_name()
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def alike_everywhere(golden: Golden) -> dict:
    """What of a golden every machine of its class records alike: each stored tensor's name, dtype and
    shape; the inputs and the routes' expert ids (the routers decide clearly, margins over the tie
    epsilon); the manifest but for what the machine measures (bounds, router margins, the ratios its canaries
    reached, so the hashes) and describes (its device), and the approval trail, which only a refresh writes."""
    m = golden.manifest
    exact = {name: t.tolist() for name, t in golden.tensors.items()
             if name.startswith("inputs.") or (name.startswith("routes.") and name.endswith(".experts"))}
    return {
        "tensors": {name: (t.dtype, tuple(t.shape)) for name, t in golden.stored_tensors().items()},
        "exact": exact,
        "manifest": replace(m, tolerance=dict.fromkeys(m.tolerance), min_margin=dict.fromkeys(m.min_margin),
                            payload_hash="", manifest_hash="", approvals=[],
                            reference=replace(m.reference, sensitivity=dict.fromkeys(m.reference.sensitivity or {})),
                            provenance=replace(m.provenance, device="", capability="", cuda=None, driver=None)),
    }


def figures(report: CheckReport) -> dict[str, tuple[float, float, float]]:
    """What a check says of each tensor: its error, bound and ratio."""
    return {t.name: (t.error, t.bound, t.ratio) for t in report.tensors}


@functools.cache
def _eager(goldens: Path, configs: Path, testdata: Path, key: GoldenKey) -> CheckReport:
    from veosnap.candidates import backends
    from veosnap.runs.check import check

    report = check(Project(goldens=goldens, configs=configs, testdata=testdata, hardware_class=key.hardware_class),
                   key, backends.resolve("eager"))
    assert report.passed, (report.error, report.worst)
    return report


def eager_report(project: Project, model: str, dtype: str = "float32", scenario: str = "step") -> CheckReport:
    """The eager backend, the reference itself run again, checked against the project's golden on this
    machine (once per test process): what a candidate computing the reference's very bits scores here.
    All 0 where the golden was recorded; the same nonzero figures, tensor by tensor, on a machine that
    computes the reference in other bits."""
    return _eager(project.goldens, project.configs, project.testdata,
                  GoldenKey(project.hardware_class, model, scenario, dtype))


def eager_figures(project: Project, model: str, dtype: str = "float32", scenario: str = "step") -> dict:
    """`figures` of `eager_report`."""
    return figures(eager_report(project, model, dtype, scenario))
