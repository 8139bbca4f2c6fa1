"""The command's small things: --version, ls filters, refresh --scenario, --format help, matrix progress,
a closed pipe."""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

import pytest
from golden_repo import CLASS, REPO, copy_zoo, golden_path

import veosnap
from veosnap.surfaces.cli import build_parser, main


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"veosnap {veosnap.__version__}\n"


def test_ls_lists_every_class_and_filters_by_class_model_dtype_and_scenario(capsys: pytest.CaptureFixture) -> None:
    goldens = ["--goldens", str(REPO / "goldens")]

    def listed(*flags: str) -> list[str]:
        assert main(["ls", *goldens, *flags, "--format", "json"]) == 0
        return [entry["key"] for entry in json.loads(capsys.readouterr().out)]

    every = listed()
    # every class this checkout holds goldens of (a device call may carry only its own class's)
    assert {key.split("/")[0] for key in every} == {p.parts[-3] for p in (REPO / "goldens").glob("*/*/*.zst")}
    assert listed("--hardware-class", CLASS) == [key for key in every if key.startswith(f"{CLASS}/")]
    assert listed("--hardware-class", CLASS, "--model", "llama", "--dtype", "float32") == [
        f"{CLASS}/llama/step-float32", f"{CLASS}/llama/train-float32"]
    assert listed("--model", "qwen3", "--scenario", "train", "--hardware-class", CLASS) == [
        f"{CLASS}/qwen3/train-bfloat16", f"{CLASS}/qwen3/train-float32"]
    assert main(["ls", *goldens, "--model", "nothing"]) == 0
    assert capsys.readouterr().out.endswith("matching the filters\n")


def test_refresh_takes_a_scenario(tmp_path, capsys: pytest.CaptureFixture, monkeypatch) -> None:
    if not golden_path("llama", scenario="train").is_file():
        pytest.skip(f"no committed {CLASS} train golden yet")
    copy_zoo(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["refresh", "--reason", "routine", "--model", "llama", "--dtype", "float32",
                 "--scenario", "train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"unchanged goldens/{CLASS}/llama/train-float32.safetensors.zst")


def test_format_help_says_what_each_format_is(capsys: pytest.CaptureFixture) -> None:
    parser = build_parser()
    for command in ("check", "diff", "ls"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert re.search(r"--format \{[a-z,]+\} text: ", text), command
        assert "json: " in text, command


def test_the_matrix_says_each_cell_on_stderr_as_it_goes(capsys: pytest.CaptureFixture) -> None:
    assert main(["check", "--matrix", "--model", "llama", "--dtype", "float32", "--backends", "eager,sdpa"]) == 0
    captured = capsys.readouterr()  # stdout is not a terminal here, as when it is redirected or in CI
    lines = captured.err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[1/2] llama float32 eager/single: pass",
                                                       "[2/2] llama float32 sdpa/single: pass"]
    assert "2 cells: 2 pass" in captured.out


def test_a_reader_that_leaves_early_is_not_an_error() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(f"{sys.executable} -m veosnap show {golden_path('llama')} --full | head -1", shell=True,
                          capture_output=True, text=True, env=env)
    assert done.stdout.startswith("golden") and done.stderr == ""


def test_the_command_freezes_its_imports_out_of_the_garbage_collector_and_main_does_not() -> None:
    # A full collection during a check scanned every object of torch and transformers (about 170 ms, and one
    # landed on a check's path on the H200): the `veosnap` command freezes them before it runs; `main`, which
    # programs and these tests call in their own process, leaves the collector alone.
    script = ("import gc, sys; from veosnap.surfaces import cli; sys.argv = ['veosnap', 'ls', '--model', 'llama']; "
              "code = cli.command(); print(code, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True).stdout
    code, frozen = out.split()[-2:]
    assert code == "0" and int(frozen) > 100_000
    before = gc.get_freeze_count()
    assert main(["ls", "--model", "llama"]) == 0
    assert gc.get_freeze_count() == before
