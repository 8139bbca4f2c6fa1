"""What only a CUDA machine can check: the GPU kernels against this class's goldens, the cpu goldens
checked across classes, and the sketch's Triton kernel on the device. On the CPU every test here skips
with the reason; `tools/gpu/gpu_pytest.sh` runs the whole suite on the GPU box (docs/gpu.md).

The backends and models are the cells docs/gpu.md measured passing on an H200; the CPU counterparts of
these tests (flex_attention forward only, liger skipped) are in test_backends.py.
"""

from __future__ import annotations

import pytest
import torch
from golden_repo import CLASS, ON_CUDA, REPO, needs_goldens

from veosnap.candidates import backends
from veosnap.golden import names
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.check import check

pytestmark = pytest.mark.skipif(not (ON_CUDA and torch.cuda.is_available()),
                                reason=f"needs a CUDA GPU (this machine's class is {CLASS})")


@pytest.mark.parametrize("backend, model, dtype", [
    ("sdpa_efficient", "llama", "float32"),
    ("sdpa_math", "qwen3_moe", "float32"),
    ("sdpa_cudnn", "qwen3", "bfloat16"),
    ("flex_attention", "qwen3_moe", "float32"),
    ("sdpa+grouped_mm", "mixtral", "bfloat16"),
    ("liger", "llama", "bfloat16"),
    ("liger", "qwen3", "float32"),
])
def test_gpu_kernels_pass_this_classes_goldens_with_their_gradients(repo_project: Project, backend: str, model: str,
                                                                    dtype: str) -> None:
    if backends.unavailable_here(backend.split("+")[0]):
        pytest.skip(f"{backend}: {backends.unavailable_here(backend.split('+')[0])}")
    report = check(repo_project, GoldenKey(CLASS, model, "step", dtype), backends.resolve(backend))
    assert report.status == "PASS", (report.error, report.skipped, report.worst)
    assert any(isinstance(names.parse(t.name), names.Grad) for t in report.tensors), "the backward was checked too"
    assert not any("forward only" in note for note in report.notes)


def test_a_planted_attention_bug_fails_on_the_gpu(repo_project: Project) -> None:
    fault = f"{REPO / 'tests' / 'faults.py'}:pad_leak"
    report = check(repo_project, GoldenKey(CLASS, "qwen3_moe", "step", "float32"), backends.resolve(fault))
    assert report.status == "FAIL" and report.first_divergence.startswith("layer 1 ")


@pytest.mark.parametrize("model", [pytest.param(m, marks=needs_goldens("cpu", m)) for m in ("llama", "qwen3_moe")])
def test_the_cpu_goldens_checked_here_measure_how_far_the_classes_are_apart(model: str) -> None:
    cpu = Project.resolve(goldens=REPO / "goldens", configs=REPO / "toy_configs", testdata=REPO / "testdata",
                          hardware_class="cpu")
    report = check(cpu, GoldenKey("cpu", model, "step", "float32"), backends.resolve("eager"), cross_class=True)
    assert report.passed, report.worst  # 0.15x-0.2x on an H200 (docs/gpu.md)
    assert any(note.startswith(f"cross-class: a cpu golden checked on {CLASS}") for note in report.notes)


def test_the_sketch_kernel_on_the_gpu_computes_the_torch_rule() -> None:
    pytest.importorskip("triton", reason="the sketch kernel is written in Triton")
    from veosnap.numerics import sketch, sketch_triton

    x = torch.randn(300, 5000, device="cuda")
    ours = sketch_triton.rowsketch(x, 32, 7)
    rule = sketch.rowsketch_torch(x.cpu(), 32, 7)
    scale = x.double().norm(dim=1).max().item()
    assert (ours.values.cpu() - rule.values).abs().max().item() / scale < 1e-6
    halves = torch.cat([sketch_triton.rowsketch(x[:123], 32, 7).values,
                        sketch_triton.rowsketch(x[123:], 32, 7, row_offset=123).values])
    assert torch.equal(ours.values, halves)  # a row shard's sketch: the same bits as in the whole
