"""The ten models of issue 15 (hybrid linear attention, VLMs, omni thinkers) checked like the rest of the zoo.

Every model passes with every built-in backend the CPU runs and with every layout that applies (the matrix
machinery, one row per model and scenario), against the committed goldens of this machine's class (`golden_repo.CLASS`; a test whose golden is not
recorded for the class skips saying how to record it), but for the cells
`EXPECTED` names (findings about the reference, in docs/models.md), which must fail or skip exactly as
named; bugs planted in the new
parts (`tests/mm_faults.py`) fail naming the tensor where they first show; a rank whose encoder runs alone
(`fsdp2_asym`) ends the check with an error naming where each rank stopped, never a hang.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import findings
import pytest

from veosnap.candidates import backends
from veosnap.candidates.layouts import registry
from veosnap.golden.key import GoldenKey
from veosnap.reference import scenarios
from veosnap.reference.zoo import Project, load_config
from veosnap.runs.check import check, check_layouts
from veosnap.runs.matrix import Row, default_check, run_matrix
from veosnap.surfaces.cli import main

from golden_repo import CLASS, ON_CUDA, committed_golden, gpus_for

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAULTS = HERE / "mm_faults.py"
SLOW = os.environ.get("VEOSNAP_SLOW") == "1"
TIMEOUT_S = 300

# Each model with the scenario that exercises most of it: its media (vision, audio), else the text batch.
NEW_MODELS = {
    "qwen3_5": "vision", "qwen3_5_moe": "vision", "seed_oss": "step", "deepseek_v4": "step",
    "qwen2_vl": "vision", "qwen2_5_vl": "vision", "qwen3_vl": "vision", "qwen3_vl_moe": "vision",
    "qwen2_5_omni": "audio", "qwen3_omni_moe": "audio",
}
# Further rows: a VLM on a text-only batch (its towers idle on every rank), an omni thinker on images and
# videos, a frozen vision tower (checked against the vision golden without the tower's gradients).
MORE_ROWS = [("qwen2_5_vl", "step"), ("qwen2_5_omni", "vision"), ("qwen3_vl", "frozen_vision")]
BACKENDS = ["eager", "sdpa", "flex_attention", "grouped_mm", "batched_mm"]
# ddp and fsdp2 run one rank per GPU on CUDA: left out of the row where fewer than 2 are visible.
TWO_RANKS = not ON_CUDA or __import__("torch").cuda.device_count() >= 2
# (eager under `single` is the backends' first cell already)
LAYOUTS = ["packed", "microbatch", *(["ddp", "fsdp2"] if TWO_RANKS else [])]
# Cells that do not pass, and the words their reason must hold; every other cell passes. Findings, not
# bugs of veosnap's: docs/models.md says why each one is right.
EXPECTED = {
    # HF's torch fallbacks for Gated DeltaNet ignore sequence boundaries: an eager packed row runs each
    # sequence's recurrent state into the next (flash-linear-attention's kernels honour them: `fla`).
    ("qwen3_5", "vision", "eager", "packed"): ("fail", "layers.0.output"),
    ("qwen3_5_moe", "vision", "eager", "packed"): ("fail", "layers.0.output"),
    ("deepseek_v4", "step", "eager", "packed"): ("skip", "compressors cut windows"),
    ("deepseek_v4", "step", "sdpa", "single"): ("skip", "does not support an attention implementation"),
    # Qwen3-Omni's audio encoder pads every chunk to the batch's longest and its convolutions read that
    # padding into a clip's last frames: a clip's encoding depends on the other clips in its batch, so
    # any split of the rows changes it.
    ("qwen3_omni_moe", "audio", "eager", "microbatch"): ("fail", "audio.0.output"),
    ("qwen3_omni_moe", "audio", "eager", "ddp"): ("fail", "audio.0.output"),
    ("qwen3_omni_moe", "audio", "eager", "fsdp2"): ("fail", "audio.0.output"),
}
# transformers declines flex attention for most of these classes, and on CUDA veosnap's flex backend declines
# toy head dims below 16 (inductor's limit; qwen3_vl_moe's vision tower has 8): the tests check they say so.
DECLINES_FLEX = ("does not support an attention implementation through torch's flex_attention",
                 "flex_attention on CUDA needs attention head dims of at least 16")


@functools.cache
def cpu_flex_wrong_here() -> bool:
    """Whether torch's compiled flex_attention gives wrong rows on this CPU (lengths not a multiple of 16: seen
    with torch 2.13 on an AVX2 machine, not on the machines that recorded the goldens;
    docs/findings/torch-flex-attention-cpu.md). qwen3_vl_moe's vision tower runs such lengths."""
    return findings.load("repro_flex_cpu.py").cpu_flex_is_wrong_here()


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class=CLASS)


def key_of(model: str, scenario: str, dtype: str = "float32") -> GoldenKey:
    """This class's key, or the test skips where its golden is not recorded (`committed_golden`)."""
    key = GoldenKey(CLASS, model, scenario, dtype)
    committed_golden(model, dtype, key.recorded.scenario)
    return key


def _expected(model: str, scenario: str, backend: str, layout: str) -> tuple[str, str]:
    if (model, scenario, backend, layout) in EXPECTED:
        return EXPECTED[model, scenario, backend, layout]
    return "pass", ""


@pytest.mark.heavy
@pytest.mark.parametrize(("model", "scenario"), [*NEW_MODELS.items(), *MORE_ROWS])
def test_every_backend_and_layout_passes(project: Project, model: str, scenario: str) -> None:
    """Backends on one process, layouts with the eager backend: one torchrun per row for ddp and fsdp2."""
    key_of(model, scenario)
    check_cells = default_check(nproc=2, timeout_s=TIMEOUT_S)
    by_backend = run_matrix(project, [model], ["float32"], BACKENDS, ["single"], check_cells=check_cells,
                            scenario=scenario)
    by_layout = run_matrix(project, [model], ["float32"], ["eager"], LAYOUTS, check_cells=check_cells,
                           scenario=scenario)
    cells = [*by_backend.cells, *by_layout.cells]
    assert len(cells) == len(BACKENDS) + len(LAYOUTS)
    for cell in cells:
        where = f"{model}/{scenario} {cell.backend}/{cell.layout}: {cell.status} {cell.reason}"
        if cell.backend == "flex_attention" and cell.status == "skip":
            assert any(reason in cell.reason for reason in DECLINES_FLEX), where
            continue
        if cell.backend == "flex_attention" and model == "qwen3_vl_moe" and not ON_CUDA and cpu_flex_wrong_here():
            # torch's bug, caught: the check fails from the first block where flex runs those lengths
            assert cell.status == "fail" and (cell.report.first_divergence or "").startswith("vision block 0"), where
            continue
        if cell.status == "skip" and "has no experts" in cell.reason:  # an experts kernel on a dense model: n/a
            assert cell.backend in ("grouped_mm", "batched_mm"), where
            continue
        status, words = _expected(model, scenario, cell.backend, cell.layout)
        assert cell.status == status and words in cell.reason, where
    eager = by_backend.cell(Row(model, "float32"), by_backend.columns[0])
    compared = {t.name for t in eager.report.tensors}
    assert {"loss", "logits", "layers.0.output"} <= compared
    if scenario in ("vision", "frozen_vision"):
        assert {"vision.0.output", "vision.merger.output"} <= compared
    if scenario == "audio":
        assert "audio.0.output" in compared


@pytest.mark.skipif(not SLOW, reason="torch.compile's first step takes about a minute on 2 CPU cores; VEOSNAP_SLOW=1 runs it")
def test_compile_passes_on_one_new_model(project: Project) -> None:
    report = check(project, key_of("seed_oss", "step"), backends.resolve("compile"))
    assert report.passed, (report.error, report.worst)


@pytest.mark.heavy
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", list(NEW_MODELS))
def test_every_committed_golden_checks_against_its_own_reference(project: Project, model: str, dtype: str) -> None:
    config = load_config(project.configs, model).config
    for scenario in scenarios.applicable(config):
        key = GoldenKey(CLASS, model, scenario.name, dtype)
        committed_golden(model, dtype, key.recorded.scenario)  # else a skip saying how to record this class's
        report = check(project, key, backends.resolve("eager"))
        assert report.passed, (str(key), report.error, report.worst)


PLANTED = [
    # (model, scenario, bug, the first diverging block as reports name it)
    ("qwen2_vl", "vision", "patch_off_by_one", "vision.0.output"),
    ("qwen3_vl_moe", "vision", "patch_off_by_one", "vision.0.output"),
    ("qwen2_5_omni", "vision", "patch_off_by_one", "vision.0.output"),
    ("qwen2_vl", "vision", "video_rope_section_wrong", "layers.0.output"),
    ("qwen2_5_vl", "vision", "video_rope_section_wrong", "layers.0.output"),
    ("qwen3_5", "step", "decay_applied_twice", "layers.0.output"),
    ("qwen3_5_moe", "vision", "decay_applied_twice", "layers.0.output"),
    ("qwen2_5_omni", "audio", "audio_shifted_one_placeholder", "layers.0.output"),
    ("qwen3_omni_moe", "audio", "audio_shifted_one_placeholder", "layers.0.output"),
]


