"""Backends: built-ins, combinations, forward-only candidates, user backends (file, module, entry point)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from golden_repo import CLASS, ON_CUDA, needs_goldens

from veosnap.candidates import backends, pristine
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.check import check
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/my_attention_backend.py"
SLOW = os.environ.get("VEOSNAP_SLOW") == "1"


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.resolve()


def key(project: Project, model: str, dtype: str = "float32") -> GoldenKey:
    return GoldenKey(project.hardware_class, model, "step", dtype)


def test_every_builtin_named_in_the_issue_is_registered() -> None:
    for name in ("eager", "sdpa", "flex_attention", "grouped_mm", "batched_mm", "compile", "liger"):
        assert name in backends.builtin_names()


@pytest.mark.parametrize("spec", ["sdpa+grouped_mm", "flex_attention+batched_mm"])
def test_attention_and_experts_backends_combine(project: Project, spec: str) -> None:
    report = check(project, key(project, "qwen3_moe"), backends.resolve(spec))
    assert report.status == "PASS", report.error or report.worst
    assert report.backend == spec
    assert any(t.name.startswith("routes.") for t in report.tensors)


def test_flex_attention_on_cpu_checks_the_forward_and_says_gradients_were_not(project: Project) -> None:
    if torch.cuda.is_available():
        pytest.skip("flex_attention has a backward on CUDA: the full step is checked there")
    report = check(project, key(project, "llama"), backends.resolve("flex_attention"))
    names = {t.name for t in report.tensors}
    assert report.passed
    assert {"loss", "logits", "layers.0.output"} <= names
    assert not any(name.startswith("grad.") for name in names)
    assert any("no backward on CPU" in note and "gradients not checked" in note for note in report.notes)


def test_a_user_backend_declares_forward_only_by_returning_it(project: Project, tmp_path: Path) -> None:
    file = tmp_path / "fwd.py"
    file.write_text(textwrap.dedent("""
        from veosnap import forward_only

        def no_backward_here(model):
            return forward_only(model, "my kernel has no backward yet")
    """))
    report = check(project, key(project, "qwen3"), backends.resolve(f"{file}:no_backward_here"))
    assert report.passed
    assert not any(t.name.startswith("grad.") for t in report.tensors)
    assert "my kernel has no backward yet" in report.notes[0]


def test_a_generator_backend_undoes_its_patch_after_the_check(project: Project, tmp_path: Path) -> None:
    file = tmp_path / "patching.py"
    file.write_text(textwrap.dedent("""
        import transformers.models.llama.modeling_llama as modeling
        seen = []

        def patch_rope(model):
            original = modeling.apply_rotary_pos_emb
            modeling.apply_rotary_pos_emb = lambda q, k, *a, **kw: (seen.append(1), original(q, k, *a, **kw))[1]
            try:
                yield model
            finally:
                modeling.apply_rotary_pos_emb = original
    """))
    import transformers.models.llama.modeling_llama as modeling

    before = modeling.apply_rotary_pos_emb
    backend = backends.resolve(f"{file}:patch_rope")
    report = check(project, key(project, "llama"), backend)
    assert report.passed
    assert sys.modules[backend.steps[0].__module__].seen, "the patched function ran during the check"
    assert modeling.apply_rotary_pos_emb is before


def test_liger_is_skipped_on_cpu_with_the_reason(project: Project) -> None:
    if backends.unavailable_here("liger") is None:
        pytest.skip("liger can run here: the GPU suite checks it")
    report = check(project, key(project, "llama"), backends.resolve("liger"))
    assert report.status == "skip"
    assert "GPU" in report.skipped or "not installed" in report.skipped


def test_liger_patches_are_undone_even_when_process_wide() -> None:
    import transformers.models.llama.modeling_llama as modeling

    before_fn, before_forward = modeling.apply_rotary_pos_emb, modeling.LlamaRMSNorm.forward
    with pristine.kept(modeling.__name__, watched=False) as left:  # what liger's backend runs inside
        modeling.apply_rotary_pos_emb = None
        modeling.LlamaRMSNorm.forward = None
        modeling.added_by_patch = lambda: None
    assert left.patches == [f"{modeling.__name__}.added_by_patch", f"{modeling.__name__}.apply_rotary_pos_emb",
                    f"{modeling.__name__}.LlamaRMSNorm.forward"]
    assert modeling.apply_rotary_pos_emb is before_fn
    assert modeling.LlamaRMSNorm.forward is before_forward
    assert not hasattr(modeling, "added_by_patch")


@pytest.mark.skipif(not (SLOW or ON_CUDA),
                    reason="torch.compile's first step takes about a minute on 2 CPU cores; VEOSNAP_SLOW=1 runs it")
def test_compile_matches_the_golden(project: Project) -> None:
    report = check(project, key(project, "llama"), backends.resolve("compile"))
    assert report.status == "PASS", report.error or report.worst


def test_the_documented_example_backend_passes_with_one_command(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(REPO)
    assert main(["check", "--backend", f"{EXAMPLE}:my_attention"]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out
    assert "skipped: my_attention has no attention sinks" in out  # gpt_oss


def test_the_buggy_example_fails_naming_the_first_diverging_tensor(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(REPO)
    code = main(["check", "--model", "llama", "--dtype", "float32",
                 "--backend", f"{EXAMPLE}:my_attention_buggy", "--format", "json"])
    result = json.loads(capsys.readouterr().out)["results"][0]
    assert code == 1
    assert result["first_divergence"].startswith("layer 0 (layers.0.output")
    failing = {t["name"] for t in result["tensors"] if not t["passed"]}
    assert {"logits", "layers.0.output"} <= failing
    assert "loss" in failing


def _install_plugin(tmp_path: Path, module: str, body: str, target: str) -> None:
    """A distribution on sys.path that declares a `veosnap.backends` entry point, as pip would install it."""
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    dist = tmp_path / f"{module}-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-kernels\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[veosnap.backends]\nacme = {target}\n")


def test_an_installed_package_registers_a_backend_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    _install_plugin(tmp_path, "acme_kernels", """
        def acme_attention(model):
            model.set_attn_implementation("sdpa")
            return model
    """, "acme_kernels:acme_attention")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--model", "qwen3", "--dtype", "float32", "--backend", "acme+grouped_mm"]) == 0
    assert f"PASS  {CLASS}/qwen3/step-float32  backend=acme+grouped_mm" in capsys.readouterr().out


def test_a_broken_entry_point_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    _install_plugin(tmp_path, "acme_broken", "import not_a_module_anywhere\n", "acme_broken:acme_attention")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--model", "qwen3", "--backend", "acme"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("veosnap: error: backend 'acme': entry point acme_broken:acme_attention failed to load")
    assert "\n" not in err


def test_an_unknown_backend_names_the_built_ins(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--model", "llama", "--backend", "sdpa+flash_nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "unknown backend 'flash_nonexistent'" in err and "flex_attention" in err


class _GroupedAttention(torch.nn.Module):
    """What HF's SDPA attention function reads from an attention module: its key/value groups."""

    num_key_value_groups = 4
    is_causal = True


