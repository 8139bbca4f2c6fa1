"""`veosnap verify`: corrupt, hand-edited or inconsistent goldens are named with their cause.

Verifying runs no model; these tests edit the committed goldens of the class the suite runs on.
"""

from __future__ import annotations

import shutil

import pytest
from golden_repo import CLASS, REPO

from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Tolerance
from veosnap.runs.verify import verify, verify_file
from veosnap.surfaces import cli

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")


@pytest.fixture
def goldens(tmp_path):
    dest = tmp_path / "goldens"
    shutil.copytree(REPO / "goldens" / CLASS, dest / CLASS)
    return dest


def test_committed_goldens_verify():
    """Every golden this checkout holds verifies (tests/test_trust_goldens.py counts them per class)."""
    results = verify([REPO / "goldens"])
    assert results and [r.line() for r in results if not r.ok] == []


def test_flipping_one_byte_makes_verify_exit_1_naming_that_file(goldens, capsys):
    path = goldens / LLAMA.relpath
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    assert cli.main(["verify", "--goldens", str(goldens)]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if ": ok; excused " not in line]  # a note, sound
    assert lines[0].startswith(f"{path}: ") and "corrupt" in lines[0]
    assert lines[1] == f"verified {len(store.list_goldens(goldens))} golden(s): 1 bad"


def test_sound_files_given_by_path_exit_0(goldens, capsys):
    paths = [str(p) for _, p in store.list_goldens(goldens)[:2]]
    assert cli.main(["verify", *paths]) == 0
    assert capsys.readouterr().out == "verified 2 golden(s): 0 bad\n"


def _edit_config(g):
    g.manifest.config["hidden_size"] = 65


def _nan_logits(g):
    g.tensors["logits"][0, -1, 3] = float("nan")


def _drop_tolerance(g):
    del g.manifest.tolerance["grad.lm_head.weight"]


def _zero_bound(g):
    g.manifest.tolerance["loss"] = Tolerance(0.0, 0.0)


@pytest.mark.parametrize(("edit", "cause"), [
    (_edit_config, "manifest config hash does not match its config"),
    (_nan_logits, "tensor 'logits' has 1 non-finite value(s)"),
    (_drop_tolerance, "tensor 'grad.lm_head.weight' is not part of a golden"),
    (_zero_bound, "tolerance of 'loss' is not [noise, bound]"),
])
def test_hand_edits_that_keep_the_payload_hash_valid_are_caught(goldens, edit, cause):
    # store.write recomputes the payload hash, as a careful hand-editor would.
    path = goldens / LLAMA.relpath
    g = store.read(path)
    edit(g)
    store.write(g, path)

    result = verify_file(path)
    assert not result.ok and cause in result.problem


def test_a_golden_under_another_models_path_is_caught(goldens):
    wrong = goldens / CLASS / "qwen2" / "step-float32.safetensors.zst"
    shutil.copy(goldens / LLAMA.relpath, wrong)
    assert f"manifest key {CLASS}/llama/step-float32 disagrees with its path ({CLASS}/qwen2/step-float32)" in verify_file(wrong).problem


def test_a_missing_path_is_bad_input(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path / "nope.safetensors.zst")]) == 2
    assert "no such file or directory" in capsys.readouterr().err


def test_a_bound_loosened_by_hand_in_the_manifest_is_caught(goldens):
    """Editing the JSON inside the file (not through veosnap) leaves the manifest hash stale."""
    import json

    import zstandard
    from safetensors.torch import load, save

    path = goldens / LLAMA.relpath
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    manifest = json.loads(header["__metadata__"]["veosnap"])
    manifest["tolerance"]["logits"][1] *= 1000  # a bound that would pass a real bug
    edited = save(load(raw), metadata={"veosnap": json.dumps(manifest, sort_keys=True, separators=(",", ":"))})
    path.write_bytes(zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(edited))

    result = verify_file(path)
    assert not result.ok and "manifest hash mismatch: the manifest was edited after recording" in result.problem
