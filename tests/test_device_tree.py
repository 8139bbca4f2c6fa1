"""tools/gpu/device_tree.py leaves out of the checkout the golden folders a device call does not need and brings
them back, git seeing nothing changed all along (a fresh git repository stands in for the project)."""

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


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "goldens").rglob("*") if p.is_file())


def test_aside_keeps_only_what_a_call_needs_git_sees_nothing_changed_and_restore_brings_everything_back(project,
                                                                                                     capsys):
    git = ["git", "-C", str(project)]
    assert device_tree.main(["aside", "--for", "real", "--root", str(project)]) == 0
    out = capsys.readouterr().out
    assert "2 golden folder(s) left out" in out and "fits" in out
    assert files(project) == ["goldens/cuda-sm90/llama-real/step-float32.safetensors.zst"]
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout == ""
    assert len(subprocess.run([*git, "ls-files"], capture_output=True, text=True).stdout.split()) == 4, \
        "the goldens left out stay tracked"

    # another call's needs: one more aside, no restore between (sizes come from the index, not the disk)
    assert device_tree.main(["aside", "--for", "suite", "--root", str(project)]) == 0
    assert "tracked tree, 2 golden folder(s) left out: 0.0 MiB" in capsys.readouterr().out
    assert files(project) == ["goldens/cuda-sm90/llama/step-float32.safetensors.zst"]

    assert device_tree.main(["restore", "--root", str(project)]) == 0
    assert "git sees the goldens unchanged" in capsys.readouterr().out
    assert files(project) == ["goldens/cpu/llama/step-float32.safetensors.zst",
                              "goldens/cuda-sm90/llama-real/step-float32.safetensors.zst",
                              "goldens/cuda-sm90/llama/step-float32.safetensors.zst"]
    assert (project / "goldens/cpu/llama/step-float32.safetensors.zst").stat().st_size == 3000
    assert device_tree.main(["restore", "--root", str(project)]) == 0, "a second restore has nothing to do"
    assert "nothing to restore" in capsys.readouterr().out


def test_a_plan_over_the_limit_leaves_everything_in_place(project, monkeypatch, capsys):
    monkeypatch.setattr(device_tree, "LIMIT", 1000)
    assert device_tree.main(["aside", "--for", "bench", "--root", str(project)]) == 2
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert len(files(project)) == 3


def test_a_base_tree_for_a_benchmark_holds_what_its_bench_reads_and_goes_only_where_git_ignores(project, capsys):
    for path in ("veosnap/__init__.py", "tools/bench/bench_scale.py", "toy_configs/llama/config.json",
                 "testdata/sequences.parquet", "pyproject.toml"):
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text("v1\n")
    (project / ".gitignore").write_text("/.whl/\n")
    subprocess.run(["git", "-C", str(project), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"],
                   check=True)
    (project / "veosnap/__init__.py").write_text("v2\n")  # the new tree, uncommitted

    assert device_tree.main(["base", "HEAD", "--root", str(project)]) == 0
    base = project / ".whl" / "base"
    assert sorted(p.name for p in base.iterdir()) == ["pyproject.toml", "testdata", "tools", "toy_configs", "veosnap"]
    assert (base / "veosnap/__init__.py").read_text() == "v1\n" and not (base / "goldens").exists()
    assert "cd .whl/base && python tools/bench/bench_scale.py" in capsys.readouterr().out
    status = subprocess.run(["git", "-C", str(project), "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout.split() == ["M", "veosnap/__init__.py"]  # the base tree is not in git's view

    assert device_tree.main(["base", "HEAD", "--root", str(project), "--into", "tools/base"]) == 2
    assert "git does not ignore it" in capsys.readouterr().err
    assert device_tree.main(["base", "no-such-rev", "--root", str(project)]) == 2
    assert "no such commit here" in capsys.readouterr().err
