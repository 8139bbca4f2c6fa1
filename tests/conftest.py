"""Shared fixtures: the project as checked out, and a scratch project for tests that record.

The project's own suite runs on the veosnap pytest plugin.
"""

from __future__ import annotations

import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from veosnap.reference.zoo import Project

ROOT = Path(__file__).resolve().parent.parent

# An installed veosnap registers the plugin through its `pytest11` entry point; a checkout run with
# PYTHONPATH pointing at it (and an older install's metadata) does not, so load it here instead.
if not any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["veosnap.surfaces.pytest_plugin"]


@pytest.fixture(scope="session")
def repo_project() -> Project:
    """The repository's own zoo and committed goldens, hardware class `cpu`."""
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class="cpu")


@pytest.fixture
def scratch_project(tmp_path: Path) -> Project:
    """A project in a temp dir: copies of the toy configs and test data, no goldens yet."""
    shutil.copytree(ROOT / "toy_configs", tmp_path / "toy_configs")
    shutil.copytree(ROOT / "testdata", tmp_path / "testdata")
    return Project.resolve(goldens=tmp_path / "goldens", configs=tmp_path / "toy_configs",
                           testdata=tmp_path / "testdata", hardware_class="cpu")
