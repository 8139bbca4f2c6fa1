"""Every branch of every zoo family's routing code matters at the toy routers, and the golden notices it.

Each branch is perturbed by a backend of `tests/router_branches.py` (one test per family, one case per
branch): a branch that changes which experts a token goes to fails as a routing difference, one that
changes only the routing weights fails on `routes.N.weights` with every token routed as the golden. The
re-statement of transformers' routing the perturbations start from matches the golden exactly, so each
failure is its branch's alone. See docs/routers.md for the list and the counts of tokens each moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_repo import CLASS, eager_figures, figures
import router_branches as rb
import torch

from veosnap.candidates import backends
from veosnap.golden.key import GoldenKey
from veosnap.numerics.routes import GroupLimit, margins
from veosnap.runs.check import check
from veosnap.runs.verdict import CheckReport

BRANCHES_FILE = Path(__file__).with_name("router_branches.py")


def run(project, family: str, backend: str, dtype: str = "float32") -> CheckReport:  # noqa: ANN001
    report = check(project, GoldenKey(CLASS, family, "step", dtype), backends.resolve(f"{BRANCHES_FILE}:{backend}"))
    assert not report.error, report.error
    return report


def assert_noticed(report: CheckReport, notice: str) -> None:
    failing = {t.name for t in report.tensors if not t.passed}
    if notice == "routes":
        moved = [r for r in report.routes if r.clear_flips]
        assert moved and not report.passed, [r.message() for r in report.routes]
        assert moved[0].message().startswith(f"routing differs: layer {moved[0].layer} sends {moved[0].clear_flips} ")
    elif notice == "weights":
        assert report.routes_passed, [r.message() for r in report.routes]
        assert any(name.startswith("routes.") and name.endswith(".weights") for name in failing), failing
    else:  # the same function as transformers': nothing to notice
        assert report.passed, (report.worst, failing)


def cases(family: str) -> list:
    return [pytest.param(backend, notice, id=backend) for backend, _what, notice in rb.BRANCHES[family]]


@pytest.mark.parametrize("family", list(rb.BRANCHES))
def test_the_restated_routing_is_transformers_own(repo_project, family):
    for dtype in ("float32", "bfloat16"):
        report = run(repo_project, family, rb.AS_TRANSFORMERS[family], dtype)
        assert report.passed and report.routes_passed
        # transformers' bits exactly: every tensor's figures are the eager backend's on this machine (all 0
        # on the machine that recorded the golden), so a branch's failure below is that branch's alone
        assert figures(report) == eager_figures(repo_project, family, dtype), report.worst


@pytest.mark.parametrize(("backend", "notice"), cases("deepseek_v3"))
def test_deepseek_v3_routing_branches(repo_project, backend, notice):
    assert_noticed(run(repo_project, "deepseek_v3", backend), notice)


@pytest.mark.parametrize(("backend", "notice"), cases("gpt_oss"))
def test_gpt_oss_routing_branches(repo_project, backend, notice):
    assert_noticed(run(repo_project, "gpt_oss", backend), notice)


@pytest.mark.parametrize(("backend", "notice"), cases("qwen3_moe"))
def test_qwen3_moe_routing_branches(repo_project, backend, notice):
    assert_noticed(run(repo_project, "qwen3_moe", backend), notice)


@pytest.mark.parametrize(("backend", "notice"), cases("mixtral"))
def test_mixtral_routing_branches(repo_project, backend, notice):
    assert_noticed(run(repo_project, "mixtral", backend), notice)


def test_the_bfloat16_goldens_notice_every_branch_that_moves_experts(repo_project):
    for family, branches in rb.BRANCHES.items():
        for backend, _what, notice in branches:
            if notice == "routes":
                assert_noticed(run(repo_project, family, backend, "bfloat16"), notice)


def test_a_group_limit_margin_counts_the_groups_and_their_experts():
    # 4 groups of 2 experts, the best 2 groups kept, top-2. Group scores (sum of both): 0.9, 0.95, 0.2, 0.6.
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.45, 0.1, 0.1, 0.3, 0.3]])
    limit = GroupLimit(groups=4, keep=2)
    # Kept groups 0 and 1; chosen 0 and 2; best other kept expert 3 (0.45): an expert margin of 0.05.
    assert margins(scores, torch.tensor([[0, 2]]), group_limit=limit).item() == pytest.approx(0.05)
    # Groups 0.9, 0.7, 0.2, 0.8: kept 0 and 3, chosen 0 and 6 (0.8), clear of their kept peers by 0.8; but
    # group 1 (expert 2 at 0.5) is 0.1 behind group 3, and swapping them would change the experts. A
    # group's score is a sum of two, so its gap counts half (the four scores can each move).
    high = torch.tensor([[0.9, 0.0, 0.5, 0.2, 0.1, 0.1, 0.8, 0.0]])
    assert margins(high, torch.tensor([[0, 6]]), group_limit=limit).item() == pytest.approx(0.05)
    assert margins(high, torch.tensor([[0, 6]])).item() == pytest.approx(0.3)  # without the limit: 0.8 vs 0.5
    # Two groups a hair apart whose swap would change the experts: the group gap is the margin.
    close = torch.tensor([[0.9, 0.0, 0.5, 0.3, 0.79, 0.0, 0.1, 0.1]])  # groups 0.9, 0.8, 0.79, 0.2
    assert margins(close, torch.tensor([[0, 2]]), group_limit=limit).item() == pytest.approx(0.005)
    # Two groups a hair apart whose swap changes nothing: no group margin.
    idle = torch.tensor([[0.9, 0.8, 0.1, 0.3, 0.29, 0.0, 0.0, 0.0]])  # groups 1.7, 0.4, 0.29, 0.0; chosen 0, 1
    assert margins(idle, torch.tensor([[0, 1]]), group_limit=limit).item() == pytest.approx(0.5)


def test_at_many_experts_routers_decide_clearly_and_idle_experts_are_the_batchs_business(scratch_project):
    """256 experts top-2 (more experts than the 86-token batch fills: 172 slots): the routers still decide
    every token clearly, and the recorder records though experts get no tokens (issue 11 item 3: whether
    every expert is used is a property of the batch, not a rule of the recorder)."""
    import json

    from veosnap.reference.inputs import Batch
    from veosnap.runs.record import build_golden

    config = json.loads((scratch_project.configs / "qwen3_moe" / "config.json").read_text())
    config.update(num_experts=256, hidden_size=320, moe_intermediate_size=8, num_hidden_layers=2)
    (scratch_project.configs / "qwen3_moe_wide").mkdir()
    (scratch_project.configs / "qwen3_moe_wide" / "config.json").write_text(json.dumps(config))
    golden = build_golden(scratch_project, GoldenKey(CLASS, "qwen3_moe_wide", "step", "bfloat16"))
    mask = Batch.from_golden(golden).token_mask
    assert min(golden.manifest.min_margin.values()) > 10 * golden.manifest.tie_epsilon, golden.manifest.min_margin
    for layer in golden.manifest.min_margin:
        used = golden.tensors[f"routes.{layer}.experts"][mask].unique().numel()
        assert 100 < used < 256, used  # spread over many experts, and not all of them: the batch is too small
