"""Every hint runs as printed, and the CLI finds its project from anywhere inside it (issue 36, items 3-5).

A hint is a command a message tells the user to run: a `veosnap ...` or `pytest ...` in backquotes, the
`next:` line of a failed check, the indented commands of the pytest plugin's missing-golden message. Each
test here makes a sandbox project, provokes a message, takes the commands out of it as printed and runs
them there: they must do what they say. `test_every_place_that_prints_a_hint_is_run_by_a_test` finds the
places in veosnap's source that build one, so a new hint without a test fails.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import zstandard
from golden_repo import CLASS, REPO, committed_golden, golden_path, gpus_for

import veosnap
from safetensors.torch import save

from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import find_root
from veosnap.runs.record import refusal
from veosnap.surfaces import cli

OTHER_CLASS = "cuda-sm90" if CLASS == "cpu" else "cpu"


def hints(text: str) -> list[str]:
    """The commands a message advises, as printed: in backquotes, after `next:`, or on a line of their own
    (past the versions note, which a run on other versions than the goldens' adds: tests/test_versions.py)."""
    text = "\n".join(line for line in text.splitlines() if "on other versions than their golden" not in line)
    found = re.findall(r"`((?:veosnap|pytest) [^`]+)`", text)
    found += [line.split("next: ", 1)[1].split("  (", 1)[0] for line in text.splitlines() if "next: veosnap" in line]
    found += [line.strip().removeprefix("E").strip() for line in text.splitlines()
              if re.match(r"(E\s+)?\s{4}(veosnap|pytest) ", line)]  # pytest's failure lines start with E
    return [command.removeprefix("fix the backend error, then ") for command in found]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_hint(capsys: pytest.CaptureFixture, command: str) -> tuple[int, str, str]:
    argv = shlex.split(command)
    assert argv[0] == "veosnap", command
    return run(capsys, *argv[1:])


def console(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A printed `veosnap ...` command run by the installed `veosnap` script, as a user's shell runs it: the
    current directory is not on its import path (as it is for `python -m`)."""
    script = Path(sys.executable).parent / "veosnap"
    head = [str(script)] if script.is_file() else [sys.executable, "-P", "-m", "veosnap"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VEOSNAP_"))}
    # this veosnap first, then whatever else the suite runs with (a device call's wheels live on PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(veosnap.__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH")]))
    return subprocess.run([*head, *shlex.split(command)[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def copy_golden(root: Path, model: str, dtype: str = "float32", hardware_class: str = CLASS) -> Path:
    source = committed_golden(model, dtype) if hardware_class == CLASS else golden_path(model, dtype,
                                                                                        hardware_class=hardware_class)
    if not source.is_file():
        pytest.skip(f"no committed golden {source.relative_to(REPO)}")
    target = store.path_for(root / "goldens", GoldenKey(hardware_class, model, "step", dtype))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(source, target)
    return target


def copy_config(root: Path, model: str) -> Path:
    shutil.copytree(REPO / "toy_configs" / model, root / "toy_configs" / model)
    return root / "toy_configs" / model / "config.json"


# --- item 3: the project from anywhere inside it ---------------------------------------------------------------


def test_from_a_subdirectory_the_project_is_checked_and_the_header_names_it(tmp_path, monkeypatch, capsys):
    copy_config(tmp_path, "llama")
    copy_golden(tmp_path, "llama")
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path / "tests")
    code, out, _ = run(capsys, "check")
    assert code == 0, out
    header, _, report = out.partition("\n\n")
    assert header == f"project {tmp_path.resolve()}: goldens {tmp_path.resolve() / 'goldens'}; test data from " \
                     "veosnap's bundled zoo"
    assert report.splitlines()[-1] == "1 passed, 0 failed"  # the project's llama only, not the zoo's twenty
    code, out, _ = run(capsys, "check", "--format", "json")
    assert json.loads(out)["project"] == {"root": str(tmp_path.resolve()), "goldens": str(tmp_path.resolve() / "goldens"),
                                          "bundled": ["testdata"]}


def test_outside_any_project_the_header_says_it_checks_the_bundled_zoo(tmp_path, monkeypatch, capsys):
    committed_golden("llama")
    (tmp_path / "repo" / "work").mkdir(parents=True)
    (tmp_path / "goldens").mkdir()  # above a repository's top: not this directory's project
    (tmp_path / "repo" / ".git").mkdir()
    monkeypatch.chdir(tmp_path / "repo" / "work")
    assert find_root() is None
    code, out, _ = run(capsys, "check", "--model", "llama", "--dtype", "float32")
    assert code == 0
    assert out.startswith(f"no veosnap project in {tmp_path.resolve() / 'repo' / 'work'} or above it")
    assert f"veosnap's bundled zoo, goldens {REPO / 'goldens'}" in out.splitlines()[0]


def test_a_pyproject_with_a_veosnap_table_marks_a_project_before_its_goldens_exist(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'mine'\n\n[tool.veosnap]\n")
    (tmp_path / "src" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "src" / "mine")
    assert find_root() == tmp_path.resolve()
    committed_golden("llama")
    code, _, err = run(capsys, "check", "--model", "llama", "--dtype", "float32")
    assert code == 2 and f"{tmp_path.resolve() / 'goldens'}: no goldens for hardware class {CLASS}" in err


def test_a_missing_golden_the_bundled_zoo_has_says_how_to_use_it_and_both_hints_run(tmp_path, monkeypatch, capsys):
    # A scratch directory where one `veosnap record` ran: ./goldens exists and holds llama only.
    copy_golden(tmp_path, "llama")
    committed_golden("qwen3_moe")
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "check", "--model", "qwen3_moe", "--dtype", "float32")
    assert code == 2 and "veosnap's bundled zoo has it" in err, err
    record, bundled = hints(err)
    assert record == "veosnap record --model qwen3_moe --dtype float32"
    assert bundled == f"veosnap check --model qwen3_moe --dtype float32 --goldens {REPO / 'goldens'}"
    code, out, _ = run_hint(capsys, bundled)
    assert code == 0 and out.splitlines()[-1] == "1 passed, 0 failed"
    code, out, _ = run_hint(capsys, record)
    assert code == 0 and out.startswith(f"wrote     goldens/{CLASS}/qwen3_moe/step-float32")
    assert run(capsys, "check", "--model", "qwen3_moe", "--dtype", "float32")[0] == 0
    # without --dtype, the same advice for the dtypes the project lacks
    code, _, err = run(capsys, "check", "--model", "qwen3")
    assert code == 2 and f"`veosnap check --model qwen3 --goldens {REPO / 'goldens'}` checks against it" in err


# --- item 4: every hint runs -------------------------------------------------------------------------------------


def test_a_scenario_the_model_cannot_run_is_a_skip_not_a_record_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "check", "--model", "llama", "--scenario", "vision")
    assert code == 0 and not hints(out + err), err
    assert "skipped: scenario vision needs a vision encoder, which llama has not" in out
    assert out.splitlines()[-1] == "0 passed, 0 failed, 1 skipped"


def test_a_real_shape_golden_is_advised_to_be_recorded_only_where_it_can_be(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "goldens").mkdir()
    code, _, err = run(capsys, "check", "--model", "llama-real")
    assert code == 2
    why = refusal(cli._project(cli.build_parser().parse_args(["check"])), GoldenKey(CLASS, "llama-real"))
    records = [h for h in hints(err) if h.startswith("veosnap record")]
    if why:  # this machine has too little memory: no record command, the reason instead
        assert not records and f"this machine cannot record it ({why})" in err
    else:  # recording it takes minutes: the command is checked as far as record checks before it records
        # (the cpu real tier is float32 only; a GPU records both dtypes)
        dtype = " --dtype float32" if CLASS == "cpu" else ""
        assert records == [f"veosnap record --model llama-real{dtype}"]


def test_a_changed_config_and_a_corrupt_golden_advise_refreshes_that_run(tmp_path, monkeypatch, capsys):
    config = copy_config(tmp_path, "llama")
    golden = copy_golden(tmp_path, "llama")
    monkeypatch.chdir(tmp_path)
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    code, _, err = run(capsys, "check", "--model", "llama", "--dtype", "float32")
    assert code == 2 and "recorded from another config" in err, err
    (refresh,) = hints(err)
    assert refresh.startswith("veosnap refresh --reason 'config changed: <why>' --model llama --dtype float32")
    assert run_hint(capsys, refresh)[0] == 0
    assert run(capsys, "check", "--model", "llama", "--dtype", "float32")[0] == 0

    g = store.read(golden)  # the refreshed golden, its manifest hash removed: its bounds cannot be trusted
    manifest = json.loads(g.manifest.to_json())
    del manifest["manifest_hash"]
    raw = save(g.tensors, metadata={codec.METADATA_KEY: json.dumps(manifest, sort_keys=True)})
    golden.write_bytes(zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(raw))
    code, _, err = run(capsys, "check", "--model", "llama", "--dtype", "float32")
    assert code == 2 and "no manifest hash" in err, err
    (refresh,) = hints(err)
    assert refresh.startswith("veosnap refresh --force --reason '<why>' --model llama --dtype float32")
    assert run_hint(capsys, refresh)[0] == 0
    assert run(capsys, "check", "--model", "llama", "--dtype", "float32")[0] == 0


def test_goldens_of_another_class_are_named_with_flags_that_run(tmp_path, monkeypatch, capsys):
    copy_config(tmp_path, "llama")
    copy_golden(tmp_path, "llama", hardware_class=OTHER_CLASS)
    (tmp_path / "goldens" / CLASS).mkdir()
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "check", "--model", "llama")
    assert code == 2
    flags = re.search(r"\((another hardware class: )(--hardware-class \S+ --cross-class)", err).group(2)
    code, out, err = run(capsys, "check", "--model", "llama", *shlex.split(flags))
    assert code in (0, 1) and f"cross-class: a {OTHER_CLASS} golden checked on {CLASS}" in out, err


DOWNSTREAM = {
    "mypkg/__init__.py": "",
    "mypkg/attention.py": '''import torch


def patch(model):
    """A kernel with a bug: layer 0's MLP output 1% too large."""
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
    return model
''',
    "tests/test_things.py": '''def test_kernel(veosnap_check):
    veosnap_check("llama", backend="mypkg.attention:patch+grouped_mm")


def test_half(veosnap_check):
    veosnap_check("llama", dtype="float16")


def test_misspelt(veosnap_check):
    veosnap_check("lama")


def test_unrecorded(veosnap_check):
    veosnap_check("qwen3")
''',
}


def pytest_in(project: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VEOSNAP_"))}
    # this veosnap first, then whatever else the suite runs with (a device call's wheels live on PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(veosnap.__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH")]))
    # veosnap on PYTHONPATH only (a device call's checkout) has no pytest11 entry point: name the plugin
    plugin = [] if any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")) \
        else ["-p", "veosnap.surfaces.pytest_plugin"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                           "-p", "no:randomly", *plugin, "-q", *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)
    return done.stdout + done.stderr


def failure(output: str, test: str) -> str:
    """The failure section of `test` in pytest's output."""
    part = output.split(f"_ {test} _", 1)[1]
    return re.split(r"\n_{5,} \S+ _{5,}\n|\n=+ short test summary", part)[0]


@pytest.mark.heavy  # three pytest and three veosnap processes: about 40 s on the 2-core CPU
def test_the_pytest_plugins_hints_run_as_printed(tmp_path):
    project = tmp_path / "downstream"
    for name, text in DOWNSTREAM.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    copy_config(project, "llama")
    copy_config(project, "qwen3")
    copy_golden(project, "llama")
    output = pytest_in(project)
    assert "4 failed" in output, output

    # a module SPEC: pytest imports it from the rootdir; the `veosnap` command does so too, from the project
    # or any directory in it
    (command,) = hints(failure(output, "test_kernel"))
    assert "--backend mypkg.attention:patch+grouped_mm" in command
    for cwd in (project, project / "tests"):
        done = console(command, cwd)
        assert done.returncode == 1, done.stderr
        (result,) = json.loads(done.stdout)["results"]
        assert result["first_divergence"].startswith("layer 0")
        assert "changed nothing: grouped_mm swaps the MoE experts' kernel" in " ".join(result["notes"])

    half = failure(output, "test_half")
    assert "veosnap: dtype 'float16': goldens are recorded for float32, bfloat16" in half and not hints(half)
    misspelt = failure(output, "test_misspelt")
    assert "toy_configs/lama/config.json: no such toy config" in misspelt and not hints(misspelt)

    bundled, pytest_command, record = hints(failure(output, "test_unrecorded"))
    assert bundled == f"veosnap check --model qwen3 --dtype float32 --goldens {REPO / 'goldens'}"
    done = console(bundled, project)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "1 passed, 0 failed", done.stderr
    assert record == "veosnap record --model qwen3 --dtype float32"
    done = console(record, project)
    assert done.returncode == 0 and done.stdout.startswith(f"wrote     goldens/{CLASS}/qwen3/step-float32"), done.stderr
    assert pytest_command == "pytest --snapshot-update tests/test_things.py::test_unrecorded"
    assert "1 passed" in pytest_in(project, *shlex.split(pytest_command)[1:])


# Where veosnap builds a hint (file::function), and the test that runs it as printed.
HINT_SITES = {
    "veosnap/reference/zoo.py::bundled_hint":
        "test_hints.py::test_a_missing_golden_the_bundled_zoo_has_says_how_to_use_it_and_both_hints_run",
    "veosnap/reference/zoo.py::no_golden":
        "test_check_selection.py::test_no_golden_names_the_command_that_records_it_and_that_command_runs",
    "veosnap/surfaces/cli.py::_checked": "test_hints.py::test_a_real_shape_golden_is_advised_to_be_recorded_only_where_it_can_be",
    "veosnap/surfaces/cli.py::no_golden": "test_hints.py::test_a_real_shape_golden_is_advised_to_be_recorded_only_where_it_can_be",
    "veosnap/reference/zoo.py::load_golden":
        "test_hints.py::test_a_missing_golden_the_bundled_zoo_has_says_how_to_use_it_and_both_hints_run",
    "veosnap/reference/zoo.py::advise": "test_hints.py::test_a_changed_config_and_a_corrupt_golden_advise_refreshes_that_run",
    "veosnap/reference/zoo.py::load_checked":
        "test_hints.py::test_a_changed_config_and_a_corrupt_golden_advise_refreshes_that_run",
    "veosnap/render/view.py::next_step":
        "test_docs_commands.py::test_the_next_command_of_a_report_runs_as_printed_with_the_projects_flags",
    "veosnap/surfaces/pytest_plugin.py::_missing_message": "test_hints.py::test_the_pytest_plugins_hints_run_as_printed",
    "veosnap/runs/record.py::stored_bytes": "test_trust_goldens.py::test_item8_record_keeps_the_trail_of_an_unchanged_golden_and_refuses_to_change_a_trailed_one",
    "veosnap/runs/record.py::record": "test_excuse.py::test_a_golden_a_variant_fails_is_recorded_only_with_its_excuse_and_checks_of_it_still_fail",
    "veosnap/runs/refresh.py::_refresh": "test_excuse.py::test_a_golden_a_variant_fails_is_recorded_only_with_its_excuse_and_checks_of_it_still_fail",
    "veosnap/runs/refresh.py::_read_old": "test_hints.py::test_a_changed_config_and_a_corrupt_golden_advise_refreshes_that_run",
}
# Functions that build a command for others to print (the sites above call them).
BUILDERS = {"veosnap/reference/zoo.py::command", "veosnap/reference/zoo.py::recording_command",
            "veosnap/render/json.py::check_dict", "veosnap/render/view.py::check_view"}


def hint_sites() -> set[str]:
    """Each function in veosnap/ that builds a command for a message: calls a command builder or joins an
    argv that starts with `veosnap` or `pytest`."""
    found = set()
    for path in sorted((REPO / "veosnap").rglob("*.py")):
        for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                argv = node.args[0] if node.args else None
                if name in ("command", "recording_command", "next_step", "bundled_hint", "no_golden") or (
                        name == "join" and isinstance(argv, ast.List) and argv.elts
                        and isinstance(argv.elts[0], ast.Constant) and argv.elts[0].value in ("veosnap", "pytest")):
                    found.add(f"{path.relative_to(REPO)}::{function.name}")
    return found


def test_every_place_that_prints_a_hint_is_run_by_a_test():
    assert hint_sites() - BUILDERS == set(HINT_SITES)
    for test in HINT_SITES.values():
        file, name = test.split("::")
        assert f"def {name}(" in (REPO / "tests" / file).read_text(encoding="utf-8"), test


# --- item 5: honest cells, progress on long runs ---------------------------------------------------------------


def test_a_backend_that_changes_nothing_is_not_applicable_not_a_pass(tmp_path, monkeypatch, capsys):
    committed_golden("llama")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "check", "--matrix", "--model", "llama", "--dtype", "float32", "--backends",
                       "eager,grouped_mm,sdpa+grouped_mm", "--format", "json")
    assert code == 0
    cells = {c["backend"]: c for c in json.loads(out)["cells"]}
    assert cells["grouped_mm"]["status"] == "skip"
    assert cells["grouped_mm"]["reason"] == ("grouped_mm swaps the MoE experts' kernel; LlamaForCausalLM has no "
                                             "experts (a dense model)")
    assert cells["sdpa+grouped_mm"]["status"] == "pass"  # sdpa changed the attention: a check of sdpa
    assert any(n.startswith("changed nothing: grouped_mm") for n in cells["sdpa+grouped_mm"]["notes"])
    code, out, _ = run(capsys, "check", "--matrix", "--model", "llama", "--dtype", "float32", "--backends",
                       "grouped_mm")
    assert code == 0 and "│ llama │ n/a" in out and "1 cells: 1 n/a" in out
    assert "n/a   grouped_mm/single on llama float32: grouped_mm swaps the MoE experts' kernel" in out


@pytest.mark.heavy  # a torchrun of two ranks
@gpus_for(2)
def test_a_multi_process_check_says_what_starts_and_how_far_it_is(tmp_path, monkeypatch, capsys):
    committed_golden("llama")
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "check", "--model", "llama", "--dtype", "float32", "--layout", "packed",
                       "--layout", "ddp")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("[1/1]")]
    assert lines[0] == f"[1/1] {CLASS}/llama/step-float32 backend=eager layout=packed,ddp: started (ddp on torchrun)"
    assert re.fullmatch(rf"\[1/1\] {CLASS}/llama/step-float32: packed PASS, ddp PASS \(\d+\.\d s\)", lines[1])
