"""Every zoo model, with each built-in backend, in float32 and bfloat16, against its golden; layouts through
the same fixture."""

import pytest

from veosnap.surfaces.pytest_plugin import matrix


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
