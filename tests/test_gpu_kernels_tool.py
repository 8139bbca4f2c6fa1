"""tools/gpu/gpu_kernels.py on the CPU: wheels installed with `pip --target DIR` and put on PYTHONPATH keep
working when they expose a package through a `.pth` file (as nvidia-cutlass-dsl exposes `cutlass`), in
the script and in the worker processes it starts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_repo import CLASS, needs_goldens

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("gpu_kernels_tool", ROOT / "tools" / "gpu" / "gpu_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_target_dir(target: Path) -> Path:
    """What `pip install --target DIR nvidia-cutlass-dsl` leaves: a package beside a `.pth` whose import
    line puts the package's `dsl_packages` folder (holding the importable `cutlass`) on sys.path; plus
    a plain-path `.pth` line, the other kind."""
    dsl = target / "veosnap_fake_dsl"
    (dsl / "dsl_packages" / "veosnap_fake_cutlass").mkdir(parents=True)
    (dsl / "__init__.py").write_text("")
    (dsl / "dsl_packages" / "veosnap_fake_cutlass" / "__init__.py").write_text("")
    (target / "veosnap_fake_dsl_packages.pth").write_text(
        "import sys, os, veosnap_fake_dsl; "
        "sys.path.insert(0, os.path.join(veosnap_fake_dsl.__path__[0], 'dsl_packages'))\n")
    (target / "plain" / "veosnap_fake_plain").mkdir(parents=True)
    (target / "plain" / "veosnap_fake_plain" / "__init__.py").write_text("")
    (target / "veosnap_fake_plain.pth").write_text("plain\n")
    return dsl / "dsl_packages"


def imports(module: str, env: dict) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True).returncode == 0


def test_pth_files_on_pythonpath_are_read_here_and_passed_to_workers(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool()
    target = tmp_path / "site"
    dsl_packages = fake_target_dir(target)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("veosnap_fake_dsl", "veosnap_fake_cutlass", "veosnap_fake_plain"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    env = dict(os.environ, PYTHONPATH=str(target))
    assert not imports("veosnap_fake_cutlass", env)  # what the workers saw on the H200: no module named 'cutlass'

    added = tool.read_pythonpath_pth_files(env)

    assert added == [str(dsl_packages), str(target / "plain")]
    assert env["PYTHONPATH"] == os.pathsep.join([str(target), str(dsl_packages), str(target / "plain")])
    assert importlib.util.find_spec("veosnap_fake_cutlass") is not None
    assert importlib.util.find_spec("veosnap_fake_plain") is not None
    assert imports("veosnap_fake_cutlass", env) and imports("veosnap_fake_plain", env)

    # a worker calls it again with the env it was given: nothing more to add, no duplicate on sys.path
    assert tool.read_pythonpath_pth_files(env) == []
    assert env["PYTHONPATH"].count(str(dsl_packages)) == 1
    assert sys.path.count(str(dsl_packages)) == 1


def test_no_pythonpath_or_one_without_pth_files_changes_nothing(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool()
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert tool.read_pythonpath_pth_files({}) == []
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(tmp_path / "missing")])}
    assert tool.read_pythonpath_pth_files(env) == []
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path), str(tmp_path / "missing")])


@needs_goldens(CLASS, "mixtral", "llama")
def test_plan_keeps_only_the_models_and_dtypes_asked_for() -> None:
    tool = load_tool()
    dirs = {"goldens": "", "configs": ""}
    project = tool.project_from(dirs)
    cells, not_applicable = tool.plan([(project, dirs)], ["liger", "liger@ieee"], ["mixtral", "llama"], ["float32"])
    assert {(c["model"], c["dtype"]) for c in cells["liger"]} == {("mixtral", "float32"), ("llama", "float32")}
    assert {c["model"] for c in cells["liger@ieee"]} == {"mixtral"}  # llama has no experts: n/a
    assert {(c["model"], c["dtype"], c["backend"]) for c in not_applicable} == {("llama", "float32", "liger@ieee")}


REAL_SMALL = "qwen2-real,qwen3-real,qwen3_moe-real-small,llama-real,qwen3_moe-real,gpt_oss-real"
REAL_ALL = REAL_SMALL + ",mixtral-real,deepseek_v3-real"


# A plan schedules the cells of the goldens there are: the H200's committed real tier, which a device call of the
# GPU suite does not carry.
@needs_goldens("cuda-sm90", *REAL_ALL.split(","))
def test_plan_says_fits_for_a_command_that_fits_and_refuses_one_that_does_not(
        capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool()
    monkeypatch.delenv("LIGER_FUSED_MOE_AUTOTUNE", raising=False)
    attention = "fa4,flash_attention_4,quack,fa4+quack"
    assert tool.main(["--plan", "--backends", attention, "--models", REAL_SMALL, "--dtypes", "bfloat16",
                      "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    assert "\nfits\n" in out
    assert "| quack | qwen3_moe-real bfloat16 |" in out
    assert "| quack | qwen2-real" not in out  # dense: no experts
    assert "not run, 3 golden(s): quack: dense model (no experts)" in out

    assert tool.main(["--plan", "--backends", "fa4", "--models", "llama-real", "--jobs", "1"]) == 0
    assert "fa4: 16-bit kernels: the backend declines float32" in capsys.readouterr().out

    # every real golden with four workers at once: deepseek_v3-real is cut at the deadline, and the
    # workers' memory adds up past the H200
    assert tool.main(["--plan", "--backends", attention, "--models", REAL_ALL, "--jobs", "4"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "past the deadline" in out and "GiB at once" in out


@needs_goldens("cuda-sm90", "qwen3_moe-real", "mixtral-real", "deepseek_v3-real", "qwen3_moe-real-small")
def test_liger_autotune_dominates_its_moe_cells_unless_switched_off(capsys: pytest.CaptureFixture,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_tool()
    # set, then removed: monkeypatch then restores the variable's absence after main() below sets it
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "1")
    monkeypatch.delenv("LIGER_FUSED_MOE_AUTOTUNE")
    assert not tool.liger_autotune_off()
    moe = "qwen3_moe-real,mixtral-real,deepseek_v3-real"
    assert tool.main(["--plan", "--backends", "liger", "--models", moe, "--dtypes", "bfloat16", "--jobs", "1"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out

    assert tool.main(["--plan", "--no-liger-autotune", "--backends", "liger", "--models",
                      "qwen3_moe-real-small,mixtral-real", "--dtypes", "bfloat16", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "autotune off (LIGER_FUSED_MOE_AUTOTUNE=0)" in out and "\nfits\n" in out
    assert tool.liger_autotune_off()  # what the workers it starts inherit


def test_cell_seconds_counts_builds_per_layout_and_the_libraries_first_costs() -> None:
    tool = load_tool()
    moe = dict(b=2.0, kt=8.0, model_type="qwen3_moe", gib={"bfloat16": 40.0, "float32": 50.0})
    gpt_oss = dict(moe, model_type="gpt_oss")
    cell = dict(backend="liger", model="qwen3_moe-real", dtype="bfloat16", layouts=["single", "packed"], width=2048)
    tuned = tool.cell_seconds(cell, moe, first=True, autotune=True)
    fixed = tool.cell_seconds(cell, moe, first=True, autotune=False)
    assert tuned - fixed == tool.REAL_AUTOTUNE_S - tool.FIXED_CONFIG_S
    # gpt_oss: liger keeps HF's experts (no autotune), and packed declines before building (one build)
    assert tool.cell_seconds(cell, gpt_oss, first=True, autotune=True) < fixed / 1.5
    ieee = tool.cell_seconds(dict(cell, backend="liger@ieee", dtype="float32"), moe, first=True, autotune=True)
    assert ieee > tuned + tool.REAL_AUTOTUNE_S  # IEEE dots tune longer (288 s against 119 s on the toy)
    fa4 = dict(cell, backend="fa4")
    assert tool.cell_seconds(fa4, moe, first=True, autotune=True) > tool.cell_seconds(fa4, moe, first=False,
                                                                                      autotune=True, new_shape=False)


def test_a_library_that_fails_to_import_errors_every_later_cell_of_its_worker_without_building_them(
        tmp_path: Path) -> None:
    from golden_repo import CLASS

    calls = tmp_path / "calls"
    spec = tmp_path / "broken.py"
    spec.write_text(f"def broken(model):\n"
                    f"    open({str(calls)!r}, 'a').write('x')\n"
                    f"    raise ModuleNotFoundError(\"No module named 'cutlass.cute'\")\n")
    dirs = {"goldens": str(ROOT / "goldens"), "configs": str(ROOT / "toy_configs"),
            "testdata": str(ROOT / "testdata"), "hardware_class": CLASS}
    cells = [dict(model=model, dtype="float32", scenario="step", layouts=["single"], dirs=dirs)
             for model in ("llama", "qwen2")]
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    tool = load_tool()
    tool.worker(f"{spec}:broken", tmp_path / "cells.json", tmp_path / "results.jsonl", time.time() + 600)

    done = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    rows = [event["rows"][0] for event in done if event["event"] == "done"]
    assert [r["status"] for r in rows] == ["ERROR", "ERROR"]
    assert rows[0]["reason"].startswith("ModuleNotFoundError: No module named 'cutlass.cute'")
    assert rows[1]["reason"].startswith(rows[0]["reason"]) and "not run" in rows[1]["reason"]
    assert calls.read_text() == "x"  # the second model was never built for the broken backend


@needs_goldens(CLASS, "qwen3_moe")
def test_a_bug_only_isolation_sees_fails_and_the_table_names_its_place(tmp_path: Path) -> None:
    """One attention head off by 1% in bfloat16: the whole model cannot see it, the isolated heads can. The
    row keeps the isolated statistic beside the whole-model ratio and the table says where."""
    dirs = {"goldens": str(ROOT / "goldens"), "configs": str(ROOT / "toy_configs"),
            "testdata": str(ROOT / "testdata"), "hardware_class": CLASS}
    cells = [dict(model="qwen3_moe", dtype="bfloat16", scenario="step", layouts=["single"], dirs=dirs)]
    (tmp_path / "cells.json").write_text(json.dumps(cells))
    tool = load_tool()
    tool.worker(f"{ROOT / 'tests' / 'scaled_faults.py'}:one_head_scaled", tmp_path / "cells.json",
                tmp_path / "results.jsonl", time.time() + 600)

    done = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    row = next(event for event in done if event["event"] == "done")["rows"][0]
    assert row["status"] == "FAIL" and row["ratio"] < 1 < row["isolated"]
    assert "head" in row["isolated_place"]
    text, _ = tool.table([dict(cells[0], backend="tests/scaled_faults.py:one_head_scaled", **row)])
    assert "one_head_scaled (bug)" in text and f"iso {tool.fmt_ratio(row['isolated'])}" in text
    assert f"isolated: {row['isolated_place']}" in text
