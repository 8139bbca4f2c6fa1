"""`veosnap diff`: how goldens moved between two revisions or directories.

A diff runs no model; these tests use the committed goldens of the class the suite runs on.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

from golden_repo import CLASS, REPO, commit, copy_zoo, git, git_repo

from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Manifest
from veosnap.numerics.metric import rows_of
from veosnap.reference.inputs import Batch
from veosnap.runs.diff import diff, diff_goldens
from veosnap.surfaces import cli

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")


def test_identical_trees_report_no_change(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(REPO / "goldens", a)
    shutil.copytree(REPO / "goldens", b)

    report = diff(str(a), str(b), goldens_dir=a)

    assert report.empty and not report.material
    assert len(report.unchanged) == len(store.list_goldens(a)) > 0
    assert cli.main(["diff", str(a), str(b), "--fail-on-change"]) == 0
    assert "no golden changed" in capsys.readouterr().out


def test_working_tree_against_head_in_a_git_repo(tmp_path, capsys, monkeypatch):
    git_repo(tmp_path)
    monkeypatch.chdir(tmp_path)

    assert cli.main(["diff", "HEAD", "--fail-on-change"]) == 0
    committed = sum(1 for key, _ in store.list_goldens(REPO / "goldens") if key.hardware_class == CLASS)
    assert f"0 changed (0 material), 0 added, 0 removed, {committed} unchanged" in capsys.readouterr().out


def test_noise_level_move_reads_as_noise_and_large_move_as_material(tmp_path):
    old = store.read(REPO / "goldens" / LLAMA.relpath)
    bound = old.manifest.tolerance["logits"].bound
    rows, _ = rows_of("logits", old.tensors["logits"], Batch.from_golden(old).token_mask)
    typical = rows.norm(dim=1).pow(2).mean().sqrt()
    worst_row = rows.norm(dim=1).max()

    def scaled_logits(times_bound: float):
        # Scaling by (1 + e) moves each row by e * |row|; the worst row sets the tensor's row error.
        e = times_bound * bound * float(typical / worst_row)
        tensors = dict(old.tensors, logits=(old.tensors["logits"].double() * (1 + e)).to(old.tensors["logits"].dtype))
        return codec.decode(codec.encode(codec.Golden(old.manifest, tensors)), "edited")

    noise = diff_goldens(old, scaled_logits(0.3))
    real = diff_goldens(old, scaled_logits(40.0))

    assert [t.name for t in noise.tensors] == ["logits"]
    assert 0.2 < noise.tensors[0].ratio < 0.4 and noise.verdict == "noise" and not noise.material
    assert 30 < real.tensors[0].ratio < 50 and real.material


def test_removed_and_added_goldens_are_material(tmp_path, capsys, monkeypatch):
    project = git_repo(tmp_path)
    removed = project.goldens / CLASS / "qwen2" / "step-bfloat16.safetensors.zst"
    removed.unlink()
    added = project.goldens / CLASS / "llama_copy" / "step-float32.safetensors.zst"
    added.parent.mkdir()
    shutil.copy(project.goldens / LLAMA.relpath, added)
    monkeypatch.chdir(tmp_path)

    assert cli.main(["diff", "HEAD", "--format", "json", "--fail-on-change"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["removed"] == [f"{CLASS}/qwen2/step-bfloat16"]
    assert doc["added"] == [f"{CLASS}/llama_copy/step-float32"]
    assert doc["material"] and doc["changed"] == []


def test_routes_and_provenance_changes_are_listed(tmp_path):
    key = GoldenKey(CLASS, "qwen3_moe", "step", "float32")
    old = store.read(REPO / "goldens" / key.relpath)
    tensors = dict(old.tensors)
    experts = tensors["routes.0.experts"].clone()
    real_tokens = Batch.from_golden(old).token_mask.nonzero().flatten()[:3]
    experts[real_tokens] = experts[real_tokens].flip(-1) + 1000  # any ids that differ
    tensors["routes.0.experts"] = experts
    manifest = Manifest.from_json(old.manifest.to_json(), "copy")
    manifest.provenance = replace(manifest.provenance, torch="0.0-test")
    edited = tmp_path / "edited"
    store.write(codec.Golden(manifest, tensors), store.path_for(edited, key))

    report = diff(str(REPO / "goldens"), str(edited), goldens_dir=edited)

    (d,) = report.changed
    assert [(r.layer, r.flipped) for r in d.routes] == [(0, 3)]
    assert [(c.field, c.new) for c in d.provenance] == [("torch", "0.0-test")]
    assert d.tensors == [] and d.material  # routes alone make a change material


def test_markdown_puts_the_summary_first_and_folds_details(tmp_path, capsys, monkeypatch):
    project = git_repo(tmp_path)
    g = store.read(project.goldens / LLAMA.relpath)
    g.tensors["loss"] = g.tensors["loss"] + 1.0
    store.write(g, project.goldens / LLAMA.relpath)
    commit(tmp_path, "hand-edited loss")
    monkeypatch.chdir(tmp_path)

    assert cli.main(["diff", "HEAD~1", "HEAD", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    table_row = next(line for line in out.splitlines() if line.startswith(f"| `{CLASS}/llama/step-float32`"))
    assert "**material**" in table_row and "`loss`" in table_row
    assert out.index("| golden |") < out.index("<details>") and "</details>" in out


def test_bad_input_exits_2_with_one_line(tmp_path, capsys, monkeypatch):
    git_repo(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["diff", "no-such-revision"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-revision: neither a directory nor a git revision" in err

    # A corrupt golden at a revision is named by revision and path.
    path = tmp_path / "goldens" / LLAMA.relpath
    path.write_bytes(b"not a golden")
    commit(tmp_path, "corrupt")
    assert cli.main(["diff", "HEAD~1", "HEAD"]) == 2
    assert f"HEAD:goldens/{CLASS}/llama/step-float32.safetensors.zst: not a zstd frame" in capsys.readouterr().err


def test_outside_git_a_revision_is_refused(tmp_path, capsys):
    copy_zoo(tmp_path)
    assert cli.main(["diff", "HEAD", "--goldens", str(tmp_path / "goldens")]) == 2
    assert "not inside a git repository" in capsys.readouterr().err


def test_git_sides_do_not_touch_the_working_tree(tmp_path):
    project = git_repo(tmp_path)
    status_before = git(tmp_path, "status", "--porcelain")
    diff("HEAD", "HEAD", goldens_dir=project.goldens)
    assert git(tmp_path, "status", "--porcelain") == status_before == ""
