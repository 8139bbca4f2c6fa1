"""Kernel-library backends (fa4, fla, quack, liger, flash_attention_2/3/4): why each skips on a CPU, what
each declines, that their process-wide registrations are undone, that their own plumbing (unpadding,
cu_seqlens, sinks, windows, expert sorting, the grouped GEMM's backward) passes the cpu goldens on
plain-torch stand-ins for the kernels and fails them with a planted bug, and that the reference never
runs a kernel package transformers found installed (fla)."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import reference_kernels as rk
import torch
import transformers
from golden_repo import CLASS, built_once

from veosnap.candidates import backends
from veosnap.candidates.kernels import fa4, fla, quack, support
from veosnap.golden.key import GoldenKey
from veosnap.reference import models
from veosnap.reference.zoo import Project, load_config
from veosnap.runs.check import check, check_layouts
from veosnap.runs.record import record

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ["fa4", "fla", "quack", "liger", "flash_attention_2", "flash_attention_3", "flash_attention_4"]

backends.register("fa4_on_torch", rk.fa4_on_torch)
backends.register("quack_on_torch", rk.quack_on_torch)
backends.register("fla_on_torch", rk.fla_on_torch)


def key(model: str, dtype: str = "float32") -> GoldenKey:
    return GoldenKey(CLASS, model, "step", dtype)


def run(project: Project, model: str, spec: str, dtype: str = "float32", layouts=("single",)):
    return check_layouts(project, key(model, dtype), backends.resolve(spec), list(layouts))


# --- where they cannot run -----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs these backends (tools/gpu/gpu_kernels.py)")
@pytest.mark.parametrize("name", LIBRARIES)
def test_each_library_skips_on_a_cpu_with_the_reason(repo_project: Project, name: str) -> None:
    assert backends.unavailable_here(name).endswith("needs a CUDA GPU")
    report = check(repo_project, key("qwen3_moe"), backends.resolve(name))
    assert report.status == "skip" and report.skipped.endswith("needs a CUDA GPU")


@pytest.mark.parametrize(("name", "distribution"), [("fa4", "flash-attn-4"), ("fla", "flash-linear-attention"),
                                                    ("quack", "quack-kernels"), ("liger", "liger-kernel"),
                                                    ("flash_attention_2", "flash-attn")])
def test_a_gpu_without_the_package_names_it_and_how_to_get_it(monkeypatch: pytest.MonkeyPatch, name: str,
                                                              distribution: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    real = support.metadata.version

    def version(dist: str) -> str:
        if dist == distribution:
            raise support.metadata.PackageNotFoundError(dist)
        return real(dist)

    monkeypatch.setattr(support.metadata, "version", version)
    reason = backends.unavailable_here(name)
    assert f"{distribution} is not installed" in reason
    assert "pip install" in reason or "wheel" in reason


def test_an_older_gpu_is_told_the_capability_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    assert backends.unavailable_here("quack") == ("quack needs a CUDA GPU of compute capability 9.0 or newer "
                                                  "(this one: 8.6)")


# --- what they decline ----------------------------------------------------------------------------------


def test_fa4_declines_a_dtype_its_kernels_do_not_take(repo_project: Project) -> None:
    def bf16_only(model):
        yield from fa4.switch(model, fa4.Kernels(rk.flash_dense, rk.flash_varlen, label="flash_attn.cute"))

    backends.register("fa4_bf16_only", bf16_only)
    (report,) = run(repo_project, "llama", "fa4_bf16_only")
    assert report.status == "skip"
    assert report.skipped == "flash_attn.cute computes attention in float16/bfloat16 only, not float32"


def test_fa4_names_its_known_sm90_backward_bug_only_where_it_applies() -> None:
    note = fa4.known_issue("4.0.0b36", (9, 0), {16, 64})
    assert note.startswith("known flash-attn 4.0.0b36 bug on sm90: wrong backward (dq; dk/dv with GQA) for head dim 16,")
    assert "docs/findings/fa4-sm90-backward-head-dim.md" in note
    assert "48, 80" in fa4.known_issue("4.0.0b36", (9, 0), {48, 80, 96})
    assert fa4.known_issue("4.0.0b36", (9, 0), {24, 32, 64, 128, 192}) is None  # both sides round alike
    assert fa4.known_issue("4.0.0b36", (10, 0), {16}) is None  # Blackwell runs another backward
    assert fa4.known_issue("4.0.0b36", None, {16}) is None  # not on a GPU
    assert fa4.known_issue("4.0.1", (9, 0), {16}) is None  # a version not known to have it


def test_quack_declines_a_dense_model_and_fla_a_model_without_linear_attention(repo_project: Project) -> None:
    (dense,) = run(repo_project, "llama", "quack_on_torch")
    assert dense.skipped == "LlamaForCausalLM has no MoE experts module (quack replaces the experts' GEMMs)"
    (no_delta,) = run(repo_project, "qwen3_moe", "fla_on_torch")
    assert no_delta.skipped.startswith("fla replaces gated DeltaNet (linear-attention) layers; Qwen3MoeForCausalLM")


def test_a_library_that_ran_nothing_fails_the_check(repo_project: Project) -> None:
    # sdpa after fa4 switches every attention module away again: fa4 would have checked nothing.
    (report,) = run(repo_project, "llama", "fa4_on_torch+sdpa")
    assert report.status == "ERROR"
    assert "fa4 was switched on but none of its kernels ran" in report.error


# --- their plumbing on plain-torch kernels, against the cpu goldens --------------------------------------


@pytest.mark.parametrize("model", ["llama", "gpt_oss", "deepseek_v3"])
def test_fa4_unpads_packs_and_passes_sinks_windows_and_mla(repo_project: Project, model: str) -> None:
    reports = run(repo_project, model, "fa4_on_torch", layouts=("single", "packed"))
    for report in reports:
        if report.status == "skip":  # gpt_oss cannot be packed (transformers bug): the layout says so
            assert model == "gpt_oss" and report.layout == "packed"
            continue
        assert report.status == "PASS", (report.layout, report.error, report.worst)
        how = "unpadded" if report.layout == "single" else "packed"
        assert f"): varlen ({how}) " in report.notes[-1]
        assert report.notes[-1].startswith("fa4 ran for ")


def test_fa4_keeps_a_packed_row_apart_beside_an_ordinary_row() -> None:
    # The real-shape goldens' single batch: row 0 one sequence, row 1 many packed ones, no mask. Looking
    # for packing only at batch size 1 (as transformers' flash paths do) ran row 1 dense: 22-47x on the H200.
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 97, (2, 16))
    positions = torch.stack([torch.arange(16), torch.cat([torch.arange(n) for n in (5, 7, 4)])])
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        switched = fa4.switch(model, rk.FA4)
        next(switched)
        try:
            got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            alone = model(input_ids=ids[:1], position_ids=positions[:1], use_cache=False).logits
        finally:
            switched.close()  # fa4's registrations with transformers are process-wide: undo them here
    torch.testing.assert_close(got, reference)
    torch.testing.assert_close(alone, reference[:1])


def test_quack_experts_forward_and_backward_pass(repo_project: Project) -> None:
    for model, dtype in [("qwen3_moe", "float32"), ("gpt_oss", "float32"), ("mixtral", "bfloat16")]:
        (report,) = run(repo_project, model, "quack_on_torch", dtype)
        assert report.status == "PASS", (model, report.error, report.worst)
        assert report.notes[-1].startswith("quack ran for 2 experts modules (model.layers.{0-1}.mlp.experts)")


def test_quack_experts_match_eager_with_idle_experts_and_expert_parallel_sentinels() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    eager = Qwen3MoeExperts(config).double()
    torch.nn.init.normal_(eager.gate_up_proj, std=0.3)
    torch.nn.init.normal_(eager.down_proj, std=0.3)
    x = torch.randn(10, 32, dtype=torch.float64)
    index = torch.tensor([[0, 2]] * 5 + [[2, 5]] * 4 + [[0, 6]])  # experts 1, 3, 4 idle; 6 = another rank's
    weights = torch.rand(10, 2, dtype=torch.float64) * (index < 6)
    runs = []
    for forward in (type(eager).forward, quack.experts_forward(rk.QUACK, support.Ran("quack", eager, "experts"))):
        xi = x.clone().requires_grad_(True)
        eager.zero_grad()
        out = forward(eager, xi, index, weights)
        out.square().sum().backward()
        runs.append((out, xi.grad, eager.gate_up_proj.grad.clone(), eager.down_proj.grad.clone()))
    for reference, candidate in zip(*runs):
        torch.testing.assert_close(candidate, reference, rtol=1e-12, atol=1e-12)
    assert runs[1][2][[1, 3, 4]].abs().max() == 0  # idle experts: zero weight gradient


def test_quack_sums_each_experts_bias_gradient_as_eager_does_in_bfloat16() -> None:
    # gpt_oss-real bfloat16 on the H200 failed quack at 3.5x from a down_proj_bias gradient: a bfloat16
    # gather's backward rounds after every row it adds (about 512 rows an expert here), eager once.
    import copy

    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    experts = GptOssExperts(config)
    for parameter in experts.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    experts = experts.to(torch.bfloat16)
    x = torch.randn(1024, 64).to(torch.bfloat16)
    index = torch.stack([torch.arange(1024) % 4, (torch.arange(1024) + 1) % 4], 1)
    weights = torch.rand(1024, 2).to(torch.bfloat16)

    def bias_gradients(forward, dtype):
        module = copy.deepcopy(experts).to(dtype)
        out = forward(module, x.to(dtype), index, weights.to(dtype))
        (out.double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        return [module.down_proj_bias.grad.double(), module.gate_up_proj_bias.grad.double()]

    exact = bias_gradients(GptOssExperts.forward, torch.float64)
    eager = bias_gradients(GptOssExperts.forward, torch.bfloat16)
    fused = bias_gradients(quack.experts_forward(rk.QUACK, support.Ran("quack", experts, "experts")), torch.bfloat16)
    for want, eager_grad, quack_grad in zip(exact, eager, fused):
        eager_error, quack_error = (eager_grad - want).abs().max(), (quack_grad - want).abs().max()
        assert quack_error <= 1.5 * eager_error, (quack_error, eager_error)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Project:
    """A scratch project with a float32 golden of the Qwen3.5 toy (gated DeltaNet layer 0), this machine's class."""
    source = next((p for p in (ROOT / "toy_configs" / "qwen3_5", ROOT / "toy_configs_next" / "qwen3_5") if p.is_dir()),
                  None)
    if source is None:
        pytest.skip("no qwen3_5 toy config in this checkout")

    def project_at(tmp: Path) -> Project:
        return Project.resolve(goldens=tmp / "goldens", configs=tmp / "toy_configs", testdata=tmp / "testdata",
                               hardware_class=CLASS)

    def recorded(tmp: Path) -> None:
        shutil.copytree(source, tmp / "toy_configs" / "qwen3_5")
        shutil.copytree(ROOT / "testdata", tmp / "testdata")
        record(project_at(tmp), "qwen3_5", "float32")

    return project_at(built_once(tmp_path_factory, "qwen3_5", recorded))  # once per run, under xdist too


