"""The CPU side of `tools/gpu/gpu_session.py record`: the lead's one device call records the zoo's goldens of the
GPU's class in parallel processes (`--jobs`), for chosen models (`--model`), and brings them back in tars of
at most 15 MiB. Here it records this machine's class into a scratch project, as it would on the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
gpu_session = pytest.importorskip("gpu_session")


def test_record_keys_cover_every_scenario_a_model_has_a_golden_for(repo_project):
    keys = gpu_session.record_keys(repo_project, ["seed_oss", "qwen2_vl"], [])
    assert sorted({(m, s) for m, s, _ in keys}) == [("qwen2_vl", "step"), ("qwen2_vl", "train"),
                                                     ("qwen2_vl", "vision"), ("seed_oss", "step"),
                                                     ("seed_oss", "train")]
    assert {d for _, _, d in keys} == {"float32", "bfloat16"}  # frozen_vision has the vision golden
    assert gpu_session.record_keys(repo_project, ["qwen2_vl"], ["frozen_vision"]) == [
        ("qwen2_vl", "vision", "float32"), ("qwen2_vl", "vision", "bfloat16")]
    # the costliest first: a multimodal model's media batch before a text model's step
    order = sorted(keys, key=lambda k: gpu_session._cost(repo_project, k), reverse=True)
    assert order[0][:2] in {("qwen2_vl", "vision"), ("qwen2_vl", "train")} and order[-1][:2] == ("seed_oss", "step")


@pytest.mark.heavy
def test_two_jobs_record_the_chosen_models_and_tar_what_they_recorded(scratch_project, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    gpu_session.phase_record(scratch_project, out, ["llama", "qwen2"], ["step"], budget_s=3600, jobs=2)
    data = json.loads((out / "record.json").read_text())
    assert data["jobs"] == 2 and data["verify_bad"] == [] and data["left"] == []
    made = {(r["model"], r["dtype"]) for r in data["goldens"] if r.get("written")}
    assert made == {(m, d) for m in ("llama", "qwen2") for d in ("float32", "bfloat16")}, data["goldens"]
    [tar_name] = data["tars"]
    with tarfile.open(out / tar_name) as tar:
        names = sorted(tar.getnames())
    cls = scratch_project.hardware_class
    assert names == sorted(f"{cls}/{m}/step-{d}.safetensors.zst" for m in ("llama", "qwen2")
                           for d in ("float32", "bfloat16"))
    assert "| llama | step | float32 | recorded |" in (out / "record.md").read_text()


def test_past_the_budget_nothing_starts_and_the_rest_is_printed_as_a_command(scratch_project, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    gpu_session.phase_record(scratch_project, out, ["llama"], ["step"], budget_s=-1)
    data = json.loads((out / "record.json").read_text())
    assert data["left"] == [["llama", "step"]] and data["tars"] == []
    assert "python tools/gpu/gpu_session.py record --model llama" in capsys.readouterr().out
    assert not (scratch_project.goldens / scratch_project.hardware_class / "llama").exists()


def test_without_cuda_record_skips_on_a_cpu_machine(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "gpu_session.py"), "record", "--jobs", "4",
                           "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0 and "skipped, no CUDA device" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == []
