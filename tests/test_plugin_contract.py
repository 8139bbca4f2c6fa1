"""The plugin contract a training framework uses (issue 14, docs/backends.md), one test per item, each with
a planted bug that must fail. The backends are in `tests/plugin_backends.py`, given by file SPEC as a
framework's would be; torchrun starts cost seconds, so each multi-process check runs its layouts in one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from golden_repo import CLASS, alike_everywhere, eager_figures, figures, gpus_for, skip_unless_reproduced
import torch

import veosnap
from veosnap.candidates import backends
from veosnap.candidates.layouts import torchrun
from veosnap.errors import VeosnapError
from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.reference import models
from veosnap.reference.zoo import Project, load_config, load_golden
from veosnap.render import json as render_json
from veosnap.render import text as render_text

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PLUGIN = "tests/plugin_backends.py"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class=CLASS)  # this machine's goldens: cpu here, cuda-sm90 on an H200


@pytest.fixture(autouse=True)
def _from_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the backends are named by a path relative to the repository


def check(model: str, backend: str, *layouts: str, project: Project | None = None) -> dict[str, veosnap.CheckReport]:
    spec = backend if backend == "eager" else f"{PLUGIN}:{backend}"
    reports = veosnap.check(model, spec, "float32", layouts=layouts or ("single",), project=project,
                            timeout_s=TIMEOUT_S)
    return {r.layout: r for r in reports}


def events(path: Path) -> dict[str, list[str]]:
    """The events the backends wrote, by rank ('-' in process)."""
    by_rank: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        rank, _, text = line.partition(" ")
        by_rank.setdefault(rank, []).append(text)
    return by_rank


# --- 1. a loss computed without logits ----------------------------------------------------------------


def test_a_candidate_without_logits_is_checked_on_everything_else(project: Project) -> None:
    reports = check("llama", "fused_loss", "single", "microbatch", project=project)
    for report in reports.values():
        assert report.passed, (report.layout, report.error, report.worst)
        assert "logits" not in {t.name for t in report.tensors}
        assert {"loss", "grad.lm_head.weight", "layers.1.output"} <= {t.name for t in report.tensors}
        assert report.absent["logits"].startswith("not produced by the candidate")
        assert any(note.startswith("logits: not produced by the candidate") for note in report.notes)
    document = json.loads(render_json.checks(list(reports.values())))["results"][0]
    assert "fused or chunked loss" in document["not_compared"]["logits"]


def test_a_fused_loss_that_counts_padding_fails_without_logits(project: Project) -> None:
    (report,) = check("llama", "fused_loss_counts_padding", project=project).values()
    assert report.status == "FAIL"
    assert {"loss", "grad.lm_head.weight"} <= {t.name for t in report.tensors if not t.passed}


# --- 2. routes from the experts' inputs ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["one_tensor_router", "one_tensor_router_top_k_on_block"])
def test_a_router_returning_only_its_logits_is_read_right(project: Project, backend: str) -> None:
    (report,) = check("qwen3_moe", backend, project=project).values()
    assert report.passed, (report.routes, report.worst)
    assert [(r.layer, r.tokens, r.clear_flips, r.unreadable) for r in report.routes] == [(0, 86, 0, ""), (1, 86, 0, "")]
    # The same function: the reference's bits, route weights included, so every tensor's figures are the
    # eager backend's on this machine (all 0 where the golden was recorded).
    assert figures(report) == eager_figures(project, "qwen3_moe")
    assert {"routes.0.weights", "routes.1.weights"} <= {t.name for t in report.tensors}


def test_a_flip_through_a_one_tensor_router_is_a_routing_difference_replayed_at_the_experts(project: Project) -> None:
    (report,) = check("qwen3_moe", "one_tensor_router_flips_a_token", project=project).values()
    assert report.status == "FAIL"
    assert [r.message() for r in report.routes] == [
        f"routing differs: layer {layer} sends 1 of 86 tokens to other experts than the golden" for layer in (0, 1)]
    # Forced onto the golden's experts at the experts' inputs, weighed from the router's own logits:
    # every tensor is then the reference's again.
    assert report.route_replay and all(t.passed for t in report.tensors)


def test_without_router_logits_routes_are_compared_and_replay_says_it_cannot_force(project: Project) -> None:
    (report,) = check("qwen3_moe", "hidden_logits_router_flips_a_token", project=project).values()
    assert report.status == "FAIL" and [r.clear_flips for r in report.routes] == [1, 1]
    assert any("route replay could not force layer 0" in note and "no [tokens, 8] logits" in note
               for note in report.notes), report.notes


def test_routes_that_cannot_be_read_are_said_not_reported_as_every_token_rerouted(project: Project) -> None:
    reports = check("qwen3_moe", "experts_bypassed", "single", "packed", project=project)
    for report in reports.values():
        assert report.passed, (report.layout, report.routes, report.worst)
        assert [r.clear_flips for r in report.routes] == [0, 0]
        assert all(r.unreadable and "not called" in r.unreadable for r in report.routes)
        assert "routes.0.weights" not in {t.name for t in report.tensors}
        text = render_text.checks([report])
        assert "routes not readable in layer 0" in text and "sends 86 of 86" not in text


def test_routes_that_cannot_be_read_in_the_train_scenario_are_said_too(project: Project) -> None:
    (report,) = veosnap.check("qwen3_moe", f"{PLUGIN}:experts_bypassed", "float32", scenario="train", project=project)
    assert report.passed and all("not called" in r.unreadable for r in report.routes), report.routes


def test_a_moe_block_without_a_readable_router_is_an_absence_not_a_router_the_golden_must_hold() -> None:
    """Routes of a router-less block can be read at its experts' inputs when checking, but a golden needs the
    router's logits (margins): coverage counts it as unread, so the recorder says why its routes are absent."""
    from veosnap.reference import coverage, probes

    model = models.build(load_config(ROOT / "toy_configs", "qwen3_moe"), torch.float32)
    made = coverage.produces(model)
    assert made.routers == {"model.layers.0.mlp.gate": 0, "model.layers.1.mlp.gate": 1} and made.unread == ()
    for layer in model.model.layers:
        layer.mlp.gate = torch.nn.Identity()  # no weight row per expert beside the experts
    made = coverage.produces(model)
    assert made.routers == {} and made.unread == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert [a.kind for a in coverage.absences(made, probes.found_unread(model))] == ["router_unread"]


