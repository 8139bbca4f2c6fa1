"""The train scenario: a few AdamW steps with clipping, checked against the committed train goldens.

Backends and layouts that compute the same steps pass; a clipping bug that leaves every gradient of
the first step right (the `step` scenario passes) fails on the grad norms and the updates.
Each torchrun start costs about 10 s: the passing data-parallel layouts share one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_repo import CLASS, committed_golden, gpus_for

from veosnap.candidates import backends
from veosnap.golden import names, store
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.check import check, check_layouts
from veosnap.surfaces.cli import main

TIMEOUT_S = 300
FAULTS = Path(__file__).with_name("layout_faults.py")
LOSS, GRAD_NORM, UPDATE = str(names.TRAIN_LOSS), str(names.TRAIN_GRAD_NORM), names.Update.prefix


def key(model: str, dtype: str = "float32", scenario: str = "train") -> GoldenKey:
    committed_golden(model, dtype, scenario)  # the cuda-sm90 train goldens are recorded on the GPU
    return GoldenKey(CLASS, model, scenario, dtype)


def names_over(report) -> set[str]:  # noqa: ANN001 - a CheckReport
    return {t.name for t in report.tensors if not t.passed}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["eager", "sdpa", "grouped_mm"])
def test_backends_pass_the_train_golden(repo_project: Project, model: str, dtype: str, backend: str) -> None:
    report = check(repo_project, key(model, dtype), backends.resolve(backend))
    if backend == "grouped_mm" and model == "llama":  # an experts kernel on a dense model changes nothing: n/a
        assert report.skipped and "has no experts" in report.skipped
        return
    assert report.passed, (report.error, report.worst)
    compared = {t.name for t in report.tensors}
    assert {LOSS, GRAD_NORM} <= compared
    assert any(n.startswith(UPDATE) for n in compared) and not any(n.startswith("grad.") for n in compared)
    if model == "qwen3_moe":
        assert report.routes and all(r.clear_flips == 0 for r in report.routes)


def test_a_train_golden_records_its_steps_and_clips_at_every_one(repo_project: Project) -> None:
    gold = store.read(store.path_for(repo_project.goldens, key("llama")))
    hyper = gold.manifest.reference.train
    assert gold.tensors[LOSS].shape == (hyper.steps,)
    assert (gold.tensors[GRAD_NORM] > hyper.max_norm).all(), "clipping is active at every step"
    assert "logits" not in gold.tensors and not any(n.startswith("grad.") for n in gold.tensors)


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_microbatch_accumulation_passes_on_train(repo_project: Project, model: str) -> None:
    report = check(repo_project, key(model), backends.resolve("eager"), "microbatch")
    assert report.passed, (report.error, report.worst)


@gpus_for(2)
@pytest.mark.heavy
def test_ddp_and_fsdp2_pass_on_train_and_tp_says_why_it_does_not_run(repo_project: Project) -> None:
    reports = check_layouts(repo_project, key("qwen3_moe"), backends.resolve("eager"),
                            ["ddp", "fsdp2", "tp"], nproc=2, timeout_s=TIMEOUT_S)
    ddp, fsdp2, tp = reports
    for report in (ddp, fsdp2):
        assert report.passed and not report.skipped, (report.layout, report.error, report.worst)
        assert any(t.name.startswith(UPDATE) for t in report.tensors)
    assert tp.skipped and "train" in tp.skipped


def test_clipping_per_micro_batch_fails_on_train_while_step_passes(repo_project: Project) -> None:
    eager, planted = backends.resolve("eager"), f"{FAULTS}:microbatch_clip_micro"
    assert check(repo_project, key("llama", scenario="step"), eager, planted).passed
    report = check(repo_project, key("llama"), eager, planted)
    assert not report.passed
    assert GRAD_NORM in names_over(report)
    assert any(n.startswith(UPDATE) for n in names_over(report))
    # the per-step figures say which step diverged, counting from 1, as the report's text does
    grad_norm = next(t for t in report.tensors if t.name == GRAD_NORM)
    assert grad_norm.where.startswith("step ") and " of 3: golden " in grad_norm.where, grad_norm.where
    from veosnap.render import text

    assert "/3 steps over; step " in text.checks([report])


@gpus_for(2)
@pytest.mark.heavy
def test_clipping_by_the_local_shard_norm_fails_under_fsdp2_while_step_passes(repo_project: Project) -> None:
    eager, planted = backends.resolve("eager"), f"{FAULTS}:fsdp2_clip_local"
    step = check(repo_project, key("llama", scenario="step"), eager, planted, timeout_s=TIMEOUT_S)
    assert step.passed, (step.error, step.worst)
    report = check(repo_project, key("llama"), eager, planted, timeout_s=TIMEOUT_S)
    assert not report.passed and not report.error
    assert report.worst.name == GRAD_NORM
    assert any(n.startswith(UPDATE) for n in names_over(report))


def test_cli_records_and_checks_the_train_scenario(scratch_project: Project, capsys: pytest.CaptureFixture) -> None:
    dirs = ["--goldens", str(scratch_project.goldens), "--configs", str(scratch_project.configs),
            "--testdata", str(scratch_project.testdata)]
    assert main(["record", *dirs, "--model", "qwen3", "--dtype", "float32", "--scenario", "train"]) == 0
    assert main(["record", *dirs, "--model", "qwen3", "--dtype", "float32", "--scenario", "train"]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "train-float32" in out and "unchanged" in out  # recording twice: the same bytes
    assert main(["check", *dirs, "--model", "qwen3", "--dtype", "float32", "--scenario", "train"]) == 0
    assert "train-float32" in capsys.readouterr().out
    assert not (scratch_project.goldens / CLASS / "qwen3" / "step-float32.safetensors.zst").exists()