def test_fla_keeps_packed_sequences_apart_where_the_torch_reference_cannot(qwen3_5: Project) -> None:
    eager_single, eager_packed = run(qwen3_5, "qwen3_5", "eager", layouts=("single", "packed"))
    assert eager_single.passed
    assert not eager_packed.passed and eager_packed.first_divergence.startswith("layer 0 ")
    single, packed = run(qwen3_5, "qwen3_5", "fla_on_torch", layouts=("single", "packed"))
    assert single.status == packed.status == "PASS", (single.worst, packed.worst)
    assert single.notes[-1] == ("fla ran for 1 gated DeltaNet layers (model.language_model.layers.0.linear_attn): "
                                "causal_conv1d 1x, chunk_gated_delta_rule 1x")
    assert "causal_conv1d (cu_seqlens) 1x, chunk_gated_delta_rule (cu_seqlens) 1x" in packed.notes[-1]


# --- planted bugs in each backend's plumbing fail the check ----------------------------------------------


def test_a_window_off_by_one_in_fa4_fails_gpt_oss(repo_project: Project) -> None:
    def wide_window(q, k, v, window_size=(None, None), **options):
        left, right = window_size
        return rk.flash_varlen(q, k, v, window_size=(None if left is None else left + 1, right), **options)

    def buggy(model):
        yield from fa4.switch(model, fa4.Kernels(rk.flash_dense, wide_window, dtypes=(torch.float32,)))

    backends.register("fa4_wide_window", buggy)
    (report,) = run(repo_project, "gpt_oss", "fa4_wide_window")
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 0 (layers.0.output")


def test_a_grouped_gemm_whose_weight_gradient_reads_the_next_experts_rows_fails(repo_project: Project) -> None:
    def shifted(a, b, cu_seqlens_m=None, cu_seqlens_k=None):
        if cu_seqlens_k is not None:
            cu_seqlens_k = torch.cat([cu_seqlens_k[:1], (cu_seqlens_k[1:-1] + 1).clamp(max=int(cu_seqlens_k[-1])),
                                      cu_seqlens_k[-1:]])
        return rk.grouped_gemm(a, b, cu_seqlens_m=cu_seqlens_m, cu_seqlens_k=cu_seqlens_k)

    def buggy(model):
        yield from quack.switch(model, quack.Kernels(shifted, dtypes=(torch.float32,)))

    backends.register("quack_shifted_dw", buggy)
    (report,) = run(repo_project, "qwen3_moe", "quack_shifted_dw")
    assert report.status == "FAIL"
    assert report.first_divergence is None  # the forward is right: only expert weight gradients differ
    failing = {t.name for t in report.tensors if not t.passed}
    assert failing and all(".mlp.experts." in name for name in failing)


def test_fla_with_a_conv_that_ignores_sequence_boundaries_fails_packed(qwen3_5: Project) -> None:
    def leaky_conv(x, cu_seqlens=None, **options):
        return rk.causal_conv1d(x, cu_seqlens=None, **options)

    def buggy(model):
        yield from fla.switch(model, fla.Kernels(rk.chunk_gated_delta_rule, leaky_conv))

    backends.register("fla_leaky_conv", buggy)
    single, packed = run(qwen3_5, "qwen3_5", "fla_leaky_conv", layouts=("single", "packed"))
    assert single.passed
    assert packed.status == "FAIL" and packed.first_divergence.startswith("layer 0 (layers.0.output")


# --- process-wide registrations are undone --------------------------------------------------------------


def test_registrations_and_patched_functions_are_undone_after_the_check(repo_project: Project,
                                                                        qwen3_5: Project) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    before = modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn
    run(repo_project, "llama", "fa4_on_torch")
    run(repo_project, "qwen3_moe", "quack_on_torch")
    run(qwen3_5, "qwen3_5", "fla_on_torch", layouts=("single", "packed"))
    assert fa4.IMPLEMENTATION not in AttentionInterface._global_mapping
    assert fa4.IMPLEMENTATION not in AttentionMaskInterface._global_mapping
    assert quack.IMPLEMENTATION not in ExpertsInterface._global_mapping
    assert (modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn) == before


# --- the reference never runs a kernel package transformers found installed --------------------------------


def _transformers_picked(monkeypatch: pytest.MonkeyPatch, modeling: types.ModuleType, calls: list) -> None:
    """Make `modeling` look as transformers imports it on a machine with fla installed, for inputs on a device
    fla runs on: its delta-rule function wrapped, by transformers' own decorator, around fla's (here a spy).

    The decorator is transformers' internal: where it no longer picks the package this way, the test skips
    naming the version instead of testing an imitation of nothing."""
    from transformers.integrations import hub_kernels

    fake_fla = types.ModuleType("fla")
    fake_fla.chunk_gated_delta_rule = lambda *args, **kwargs: calls.append("fla") or (_ for _ in ()).throw(
        AssertionError("the reference ran fla"))
    monkeypatch.setitem(sys.modules, "fla", fake_fla)
    # transformers 5.25 runs a package only on the devices it lists for it (fla: cuda, xpu, ...): here, the CPU.
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if isinstance(devices, dict):
        monkeypatch.setitem(devices, "fla", ("cpu",))
    torch_rule = models.unwrapped(modeling.torch_chunk_gated_delta_rule)
    picked = hub_kernels.use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")(torch_rule)
    try:
        picked(*[torch.zeros(1, 4, 2, 16)] * 3, g=torch.zeros(1, 4, 2), beta=torch.zeros(1, 4, 2))
    except AssertionError:
        pass
    if calls != ["fla"]:
        pytest.skip(f"transformers {transformers.__version__}: use_kernel_func_from_hub_with_fallback no longer "
                    "picks an installed package the way this test imitates; look at hub_kernels.py again")
    calls.clear()
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", picked)


def _qwen3_5_toy():
    source = next((p for p in (ROOT / "toy_configs", ROOT / "toy_configs_next") if (p / "qwen3_5").is_dir()), None)
    if source is None:
        pytest.skip("no qwen3_5 toy config in this checkout")
    return load_config(source, "qwen3_5")


def test_the_reference_runs_torch_even_where_transformers_picked_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    calls: list = []
    _transformers_picked(monkeypatch, modeling, calls)
    ids = torch.arange(3, 43).reshape(2, 20)
    with pytest.raises(AssertionError, match="the reference ran fla"):  # what an unpinned "eager" model does
        modeling.torch_chunk_gated_delta_rule(*[torch.zeros(1, 4, 2, 16)] * 3, g=torch.zeros(1, 4, 2),
                                              beta=torch.zeros(1, 4, 2))
    calls.clear()
    model = models.build(_qwen3_5_toy(), torch.float32)
    loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss) and calls == []
    assert models.pin_torch_fallbacks(model) == []  # idempotent: nothing left to pin


