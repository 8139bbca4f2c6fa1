"""`veosnap check --matrix`: one table, models by (backend, layout), one run."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from veosnap.candidates import backends
from veosnap.golden.key import GoldenKey
from veosnap.numerics.compare import TensorResult
from veosnap.reference.zoo import Project
from veosnap.render.text import matrix as text
from veosnap.runs.matrix import Cell, Column, Row, default_backends, run_matrix
from veosnap.runs.verdict import CheckReport
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_a_small_matrix_prints_one_row_per_model_and_one_column_per_backend(capsys: pytest.CaptureFixture) -> None:
    code = main(["check", "--matrix", "--model", "llama", "--model", "qwen3_moe", "--dtype", "float32",
                 "--backends", "eager,sdpa+grouped_mm"])
    out = capsys.readouterr().out
    assert code == 0
    header = next(line for line in out.splitlines() if "model" in line and "eager" in line)
    assert "sdpa+grouped_mm" in header
    for model in ("llama", "qwen3_moe"):
        row = next(line for line in out.splitlines() if f" {model} " in line)
        assert row.count("pass") == 2
    assert "4 cells: 4 pass" in out


def test_json_lists_every_cell_with_its_worst_ratio(capsys: pytest.CaptureFixture) -> None:
    code = main(["check", "--matrix", "--model", "qwen3", "--dtype", "float32", "--backends", "sdpa,liger",
                 "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["passed"]
    cells = {c["backend"]: c for c in doc["cells"]}
    assert cells["sdpa"]["status"] == "pass"
    assert 0 <= cells["sdpa"]["worst_ratio"] <= 1
    if backends.unavailable_here("liger"):
        assert cells["liger"]["status"] == "skip" and cells["liger"]["reason"]


def test_a_backend_that_raises_for_one_model_is_an_error_cell_and_the_rest_still_run(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "moe_only_bug.py"
    file.write_text(textwrap.dedent("""
        def fused_moe(model):
            if type(model)._can_set_experts_implementation():
                raise RuntimeError("fused kernel: shape mismatch")
            return model
    """))
    code = main(["check", "--matrix", "--model", "qwen3", "--model", "qwen3_moe", "--dtype", "float32",
                 "--backends", f"eager,{file}:fused_moe", "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    status = {(c["model"], c["backend"].rsplit(":", 1)[-1]): c for c in doc["cells"]}
    assert code == 1
    assert status["qwen3_moe", "fused_moe"]["status"] == "error"
    assert "RuntimeError: fused kernel: shape mismatch" in status["qwen3_moe", "fused_moe"]["reason"]
    assert status["qwen3", "fused_moe"]["status"] == "pass"
    assert status["qwen3_moe", "eager"]["status"] == "pass"


def test_a_failing_cell_names_the_first_diverging_tensor(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(REPO)
    spec = "examples/my_attention_backend.py:my_attention_buggy"
    assert main(["check", "--matrix", "--model", "qwen2", "--dtype", "float32", "--backends", spec]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  qwen2 float32 {spec}/single: first divergence: layer 0 (layers.0.output" in out


def _report(key: GoldenKey, backend: backends.Backend, layout: str, **fields: object) -> CheckReport:
    return CheckReport(golden=str(key), model=key.model, dtype=key.dtype, backend=backend.spec, layout=layout,
                       **fields)


def test_layouts_plug_in_as_a_layouts_check() -> None:
    """What `veosnap.layouts.check_layouts` looks like to the matrix: (project, key, backend, layouts) -> reports."""
    seen = []

    def one(key: GoldenKey, backend: backends.Backend, layout: str) -> CheckReport:
        if layout == "packed":
            return _report(key, backend, layout, tensors=[TensorResult("grad.lm_head.weight", 3.0, 1.0, 0.1)])
        return _report(key, backend, layout, tensors=[TensorResult("logits", 0.25, 1.0, 0.1)])

    def check_cells(project: Project, key: GoldenKey, backend: backends.Backend, layouts: list[str]) -> list:
        seen.append((key.model, backend.spec, tuple(layouts)))
        if key.model == "mixtral" and backend.spec == "sdpa":
            raise TimeoutError("rank 1 did not finish within 120 s")
        return [one(key, backend, layout) for layout in layouts]

    project = Project.resolve()
    result = run_matrix(project, ["llama", "mixtral"], ["float32"], ["eager", "sdpa"], ["single", "packed", "fsdp2"],
                        check_cells=check_cells)
    assert len(seen) == 2 * 2, "one call per (model, backend): every layout shares one torchrun"
    assert [c.label for c in result.columns][:3] == ["eager/single", "eager/packed", "eager/fsdp2"]
    cell = result.cell(Row("mixtral", "float32"), Column("sdpa", "fsdp2"))
    assert cell.status == "error" and "rank 1 did not finish" in cell.reason
    packed = result.cell(Row("llama", "float32"), Column("eager", "packed"))
    assert (packed.status, packed.worst_ratio, packed.worst_tensor) == ("fail", 3.0, "grad.lm_head.weight")
    assert result.cell(Row("llama", "float32"), Column("sdpa", "single")).worst_ratio == 0.25
    assert not result.passed
    assert result.counts() == {"pass": 6, "fail": 3, "skip": 0, "error": 3}
    table = text(result)
    assert "eager/packed" in table and "FAIL 3x" in table and "ERROR" in table


def test_a_matrix_of_only_skips_and_passes_passes() -> None:
    cells = [Cell("llama", "float32", "liger", "single", "skip", reason="needs a GPU"),
             Cell("llama", "float32", "eager", "single", "pass", worst_ratio=0.0)]
    from veosnap.runs.matrix import Matrix

    assert Matrix([Row("llama", "float32")], [Column("eager"), Column("liger")], cells).passed


def test_default_columns_are_the_builtins_this_machine_runs() -> None:
    runnable, unavailable = default_backends()
    assert runnable[0] == "eager"
    assert set(runnable) | set(unavailable) == set(backends.builtin_names())
    assert not set(runnable) & set(unavailable)
    assert all(reason for reason in unavailable.values())


def test_matrix_flags_are_checked(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--matrix", "--backend", "sdpa"]) == 2
    assert "--matrix takes --backends" in capsys.readouterr().err
    assert main(["check", "--backends", "sdpa"]) == 2
    assert "go with --matrix" in capsys.readouterr().err
    assert main(["check", "--matrix", "--backends", "sdpa,,eager"]) == 2
    assert "empty name" in capsys.readouterr().err
    assert main(["check", "--matrix", "--backends", "sdpa,nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
