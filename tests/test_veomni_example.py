"""The VeOmni example (examples/veomni): VeOmni's own model classes and parallel state against the goldens.

VeOmni pins its own transformers, so it lives in a separate environment that `tools/veomni_env.sh`
builds (`.venv-veomni`). The example runs here when `veomni` is importable in this interpreter, or
through that script when its environment exists (or `VEOSNAP_VEOMNI_BUILD=1` lets the test build it,
which downloads from PyPI); otherwise those tests skip with the reason. Without VeOmni the plugin must
skip cleanly, which runs everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLUGIN = "examples/veomni/plugin.py"
SCRIPT = ROOT / "tools" / "veomni_env.sh"
VENV = Path(os.environ.get("VEOMNI_VENV", ROOT / ".venv-veomni"))
HERE = importlib.util.find_spec("veomni") is not None
QUICK = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_vl")  # the --quick run's models VeOmni implements
MUST_PASS = {  # (model, dtype, backend, layout) of the --quick run that must pass
    (m, "float32", "veomni", layout) for m in QUICK for layout in ("single", "packed", "microbatch", "fsdp2")
} | {(m, "float32", b, "single") for m in QUICK for b in ("veomni_chunk_loss", "veomni_sdpa", "eager")} | {
    (m, "float32", "veomni_collator", layout) for m in QUICK for layout in ("single", "fsdp2")} | {
    (m, "float32", "veomni_fsdp2", "fsdp2") for m in QUICK} | {
    (m, "bfloat16", "veomni", "single") for m in ("qwen3", "qwen3_moe", "qwen3_vl")}


def _doc(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def _cells(out: Path) -> dict[tuple[str, str, str, str], dict]:
    doc = _doc(out)
    assert doc["versions"]["veomni"] == "0.1.12"
    return {(c["model"], c["dtype"], c["backend"], c["layout"]): c for c in doc["cells"]}


def _assert_quick_run(out: Path) -> None:
    cells = _cells(out)
    assert MUST_PASS <= set(cells)
    failed = {k: (c["status"], c["reason"]) for k, c in cells.items() if k in MUST_PASS and c["status"] != "PASS"}
    assert not failed
    # VeOmni's eager modeling computes the reference's function: its error against the golden is the eager
    # reference's own, to the bit, tensor for tensor (DeepSeek-V3's one-tensor router is read at its experts' inputs).
    for model in ("qwen3_moe", "deepseek_v3", "qwen3_vl"):
        veomni, eager = cells[(model, "float32", "veomni", "single")], cells[(model, "float32", "eager", "single")]
        assert (veomni["worst"], veomni["ratio"]) == (eager["worst"], eager["ratio"]), model
    # VeOmni's chunked loss has no logits: everything else is compared, and the cell says so.
    assert all(c["no_logits"] for k, c in cells.items() if k[2] == "veomni_chunk_loss" and k[0] in QUICK)
    assert not cells[("qwen3", "float32", "veomni", "single")]["no_logits"]
    # What does not apply is a skip with its reason, not a failure; every non-PASS cell is in expected.toml,
    # none is an ERROR, and no expectation is stale.
    assert all(c["status"] == "skip" and "no model class for 'mixtral'" in c["reason"]
               for k, c in cells.items() if k[0] == "mixtral" and k[2] != "eager")
    assert "fused MoE kernels" in cells[("qwen3_moe", "float32", "veomni", "ep")]["reason"]
    assert all(c["expected"] and c["status"] in ("skip", "FAIL") for c in cells.values() if c["status"] != "PASS")
    assert not _doc(out)["unexpected"] and not _doc(out)["stale"]
    # VeOmni's import-time registrations are said once (the plugin imports VeOmni before any check), not
    # found "left behind" by every check.
    assert len(_doc(out)["import_registrations"]) == 7
    assert not [n for c in cells.values() for n in c["notes"] if "left patches behind" in n]
    # The all-eager backends declare they run the reference path; the others do not.
    assert any(n.startswith("runs the reference path: ") for n in cells[("qwen3", "float32", "veomni", "fsdp2")]["notes"])
    assert not any(n.startswith("runs the reference path") for n in cells[("qwen3", "float32", "veomni_sdpa", "single")]["notes"])
    # transformers 5.22 keeps DeepSeek-V3's router weight in bfloat16 (5.24, the golden's, in float32): said as
    # a structure change naming the versions, before any number.
    drift = cells[("deepseek_v3", "bfloat16", "veomni", "single")]
    assert drift["status"] == "FAIL"
    assert drift["reason"].startswith("structure differs from the golden (versions differ: ")
    assert table_ok(out)


def table_ok(out: Path) -> bool:
    text = (out / "table.md").read_text()
    return text.startswith("| model |") and "unexpected" in text and "stale expectations" in text


@pytest.mark.skipif(not HERE, reason="veomni is not importable in this interpreter (tools/veomni_env.sh builds "
                                     "an environment with it; the script test below runs it there)")
def test_example_runs_in_this_interpreter(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "examples/veomni/run.py", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_quick_run(tmp_path)


def _script_can_run() -> str | None:
    if (VENV / "bin" / "python").exists() or os.environ.get("VEOSNAP_VEOMNI_BUILD") == "1":
        return None
    return (f"{VENV} does not exist: run tools/veomni_env.sh once (or set VEOSNAP_VEOMNI_BUILD=1 to let this "
            "test build it; it downloads transformers and veomni from PyPI)")


@pytest.mark.skipif(_script_can_run() is not None, reason=str(_script_can_run()))
def test_env_script_builds_and_runs_the_example(tmp_path: Path) -> None:
    env = {**os.environ, "VEOMNI_VENV": str(VENV)}
    proc = subprocess.run(["bash", str(SCRIPT), "--quick", "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "versions: " in proc.stderr and "transformers 5.22.2" in proc.stderr
    assert "[1/" in proc.stderr  # progress
    # A rank's output reaches the console: VeOmni's build_parallelize_model (veomni_fsdp2) runs only on the
    # torchrun ranks, and its log line is on the console.
    assert "Every rank would read weights from disk" in proc.stderr
    _assert_quick_run(tmp_path)


def test_plugin_skips_with_the_reason_without_veomni() -> None:
    """In an environment without VeOmni, every VeOmni cell is a skip that says how to get it, not an error."""
    if HERE:
        pytest.skip("veomni is importable here: the skip path is for environments without it")
    proc = subprocess.run([sys.executable, "-m", "veosnap", "check", "--model", "qwen3", "--dtype", "float32",
                           "--backend", f"{PLUGIN}:veomni", "--format", "json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (result,) = json.loads(proc.stdout)["results"]
    assert result["status"] == "skip"
    assert "veomni is not importable" in result["skipped"] and "tools/veomni_env.sh" in result["skipped"]


@pytest.mark.skipif(not HERE, reason="veomni is not importable in this interpreter (tools/veomni_env.sh)")
def test_plugin_restores_transformers_loss_mapping() -> None:
    """VeOmni installs tuple-returning losses into transformers' LOSS_MAPPING; after the check they are HF's again."""
    import torch
    from transformers.loss.loss_utils import LOSS_MAPPING

    from veosnap.candidates import backends
    from veosnap.reference import models
    from veosnap.reference.zoo import Project, load_config

    before = dict(LOSS_MAPPING)
    reference = models.build(load_config(Project.resolve(configs=ROOT / "toy_configs").configs, "qwen3"), torch.float32)
    with backends.resolve(f"{PLUGIN}:veomni").prepare(reference) as candidate:
        assert type(candidate.model).__module__.startswith("veomni.")
        assert dict(LOSS_MAPPING) != before  # VeOmni's losses, while its candidate runs
        ids = torch.arange(8)[None]
        loss = candidate.model(input_ids=ids, labels=ids).loss
        assert loss.ndim == 0
    assert dict(LOSS_MAPPING) == before  # restored when the check is done
    from veomni.distributed.parallel_state import is_parallel_state_initialized

    assert not is_parallel_state_initialized()
    hf = models.build(load_config(Project.resolve(configs=ROOT / "toy_configs").configs, "qwen3"), torch.float32)
    assert hf(input_ids=ids, labels=ids).loss.ndim == 0  # an HF model built afterwards gets a tensor loss


@pytest.mark.skipif(not HERE, reason="veomni is not importable in this interpreter (tools/veomni_env.sh)")
def test_a_bug_planted_in_veomnis_model_fails_at_its_layer() -> None:
    """The check reaches VeOmni's own modules: a wrong RMSNorm epsilon in one VeOmni layer fails from there."""
    from veosnap.candidates import backends
    from veosnap.golden.key import GoldenKey
    from veosnap.reference.zoo import Project
    from veosnap.runs.check import check

    def planted(model):  # noqa: ANN001, ANN202
        assert type(model).__module__.startswith("veomni.")
        model.model.layers[1].post_attention_layernorm.variance_epsilon = 1.0
        return model

    veomni = backends.resolve(f"{PLUGIN}:veomni")
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    report = check(project, GoldenKey(project.hardware_class, "qwen3", "step", "float32"),
                   backends.Backend("veomni+planted", (*veomni.steps, planted)))
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 1")


