"""VeOmni's production GPU kernels (examples/veomni: the backends veomni_fused_moe, veomni_quack, veomni_liger,
veomni_liger_loss, veomni_fa4, veomni_fla, veomni_production, and the runner gpu.py) on the CPU: each backend
declines with its one-line reason (no CUDA, float32 for a 16-bit kernel, a model without the part; without VeOmni,
how to get it), the runner says there is no GPU and exits 0, runs its whole pipeline with --cpu, and plans without a
GPU; what VeOmni bound is counted and a model that binds none of a backend's kernels is a skip; `restored()` undoes
the per-model patches VeOmni makes in its generated modeling modules. The GPU itself: examples/veomni/README.md.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "veomni"
RUNNER = EXAMPLE / "gpu.py"
HERE = importlib.util.find_spec("veomni") is not None
NO_VEOMNI = "veomni is not importable in this interpreter (tools/veomni_env.sh builds an environment with it)"
GPU_BACKENDS = ["veomni_fused_moe", "veomni_quack", "veomni_liger", "veomni_liger_loss", "veomni_fa4", "veomni_fla",
                "veomni_production"]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: the CPU paths are not taken")


def _adapter():  # noqa: ANN202 - the package veosnap_veomni
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import veosnap_veomni

    return veosnap_veomni


def _reference(model: str, dtype: str) -> torch.nn.Module:
    """The eager reference veosnap builds for a toy (no golden needed: the tree may be fitted for a device call)."""
    from veosnap.reference import models
    from veosnap.reference.zoo import load_config

    return models.build(load_config(ROOT / "toy_configs", model), getattr(torch, dtype))


def _declined(backend: str, model: str, dtype: str) -> str:
    """The reason `backend` (a veosnap_veomni backend's name) declines the toy `model` in `dtype` with."""
    import veosnap
    from veosnap.candidates.context import in_process

    reference = _reference(model, dtype)
    with pytest.raises(veosnap.Unsupported) as caught:
        next(getattr(_adapter(), backend)(reference, in_process(reference)))
    return str(caught.value)


# what each backend says on this CPU: (model, dtype) -> the reason's words
DECLINES = {
    ("qwen3_moe", "bfloat16"): {b: "needs a CUDA GPU" for b in GPU_BACKENDS if b != "veomni_fla"}
    | {"veomni_fla": "the model has no linear-attention layers"},
    ("qwen3", "float32"): {"veomni_fused_moe": "the model has no MoE experts",
                           "veomni_quack": "the model has no MoE experts",
                           "veomni_liger": "needs a CUDA GPU", "veomni_liger_loss": "needs a CUDA GPU",
                           "veomni_fa4": "takes bfloat16/float16 only, not float32",
                           "veomni_fla": "the model has no linear-attention layers",
                           "veomni_production": "takes bfloat16/float16 only, not float32"},
}


@CPU_ONLY
@pytest.mark.skipif(not HERE, reason=NO_VEOMNI)
def test_the_gpu_backends_decline_on_the_cpu_with_their_reason() -> None:
    for (model, dtype), reasons in DECLINES.items():
        for backend, words in reasons.items():
            reason = _declined(backend, model, dtype)
            assert words in reason and "\n" not in reason, (backend, model, reason)
            assert reason.startswith("VeOmni's "), reason  # it names what cannot run


def test_the_gpu_backends_skip_with_the_reason_without_veomni() -> None:
    if HERE:
        pytest.skip("veomni is importable here: the skip path is for environments without it")
    for backend in GPU_BACKENDS:
        reason = _declined(backend, "qwen3_moe", "bfloat16")
        assert "veomni is not importable" in reason and "tools/veomni_env.sh" in reason, (backend, reason)


@pytest.mark.skipif(not HERE, reason=NO_VEOMNI)
def test_a_kernel_the_model_does_not_bind_is_a_skip_and_one_it_binds_is_counted() -> None:
    """A fused MoE kernel on a dense model: VeOmni's qwen3 has no experts slot, so nothing of the backend would run:
    a skip that says so (not VeOmni's eager path passing as the kernel). On qwen3_moe the report counts its calls."""
    import veosnap
    from veosnap.candidates.context import in_process

    sys.path.insert(0, str(ROOT / "tests"))
    import veomni_fused_moe

    dense = _reference("qwen3", "float32")
    with pytest.raises(veosnap.Unsupported, match="binds none of moe_implementation=fused_toy"):
        next(veomni_fused_moe.fused_toy(dense, in_process(dense)))
    reference = _reference("qwen3_moe", "float32")
    steps = veomni_fused_moe.fused_toy(reference, in_process(reference))
    candidate = next(steps)
    ids = torch.arange(16)[None]
    candidate.model(input_ids=ids, labels=ids).loss.backward()
    with pytest.raises(StopIteration):
        next(steps)
    (ran,) = [n for n in candidate.notes if n.startswith("VeOmni ran ")]
    assert ran == "VeOmni ran moe_experts/standard=toy (pure-torch grouped GEMM (tests/veomni_fused_moe.py)): 2x"


@pytest.mark.skipif(not HERE, reason=NO_VEOMNI)
def test_a_bound_kernel_that_never_ran_fails_the_check() -> None:
    vv = _adapter()
    bound = vv.kernels.Bound({"moe_implementation": "fused_triton"})
    bound.counted("moe_experts/standard=triton", lambda: None)
    with pytest.raises(RuntimeError, match="VeOmni bound moe_experts/standard=triton for moe_implementation="
                                           "fused_triton but none of it ran"):
        bound.require_ran()


@pytest.mark.skipif(not HERE, reason=NO_VEOMNI)
def test_restored_undoes_veomnis_per_model_patches() -> None:
    """VeOmni's apply_per_model_patches (DeepSeek-V3's device_patch.py) replaces classes and functions in a generated
    modeling module, and an eager build never puts them back; inside restored() they are recorded and undone."""
    from veomni.ops.config import BackendSpec, apply_per_model_patches, set_ops_config
    from veomni.ops.config.singleton import get_ops_config

    vv = _adapter()

    class Norm:
        def forward(self) -> str:
            return "eager"

    def rope() -> str:
        return "eager"

    def fused_forward(self) -> str:  # noqa: ANN001
        return "fused"

    kernels = types.ModuleType("veosnap_test_per_model_kernels")
    kernels.FusedNorm, kernels.fused_forward = type("FusedNorm", (), {}), fused_forward
    kernels.fused_rope = lambda: "fused"
    generated = types.ModuleType("veosnap_test_generated_modeling")
    generated.Norm, generated.apply_rotary_pos_emb = Norm, rope
    sys.modules[kernels.__name__] = kernels
    ops = get_ops_config()
    try:
        with vv.restored() as snapshot:
            set_ops_config(vv.ops_config(rms_norm_implementation="mine", rotary_pos_emb_implementation="mine"))
            entry = f"{kernels.__name__}:"
            mine = {"rms_norm": {"mine": BackendSpec(entry=entry + "FusedNorm")},
                    "rotary_pos_emb": {"mine": BackendSpec(entry=entry + "fused_rope")}}
            apply_per_model_patches(generated, "Test", {"rms_norm": "Norm", "rotary_pos_emb": "apply_rotary_pos_emb"},
                                    extra_backends=mine)
            assert generated.Norm is kernels.FusedNorm and generated.apply_rotary_pos_emb is kernels.fused_rope
            set_ops_config(vv.ops_config(rms_norm_implementation="mine"))
            apply_per_model_patches(generated, "Test", {"rms_norm": "Norm"}, extra_backends={"rms_norm": {
                "mine": BackendSpec(entry=entry + "fused_forward", replace_forward=True, target_override="Norm")}})
            assert [p.attr for p in snapshot.patches] == ["Norm", "apply_rotary_pos_emb", "forward"]
        assert generated.Norm is Norm and generated.apply_rotary_pos_emb is rope
        assert Norm().forward() == "eager" and "forward" in vars(Norm)
        assert get_ops_config() is ops
    finally:
        sys.modules.pop(kernels.__name__, None)


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@CPU_ONLY
def test_the_runner_says_there_is_no_gpu_and_exits_0(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = "no CUDA GPU here (torch.cuda.is_available() is False): nothing recorded or checked"
    assert said in proc.stdout
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["said"].startswith(said) and doc["cells"] == [] and doc["env"]["torch"]
    assert (tmp_path / "table.md").read_text().startswith(said)


def test_the_runner_plans_without_a_gpu() -> None:
    proc = _run("--plan", "--models", "qwen3,qwen3_moe", "--hd64", "qwen3", "--jobs", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "veomni_fa4: 5 cells (qwen3 bfloat16, qwen3_moe bfloat16, qwen3-hd64 bfloat16, qwen3 float32, " \
           "qwen3_moe float32)" in lines
    assert "veomni_liger: 4 cells (qwen3 bfloat16, qwen3_moe bfloat16, qwen3 float32, qwen3_moe float32)" in lines
    assert lines[-1].startswith("5 goldens to record, 35 cells on 4 workers: about ")


def test_the_runner_refuses_an_unknown_backend_in_one_line() -> None:
    proc = _run("--plan", "--backends", "veomni,veomni_fa5")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("examples/veomni/gpu.py: unknown backend or dtype veomni_fa5 (backends: " +
                                   ", ".join(["veomni", *GPU_BACKENDS]) + "; dtypes: bfloat16, float32)")


@pytest.mark.heavy
@CPU_ONLY
@pytest.mark.skipif(not HERE, reason=NO_VEOMNI)
def test_the_runner_records_checks_and_tabulates_on_the_cpu(tmp_path: Path) -> None:
    """The whole pipeline with --cpu: a scratch project with a -hd64 variant, its goldens recorded here, a worker per
    backend, the table: VeOmni's eager control passes (0.00x: the golden is this environment's), the GPU backends
    decline with their reasons, and the repository's goldens are untouched."""
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    proc = _run("--cpu", "--out", str(out), "--scratch", str(scratch), "--models", "qwen3", "--hd64", "qwen3",
                "--dtypes", "float32,bfloat16", "--backends", "veomni,veomni_liger,veomni_fa4", "--jobs", "2",
                "--budget", "400")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[record] qwen3-hd64/bfloat16: recorded in " in proc.stdout
    assert "[veomni_liger] qwen3 float32 single: skip VeOmni's liger_kernel RMSNorm, SwiGLU and RoPE needs a CUDA " \
           "GPU" in proc.stdout  # a cell's line as it ends
    config = json.loads((scratch / "toy_configs" / "qwen3-hd64" / "config.json").read_text())
    assert config["head_dim"] == 64 and sorted(p.name for p in (scratch / "goldens" / "cpu").iterdir()) == [
        "qwen3", "qwen3-hd64"]
    text = (out / "table.md").read_text()
    assert text.startswith("| model | veomni bf16 single | veomni f32 single | veomni_liger bf16 single | veomni_liger "
                           "f32 single | veomni_fa4 bf16 single | veomni_fa4 f32 single |\n")
    assert "| qwen3-hd64 | PASS 0.00x |  |  |  | skip |  |" in text  # liger does not run on the variants
    assert "\n- skip veomni_fa4 single (qwen3/bfloat16, qwen3-hd64/bfloat16): VeOmni's flash_attention_4 " in text
    doc = json.loads((out / "results.json").read_text())
    cells = {(c["model"], c["dtype"], c["cell"]["backend"]): c for c in doc["cells"]}
    assert len(cells) == 8 and cells[("qwen3", "float32", "veomni")]["status"] == "PASS"
    assert "takes bfloat16/float16 only" in cells[("qwen3", "float32", "veomni_fa4")]["reason"]
    assert {r["model"] for r in doc["recorded"] if "path" in r} == {"qwen3", "qwen3-hd64"}
    assert (out / "log.txt").is_file()