def test_the_pinned_torch_function_refuses_packed_sequences_it_cannot_keep_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    _transformers_picked(monkeypatch, modeling, [])
    models.build(_qwen3_5_toy(), torch.float32)
    with pytest.raises(ValueError, match="cannot keep packed sequences apart"):
        modeling.torch_chunk_gated_delta_rule(*[torch.zeros(1, 4, 2, 16)] * 3, g=torch.zeros(1, 4, 2),
                                              beta=torch.zeros(1, 4, 2), cu_seqlens=torch.tensor([0, 2, 4]))


# --- liger's report of what it replaced (its patches apply on a CPU; its kernels run on a GPU only) -------


def test_liger_says_which_modules_and_functions_it_replaced(repo_project: Project) -> None:
    pytest.importorskip("liger_kernel.transformers", reason="liger-kernel not installed here")
    from veosnap.candidates.kernels import liger

    model = models.build(load_config(repo_project.configs, "qwen3_moe"), torch.float32)
    with support.restoring_modules("transformers.models.qwen3_moe.modeling_qwen3_moe",
                                     "transformers.loss.loss_utils", "torch.nn.functional"):
        note = "; ".join(liger.apply(model))
    assert "LigerRMSNorm.forward on " in note and "model.layers.{0-1}.input_layernorm" in note
    assert "LigerExperts.forward on 2 modules (model.layers.{0-1}.mlp.experts)" in note
    assert "modeling_qwen3_moe.apply_rotary_pos_emb -> liger_rotary_pos_emb" in note


def test_module_names_fold_their_layer_index() -> None:
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.3.self_attn", "lm_head"]
    assert support.compact(names) == "model.layers.{0-1,3}.self_attn, lm_head"
