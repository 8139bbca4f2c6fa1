"""The reproduction of docs/findings/transformers-grouped-mm-bias-grad-bf16.md (`repro_moe_bias_grad.py`, run
from the doc) on the CPU, at a narrow width: it reproduces the finding (grouped_mm's
bfloat16 bias gradients several times eager's error), writes repro.json after every stage so a run cut
short leaves what it measured, and skips a CUDA device it does not have with a line."""

from __future__ import annotations

import json

import findings
import pytest

pytest.importorskip("transformers.models.gpt_oss")
tool = findings.load("repro_moe_bias_grad.py")


def test_grouped_mm_bias_grads_are_worse_than_eager_and_the_result_is_saved(tmp_path):
    assert tool.main(["--hidden", "64", "--tokens", "2050", "--devices", "cpu", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "repro.json").read_text())
    assert saved["done"] and saved["reference_device"] == "cpu"
    assert {r["tensor"] for r in saved["rows"]} == {"gate_up_proj_bias", "down_proj_bias"}
    assert all(r["ratio"] > 2 for r in saved["rows"]), saved["rows"]  # the finding: 3-6x at 256 rows per expert
    assert [s["stage"] for s in saved["stages"]][:2] == ["weights and inputs drawn", "float64 reference (cpu)"]


def test_a_run_over_its_budget_leaves_its_partial_result(tmp_path):
    assert tool.main(["--hidden", "32", "--tokens", "64", "--devices", "cpu", "--budget-s", "0",
                      "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "repro.json").read_text())
    assert not saved["done"] and saved["rows"] == []
    assert saved["stages"][-1]["stage"].startswith("over --budget-s 0")
    assert "float64 reference (cpu)" in [s["stage"] for s in saved["stages"]]  # what it did is kept


def test_without_cuda_a_cuda_device_is_skipped_with_a_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: False)
    assert tool.main(["--hidden", "32", "--tokens", "64", "--devices", "cuda", "--out", str(tmp_path)]) == 0
    assert "skipped cuda, no CUDA device here" in capsys.readouterr().out
    saved = json.loads((tmp_path / "repro.json").read_text())
    assert saved["done"] and saved["rows"] == [] and saved["reference_device"] == "cpu"
