"""Every zoo model, with each built-in backend, in float32 and bfloat16, against its golden; layouts through
the same fixture."""

from pathlib import Path

import pytest

from veosnap.surfaces.pytest_plugin import GoldenMismatch, matrix


@matrix(backends=["eager", "sdpa", "grouped_mm", "batched_mm"], dtypes=["float32", "bfloat16"])
def test_backend_matches_golden(veosnap_check, model, dtype, backend):
    report = veosnap_check(model, backend=backend, dtype=dtype)
    assert report.tensors, "a passing check compared tensors"


@matrix(dtypes=["float32", "bfloat16"])
def test_train_steps_match_golden(veosnap_check, model, dtype):
    report = veosnap_check(model, dtype=dtype, scenario="train")
    assert any(t.name == "train.grad_norm" for t in report.tensors)


@pytest.mark.parametrize("layout", ["packed", "microbatch", "ddp", "fsdp2"])
def test_layouts_are_checked_through_the_fixture(veosnap_check, layout):
    report = veosnap_check("qwen3_moe", layout=layout)
    assert report.layout == layout and report.passed
    assert report.routes and any(t.name.startswith("grad.") for t in report.tensors)


def test_a_planted_layout_bug_fails_through_the_fixture(veosnap_check):
    planted = f"{Path(__file__).with_name('layout_faults.py')}:packed_no_restart"
    with pytest.raises(GoldenMismatch) as failed:
        veosnap_check("llama", layout=planted)
    assert failed.value.report.layout == planted and failed.value.report.first_divergence.startswith("layer 0 ")
