"""`veosnap refresh`: approved re-recording that rewrites only goldens that really moved."""

from __future__ import annotations

import json

import pytest
from golden_repo import CLASS, commit, copy_zoo, git_repo

from veosnap.errors import GoldenError, VeosnapError
from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.render.text import golden as describe
from veosnap.runs.refresh import refresh
from veosnap.runs.verify import verify_file
from veosnap.surfaces import cli

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")  # refresh re-records: this machine's class


def test_config_change_refresh_and_diff_show_only_that_model_moved(tmp_path, capsys, monkeypatch):
    project = git_repo(tmp_path)
    config = project.configs / "llama" / "config.json"
    config.write_text(config.read_text().replace('"silu"', '"gelu"'))
    monkeypatch.chdir(tmp_path)

    assert cli.main(["refresh", "--reason", "llama switches to gelu", "--model", "llama", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rewrote   goldens/{LLAMA.relpath}")  # the project in the current directory
    assert "config.hidden_act: silu -> gelu" in out
    commit(tmp_path, "llama: gelu")

    assert cli.main(["diff", "HEAD~1", "--format", "json", "--fail-on-change"]) == 1
    doc = json.loads(capsys.readouterr().out)
    (changed,) = doc["changed"]
    assert changed["key"] == str(LLAMA) and changed["material"]
    assert len(changed["tensors"]) == changed["compared"]  # every compared tensor moved...
    assert min(t["ratio"] for t in changed["tensors"]) > 100  # ...by large multiples of its bound
    assert [a["reason"] for a in changed["approvals"]] == ["llama switches to gelu"]
    assert {"field": "config.hidden_act", "old": "silu", "new": "gelu"} in changed["manifest"]
    others = len(store.list_goldens(project.goldens)) - 1
    assert len(doc["unchanged"]) == others and not doc["added"] and not doc["removed"]


def test_refresh_of_an_unchanged_model_leaves_the_file_byte_identical(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    before = path.read_bytes()

    outcome = refresh(project, "llama", "float32", reason="nothing changed")

    assert outcome.action == "unchanged" and not outcome.written
    assert path.read_bytes() == before


def test_forced_refresh_appends_to_the_approval_trail(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    original = store.read(path).manifest.payload_hash

    first = refresh(project, "llama", "float32", reason="new torch", force=True)
    second = refresh(project, "llama", "float32", reason="new driver", force=True)

    assert first.action == second.action == "rewrote"
    trail = store.read(path).manifest.approvals
    assert [a.reason for a in trail] == ["new torch", "new driver"]
    assert trail[0].previous_payload_hash == original
    assert [a.reason for a in second.diff.approvals] == ["new driver"]  # the diff shows the new entry only
    assert "approved    'new driver'" in describe(store.read(path))
    assert verify_file(path).ok


def test_a_golden_within_noise_of_the_reference_is_not_rewritten(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    g = store.read(path)
    # As if recorded on another CPU of the same class: logits off by a small fraction of their bound.
    g.tensors["logits"] = g.tensors["logits"] * (1 + 0.1 * g.manifest.tolerance["logits"].bound)
    store.write(g, path)
    edited = path.read_bytes()

    assert refresh(project, "llama", "float32", reason="routine").action == "unchanged"
    assert path.read_bytes() == edited


def test_refresh_refuses_another_hardware_class(tmp_path, capsys, monkeypatch):
    other = "cuda-sm90" if CLASS != "cuda-sm90" else "cuda-sm89"
    project = copy_zoo(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VeosnapError, match=f"cannot refresh hardware class {other} on this machine"):
        refresh(project.__class__(project.goldens, project.configs, project.testdata, other), "llama", "float32", "x")

    assert cli.main(["refresh", "--reason", "x", "--hardware-class", other, "--model", "llama"]) == 2
    assert f"run `veosnap refresh` on a {other} machine" in capsys.readouterr().err


def test_refresh_needs_a_reason(tmp_path):
    project = copy_zoo(tmp_path)
    with pytest.raises(VeosnapError, match="--reason"):
        refresh(project, "llama", "float32", reason="  ")


def test_unreadable_golden_is_replaced_only_with_force(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    path.write_bytes(b"garbage")

    with pytest.raises(GoldenError, match="pass --force to replace it"):
        refresh(project, "llama", "float32", reason="repair")
    assert path.read_bytes() == b"garbage"  # nothing on disk lost

    outcome = refresh(project, "llama", "float32", reason="repair", force=True)
    assert outcome.action == "created" and verify_file(path).ok
