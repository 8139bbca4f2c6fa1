"""What `pip install` gives a user: a small wheel that checks the bundled zoo, and the goldens of other
hardware classes and of the real tier as data packages of their own (data/README.md)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from golden_repo import CLASS, needs_goldens

ROOT = Path(__file__).resolve().parent.parent
MAX_WHEEL_BYTES = 40_000_000  # issue 39: 40 MB, the zoo's growth in mind (a package index refuses 100 MB)
BUNDLED = "veosnap/_bundled/goldens/"


def data_package(hardware_class: str, tier: str = "toy") -> Path:
    """The data package of a class's goldens of one tier (the cpu toy tier is in the wheel itself)."""
    return ROOT / "data" / (hardware_class + ("-real" if tier == "real" else ""))


def build(out: Path, *projects: Path) -> dict[str, Path]:
    """`pip wheel` of these projects (the repository, data packages): each wheel by distribution name."""
    # With hatchling here, build offline; else pip fetches it (a machine with no package index cannot).
    offline = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *offline, "-w", str(out),
                            *map(str, projects)], capture_output=True, text=True)
    if built.returncode and not offline and "hatchling" in built.stderr:
        pytest.skip("building the wheel needs the hatchling build backend, which pip could not fetch here "
                    "(no package index?): pip install hatchling")
    assert built.returncode == 0, built.stderr
    return {wheel.name.split("-")[0]: wheel for wheel in out.glob("*.whl")}


def install(site: Path, *wheels: Path) -> dict[str, str]:
    """A plain (non-editable) install of the wheels into `site`; the environment that runs from it."""
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                           "--target", str(site), *map(str, wheels)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def veosnap(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "veosnap", *args], cwd=cwd, env=env, capture_output=True, text=True)


def golden_folders(wheel: Path) -> set[str]:
    """CLASS/MODEL folders of goldens a wheel installs."""
    names = zipfile.ZipFile(wheel).namelist()
    return {"/".join(n[len(BUNDLED):].split("/")[:2]) for n in names if n.startswith(BUNDLED)}


@pytest.mark.heavy  # pip wheel, pip install and a check, each a process of its own: 20-90 s on the 2-core box
@needs_goldens("cpu", "llama")  # what the wheel carries: a checkout fitted to a GPU box builds one without them
def test_the_wheel_is_small_and_checks_the_bundled_zoo_from_an_empty_directory(tmp_path):
    """The README's main command after `pip install veosnap` (and, on another class than cpu, its data
    package): the wheel carries the cpu toy tier's goldens only."""
    extra = [] if CLASS == "cpu" else [data_package(CLASS)]
    wheels = build(tmp_path / "dist", ROOT, *extra)
    wheel = wheels["veosnap"]
    assert wheel.stat().st_size <= MAX_WHEEL_BYTES, f"{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB"
    folders = golden_folders(wheel)
    assert "cpu/llama" in folders
    assert {f.split("/")[0] for f in folders} == {"cpu"}
    assert not [f for f in folders if "-real" in f], "the real tier is a data package of its own"
    assert "veosnap/_bundled/toy_configs/qwen3-real/config.json" in zipfile.ZipFile(wheel).namelist()

    env = install(tmp_path / "site", *wheels.values())
    empty = tmp_path / "empty"
    empty.mkdir()
    run = veosnap(env, empty, "check", "--model", "llama", "--dtype", "float32")
    assert run.returncode == 0, run.stderr
    assert f"PASS  {CLASS}/llama/step-float32" in run.stdout
    assert list(empty.iterdir()) == [], "a check writes nothing into the directory it runs in"


@pytest.mark.heavy  # pip wheel, two pip installs and two commands
@needs_goldens("cpu", "llama", "qwen3-real", "qwen3_moe-real-small")
def test_a_data_package_installed_beside_the_wheel_is_found_by_the_zoo_lookup(tmp_path):
    """The cpu real tier (the smallest data package): missing, a check says which package to install;
    installed beside veosnap, the bundled zoo lists its goldens."""
    wheels = build(tmp_path / "dist", ROOT, data_package("cpu", "real"))
    package = wheels["veosnap_goldens_cpu_real"]
    assert golden_folders(package) == {"cpu/qwen3-real", "cpu/qwen3_moe-real-small"}
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert f"Requires-Dist: veosnap=={version}" in zipfile.ZipFile(package).read(
        f"veosnap_goldens_cpu_real-{version}.dist-info/METADATA").decode(), "a data package pins veosnap's version"
    for pyproject in (ROOT / "data").glob("*/pyproject.toml"):  # and every one moves with it
        assert f'version = "{version}"' in pyproject.read_text() and f'"veosnap=={version}"' in pyproject.read_text(), \
            f"{pyproject.relative_to(ROOT)}: not veosnap's version {version}"

    without = install(tmp_path / "without", wheels["veosnap"])
    missing = veosnap(without, tmp_path, "check", "--model", "qwen3-real", "--dtype", "float32",
                      "--hardware-class", "cpu")
    assert missing.returncode != 0
    assert "pip install veosnap-goldens-cpu-real" in missing.stderr

    beside = install(tmp_path / "beside", wheels["veosnap"], package)
    listed = veosnap(beside, tmp_path, "ls", "--hardware-class", "cpu", "--model", "qwen3-real")
    assert listed.returncode == 0, listed.stderr
    assert "cpu/qwen3-real/step-float32" in listed.stdout
    assert str(tmp_path / "beside" / "veosnap" / "_bundled" / "goldens") in listed.stdout
