"""Shared fixtures: the project as checked out, and a scratch project for tests that record.

The project's own suite runs on the veosnap pytest plugin. It records and checks the goldens of this
machine's hardware class (`golden_repo.CLASS`: cpu here, cuda-sm90 on an H100/H200), so the same
suite passes on either; $VEOSNAP_HARDWARE_CLASS, which picks the class of a user's commands, is
ignored here (the header says so) so that it cannot point the suite at another machine's goldens.
"""

from __future__ import annotations

import os
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO

from veosnap.reference import hardware
from veosnap.reference.zoo import Project

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