@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_recorder_still_records_the_committed_moe_goldens_byte_for_byte(project: Project, scratch_project: Project,
                                                                           model: str) -> None:
    """Routes read at the experts' inputs are the ones the router's output gave: the same golden (its trail aside)."""
    import transformers

    committed = store.path_for(project.goldens, GoldenKey(CLASS, model, "step", "float32"))
    recorded = load_golden(project, GoldenKey(CLASS, model, "step", "float32")).manifest.provenance
    if (recorded.torch, recorded.transformers) != (torch.__version__, transformers.__version__):
        pytest.skip(f"the golden was recorded with torch {recorded.torch} / transformers {recorded.transformers}")
    outcome = veosnap.record(model, "float32", project=scratch_project)
    fresh, kept = store.read(outcome.path), store.read(committed)
    # On any machine: the same tensors, inputs, expert ids and manifest but for the figures it measures.
    assert alike_everywhere(fresh) == alike_everywhere(kept)
    skip_unless_reproduced()  # the figures too, where this machine computes the committed bits
    # Everything but the trail: a refreshed golden's manifest also holds its approvals (and so another hash).
    assert fresh.manifest.payload_hash == kept.manifest.payload_hash
    # The canaries' ratios are measured by checking planted bugs, and another CPU of the class measures them in
    # other digits though its reference is the same bits (an AVX-512 EPYC: 73.531 against 73.525): close.
    measured, certified = fresh.manifest.reference.sensitivity, kept.manifest.reference.sensitivity
    assert set(measured) == set(certified)
    assert all(measured[canary] == pytest.approx(certified[canary], rel=1e-3) for canary in certified)

    def but_trail_and_ratios(m):  # noqa: ANN001, ANN202
        return replace(m, approvals=[], manifest_hash="", reference=replace(m.reference, sensitivity=None))

    assert but_trail_and_ratios(fresh.manifest) == but_trail_and_ratios(kept.manifest)


