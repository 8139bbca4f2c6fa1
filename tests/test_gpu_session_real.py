"""The CPU side of tools/gpu_session.py's real-shape phases: what comes back from the GPU machine
(tars of at most 15 MiB, at most 8 files, failing cells' reports) and the table for docs/gpu.md.
The phases themselves need CUDA and say so here."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
gpu_session = pytest.importorskip("gpu_session")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the phases would run (minutes each), not skip")
def test_without_cuda_the_real_phases_skip_with_the_reason(tmp_path):
    for phase in ("record-real", "matrix-real", "layouts-real"):
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_session.py"), phase, "--out", str(tmp_path)],
                              capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0 and "skipped, no CUDA device" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_goldens_are_packed_into_tars_under_the_limit(tmp_path):
    root = tmp_path / "goldens"
    files = []
    for i, size in enumerate([6000, 3000, 6000, 20000]):
        f = root / "cuda-sm90" / f"m{i}" / "step-float32.safetensors.zst"
        f.parent.mkdir(parents=True)
        f.write_bytes(bytes(size))
        files.append(f)
    out = tmp_path / "out"
    out.mkdir()
    made = gpu_session.pack_tars(files, root, out, "goldens", limit=12000)
    assert made[-1].startswith("LEFT OUT cuda-sm90/m3/") and len(made) == 3, made
    packed = []
    for name in made[:-1]:
        assert (out / name).stat().st_size <= 12000 + 10240  # tar's own end blocks
        with tarfile.open(out / name) as tar:
            packed += tar.getnames()
    assert sorted(packed) == [f"cuda-sm90/m{i}/step-float32.safetensors.zst" for i in range(3)]


def test_the_budgeted_matrix_names_failures_and_what_it_did_not_reach(tmp_path, repo_project):
    import time

    from veosnap.runs import matrix

    faults = f"{ROOT}/tests/faults.py:kv_groups_swapped"
    start = time.perf_counter()
    result = matrix.run_matrix(repo_project, ["llama", "qwen2"], ["float32"], ["eager", faults],
                               check_cells=_first_two(gpu_session._budgeted(3600, start)))
    data = gpu_session._finish_matrix(result, tmp_path, "single")
    status = {(c.model, c.backend): c.status for c in result.cells}
    assert status == {("llama", "eager"): "pass", ("llama", faults): "fail", ("qwen2", "eager"): "skip",
                      ("qwen2", faults): "skip"}
    assert data["counts"] == {"pass": 1, "fail": 1, "skip": 2, "error": 0}
    (saved,) = (tmp_path / "failures").iterdir()
    assert "llama-float32" in saved.name and '"passed": false' in saved.read_text()
    table = gpu_session._worst_table(result)
    assert "| eager/single | 1/0/1/0 | 0 |" in table and "kv_groups_swapped/single | 0/1/1/0 |" in table and "| llama float32 grad." in table


def _first_two(inner):  # noqa: ANN001, ANN202 - the budget runs out after two cells
    done = []

    def run(project, key, backend, layouts):  # noqa: ANN001, ANN202
        if len(done) >= 2:
            raise gpu_session.NotRun("not run: over --budget-s 0")
        done.append(key)
        return inner(project, key, backend, layouts)

    return run
