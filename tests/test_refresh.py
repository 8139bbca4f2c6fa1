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


def test_config_change_refresh_rewrites_every_stale_golden_and_diff_shows_each_material(tmp_path, capsys, monkeypatch):
    """Issue 36: after a config edit, `refresh --model llama` rewrote step-* only and left train-* recorded from the
    old config (verify said 0 bad). Now every golden of the model recorded from another config is rewritten, as
    the docs' recipe says, and the diff shows each as material."""
    project = git_repo(tmp_path)
    config = project.configs / "llama" / "config.json"
    config.write_text(config.read_text().replace('"silu"', '"gelu"'))
    monkeypatch.chdir(tmp_path)
    train = GoldenKey(CLASS, "llama", "train", "float32")

    assert cli.main(["verify", "--goldens", "goldens", "--configs", "toy_configs"]) == 1
    stale = [line for line in capsys.readouterr().out.splitlines() if "recorded from another config" in line]
    assert sorted(line.split(":")[0] for line in stale) == sorted(
        f"goldens/{CLASS}/llama/{s}-{d}.safetensors.zst" for s in ("step", "train") for d in ("bfloat16", "float32"))

    assert cli.main(["refresh", "--reason", "llama switches to gelu", "--model", "llama", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"rewrote   goldens/{LLAMA.relpath}")  # the project in the current directory
    assert f"rewrote   goldens/{train.relpath}" in out  # every scenario recorded from the old config
    assert "config.hidden_act: silu -> gelu" in out
    commit(tmp_path, "llama: gelu")

    assert cli.main(["diff", "HEAD~1", "--format", "json", "--fail-on-change"]) == 1
    doc = json.loads(capsys.readouterr().out)
    step, trained = sorted(doc["changed"], key=lambda c: c["key"])
    assert (step["key"], trained["key"]) == (str(LLAMA), str(train))
    for changed in (step, trained):  # per golden: material, config changed
        assert changed["material"] and "config changed" in changed["why"] and "config" in changed["material_fields"]
        assert [a["reason"] for a in changed["approvals"]] == ["llama switches to gelu"]
        assert {"field": "config.hidden_act", "old": "silu", "new": "gelu"} in changed["manifest"]
    assert len(step["tensors"]) == step["compared"]  # every compared tensor moved...
    assert min(t["ratio"] for t in step["tensors"]) > 100  # ...by large multiples of its bound
    others = len(store.list_goldens(project.goldens)) - 2
    assert len(doc["unchanged"]) == others and not doc["added"] and not doc["removed"]
    # the bfloat16 goldens were not asked for (--dtype float32): still stale, and verify says so
    assert cli.main(["verify", "--goldens", "goldens", "--configs", "toy_configs"]) == 1
    assert capsys.readouterr().out.count("recorded from another config") == 2


def test_a_refresh_of_named_scenarios_says_which_goldens_it_leaves_stale(tmp_path, capsys, monkeypatch):
    project = copy_zoo(tmp_path)
    config = project.configs / "llama" / "config.json"
    config.write_text(config.read_text().replace('"silu"', '"gelu"'))
    monkeypatch.chdir(tmp_path)

    named = ["--model", "llama", "--dtype", "float32", "--scenario", "step"]
    assert cli.main(["refresh", "--reason", "gelu", *named]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"rewrote   goldens/{LLAMA.relpath}") and "train-float32" not in out
    assert err == (f"veosnap: warning: goldens/{CLASS}/llama/train-float32.safetensors.zst: recorded from another "
                   "config than today's, left as it is (--scenario step); refresh it with --scenario train\n")

    # diff names every golden of the model left recorded from the old config, as material
    base = copy_zoo(tmp_path / "base")
    assert cli.main(["diff", str(base.goldens), "goldens", "--fail-on-change", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [c["key"] for c in doc["changed"]] == [str(LLAMA)]
    assert sorted(s["key"] for s in doc["stale"]) == [f"{CLASS}/llama/{s}-{d}" for s, d in
                                                      (("step", "bfloat16"), ("train", "bfloat16"), ("train", "float32"))]
    assert cli.main(["diff", str(base.goldens), "goldens"]) == 0
    assert f"stale    {CLASS}/llama/train-float32  recorded from the config {LLAMA} moved away from" in \
        capsys.readouterr().out


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
    assert [a.reason for a in trail][-2:] == ["new torch", "new driver"]  # after the committed golden's own
    assert trail[-2].previous_payload_hash == original
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