# --- 3. a generator backend's patch stays applied while any layout runs ----------------------------------


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_generator_backends_stay_applied_under_packed_and_fsdp2_and_are_undone_after(
        project: Project, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "events.txt"
    monkeypatch.setenv("VEOSNAP_TEST_EVENTS", str(log))
    reports = check("llama", "patched_while_running", "packed", "fsdp2", project=project)
    assert all(r.passed for r in reports.values()), {k: (r.error, r.worst) for k, r in reports.items()}
    seen = events(log)
    assert set(seen) == {"-", "0", "1"}  # in process (packed) and both ranks (fsdp2)
    for rank, lines in seen.items():
        assert lines[0] == "patched" and lines[-1] == "restored", (rank, lines)
        assert set(lines[1:-1]) == {"forward patched=True"}, (rank, lines)


# --- 4. where it runs; a framework that parallelizes the model itself -----------------------------------


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_a_backend_is_told_where_it_runs_in_process_and_on_every_rank(project: Project) -> None:
    reports = {**check("qwen3_moe", "where", "single", "packed", project=project),
               **check("qwen3_moe", "where", "ddp", "fsdp2", "hsdp", "ep", "sp", project=project)}
    told = {layout: dict(item.split("=", 1) for item in r.skipped.split(" ")) for layout, r in reports.items()}
    assert {layout: (t["layout"], t["rank"], t["dp"], t["mesh"], t["distributed"]) for layout, t in told.items()} == {
        "single": ("single", "0/1", "0/1", "none", "False"),
        "packed": ("packed", "0/1", "0/1", "none", "False"),
        "ddp": ("ddp", "0/2", "0/2", "none", "True"),
        "fsdp2": ("fsdp2", "0/2", "0/2", "shard:2", "True"),
        "hsdp": ("hsdp", "0/2", "0/2", "replicate:2,shard:1", "True"),
        "ep": ("ep", "0/2", "0/2", "ep:2", "True"),
        "sp": ("sp", "0/2", "0/2", "sp:2", "True"),
    }
    assert all(t["accessor"] == "True" and t["golden"] == f"{CLASS}/qwen3_moe/step-float32" for t in told.values())
    assert told["ep"]["sharded_before"] == "True"  # the ep layout hands an ordinary backend transformers' EP model


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_a_backend_that_parallelizes_gets_the_plain_reference_even_under_ep(project: Project) -> None:
    (report,) = check("qwen3_moe", "where_parallelizing", "ep", project=project).values()
    assert "layout=ep" in report.skipped and "sharded_before=False" in report.skipped


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_a_framework_shards_the_model_itself_and_the_layout_does_not_shard_it_again(project: Project) -> None:
    reports = check("llama", "own_fsdp2", "fsdp2", "hsdp", project=project)
    for report in reports.values():
        assert report.passed, (report.layout, report.error, report.worst)
        assert any("parallelized by the backend" in note for note in report.notes)


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_full_gradients_read_a_framework_reduction_and_a_forgotten_reduction_fails(project: Project) -> None:
    assert check("llama", "own_reduction", "ddp", project=project)["ddp"].passed
    report = check("llama", "own_reduction_forgotten", "fsdp2", project=project)["fsdp2"]
    assert report.status == "FAIL" and report.first_gradient_divergence.startswith("lm_head")


def test_the_context_outside_a_run_is_a_one_line_error_and_prepare_gives_an_in_process_one() -> None:
    with pytest.raises(VeosnapError, match="only while veosnap runs a candidate"):
        veosnap.context()
    model = models.build(load_config(ROOT / "toy_configs", "llama"), torch.float32)
    seen = []
    with backends.Backend("told", (lambda model, ctx: seen.append(ctx),)).prepare(model) as candidate:
        assert candidate.model is model and veosnap.context() is seen[0]
    assert (seen[0].layout, seen[0].world, seen[0].distributed) == ("single", 1, False)


def test_two_steps_of_a_combination_cannot_both_adapt_the_batch() -> None:
    model = models.build(load_config(ROOT / "toy_configs", "llama"), torch.float32)
    both = backends.resolve(f"{PLUGIN}:collator_form+{PLUGIN}:collator_form")
    with pytest.raises(VeosnapError, match="both .collator_form. and .collator_form. set adapt_batch; one step may"):
        with both.prepare(model):
            pass


# --- 5. a candidate that prints cannot corrupt --format json ------------------------------------------


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_a_candidate_printing_to_stdout_leaves_the_json_document_whole() -> None:
    spec = f"{PLUGIN}:chatty+{PLUGIN}:collator_form"  # and adapts the batch, under a layout of every kind
    done = subprocess.run([sys.executable, "-m", "veosnap", "check", "--model", "llama", "--dtype", "float32",
                           "--backend", spec, "--layout", "single", "--layout", "fsdp2", "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    document = json.loads(done.stdout)  # the whole stdout is the document
    assert done.returncode == 0 and document["passed"], done.stdout[-2000:] + done.stderr[-2000:]
    assert [r["layout"] for r in document["results"]] == ["single", "fsdp2"]
    for line in ("[chatty] imported", "[chatty] building my model", "[chatty] a C extension writes to fd 1",
                 "[chatty] forward"):
        assert line in done.stderr


# --- 6. a framework that takes the batch in its own form ---------------------------------------------


def test_a_backend_that_adapts_the_batch_is_compared_on_the_golden_tokens(project: Project) -> None:
    reports = check("llama", "collator_form", "single", "packed", "microbatch", project=project)
    for report in reports.values():
        assert report.passed, (report.layout, report.error, report.worst)
        assert {"logits", "layers.0.output", "layers.1.output"} <= {t.name for t in report.tensors}


def test_an_adapter_that_misplaces_two_tokens_fails_where_they_are(project: Project) -> None:
    (report,) = check("llama", "collator_form_positions_swapped", project=project).values()
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 0")
    worst_layer = next(t for t in report.tensors if t.name == "layers.0.output")
    assert worst_layer.rows_over == 2 and "row 0 pos 3" in worst_layer.where


# --- 7. version drift, and a structure that changed -----------------------------------------------------


@pytest.fixture
def drifted(scratch_project: Project, project: Project) -> Project:
    """The committed llama float32 golden, as if recorded with transformers 5.22.2 and torch 2.9.0."""
    key = GoldenKey(CLASS, "llama", "step", "float32")
    golden = load_golden(project, key)
    golden.manifest.provenance = replace(golden.manifest.provenance, transformers="5.22.2", torch="2.9.0")
    store.write_bytes(codec.encode(golden), store.path_for(scratch_project.goldens, key))
    return scratch_project


def test_a_golden_of_other_versions_says_so_once_a_run_in_text_and_json(drifted: Project, project: Project) -> None:
    import transformers

    reports = [*check("llama", "eager", project=drifted).values(), *check("llama", "fused_loss", project=drifted).values()]
    assert all(r.passed for r in reports)
    for report in reports:
        assert [(v.package, v.golden, v.here) for v in report.versions] == [
            ("torch", "2.9.0", torch.__version__), ("transformers", "5.22.2", transformers.__version__)]
    text = render_text.checks(reports)
    note = (f"note: 2 of 2 checks ran on other versions than their goldens: torch {torch.__version__} here, 2.9.0 in "
            f"the golden; transformers {transformers.__version__} here, 5.22.2 in the golden. To tell an upstream "
            "change from a bug in your candidate: `veosnap drift`")
    assert text.count("other versions than their goldens") == 1 and note in text
    assert text.splitlines()[-2].startswith("note: 2 of 2 checks") and text.splitlines()[-1] == "2 passed, 0 failed"
    document = json.loads(render_json.checks(reports))
    assert document["versions_note"].startswith(note)
    assert document["results"][0]["versions"][1] == {"package": "transformers", "golden": "5.22.2",
                                                     "here": transformers.__version__}


def test_a_golden_of_these_versions_gets_no_note(scratch_project: Project, project: Project) -> None:
    import transformers

    key = GoldenKey(CLASS, "llama", "step", "float32")
    golden = load_golden(project, key)
    golden.manifest.provenance = replace(golden.manifest.provenance, transformers=transformers.__version__,
                                         torch=torch.__version__)
    store.write_bytes(codec.encode(golden), store.path_for(scratch_project.goldens, key))
    (same,) = check("llama", "eager", project=scratch_project).values()
    assert same.versions == [] and "other versions" not in render_text.checks([same])
    assert json.loads(render_json.checks([same]))["versions_note"] is None


def test_a_structure_change_is_said_before_any_number_naming_the_versions(drifted: Project) -> None:
    (report,) = check("llama", "norm_in_bfloat16", project=drifted).values()
    assert report.status == "FAIL"
    assert report.structure == ["parameter dtype differs: model.norm.weight bfloat16, golden float32"]
    first = render_text.checks([report], width=400).splitlines()[1].strip()
    assert first.startswith("structure differs from the golden (versions differ: torch ")
    assert first.endswith("parameter dtype differs: model.norm.weight bfloat16, golden float32")
    assert json.loads(render_json.checks([report]))["results"][0]["structure"] == report.structure
    (extra,) = check("llama", "extra_parameter", project=drifted).values()
    assert extra.status == "FAIL" and extra.structure == ["parameters the golden does not have: model.norm.offset"]
    assert all(t.passed for t in extra.tensors)  # numerically the same: the structure is what failed


# --- 8. the first real error of a rank ------------------------------------------------------------------


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_the_rank_that_failed_first_is_reported_not_the_one_torchrun_stopped(project: Project) -> None:
    report = check("llama", "rank0_fails_first", "fsdp2", project=project)["fsdp2"]
    assert report.status == "ERROR"
    assert report.error.startswith("rank 0: ImportError: Using a `distributed_config` requires `accelerate`")


# torchrun's summary when rank 0 raised (and wrote its error) and torchrun then stopped rank 1 (SIGTERM).
STOPPED_LOG = """\
Failures:
[1]:
  time      : 2026-11-30_11:40:47
  rank      : 1 (local_rank: 1)
  exitcode  : {status} (pid: 29278)
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_11:40:46
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 29277)
"""


def test_a_peer_stopped_by_torchrun_is_no_cause() -> None:
    errors = {0: "rank 0: ImportError: no accelerate"}
    assert torchrun.explain_failure(STOPPED_LOG.format(status=-15), errors, 1, 7.0) == errors[0]
    assert torchrun.explain_failure(STOPPED_LOG.format(status=-15), {}, 1, 7.0) == \
        "rank 0 exited with status 1 after 7 s"  # nobody said why: the rank that exited by itself


def test_the_plugin_contract_is_the_public_api() -> None:
    assert {"Candidate", "Adapted", "parallelizes", "context", "Context"} <= set(veosnap.__all__)
    assert veosnap.Candidate is backends.Candidate and veosnap.Context.__module__ == "veosnap.candidates.context"
