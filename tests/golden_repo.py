"""Test helpers: a throwaway project (goldens + toy configs) in a temp dir, optionally a git repo."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from veosnap.reference import hardware
from veosnap.reference.zoo import Project

REPO = Path(__file__).resolve().parents[1]

# Recording runs the reference here, so it needs the hardware class of the committed goldens.
needs_cpu = pytest.mark.skipif(hardware.detect() != "cpu", reason="re-records cpu goldens; this machine is not cpu")


def copy_zoo(dest: Path) -> Project:
    """Copy the committed cpu goldens and the toy configs under `dest`; a Project working there."""
    shutil.copytree(REPO / "goldens" / "cpu", dest / "goldens" / "cpu")
    shutil.copytree(REPO / "toy_configs", dest / "toy_configs")
    return Project.resolve(goldens=dest / "goldens", configs=dest / "toy_configs", testdata=REPO / "testdata",
                           hardware_class="cpu")


def git(cwd: Path, *args: str) -> str:
    """Run git in `cwd` with a fixed identity and no signing; its stdout."""
    cmd = ["git", "-c", "user.name=veosnap-test", "-c", "user.email=test@veosnap.invalid",
           "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout


def git_repo(dest: Path) -> Project:
    """`copy_zoo` in a fresh git repository with everything committed."""
    project = copy_zoo(dest)
    git(dest, "init", "-q")
    commit(dest, "goldens as committed")
    return project


def commit(repo: Path, message: str) -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
