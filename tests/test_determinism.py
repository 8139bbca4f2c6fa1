"""Determinism: recording twice gives identical bytes; checking twice gives identical reports."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_repo import CLASS

from veosnap.reference.zoo import Project
from veosnap.runs.record import record
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model", ["qwen3_moe", "llama"])
def test_recording_twice_gives_identical_bytes(tmp_path, model):
    first = record(Project.resolve(goldens=tmp_path / "a", hardware_class=CLASS), model, "float32")
    second = record(Project.resolve(goldens=tmp_path / "b", hardware_class=CLASS), model, "float32")
    assert first.written and second.written
    assert first.path.read_bytes() == second.path.read_bytes()


def test_re_recording_leaves_an_identical_golden_untouched(tmp_path):
    project = Project.resolve(goldens=tmp_path, hardware_class=CLASS)
    first = record(project, "llama", "bfloat16")
    stamp = first.path.stat().st_mtime_ns
    again = record(project, "llama", "bfloat16")
    assert (first.written, again.written) == (True, False)
    assert again.path.stat().st_mtime_ns == stamp


def test_checking_twice_gives_identical_reports(capsys):
    # batched_mm on CPU varies from run to run unless checks run deterministically: it keeps this honest
    argv = ["check", "--goldens", str(REPO / "goldens"), "--hardware-class", CLASS, "--model", "qwen3_moe",
            "--model", "llama", "--dtype", "float32", "--backend", "sdpa+batched_mm", "--format", "json"]
    outputs = []
    for _ in range(2):
        main(argv)
        out, err = capsys.readouterr()
        assert err == ""
        outputs.append(out)
    assert outputs[0] == outputs[1]
    assert '"tensors": [' in outputs[0]
