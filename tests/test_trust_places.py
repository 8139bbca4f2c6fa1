"""Nothing is deleted or written outside the project's goldens directory (issue 12, item 7).

- pytest's `--veosnap-configs DIR`, given space-separated, does not make DIR's tree the project;
- deleting unused goldens is opt-in (`--veosnap-delete-unused`), lists what it deletes, and only ever
  touches goldens of the hardware class, scenarios and dtypes the run could have used;
- `veosnap record` writes to `./goldens` (creating it) or `--goldens`, never into the installed package;
- a model or class directory that is a symlink out of the goldens root is never written through.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO, recorded_here

import veosnap
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.surfaces.cli import main

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")


def pytest_in(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VEOSNAP_")) and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    plugin = [] if any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")) \
        else ["-p", "veosnap.surfaces.pytest_plugin"]
    # No property tests downstream: hypothesis's plugin (this repository's test extra) stays out of these runs.
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                           *plugin, "-q", *args], cwd=project, env=env, capture_output=True, text=True, timeout=600)


def project_with(root: Path, *keys: GoldenKey) -> Path:
    """A downstream project checking llama in float32 (step), holding the committed goldens `keys`."""
    project = root
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    (project / "tests" / "test_llama.py").write_text(
        "def test_llama(veosnap_check):\n    veosnap_check('llama', dtype='float32')\n")
    for key in keys:
        (project / "goldens" / key.relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "goldens" / key.relpath, project / "goldens" / key.relpath)
    return project


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.heavy
def test_item7_a_space_separated_veosnap_configs_dir_does_not_become_the_project(tmp_path):
    other = tmp_path / "other"  # another tree with its own pytest config and goldens
    (other / "toy_configs").mkdir(parents=True)
    shutil.copytree(REPO / "toy_configs" / "llama", other / "toy_configs" / "llama")
    (other / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    for key in (GoldenKey(CLASS, "qwen2", "step", "float32"), GoldenKey(CLASS, "mixtral", "step", "float32")):
        (other / "goldens" / key.relpath).parent.mkdir(parents=True)
        shutil.copyfile(REPO / "goldens" / key.relpath, other / "goldens" / key.relpath)
    before = snapshot(other)
    project = project_with(tmp_path / "project")

    done = pytest_in(project, "--snapshot-update", "--veosnap-configs", str(other / "toy_configs"),
                     "--veosnap-delete-unused")

    assert done.returncode == 0, done.stdout + done.stderr
    assert snapshot(other) == before
    assert (project / "goldens" / LLAMA.relpath).read_bytes() == recorded_here("llama")  # from the llama config


@pytest.mark.heavy
def test_item7_unused_goldens_are_deleted_only_on_request_and_only_those_the_run_could_have_used(tmp_path):
    used_class_dtype_scenario = GoldenKey(CLASS, "qwen2", "step", "float32")
    out_of_scope = [GoldenKey(CLASS, "llama", "step", "bfloat16"), GoldenKey(CLASS, "llama", "train", "float32"),
                    GoldenKey("cuda-sm90" if CLASS == "cpu" else "cpu", "llama", "step", "float32")]
    project = project_with(tmp_path / "project", LLAMA, used_class_dtype_scenario, *out_of_scope[:2])
    other_class = project / "goldens" / out_of_scope[2].relpath
    other_class.parent.mkdir(parents=True)
    shutil.copyfile(REPO / "goldens" / LLAMA.relpath, other_class)
    qwen2 = project / "goldens" / used_class_dtype_scenario.relpath

    done = pytest_in(project, "--snapshot-update")
    assert done.returncode == 0, done.stdout
    kept = "1 golden(s) unused (kept: pass --veosnap-delete-unused with --snapshot-update to delete them)."
    assert kept in done.stdout
    assert f"Unused {CLASS}/qwen2/step-float32" in done.stdout and qwen2.is_file()

    done = pytest_in(project, "--snapshot-update", "--veosnap-delete-unused")
    assert done.returncode == 0, done.stdout
    assert "1 unused golden(s) deleted." in done.stdout
    assert f"Deleted {CLASS}/qwen2/step-float32 (goldens/{CLASS}/qwen2/step-float32.safetensors.zst)" in done.stdout
    assert not qwen2.exists()
    for key in out_of_scope:  # another dtype, scenario or class than the run used: never deleted
        assert (project / "goldens" / key.relpath).is_file(), key


def test_item7_record_writes_to_dot_goldens_creating_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bundled = snapshot(REPO / "goldens" / CLASS / "llama")
    dirs = ["--configs", str(REPO / "toy_configs"), "--testdata", str(REPO / "testdata")]

    assert main(["record", *dirs, "--model", "llama", "--dtype", "float32"]) == 0

    out = capsys.readouterr().out  # relative to where it ran; then what its canaries certify
    assert out.startswith(f"wrote     {Path('goldens') / LLAMA.relpath}\n          certified: catches ")
    assert (tmp_path / "goldens" / LLAMA.relpath).read_bytes() == recorded_here("llama")
    assert snapshot(REPO / "goldens" / CLASS / "llama") == bundled


def test_item7_record_never_writes_into_the_installed_package(tmp_path, capsys):
    inside = Path(veosnap.__file__).resolve().parent / "_bundled" / "goldens"
    assert main(["record", "--goldens", str(inside), "--model", "llama", "--dtype", "float32"]) == 2
    assert capsys.readouterr().err == (f"veosnap: error: {inside}: inside the installed veosnap package; goldens are "
                                       "written to ./goldens or to --goldens DIR of your project\n")
    assert not inside.exists()
    with pytest.raises(veosnap.VeosnapError, match="inside the installed veosnap package"):
        veosnap.record("llama", project=Project.resolve(goldens=inside))


@pytest.mark.parametrize("linked", ["model", "class"])
def test_item7_a_directory_that_is_a_symlink_out_of_the_goldens_root_is_not_written_through(tmp_path, capsys, linked):
    goldens, outside = tmp_path / "goldens", tmp_path / "outside"
    outside.mkdir()
    link = goldens / CLASS / "llama" if linked == "model" else goldens / CLASS
    link.parent.mkdir(parents=True)
    link.symlink_to(outside, target_is_directory=True)

    code = main(["record", "--goldens", str(goldens), "--configs", str(REPO / "toy_configs"), "--testdata",
                 str(REPO / "testdata"), "--model", "llama", "--dtype", "float32"])

    assert code == 2
    rel = link.relative_to(goldens)
    assert capsys.readouterr().err == (f"veosnap: error: {goldens / LLAMA.relpath}: cannot write through {rel}, a "
                                       f"symlink to {outside.resolve()} outside the goldens directory {goldens}\n")
    assert list(outside.rglob("*")) == []


def test_item7_the_plugin_deletes_only_through_the_goldens_root(tmp_path):
    """Unused goldens are found by the same scan as `veosnap ls`: never inside a directory linked from outside."""
    from veosnap.golden import store

    goldens, outside = tmp_path / "goldens", tmp_path / "outside"
    shutil.copytree(REPO / "goldens" / CLASS / "qwen2", outside)
    (goldens / CLASS).mkdir(parents=True)
    (goldens / CLASS / "qwen2").symlink_to(outside, target_is_directory=True)
    scan = store.scan(goldens)
    assert scan.goldens == []
    assert [(p.name, why.split(",")[0]) for p, why in scan.skipped] == \
        [(p.name, f"resolves to {outside.resolve() / p.name}") for p in sorted(outside.iterdir())]
