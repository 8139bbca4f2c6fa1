"""Shared fixtures: the project as checked out, and a scratch project for tests that record.

The project's own suite runs on the veosnap pytest plugin. It records and checks the goldens of this
machine's hardware class (`golden_repo.CLASS`: cpu here, cuda-sm90 on an H100/H200), so the same
suite passes on either; $VEOSNAP_HARDWARE_CLASS, which picks the class of a user's commands, is
ignored here (the header says so) so that it cannot point the suite at another machine's goldens.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter
from importlib.metadata import entry_points
from pathlib import Path

import pytest

# The suite starts about 300 Python processes (torchrun's ranks, pytest in pytest, the CLI as printed, the
# fresh recorder). Under PYTHONDONTWRITEBYTECODE (set on the machine the suite is timed on) each of them
# compiled veosnap's and the tests' sources afresh, 0.3 s a process (`-X importtime`: veosnap's own imports
# 500 -> 200 ms). The suite's processes write and reuse byte code (in `__pycache__`, which git ignores), from
# here on: this process's later imports, the xdist workers and every subprocess inherit it.
if sys.dont_write_bytecode:
    sys.dont_write_bytecode = False
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from golden_repo import CLASS, REPO  # noqa: E402

from veosnap.reference import hardware  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402

ROOT = REPO

# An installed veosnap registers the plugin through its `pytest11` entry point; a checkout run with
# PYTHONPATH pointing at it (and an older install's metadata) does not, so load it here instead.
if not any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["veosnap.surfaces.pytest_plugin"]

_IGNORED_CLASS = os.environ.pop(hardware.ENV_VAR, None)


def pytest_report_header(config: pytest.Config) -> list[str]:
    line = f"veosnap: hardware class {CLASS} (this machine): the suite records and checks its goldens"
    if _IGNORED_CLASS and _IGNORED_CLASS != CLASS:
        line += f"; {hardware.ENV_VAR}={_IGNORED_CLASS} ignored"
    return [line]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most `heavy` tests run first, each file's tests together and in their own order, so that
    the long tests start early and module fixtures are built once per worker. Alone it did not shorten a run
    (2401 s of tests, 2026-12-07); with work stealing (below) the run took 2016 s.
    """
    heavy = Counter(item.path for item in items if item.get_closest_marker("heavy"))
    first_seen = {path: i for i, path in reversed(list(enumerate(item.path for item in items)))}
    items.sort(key=lambda item: (-heavy[item.path], first_seen[item.path]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201 - xdist's Producer, Scheduling
    """`-n 2` steals work (`--dist worksteal`) unless another `--dist` is given.

    xdist's default (`load`) refills a worker with consecutive batches it cannot give back: twice in a row
    (2026-12-07, 2 cores) one worker ran the rest of its batch alone for the last 6-9 minutes while the other
    idled. Under work stealing, a worker that runs out takes the last half of the other's queue.
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


@pytest.fixture(scope="session")
def hardware_class() -> str:
    """This machine's hardware class: the class of the goldens the suite records and checks."""
    return CLASS


@pytest.fixture(scope="session")
def repo_project() -> Project:
    """The repository's own zoo and committed goldens, this machine's hardware class."""
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class=CLASS)


@pytest.fixture
def scratch_project(tmp_path: Path) -> Project:
    """A project in a temp dir: copies of the toy configs and test data, no goldens yet."""
    shutil.copytree(ROOT / "toy_configs", tmp_path / "toy_configs")
    shutil.copytree(ROOT / "testdata", tmp_path / "testdata")
    return Project.resolve(goldens=tmp_path / "goldens", configs=tmp_path / "toy_configs",
                           testdata=tmp_path / "testdata", hardware_class=CLASS)


# --- sharing one GPU among parallel pytest processes (tools/gpu/gpu_pytest.sh --jobs N) ------------------
# Each slice is its own pytest process on the one GPU. Its caching allocator keeps the peak of any test it
# ran until the process ends, so one slice's big test could starve the others for the rest of the run
# (the H200's first --jobs 10 run: CUBLAS_STATUS_ALLOC_FAILED in another slice's cublasCreate). So after a
# test that left more than CACHE_KEPT_BYTES cached, the cache goes back to the driver; with
# $VEOSNAP_TEST_CUDA_MEMORY_FRACTION a slice takes at most that share of the GPU (a test over it fails
# there, with the OOM naming it, instead of a neighbour failing); with $VEOSNAP_TEST_CUDA_PEAKS each test's
# peak reserved memory is appended to that file (`MiB node id`), to see which tests are heavy.
CACHE_KEPT_BYTES = 1 << 30


def _cuda_in_use():  # noqa: ANN202 - torch, where a test of this process used CUDA
    import sys

    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized() else None


_capped: set[int] = set()  # processes whose share is set (a fork's child sets its own)


def _cap(torch) -> None:  # noqa: ANN001
    # Set once CUDA is in use, never by initialising it here: a test that forks must find CUDA untouched.
    fraction = os.environ.get("VEOSNAP_TEST_CUDA_MEMORY_FRACTION")
    if fraction and os.getpid() not in _capped:
        torch.cuda.set_per_process_memory_fraction(float(fraction))
        _capped.add(os.getpid())


def pytest_runtest_setup(item: pytest.Item) -> None:
    torch = _cuda_in_use()
    if torch is not None:
        _cap(torch)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    torch = _cuda_in_use()
    if torch is None:
        return
    _cap(torch)
    peaks = os.environ.get("VEOSNAP_TEST_CUDA_PEAKS")
    if peaks:
        with open(peaks, "a", encoding="utf-8") as fh:
            fh.write(f"{torch.cuda.max_memory_reserved() >> 20} {item.nodeid}\n")
        torch.cuda.reset_peak_memory_stats()
    if torch.cuda.memory_reserved() > CACHE_KEPT_BYTES:
        import gc

        gc.collect()
        torch.cuda.empty_cache()
