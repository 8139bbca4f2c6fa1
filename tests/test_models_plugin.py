"""Every zoo model, with each built-in backend, in float32 and bfloat16, against its golden."""

from veosnap.pytest_plugin import matrix


@matrix(backends=["eager", "sdpa", "grouped_mm", "batched_mm"], dtypes=["float32", "bfloat16"])
def test_backend_matches_golden(veosnap_check, model, dtype, backend):
    report = veosnap_check(model, backend=backend, dtype=dtype)
    assert report.tensors, "a passing check compared tensors"


@matrix(dtypes=["float32", "bfloat16"])
def test_train_steps_match_golden(veosnap_check, model, dtype):
    report = veosnap_check(model, dtype=dtype, scenario="train")
    assert any(t.name == "train.grad_norm" for t in report.tensors)
