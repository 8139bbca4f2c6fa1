"""No lost approval, no traceback on a hostile config, no excuse for a variant that passes (issue 35 item 4).

    attack 6  two `refresh --force` of one golden at once, reasons A and B: both kept (the second waits for
              the first's lock, then appends to what it wrote); was: both "approved", the file kept only B
    attack 7  a `veosnap.json` (or `config.json`) of 100,000 nested `[`: one line; was a RecursionError traceback
    excuses   an excuse whose figures say its variant passed is refused when read; a check of an excused
              variant that passes is an error naming the excuse (stale or forged), not a pass
    diff      a golden gaining its first excuse shows that excuse, and no stray `excused: {} -> (absent)`
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO, copy_zoo

from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Excuse, Manifest
from veosnap.runs.verify import verify_file
from veosnap.surfaces.cli import main

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")


def with_excuse(path: Path, excuse: Excuse, variant: str = "sdpa") -> None:
    """The golden at `path` with `excuse` for `variant` added, through veosnap's own writer (hashes recomputed)."""
    g = store.read(path)
    g.manifest = Manifest.from_json(g.manifest.to_json(), path)
    g.manifest.excused = {variant: excuse}
    path.write_bytes(codec.encode(g))


@pytest.mark.heavy
def test_attack6_two_concurrent_refreshes_keep_both_approvals(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    before = store.read(path).manifest.payload_hash
    command = [sys.executable, "-m", "veosnap", "refresh", "--force", "--model", "llama", "--dtype", "float32",
               "--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata",
               str(project.testdata)]
    env = {**os.environ, "VEOSNAP_HARDWARE_CLASS": CLASS}
    runs = [subprocess.Popen([*command, "--reason", reason], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env) for reason in ("A", "B")]
    outputs = [run.communicate(timeout=600) for run in runs]

    assert [run.returncode for run in runs] == [0, 0], outputs
    trail = store.read(path).manifest.approvals
    assert sorted(a.reason for a in trail) == ["A", "B"]
    first, second = trail
    assert first.previous_payload_hash == before  # the first replaced the committed golden...
    # ...and the second what the first wrote: the same payload, as a recording is deterministic (on a GPU the
    # same as the committed one; on the cpu the committed golden may predate this torch build)
    assert second.previous_payload_hash == store.read(path).manifest.payload_hash


@pytest.mark.parametrize("name", ["veosnap.json", "config.json"])
def test_attack7_deeply_nested_config_json_is_one_line(tmp_path, capsys, name):
    project = copy_zoo(tmp_path)
    hostile = project.configs / "llama" / name
    hostile.write_text("[" * 100_000)
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]

    for command in ("record", "check"):
        code = main([command, *dirs, "--model", "llama", "--dtype", "float32"])
        out, err = capsys.readouterr()
        assert (code, out) == (2, "")
        assert err == f"veosnap: error: {hostile}: not usable JSON (nested too deeply to parse)\n"


def test_an_excuse_whose_figures_say_its_variant_passed_is_refused_when_read(tmp_path):
    path = tmp_path / LLAMA.relpath
    path.parent.mkdir(parents=True)
    path.write_bytes((REPO / "goldens" / LLAMA.relpath).read_bytes())
    with_excuse(path, Excuse("forged", "logits", 0.5))

    assert main(["verify", str(path)]) == 1
    problem = verify_file(path).problem
    assert "excused.sdpa: ratio 0.5 says sdpa passed (within 1x bound); an excuse is only for a variant that fails" \
        in problem


def test_a_check_of_an_excused_variant_that_passes_is_an_error_naming_the_excuse(tmp_path, capsys):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    with_excuse(path, Excuse("forged: sdpa is broken here", "logits", 2.0))
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]

    code = main(["check", *dirs, "--model", "llama", "--dtype", "float32", "--backend", "sdpa"])
    out = capsys.readouterr().out

    assert code == 1
    assert "the golden excuses sdpa ('forged: sdpa is broken here', then logits 2x), but sdpa passes it: the " \
           "excuse is stale or forged" in out
    assert main(["check", *dirs, "--model", "llama", "--dtype", "float32", "--backend", "eager"]) == 0


def test_diff_of_a_first_excuse_lists_it_without_a_stray_empty_map(tmp_path, capsys):
    base, head = tmp_path / "base", tmp_path / "head"
    for root in (base, head):
        (root / LLAMA.relpath).parent.mkdir(parents=True)
        (root / LLAMA.relpath).write_bytes((REPO / "goldens" / LLAMA.relpath).read_bytes())
    with_excuse(head / LLAMA.relpath, Excuse("a library bug", "logits", 2.0))

    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    out = capsys.readouterr().out
    assert "  material    excused.sdpa.reason: (absent) -> a library bug" in out
    assert "excused: {}" not in out and "-> (absent)" not in out
