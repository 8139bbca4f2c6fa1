"""tools/gpu/device_tree.py sets aside the golden folders a device call does not need and puts them back,
with git seeing nothing changed (a fresh git repository stands in for the project)."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest
from golden_repo import REPO

spec = importlib.util.spec_from_file_location("device_tree", REPO / "tools" / "gpu" / "device_tree.py")
device_tree = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_tree)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for folder, size in (("goldens/cpu/llama", 3000), ("goldens/cuda-sm90/llama", 2000),
                         ("goldens/cuda-sm90/llama-real", 5000)):
        (root / folder).mkdir(parents=True)
        (root / folder / "step-float32.safetensors.zst").write_bytes(b"x" * size)
    (root / "README.md").write_text("readme\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"],
                   check=True)
    return root


def test_aside_for_a_real_shape_call_keeps_only_those_goldens_and_restore_puts_everything_back(project, tmp_path,
                                                                                              capsys):
    stash = tmp_path / "stash"
    args = ["--root", str(project), "--stash", str(stash)]

    assert device_tree.main(["aside", "--for", "real", *args]) == 0
    out = capsys.readouterr().out
    assert "2 golden folder(s) set aside" in out and "fits" in out
    assert sorted(p.name for p in (project / "goldens").glob("*/*")) == ["llama-real"]
    assert (stash / "goldens/cpu/llama/step-float32.safetensors.zst").stat().st_size == 3000

    assert device_tree.main(["aside", "--for", "real", *args]) == 2, "a second aside before restore is refused"

    assert device_tree.main(["restore", *args]) == 0
    assert "git sees the goldens unchanged" in capsys.readouterr().out
    assert sorted(str(p.relative_to(project)) for p in (project / "goldens").glob("*/*")) == [
        "goldens/cpu/llama", "goldens/cuda-sm90/llama", "goldens/cuda-sm90/llama-real"]


def test_a_plan_over_the_limit_moves_nothing(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(device_tree, "LIMIT", 1000)
    assert device_tree.main(["aside", "--for", "bench", "--root", str(project), "--stash", str(tmp_path / "s")]) == 2
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert len(list((project / "goldens").glob("*/*"))) == 3
