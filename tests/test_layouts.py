"""Layouts checked against the single-process golden: every layout that runs here passes; planted faults fail.

Each torchrun start costs seconds, so the multi-process layouts of one check share one torchrun
(`check_layouts`), and each fixture below runs once per module. Planted layout bugs are layouts of
their own (`tests/layout_faults.py`), given by SPEC like a user's. On CUDA the multi-process layouts
need a GPU per rank: with fewer than 2 visible, only the in-process ones run (the rest skip, saying so).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from golden_repo import CLASS, ON_CUDA, gpus_for

from veosnap.candidates import backends
from veosnap.candidates.layouts import registry, torchrun
from veosnap.candidates.layouts.protocol import Layout, Shard, shard_rows
from veosnap.errors import VeosnapError
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.check import check, check_layouts
from veosnap.surfaces.cli import main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAULTS = HERE / "layout_faults.py"
RUN_ON_CPU = ["single", "packed", "microbatch", "ddp", "fsdp2", "hsdp", "tp", "ep", "sp", "sp_packed", "sp_fsdp2",
              "sp_ep", "cp", "cp_packed"]
EXPERTS_ONLY = ("ep", "sp_ep")  # skip dense models
TIMEOUT_S = 300
RANKS = torch.cuda.device_count() >= 2 if ON_CUDA else True  # 2 ranks: gloo on the CPU, a GPU each on CUDA
# Only the layouts `veosnap check --layout` can run here: multi-process ones need their ranks.
RUNNABLE = [name for name in registry.names() if RANKS or not registry.resolve(name).distributed]


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class=CLASS)


def key(model: str) -> GoldenKey:
    return GoldenKey(CLASS, model, "step", "float32")


def by_layout(reports: list) -> dict:
    return {r.layout: r for r in reports}


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def every_layout(request: pytest.FixtureRequest, project: Project) -> tuple[str, dict]:
    reports = check_layouts(project, key(request.param), backends.resolve("eager"), RUNNABLE,
                            nproc=2, timeout_s=TIMEOUT_S)
    return request.param, by_layout(reports)


@pytest.mark.heavy
def test_every_layout_that_runs_here_passes_against_the_single_process_golden(every_layout: tuple[str, dict]) -> None:
    model, reports = every_layout
    assert list(reports) == RUNNABLE
    for name in (name for name in RUN_ON_CPU if name in RUNNABLE):
        report = reports[name]
        if name in EXPERTS_ONLY and model == "llama":
            assert report.skipped and "dense" in report.skipped
            continue
        assert report.passed and not report.skipped, (name, report.error, report.worst)
        assert {t.name for t in report.tensors} >= {"loss", "logits", "layers.0.output"}
        assert any(t.name.startswith("grad.") for t in report.tensors)
        if model == "qwen3_moe":
            assert report.routes and all(r.clear_flips == 0 for r in report.routes)


@pytest.mark.heavy
@gpus_for(2)
def test_sequence_parallel_layouts_say_how_attention_ran(every_layout: tuple[str, dict]) -> None:
    _, reports = every_layout
    assert reports["sp"].notes[0].startswith("Ulysses all-to-all over 2 ranks (veosnap all-to-all), 2 heads each")
    assert reports["cp"].notes[0].startswith("keys and values all-gathered over 2 ranks")
    assert "fully_shard over the same 2 ranks" in reports["sp_fsdp2"].notes


@pytest.fixture(scope="module")
def faulty(project: Project) -> dict:
    # One torchrun for the multi-process faults; `die` comes last because it ends the run.
    planted = {"packed": "packed_no_restart", "ddp": "ddp_sum_grads", "fsdp2": "fsdp2_swap_shard", "hsdp": "hsdp_die"}
    if not RANKS:
        planted = {"packed": planted["packed"]}
    reports = check_layouts(project, key("qwen3_moe"), backends.resolve("eager"),
                            [f"{FAULTS}:{fault}" for fault in planted.values()], nproc=2, timeout_s=TIMEOUT_S)
    return dict(zip(planted, reports))


def failing(report) -> set[str]:  # noqa: ANN001
    return {t.name for t in report.tensors if not t.passed}


@gpus_for(2)
@pytest.mark.heavy
def test_gradients_summed_across_ranks_fail_on_the_gradients_only(faulty: dict) -> None:
    report = faulty["ddp"]
    assert report.status == "FAIL"
    assert report.worst.name.startswith("grad.")
    assert all(name.startswith("grad.") for name in failing(report))
    assert report.first_divergence is None  # the forward pass was right
    assert "grad." in report.first_gradient_divergence


@gpus_for(2)
def test_a_rank_trained_on_another_ranks_shard_fails_on_its_rows(faulty: dict) -> None:
    report = faulty["fsdp2"]
    assert report.status == "FAIL"
    assert {"logits", "layers.0.output"} <= failing(report)
    assert report.first_divergence.startswith("layer 0 ")
    logits = next(t for t in report.tensors if t.name == "logits")
    assert logits.where.split()[:2] in (["row", "2"], ["row", "3"])  # the second rank's rows


def test_packed_positions_that_do_not_restart_fail_after_the_first_sequence(faulty: dict) -> None:
    report = faulty["packed"]
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 0 ")
    logits = next(t for t in report.tensors if t.name == "logits")
    assert not logits.passed and not logits.where.startswith("row 0 ")  # the first sequence is unaffected


@gpus_for(2)
def test_a_rank_that_dies_ends_the_check_with_an_error_naming_it(faulty: dict) -> None:
    assert faulty["hsdp"].status == "ERROR"
    assert "rank 1 exited with status 17" in faulty["hsdp"].error


@gpus_for(2)
@pytest.mark.heavy
def test_a_rank_that_hangs_is_ended_at_the_time_limit(project: Project) -> None:
    report = check(project, key("llama"), backends.resolve("eager"), f"{FAULTS}:ddp_hang", timeout_s=15)
    assert report.status == "ERROR" and "timed out after 15 s" in report.error


@pytest.mark.heavy
def test_route_flips_under_layouts_are_reported_and_gradients_compared_under_replay(project: Project) -> None:
    backend = backends.resolve(f"{HERE / 'route_flip_backend.py'}:next_expert")
    layouts = ["microbatch", "ddp"] if RANKS else ["microbatch"]
    for report in check_layouts(project, key("qwen3_moe"), backend, layouts, timeout_s=TIMEOUT_S):
        assert report.status == "FAIL" and report.route_replay, report.layout
        assert all(r.clear_flips == r.tokens > 0 for r in report.routes)
        assert "routing differs: layer 0 sends" in report.routes[0].message()
        assert all(t.passed for t in report.tensors)  # the kernels are right; only the routing is not


class TwoHalves(Layout):
    """Gradient accumulation over two half-batches: a user's layout, as the docs show it."""

    name = "halves"
    description = "two half-batches"

    def shard(self, ctx, setup):  # noqa: ANN001, ANN201
        return [Shard.rows(ctx.batch, half) for half in torch.arange(ctx.batch.rows).chunk(2)]