@pytest.mark.skipif(not HERE, reason="veomni is not importable in this interpreter (tools/veomni_env.sh)")
def test_veomnis_own_ulysses_all_to_all_is_checked_through_the_exchange_hook() -> None:
    """VeOmni's `gather_seq_scatter_heads`/`gather_heads_scatter_seq` replace veosnap's under `sp` on 2 ranks."""
    from veosnap.candidates import backends
    from veosnap.golden.key import GoldenKey
    from veosnap.reference.zoo import Project
    from veosnap.runs.check import check_layouts

    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    reports = check_layouts(project, GoldenKey(project.hardware_class, "llama", "step", "float32"),
                            backends.resolve(f"{ROOT / PLUGIN}:veomni_ulysses"), ["sp", "sp_packed"], nproc=2,
                            timeout_s=300)
    for report in reports:
        assert report.passed, (report.layout, report.error, report.worst)
        assert "VeOmni's ulysses all-to-all" in report.notes[0]


def _run_module():  # noqa: ANN202 - examples/veomni/run.py, loaded by path (it needs no VeOmni to load)
    spec = importlib.util.spec_from_file_location("veomni_run", ROOT / "examples" / "veomni" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_expectations_are_data_and_an_error_is_never_expected(tmp_path: Path) -> None:
    run = _run_module()
    assert run.load_expectations()  # the shipped table loads: every entry skip or FAIL, with why and upstream
    bad = tmp_path / "expected.toml"
    bad.write_text('[[expect]]\nmodel = "qwen3"\nstatus = "ERROR"\nwhy = "x"\nupstream = "y"\n')
    with pytest.raises(SystemExit, match="an ERROR"):
        run.load_expectations(bad)
    bad.write_text('[[expect]]\nmodel = "qwen3"\nstatus = "skip"\nwhy = "x"\n')
    with pytest.raises(SystemExit, match="upstream"):
        run.load_expectations(bad)


def test_unexpected_and_stale_are_told_apart() -> None:
    run = _run_module()
    skip = run.Expectation(model="seed_oss", status="skip", reason="liger_kernel", why="w", upstream="u")
    cells = [run.Cell("seed_oss", "float32", "veomni", "single", "skip", reason="imports liger_kernel"),
             run.Cell("qwen3", "float32", "veomni", "single", "ERROR", reason="boom"),
             run.Cell("qwen3", "float32", "veomni", "packed", "PASS")]
    matched, unexpected, stale = run.judge(cells, [skip])
    assert matched == {cells[0]: skip} and unexpected == [cells[1]] and stale == []
    # The same expectation once seed_oss runs: stale, so the table is corrected.
    ran = [run.Cell("seed_oss", "float32", "veomni", "single", "PASS")]
    assert run.judge(ran, [skip]) == ({}, [], [skip])
    # An expectation for a model this run did not select is neither.
    assert run.judge(cells[1:], [skip])[2] == []


def test_a_declared_reference_path_gets_no_is_it_applied_hint() -> None:
    from veosnap.candidates.candidate import REFERENCE_PATH
    from veosnap.numerics.compare import TensorResult
    from veosnap.render.view import check_view
    from veosnap.runs.verdict import CheckReport

    def lines(notes: list[str]) -> str:
        report = CheckReport("cpu/qwen3/step-float32", "qwen3", "float32", "plugin.py:veomni",
                             tensors=[TensorResult("logits", 0.0, 1e-5, 1e-6)], notes=notes)
        return "\n".join(check_view(report).lines)

    assert "is it applied?" in lines([])
    assert "is it applied?" not in lines([REFERENCE_PATH + "eager ops throughout"])