def _attention_call(mask: bool) -> tuple:
    q = torch.randn(1, 8, 16, 32)
    kv = torch.randn(1, 2, 16, 32)
    attention_mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril() if mask else None
    return _GroupedAttention(), q, kv, kv.clone(), attention_mask


def test_an_sdpa_kernel_that_cannot_run_the_models_call_declines_with_torchs_reasons() -> None:
    # On the CPU torch has no efficient kernel at all: the real HF call fails as on the H200, where the
    # efficient kernel refuses HF's unmasked grouped-query call (enable_gqa).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    declining = backends.declining_sdpa("efficient", sdpa_attention_forward)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), pytest.raises(backends.Unsupported) as declined:
        declining(*_attention_call(mask=False), dropout=0.0, scaling=None)
    reason = str(declined.value)
    assert reason.startswith("SDPA's efficient kernel cannot run this model's attention call")
    assert "8 query and 2 key/value heads, grouped" in reason
    assert "no mask" in reason and "head_dim 32" in reason


def test_an_sdpa_kernel_that_runs_the_call_returns_its_output_and_other_errors_stay_errors() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    declining = backends.declining_sdpa("math", sdpa_attention_forward)
    for mask in (False, True):
        with sdpa_kernel(SDPBackend.MATH):
            out, _ = declining(*_attention_call(mask), dropout=0.0, scaling=None)
        assert out.shape == (1, 16, 8, 32)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        backends.declining_sdpa("efficient", broken)(*_attention_call(mask=False))


# What torch 2.11's inductor raised on the H200 for DeepSeek-V3's float32 attention (2026-12-02).
FLEX_TOO_LARGE = ("InductorError: RuntimeError: No valid triton configs. OutOfMemoryError: out of resource: "
                  "triton_tem_fused_flex_attention_0 Required: 278784 Hardware limit:232448 Reducing block sizes "
                  "or `num_stages` may help.")


def test_a_flex_kernel_too_large_for_the_gpu_declines_with_torchs_figures() -> None:
    def too_large(*args: object, **kwargs: object) -> None:
        raise RuntimeError(FLEX_TOO_LARGE)

    module, q, k, v, _ = _attention_call(mask=False)
    with pytest.raises(backends.Unsupported) as declined:
        backends.declining_flex(too_large)(module, q, k, v[..., :16], None)
    reason = str(declined.value)
    assert reason.startswith("torch's flex_attention kernel cannot be built for this model's attention call")
    assert "head_dim 32 for queries and keys, 16 for values" in reason
    assert reason.endswith("it needs 278784 bytes of shared memory a block, the GPU has 232448")


def test_a_flex_kernel_that_fails_otherwise_stays_an_error_and_the_function_is_restored() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        backends.declining_flex(broken)(*_attention_call(mask=False))
    before = ALL_ATTENTION_FUNCTIONS["flex_attention"]
    with backends.wrapped_attention("flex_attention", backends.declining_flex):
        assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is not before
    assert ALL_ATTENTION_FUNCTIONS["flex_attention"] is before
    assert "flex_attention" not in ALL_ATTENTION_FUNCTIONS._local_mapping


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the SDPA kernels are chosen per call on the GPU")
@needs_goldens(CLASS, "qwen3_moe-real-small")
def test_sdpa_kernels_on_an_unpadded_grouped_query_golden_skip_or_pass_never_error(project: Project) -> None:
    # qwen3_moe-real-small's batch is one unpadded row: HF calls SDPA without a mask and with enable_gqa,
    # which the efficient kernel refuses (H200, 2026-12-01: "No available kernel" errors before the fix).
    for spec in ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn"):
        report = check(project, key(project, "qwen3_moe-real-small", "bfloat16"), backends.resolve(spec))
        assert not report.error, (spec, report.error)
        assert report.passed or report.skipped, (spec, report.worst)
    efficient = check(project, key(project, "qwen3_moe-real-small", "bfloat16"), backends.resolve("sdpa_efficient"))
    assert "grouped" in efficient.skipped and "no mask" in efficient.skipped
