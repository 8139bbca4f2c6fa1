"""Planted bugs fail, naming the tensor at fault (see tests/faults.py for the bugs).

Each fault is a backend plugin (`tests/faults.py:<name>`), checked against this machine's committed goldens
exactly as a user's kernel would be: `veosnap check --backend tests/faults.py:<name>`.
"""

from __future__ import annotations

from pathlib import Path

import faults
import pytest

from veosnap.candidates import backends
from veosnap.golden.key import GoldenKey
from veosnap.reference.probes import find_moe_layers
from veosnap.runs.check import check
from veosnap.runs.verdict import CheckReport

FAULTS_FILE = Path(__file__).with_name("faults.py")
MODELS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
MOE_MODELS = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"]
FORWARD_FAULTS = ["swapped_activation", "kv_groups_swapped", "pad_leak", "next_token_visible",
                  "softmax_scale_off", "norm_eps_wrong"]


def run(project, model: str, dtype: str, fault: str) -> CheckReport:  # noqa: ANN001
    key = GoldenKey(project.hardware_class, model, "step", dtype)
    report = check(project, key, backends.resolve(f"{FAULTS_FILE}:{fault}"))
    assert not report.error, report.error
    return report


def dtypes_for(fault: str) -> list:
    # Small bugs hide under bfloat16 noise by design (tools/measure/calibrate_tolerance.py shows by how much).
    size = faults.FAULTS[fault][0]
    return ["float32", "bfloat16"] if size == "large" else ["float32"]


def failing(report: CheckReport) -> set[str]:
    return {t.name for t in report.tensors if not t.passed}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fault", FORWARD_FAULTS)
def test_forward_fault_in_layer_1_is_named_as_first_divergence(repo_project, model, fault):
    for dtype in dtypes_for(fault):
        report = run(repo_project, model, dtype, fault)
        assert not report.passed
        assert "layers.0.output" not in failing(report), "the bug is confined to layer 1"
        assert report.first_divergence and report.first_divergence.startswith("layer 1 "), report.first_divergence


@pytest.mark.parametrize("model", MODELS)
def test_pad_leak_is_located_in_the_leaking_row(repo_project, model):
    report = run(repo_project, model, "float32", "pad_leak")
    layer1 = next(t for t in report.tensors if t.name == "layers.1.output")
    assert layer1.where.startswith(f"row {faults.PAD_LEAK_ROW} "), layer1.where
    logits = next(t for t in report.tensors if t.name == "logits")
    assert logits.where.startswith(f"row {faults.PAD_LEAK_ROW} ")


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unweighted_experts_diverge_at_their_layer_with_routes_intact(repo_project, model, dtype):
    report = run(repo_project, model, dtype, "unweighted_experts")
    assert report.routes_passed
    moe_layer = max(r.layer for r in report.routes)  # the fault is planted in the last MoE layer
    assert report.first_divergence.startswith(f"layer {moe_layer} ")
    assert all(f"layers.{i}.output" not in failing(report) for i in range(moe_layer))


@pytest.mark.parametrize("model", MOE_MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_rerouted_token_fails_as_routing_and_gradients_are_compared_under_replay(repo_project, model, dtype):
    report = run(repo_project, model, dtype, "one_token_rerouted")
    first = report.routes[0]
    assert first.message() == (
        f"routing differs: layer {first.layer} sends 1 of {first.tokens} tokens to other experts than the golden"
    )
    assert report.route_replay
    assert failing(report) == set(), "under route replay the kernel itself is exact"
    assert not report.passed


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loss_that_counts_padding_fails_on_loss_with_forward_intact(repo_project, model, dtype):
    report = run(repo_project, model, dtype, "loss_counts_padding")
    bad = failing(report)
    assert "loss" in bad
    assert not any(name == "logits" or name.startswith("layers.") for name in bad)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_dropped_gradient_names_only_that_parameter(repo_project, model, dtype):
    report = run(repo_project, model, dtype, "dropped_norm_gradient")
    assert failing(report) == {"grad.model.layers.1.input_layernorm.weight"}
    assert report.first_gradient_divergence.startswith("layer 1 input_layernorm ")


def test_faults_cover_at_least_eight_kinds_small_ones_among_them():
    sizes = [size for size, _ in faults.FAULTS.values()]
    assert len(faults.FAULTS) >= 8 and "small" in sizes


def test_moe_models_have_moe_layers(repo_project):
    from veosnap.reference import models
    from veosnap.reference.zoo import load_config

    for name in MOE_MODELS:
        model = models.build(load_config(repo_project.configs, name), models.dtype_from_name("float32"))
        assert len(find_moe_layers(model)) >= 1


@pytest.mark.parametrize("model", [m for m in MODELS if m != "gpt_oss"])  # GPT-OSS sinks: eager only
def test_fp8_attention_fails_in_bfloat16_while_float32_passes(repo_project, model):
    """A precision regression is what the bfloat16 goldens are for; float32 cannot see it."""
    assert faults.PRECISION_FAULTS["fp8_attention_probabilities"] == "fails"
    assert run(repo_project, model, "float32", "fp8_attention_probabilities").passed
    assert not run(repo_project, model, "bfloat16", "fp8_attention_probabilities").passed
