"""Bad candidates: non-finite values, wrong shapes or dtypes fail and say where; a backend that raises
is an error for its own check while the other checks still run.

Each candidate is a plugin backend file written into tmp_path, as a user would write one.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from golden_repo import CLASS, golden_path

from veosnap.golden import store
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]

BACKENDS = textwrap.dedent('''
    import torch

    def _patch_output(module, edit):
        def hook(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            hidden = edit(hidden.clone())
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
        module.register_forward_hook(hook)

    def nan_in_layer(model):
        def edit(h):
            h[0, 5, 3] = float("nan")
            return h
        _patch_output(model.model.layers[1], edit)
        return model

    def inf_in_logits(model):
        def edit(h):
            h[1, 7, 2] = float("inf")
            return h
        _patch_output(model.lm_head, edit)
        return model

    def nan_in_one_gradient(model):
        def poison(grad):
            grad = grad.clone()
            grad[3] = float("nan")
            return grad
        model.model.norm.weight.register_hook(poison)
        return model

    def extra_vocab_column(model):
        _patch_output(model.lm_head, lambda h: torch.cat([h, h[..., :1]], dim=-1))
        model.config.vocab_size += 1  # HF's loss reshapes logits by the config's vocab size
        return model

    def float64(model):
        return model.to(torch.float64)

    def fails_on_qwen2(model):
        if model.config.model_type == "qwen2":
            raise RuntimeError("fused kernel exploded")
        return model
''')


@pytest.fixture
def backend_file(tmp_path: Path) -> Path:
    path = tmp_path / "candidates.py"
    path.write_text(BACKENDS)
    return path


def check_json(capsys: pytest.CaptureFixture, backend: str, *models: str) -> tuple[int, list[dict]]:
    argv = ["check", "--goldens", str(REPO / "goldens"), "--hardware-class", CLASS, "--dtype", "float32",
            "--backend", backend, "--format", "json"]
    for model in models or ("llama",):
        argv += ["--model", model]
    code = main(argv)
    out, err = capsys.readouterr()
    assert err == ""
    return code, json.loads(out)["results"]


def problems(result: dict) -> dict[str, str]:
    return {t["name"]: t["problem"] for t in result["tensors"] if t["problem"]}


def golden_shape(name: str) -> tuple[int, ...]:
    path = golden_path("llama")
    return tuple(store.read(path).tensors[name].shape)


def test_nan_in_a_layer_fails_and_says_where(capsys, backend_file):
    code, [result] = check_json(capsys, f"{backend_file}:nan_in_layer")
    assert (code, result["status"]) == (1, "FAIL")
    assert problems(result)["layers.1.output"] == "1 non-finite value(s) (NaN/Inf), first at (0, 5, 3)"
    assert "layers.0.output" not in problems(result)
    assert result["first_divergence"].startswith("layer 1 (layers.1.output")


def test_inf_in_logits_fails_and_says_where(capsys, backend_file):
    code, [result] = check_json(capsys, f"{backend_file}:inf_in_logits")
    assert (code, result["status"]) == (1, "FAIL")
    assert problems(result)["logits"] == "1 non-finite value(s) (NaN/Inf), first at (1, 7, 2)"
    assert not any(name.startswith("layers.") for name in problems(result))


def test_nan_in_one_gradient_fails_and_says_where(capsys, backend_file):
    code, [result] = check_json(capsys, f"{backend_file}:nan_in_one_gradient")
    assert (code, result["status"]) == (1, "FAIL")
    assert problems(result) == {"grad.model.norm.weight": "1 non-finite value(s) (NaN/Inf), first at (3,)"}
    assert result["first_gradient_divergence"].startswith("model.norm (grad.model.norm.weight")


def test_wrong_shape_fails_naming_both_shapes(capsys, backend_file):
    code, [result] = check_json(capsys, f"{backend_file}:extra_vocab_column")
    assert (code, result["status"]) == (1, "FAIL")
    shape = golden_shape("logits")
    wider = (*shape[:-1], shape[-1] + 1)
    assert problems(result)["logits"] == f"shape {wider} but golden {shape}"


def test_wrong_dtype_fails_naming_both_dtypes(capsys, backend_file):
    code, [result] = check_json(capsys, f"{backend_file}:float64")
    assert (code, result["status"]) == (1, "FAIL")
    found = problems(result)
    assert found["logits"] == "dtype float64 but golden float32"
    assert found["grad.lm_head.weight"] == "dtype float64 but golden float32"
    assert all(t["passed"] is False for t in result["tensors"] if t["name"] != "loss")


def test_a_backend_that_raises_is_an_error_for_its_check_only(capsys, backend_file):
    code, results = check_json(capsys, f"{backend_file}:fails_on_qwen2", "llama", "qwen2", "qwen3")
    by_model = {r["model"]: r for r in results}
    assert code == 1
    assert [by_model[m]["status"] for m in ("llama", "qwen2", "qwen3")] == ["PASS", "ERROR", "PASS"]
    assert by_model["qwen2"]["error"] == f"RuntimeError: fused kernel exploded (at {backend_file}:{_line('raise RuntimeError')})"
    assert by_model["qwen2"]["tensors"] == []


def test_the_text_report_names_the_error_and_what_passed(capsys, backend_file):
    code = main(["check", "--goldens", str(REPO / "goldens"), "--hardware-class", CLASS, "--dtype", "float32",
                 "--model", "qwen2", "--backend", f"{backend_file}:fails_on_qwen2"])
    out, err = capsys.readouterr()
    assert (code, err) == (1, "")
    assert f"ERROR  {CLASS}/qwen2/step-float32" in out
    assert "error: RuntimeError: fused kernel exploded" in out
    assert out.rstrip().endswith("0 passed, 1 failed")


def _line(text: str) -> int:
    return next(i for i, line in enumerate(BACKENDS.splitlines(), 1) if text in line)