@pytest.mark.parametrize(("model", "scenario", "bug", "first"), PLANTED)
def test_a_bug_planted_in_a_new_part_fails_at_its_tensor(project: Project, model: str, scenario: str, bug: str,
                                                         first: str) -> None:
    report = check(project, key_of(model, scenario), backends.resolve(f"{FAULTS}:{bug}"))
    assert not report.error and not report.skipped, report.error or report.skipped
    assert not report.passed
    assert f"({first}," in report.first_divergence
    failing = {t.name for t in report.tensors if not t.passed}
    assert first in failing
    if bug == "audio_shifted_one_placeholder":  # the encoder is right; the scatter after it is not
        assert not any(name.startswith("audio.") for name in failing)


def test_the_wrong_video_rope_needs_positions_that_differ_on_t_h_w(project: Project) -> None:
    """Text rows have equal t, h and w positions: the text-only golden cannot see the sections' order."""
    key = key_of("qwen2_vl", "step")
    assert check(project, key, backends.resolve(f"{FAULTS}:video_rope_section_wrong")).passed


@pytest.mark.parametrize("model", ["qwen2_vl", "qwen3_5"])
def test_a_frozen_vision_tower_that_trains_fails_on_its_gradients(project: Project, model: str) -> None:
    key = key_of(model, "frozen_vision")
    assert check(project, key, backends.resolve("eager")).passed
    report = check(project, key, backends.resolve(f"{FAULTS}:unfrozen_vision"))
    assert not report.passed and report.first_divergence is None
    failing = {t.name for t in report.tensors if not t.passed}
    assert failing and all(name.startswith("grad.model.visual.") for name in failing)
    assert "vision encoder" in report.first_gradient_divergence


def test_bugs_skip_models_without_the_part_they_break(project: Project) -> None:
    report = check(project, key_of("seed_oss", "step"), backends.resolve(f"{FAULTS}:patch_off_by_one"))
    assert report.skipped and "no vision encoder" in report.skipped


@pytest.mark.heavy
@gpus_for(2)
def test_an_encoder_on_one_rank_only_is_an_error_naming_where_each_rank_stopped(project: Project) -> None:
    """fsdp2_asym: rank 0 gets the text-only rows, rank 1 the rows with media; FSDP2 shards the vision blocks,
    so rank 1 waits in an all-gather rank 0 never joins. The check ends within its timeout with an error; a
    framework's fix (dummy encoder forwards on a rank without media) passes."""
    key = key_of("qwen2_vl", "vision")
    assert "fsdp2_asym" in registry.names()
    [hang] = check_layouts(project, key, backends.resolve("eager"), ["fsdp2_asym"], nproc=2, timeout_s=120)
    assert hang.error and not hang.passed
    # Rank 0 (no media) is somewhere in the language model: how far its collectives get before rank 1's
    # mismatched all-gather stops it depends on the timing.
    assert re.search(r"rank 0 in (forward|backward) of decoder layer \d", hang.error), hang.error
    assert "rank 1 in forward of model.visual.blocks.0" in hang.error
    [fixed] = check_layouts(project, key, backends.resolve(f"{FAULTS}:dummy_encoders"), ["fsdp2_asym"], nproc=2,
                            timeout_s=TIMEOUT_S)
    assert fixed.passed, (fixed.error, fixed.worst)


def test_a_scenario_a_model_cannot_run_is_a_skip_naming_the_encoder(project: Project,
                                                                     capsys: pytest.CaptureFixture) -> None:
    [report] = check_layouts(project, GoldenKey(CLASS, "seed_oss", "audio", "float32"), backends.resolve("eager"),
                             ["single"])
    assert report.skipped and "needs an audio encoder" in report.skipped
    code = main(["check", "--goldens", str(ROOT / "goldens"), "--configs", str(ROOT / "toy_configs"),
                 "--testdata", str(ROOT / "testdata"), "--hardware-class", CLASS, "--model", "seed_oss",
                 "--dtype", "float32", "--scenario", "vision"])
    out = capsys.readouterr().out
    assert code == 0 and "vision" in out and "skip" in out.lower()
