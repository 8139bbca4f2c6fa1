"""Test helpers: this machine's hardware class and its committed goldens; a throwaway project (goldens +
toy configs) in a temp dir, optionally a git repo.

The suite records and checks goldens of the class this machine has (`CLASS`: `cpu` here, `cuda-sm90`
on an H100/H200), so it passes on either. A test that means the cpu goldens in particular says so
(`needs_cpu`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.reference import hardware
from veosnap.reference.zoo import Project

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
                    "hardware (python tools/gpu_session.py record, or tools/gpu_pytest.sh --record)")
    return path


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