def test_a_registered_in_process_layout_is_checked_like_the_built_in_ones(project: Project,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.LAYOUTS, "halves", TwoHalves())
    report = check(project, key("qwen3_moe"), backends.resolve("eager"), "halves")
    assert report.layout == "halves" and report.passed and report.routes


def test_data_parallel_shares_cover_every_row_once() -> None:
    for num_rows, world in [(4, 2), (4, 3), (5, 4)]:
        shares = [shard_rows(num_rows, world, rank) for rank in range(world)]
        assert torch.cat(shares).tolist() == list(range(num_rows))


def test_bad_layout_inputs_are_one_line_errors(project: Project) -> None:
    eager = backends.resolve("eager")
    with pytest.raises(VeosnapError, match="unknown layout 'zigzag'"):
        check(project, key("llama"), eager, "zigzag")
    with pytest.raises(VeosnapError, match="at least 2 processes"):
        check(project, key("llama"), eager, "ddp", nproc=1)
    with pytest.raises(VeosnapError, match="4 rows"):
        check(project, key("llama"), eager, "ddp", nproc=5)
    with pytest.raises(VeosnapError, match=f"{FAULTS} has no Layout instance 'typo'"):
        check(project, key("llama"), eager, f"{FAULTS}:typo")


def test_cli_checks_a_layout(project: Project, capsys: pytest.CaptureFixture) -> None:
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]
    assert main(["check", *dirs, "--model", "llama", "--dtype", "float32", "--layout", "packed"]) == 0
    assert "layout=packed" in capsys.readouterr().out
    assert main(["check", *dirs, "--model", "llama", "--layout", "ddp", "--nproc", "1"]) == 2
    assert "at least 2 processes" in capsys.readouterr().err


# torchrun's summary when the last rank exits on its own and rank 0 then fails in a collective:
# torchrun may call rank 0 the root cause, but rank 0 only lost its peer.
TORCHRUN_LOG = """\
E1130 11:40:46.819000 29273 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 29277) of binary: python
Failures:
[1]:
  time      : 2026-11-30_11:40:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 17 (pid: 29278)
  error_file: <N/A>
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_11:40:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 29277)
  error_file: <N/A>
"""


def test_a_rank_that_died_is_named_over_the_peer_that_lost_it() -> None:
    errors = {0: "rank 0: RuntimeError: Connection closed by peer [127.0.0.1]:48811"}
    assert torchrun.explain_failure(TORCHRUN_LOG, errors, 1, 9.4) == "rank 1 exited with status 17 after 9 s"
    # With every rank's own message, the root cause's message is the answer.
    both = {**errors, 1: "rank 1: ValueError: bad shard"}
    assert torchrun.explain_failure(TORCHRUN_LOG, both, 1, 9.4) == errors[0]


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_tp_and_ep_decline_a_model_automodelforcausallm_cannot_load(project: Project, layout: str) -> None:
    """They load through AutoModelForCausalLM, which has no vision-language class: a skip with the cause, not an
    ERROR 'Unrecognized configuration class Qwen3VLMoeConfig' from every rank."""
    from veosnap.errors import Unsupported
    from veosnap.reference.zoo import load_checked

    golden, _ = load_checked(project, key("qwen3_vl_moe"), cross_class=True)
    with pytest.raises(Unsupported, match="AutoModelForCausalLM.*'qwen3_vl_moe'"):
        registry.resolve(layout).accept(golden, 2)
    causal, _ = load_checked(project, key("qwen3_moe"), cross_class=True)
    registry.resolve(layout).accept(causal, 2)  # a causal LM is accepted as before
