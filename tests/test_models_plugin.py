"""Every zoo model, with each built-in backend, in float32 and bfloat16, against its golden; layouts through
the same fixture. These checks go through the plugin, which checks this machine's hardware class."""

import pytest
from golden_repo import CLASS, committed_golden, gpus_for

from veosnap.surfaces.pytest_plugin import matrix


@pytest.fixture(autouse=True)
def _this_machines_goldens(veosnap_project):  # noqa: ANN001
    if veosnap_project.hardware_class != CLASS:
        pytest.skip(f"--veosnap-hardware-class {veosnap_project.hardware_class}: these checks run the models on this "
                    f"machine ({CLASS}), so they check its own class's goldens")


@matrix(backends=["eager", "sdpa", "grouped_mm", "batched_mm"], dtypes=["float32", "bfloat16"])
def test_backend_matches_golden(veosnap_check, model, dtype, backend):
    report = veosnap_check(model, backend=backend, dtype=dtype)
    assert report.tensors, "a passing check compared tensors"


@matrix(dtypes=["float32", "bfloat16"])
def test_train_steps_match_golden(veosnap_check, model, dtype):
    committed_golden(model, dtype, "train")  # the cuda-sm90 train goldens are recorded on the GPU
    report = veosnap_check(model, dtype=dtype, scenario="train")
    assert any(t.name == "train.grad_norm" for t in report.tensors)


@pytest.mark.parametrize("layout", ["packed", "microbatch", pytest.param("ddp", marks=gpus_for(2)),
                                    pytest.param("fsdp2", marks=gpus_for(2))])
@pytest.mark.heavy
def test_layouts_are_checked_through_the_fixture(veosnap_check, layout):
    report = veosnap_check("qwen3_moe", layout=layout)
    assert report.layout == layout and report.passed
    assert report.routes and any(t.name.startswith("grad.") for t in report.tensors)
