"""Real shapes in bfloat16: the RoPE bugs that matter there, and isolation of a sketched golden's layers.

The golden here is narrow (llama at toy width, one sequence of 2049 tokens: positions past 2048) and recorded
in bfloat16 with `--sketch always`, so its layer outputs are sketches, as a real-shape golden's are. A check
does not isolate such a golden's layers by default (at 1B that costs several times the step: the reference's
forward and a float64 copy's); `isolate=True` (`veosnap check --isolate`) does, and then a 1% systematic
error fails there as it does on the toys.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_repo import CLASS, built_once

from veosnap.candidates import backends
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.render import text
from veosnap.runs.check import check
from veosnap.runs.record import record
from veosnap.runs.verdict import CheckReport

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).parent
MODEL = "narrow-long-bf16"


def _record(root: Path) -> None:
    (root / "configs" / MODEL).mkdir(parents=True)
    config = json.loads((ROOT / "toy_configs" / "llama" / "config.json").read_text())
    config.update({"vocab_size": 512, "max_position_embeddings": 8192})
    (root / "configs" / MODEL / "config.json").write_text(json.dumps(config))
    (root / "configs" / MODEL / "veosnap.json").write_text(
        json.dumps({"tier": "real", "batch": {"source": "realshape.parquet", "rows": [[2]]}}))
    record(_project(root), MODEL, "bfloat16", sketch="always", certify=False)


def _project(root: Path) -> Project:
    return Project(goldens=root / "goldens", configs=root / "configs", testdata=ROOT / "testdata", hardware_class=CLASS)


@pytest.fixture(scope="module")
def narrow_bf16(tmp_path_factory) -> Project:
    return _project(built_once(tmp_path_factory, "narrow-bf16", _record))


def run(project: Project, backend: str, isolate: bool = False) -> CheckReport:
    report = check(project, GoldenKey(CLASS, MODEL, "step", "bfloat16"), backends.resolve(backend), isolate=isolate)
    assert not report.error, report.error
    return report


@pytest.mark.heavy
def test_a_rotary_table_rounded_to_bfloat16_is_the_reference_itself_in_bfloat16(narrow_bf16):
    """transformers casts the rotary table to the activations' dtype: rounding it to bfloat16 changes nothing in a
    bfloat16 model, so the check must pass it (it fails in float32: tests/test_realshape.py)."""
    planted = run(narrow_bf16, f"{HERE / 'realshape_faults.py'}:rope_low_precision_far")
    eager = run(narrow_bf16, "eager")
    assert planted.passed
    assert [(t.name, t.error) for t in planted.tensors] == [(t.name, t.error) for t in eager.tensors]


@pytest.mark.heavy
def test_rotary_angles_in_bfloat16_past_2048_fail_in_isolation_naming_the_rotary_table(narrow_bf16):
    """One token at position 2048 gets a wrong rotation. The whole model barely moves (a random model's attention
    is diffuse: 0.19x on layer 0 here); the rotary table, an isolated part, is off by far more than rounding."""
    report = run(narrow_bf16, f"{HERE / 'realshape_faults.py'}:rope_angle_low_precision_far", isolate=True)
    assert not report.passed
    worst = report.isolated_ranked()[0]
    assert worst.place == "rotary table" and worst.ratio > 5, worst


@pytest.mark.heavy
def test_a_sketched_goldens_layers_are_isolated_only_when_asked(narrow_bf16):
    default = run(narrow_bf16, "eager")
    assert not default.isolated and "--isolate" in default.not_isolated
    assert "isolated parts: not checked (a real-shape golden" in text.checks([default])

    asked = run(narrow_bf16, "sdpa", isolate=True)  # a legitimate kernel: no false alarm in isolation
    assert asked.passed and asked.isolated and not asked.not_isolated
    assert "--isolate" in asked.selection


@pytest.mark.heavy
def test_isolated_a_one_percent_error_fails_a_sketched_golden_naming_its_place(narrow_bf16, monkeypatch):
    monkeypatch.setenv("VEOSNAP_FAULT_SCALE", "0.01")
    report = run(narrow_bf16, f"{HERE / 'scaled_faults.py'}:one_head_scaled", isolate=True)
    assert not report.passed
    worst = report.isolated_ranked()[0]
    assert not worst.passed and worst.place.endswith("heads, head 0"), worst
