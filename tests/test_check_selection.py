"""What a bare `veosnap check` checks: the dtypes that have goldens for the model on this class, and,
where none exist, one line that says so with the command that records them (which runs as printed)."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
from golden_repo import CLASS, REPO, golden_path

from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.surfaces.cli import _checked, build_parser, main


@pytest.fixture
def project_dir(tmp_path, monkeypatch):
    """A project in the current directory: the zoo's configs, an empty goldens directory of this class."""
    shutil.copytree(REPO / "toy_configs", tmp_path / "toy_configs")
    (tmp_path / "goldens" / CLASS).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _copy_golden(root, model: str, dtype: str) -> None:
    source = golden_path(model, dtype)
    if not source.is_file():
        pytest.skip(f"no committed {CLASS} golden {source.relative_to(REPO)}")
    target = store.path_for(root / "goldens", GoldenKey(CLASS, model, "step", dtype))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)


def test_check_without_dtype_checks_only_the_dtypes_recorded(project_dir, capsys) -> None:
    _copy_golden(project_dir, "qwen3", "float32")
    assert main(["check", "--model", "qwen3", "--format", "json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["model"], r["dtype"], r["passed"]) for r in results] == [("qwen3", "float32", True)]


@pytest.mark.heavy
def test_no_golden_names_the_command_that_records_it_and_that_command_runs(project_dir, capsys) -> None:
    assert main(["check", "--model", "qwen3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"veosnap: error: no golden for qwen3 on {CLASS} in goldens: record with `veosnap record "
                          "--model qwen3` on")
    command = re.search(r"`(veosnap record [^`]*)`", err).group(1)
    assert main(shlex.split(command)[1:]) == 0  # both dtypes, into ./goldens
    capsys.readouterr()
    assert main(["check", "--model", "qwen3", "--format", "json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [(r["dtype"], r["passed"]) for r in results] == [("float32", True), ("bfloat16", True)]


def test_no_golden_of_a_real_shape_model_on_the_cpu_advises_float32(project_dir, capsys) -> None:
    assert main(["check", "--model", "qwen3-real"]) == 2
    err = capsys.readouterr().err
    dtype = " --dtype float32" if CLASS == "cpu" else ""  # the cpu real tier is float32 only
    assert f"no golden for qwen3-real on {CLASS} in goldens: record with `veosnap record --model qwen3-real{dtype}`" \
        in err


def test_no_golden_says_where_goldens_of_the_model_exist(project_dir, capsys) -> None:
    other = "cuda-sm90" if CLASS == "cpu" else "cpu"
    (project_dir / "goldens" / other / "qwen3").mkdir(parents=True)
    train = store.path_for(project_dir / "goldens", GoldenKey(CLASS, "qwen3", "train", "float32"))
    train.parent.mkdir(parents=True)
    train.write_bytes(b"")  # selection looks at names only; the check would refuse this file
    assert main(["check", "--model", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert f"qwen3 has {CLASS} goldens of scenario train (add --scenario train)" in err
    assert f"goldens of qwen3 exist for {other} (another hardware class: --hardware-class {other} --cross-class" in err


def test_a_tier_check_leaves_out_models_without_goldens_with_a_note(project_dir, capsys) -> None:
    for model, dtype in (("qwen3-real", "float32"), ("qwen3_moe-real-small", "float32"),
                         ("qwen3_moe-real-small", "bfloat16")):
        path = store.path_for(project_dir / "goldens", GoldenKey(CLASS, model, "step", dtype))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")  # selection looks at names only
    project = Project.resolve(hardware_class=CLASS)
    args = build_parser().parse_args(["check", "--tier", "real"])
    assert _checked(args, project) == [("qwen3-real", "step", "float32"), ("qwen3_moe-real-small", "step", "float32"),
                                       ("qwen3_moe-real-small", "step", "bfloat16")]
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == len(project.models("real")) - 2
    assert all(line.startswith("veosnap: no golden for ") and line.endswith("(left out)") for line in notes)
    # named with --dtype, a dtype is asked for whether or not it was recorded (a missing one is an error later)
    args = build_parser().parse_args(["check", "--model", "qwen3-real", "--dtype", "bfloat16"])
    assert _checked(args, project) == [("qwen3-real", "step", "bfloat16")]


def test_a_tier_without_any_golden_is_an_error(project_dir, capsys) -> None:
    assert main(["check", "--tier", "real"]) == 2
    assert "veosnap: error: no golden for " in capsys.readouterr().err
