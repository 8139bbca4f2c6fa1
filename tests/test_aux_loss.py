"""The reference's whole loss: MoE models with their load-balancing (auxiliary) loss on.

The float64 noise run computes the same loss as the reference (the model's own load-balancing term,
in float64), so the `*_aux` goldens keep float32-noise bounds on the loss and every gradient, and a
bug in the auxiliary loss fails them (tests/faults.py's `aux_loss_*` backends).
"""

from __future__ import annotations

from pathlib import Path

import faults
import pytest
import torch
from golden_repo import CLASS

from veosnap.candidates import backends
from veosnap.golden.key import GoldenKey
from veosnap.reference import inputs, models
from veosnap.reference.capture import auxiliary_loss, causal_lm_loss, run_step
from veosnap.reference.zoo import load_config, load_golden
from veosnap.runs.check import check, check_layouts

FAULTS_FILE = Path(__file__).with_name("faults.py")
AUX_MODELS = ["qwen3_moe_aux", "mixtral_aux", "gpt_oss_aux"]


def load_balancing_in_float64(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                              mask: torch.Tensor) -> torch.Tensor:
    """The Switch-Transformer load-balancing loss as transformers defines it, written out in float64."""
    mask = mask.reshape(-1).double()
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    for logits in router_logits:
        p = torch.softmax(logits.double(), dim=-1)
        chosen = p.topk(top_k, dim=-1).indices
        counts += torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probs += (p * mask[:, None]).sum(0)
    rows = mask.sum() * len(router_logits)
    return (counts / rows * probs / rows).sum() * num_experts


@pytest.mark.parametrize("name", AUX_MODELS)
def test_the_noise_run_computes_the_models_own_auxiliary_loss_in_float64(repo_project, name):
    toy = load_config(repo_project.configs, name)
    batch = inputs.padded(inputs.load_sequences(repo_project.testdata))
    high = models.upcast_copy(models.build(toy, torch.float32), toy)
    captured = {}
    high.register_forward_hook(lambda _m, _i, out: captured.update(out=out))
    with models.KeepFloat64():
        step = run_step(high, batch, own_loss=True)
    out = captured["out"]
    config = high.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    aux = load_balancing_in_float64(out.router_logits, experts, config.num_experts_per_tok, batch.attention_mask)
    expected = causal_lm_loss(out.logits, batch.labels) + config.router_aux_loss_coef * aux
    assert step.tensors["loss"].dtype == torch.float64
    assert abs(float(step.tensors["loss"]) - float(expected.detach())) < 1e-13 * float(expected.detach())
    assert config.router_aux_loss_coef * float(aux) > 1e-4, "the auxiliary term is there, not negligible"
    assert "load-balancing" in auxiliary_loss(high)


def test_a_dense_models_noise_run_loss_is_the_plain_cross_entropy(repo_project):
    toy = load_config(repo_project.configs, "llama")
    batch = inputs.padded(inputs.load_sequences(repo_project.testdata))
    high = models.upcast_copy(models.build(toy, torch.float32), toy)
    with models.KeepFloat64():
        step = run_step(high, batch, own_loss=True)
        expected = causal_lm_loss(high(**batch.model_kwargs(with_labels=False)).logits, batch.labels)
    assert torch.equal(step.tensors["loss"], expected.detach())
    assert auxiliary_loss(high) == ""


@pytest.mark.parametrize("name", AUX_MODELS)
def test_aux_goldens_keep_float32_noise_bounds(repo_project, name):
    """Before the noise run computed the auxiliary loss, its whole value counted as noise: loss bounds
    of 2.7e-3 (qwen3_moe_aux), 5.2e-2 (mixtral_aux) and 4.7 (gpt_oss_aux) instead of ~1e-6. Now every
    bound is within a small factor of the same model's without the auxiliary loss."""
    base = name.removesuffix("_aux")
    for scenario in ("step", "train"):
        with_aux = load_golden(repo_project, GoldenKey(CLASS, name, scenario, "float32")).manifest
        without = load_golden(repo_project, GoldenKey(CLASS, base, scenario, "float32")).manifest
        assert with_aux.config["output_router_logits"] is True and not without.config["output_router_logits"]
        loss = with_aux.tolerance["loss" if scenario == "step" else "train.loss"]
        assert loss.bound < 1e-5, (scenario, loss)
        ratios = {n: t.bound / without.tolerance[n].bound for n, t in with_aux.tolerance.items()}
        assert max(ratios.values()) < 4, max(ratios.items(), key=lambda item: item[1])


@pytest.mark.parametrize("name", AUX_MODELS)
@pytest.mark.parametrize("fault", faults.AUX_LOSS_FAULTS)
def test_a_bug_in_the_auxiliary_loss_fails_the_aux_golden_with_the_forward_intact(repo_project, name, fault):
    report = check(repo_project, GoldenKey(CLASS, name, "step", "float32"),
                   backends.resolve(f"{FAULTS_FILE}:{fault}"))
    assert not report.error, report.error
    assert not report.passed and report.routes_passed
    failing = {t.name for t in report.tensors if not t.passed}
    assert failing, "the bug must show"
    assert not any(n == "logits" or n.startswith("layers.") for n in failing), "only the loss and gradients differ"
    assert report.worst.ratio > 50, report.worst


def test_aux_loss_faults_decline_a_model_without_one(repo_project):
    (report,) = [check(repo_project, GoldenKey(CLASS, "qwen3_moe", "step", "float32"),
                       backends.resolve(f"{FAULTS_FILE}:aux_loss_left_out"))]
    assert report.status == "skip" and "output_router_logits" in report.skipped


def test_layouts_that_split_the_batch_skip_the_aux_goldens_and_whole_batch_ones_pass(repo_project):
    reports = check_layouts(repo_project, GoldenKey(CLASS, "qwen3_moe_aux", "step", "float32"),
                            backends.resolve("eager"), ["single", "packed", "microbatch"])
    single, packed, micro = reports
    assert single.passed and packed.passed, (single.worst, packed.worst)
    assert micro.status == "skip"
    assert "load-balancing loss" in micro.skipped and "not a sum over tokens" in micro.skipped
