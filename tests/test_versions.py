"""Versions are part of the product: the tests run on a pinned set that recorded the committed goldens, and
`veosnap drift` says what other versions move in the reference before anyone adopts them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from golden_repo import CLASS

from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.drift import MOVED, drift
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "constraints" / "tested.txt"


def pinned() -> dict[str, str]:
    """constraints/tested.txt as {distribution: version}."""
    pins = {}
    for line in PINS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{PINS}: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_the_tested_set_pins_what_the_goldens_were_recorded_with() -> None:
    pins = pinned()
    assert {"torch", "transformers", "safetensors", "zstandard", "syrupy", "pytest", "pytest-xdist"} <= set(pins)
    for path in sorted((REPO / "goldens").rglob("*.safetensors.zst")):
        provenance = store.read_manifest(path).provenance
        assert provenance.transformers == pins["transformers"], f"{path}: recorded with transformers " \
            f"{provenance.transformers}, the tested set pins {pins['transformers']}: refresh, diff, commit together"
        if path.relative_to(REPO / "goldens").parts[0] == "cpu":  # GPU goldens come from the GPU box's torch
            assert provenance.torch.split("+")[0] == pins["torch"], f"{path}: recorded with torch {provenance.torch}"


def test_the_package_itself_pins_nothing() -> None:
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    dependencies = pyproject.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "==" not in dependencies  # a library does not pin its users


# --- the drift report ----------------------------------------------------------------------------------


@pytest.fixture
def upstream_moved(tmp_path: Path) -> Project:
    """A project whose llama float32 golden says layer 0's output is 1% larger than the reference computes here:
    what a transformers release that changed that layer would look like to `drift`."""
    project = Project.resolve(goldens=tmp_path / "goldens", configs=REPO / "toy_configs",
                              testdata=REPO / "testdata", hardware_class=CLASS)
    key = GoldenKey(CLASS, "llama", "step", "float32")
    committed = REPO / "goldens" / CLASS / "llama" / "step-float32.safetensors.zst"
    if not committed.is_file():
        pytest.skip(f"no committed llama golden for hardware class {CLASS}")
    golden = store.read(committed)
    golden.tensors["layers.0.output"] = golden.tensors["layers.0.output"] * 1.01
    store.write_bytes(codec.encode(golden), store.path_for(project.goldens, key))
    shutil.copytree(REPO / "goldens" / CLASS / "qwen2", project.goldens / CLASS / "qwen2")
    return project


def test_drift_names_the_golden_that_moved_its_worst_tensor_and_first_layer(upstream_moved: Project) -> None:
    keys = [GoldenKey(CLASS, "llama", "step", "float32"), GoldenKey(CLASS, "qwen2", "step", "float32")]
    report = drift(upstream_moved, keys)
    moved, steady = report.drifts
    assert moved.status == MOVED and report.moved == [moved]
    assert moved.worst.name == "layers.0.output" and moved.worst.ratio > 10
    assert moved.first_layer.startswith("layer 0 (layers.0.output, ")
    assert steady.status in ("same", "noise") and steady.first_layer is None


def test_veosnap_drift_prints_a_table_and_fails_on_a_move_when_asked(upstream_moved: Project, capsys) -> None:
    argv = ["drift", "--goldens", str(upstream_moved.goldens), "--configs", str(REPO / "toy_configs"),
            "--testdata", str(REPO / "testdata"), "--hardware-class", CLASS, "--model", "llama", "--model", "qwen2",
            "--dtype", "float32", "--scenario", "step"]
    before = {p: p.stat().st_mtime_ns for p in upstream_moved.goldens.rglob("*")}
    assert main([*argv, "--format", "markdown"]) == 0
    out, err = capsys.readouterr()
    assert "[1/2] recording " in err and "[2/2] recording " in err
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert rows[0].startswith(f"| `{CLASS}/llama/step-float32` | **moved** | layers.0.output ")
    assert "| layer 0 (layers.0.output, " in rows[0] and len(rows) == 2
    assert main([*argv, "--fail-on-move", "--format", "json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["moved"] == 1 and document["goldens"][0]["status"] == "moved"
    assert {p: p.stat().st_mtime_ns for p in upstream_moved.goldens.rglob("*")} == before  # drift writes nothing


def test_drift_of_nothing_selected_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(["drift", "--goldens", str(tmp_path), "--configs", str(REPO / "toy_configs"),
                 "--testdata", str(REPO / "testdata"), "--hardware-class", CLASS]) == 2
    assert capsys.readouterr().err.strip().endswith("no " + CLASS + " goldens match the selection to record again")

