"""Trust in goldens (issue 12): what a golden must be before a check believes it, and what a diff must show.

The unkeyed hashes catch accidents, not forgery: the forgeries below recompute every hash (as `codec.encode`
does), so only coverage, key/path validation and the review of `veosnap diff` can catch them.

    item 1  no legacy exemption: a golden without a manifest hash is refused
    item 2  coverage: a golden must hold every gradient, layer output and router the model produces
    item 3  diff: loosened bounds, a changed tolerance rule, a rewritten trail are material; refresh rewrites
    item 4  key and path: a symlink to another key is refused, by one reader for every command
    item 8  the approval trail: diff lists its changes, record keeps it or refuses
    item 9  special files under a goldens root are never read
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zstandard
from golden_repo import CLASS, REPO, committed_tier, copy_zoo, recorded_here
from safetensors.torch import save as st_save

from veosnap.errors import GoldenError
from veosnap.golden import codec, store
from veosnap.golden.codec import Golden
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Approval, Manifest, Tolerance
from veosnap.runs.diff import diff_goldens
from veosnap.runs.refresh import refresh
from veosnap.runs.verify import verify, verify_file
from veosnap.surfaces.cli import main

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")
MOE = GoldenKey(CLASS, "qwen3_moe", "step", "float32")
OTHER_CLASS = "cuda-sm90" if CLASS == "cpu" else "cpu"
FAULTS = REPO / "tests" / "faults.py"


def committed(key: GoldenKey) -> Golden:
    return store.read(REPO / "goldens" / key.relpath)


def forged(key: GoldenKey, edit) -> bytes:  # noqa: ANN001
    """The committed golden for `key` after `edit(golden)`, every hash recomputed (what a forger does)."""
    g = committed(key)
    g.manifest = Manifest.from_json(g.manifest.to_json(), "copy")
    edit(g)
    return codec.encode(g)


@pytest.fixture
def goldens(tmp_path: Path) -> Path:
    """A goldens directory holding the committed llama and qwen3_moe step goldens of this machine's class."""
    root = tmp_path / "goldens"
    for key in (LLAMA, MOE):
        (root / key.relpath).parent.mkdir(parents=True)
        shutil.copyfile(REPO / "goldens" / key.relpath, root / key.relpath)
    return root


def check(capsys, goldens: Path, model: str = "llama", *extra: str) -> tuple[int, str, str]:  # noqa: ANN001
    code = main(["check", "--goldens", str(goldens), "--configs", str(REPO / "toy_configs"), "--testdata",
                 str(REPO / "testdata"), "--hardware-class", CLASS, "--model", model, "--dtype", "float32", *extra])
    out, err = capsys.readouterr()
    return code, out, err


# --- item 1: no legacy exemption ------------------------------------------------------------------

NO_HASH = "no manifest hash: its bounds and trail cannot be trusted"


@pytest.mark.parametrize("how", ["empty", "removed"])
def test_item1_a_golden_without_a_manifest_hash_is_refused_by_read_check_and_verify(capsys, goldens, how):
    g = committed(LLAMA)
    manifest = json.loads(g.manifest.to_json())
    alpha, floor = manifest["alpha"], manifest["floor"]
    manifest["tolerance"] = {name: [noise * 1000, alpha * noise * 1000 + floor]
                             for name, (noise, bound) in manifest["tolerance"].items()}
    if how == "empty":
        manifest["manifest_hash"] = ""
    else:
        del manifest["manifest_hash"]
    raw = st_save(g.tensors, metadata={codec.METADATA_KEY: json.dumps(manifest, sort_keys=True)})
    path = goldens / LLAMA.relpath
    path.write_bytes(zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(raw))

    with pytest.raises(GoldenError, match=NO_HASH):
        store.read(path)
    code, out, err = check(capsys, goldens)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"veosnap: error: {path}: {NO_HASH}")
    assert f"re-record it on {CLASS} hardware with `veosnap refresh --force --reason" in err
    assert f"--model llama --dtype float32 --goldens {goldens}`" in err  # the command runs as printed
    assert not verify_file(path).ok and verify_file(path).problem.startswith(NO_HASH)


@pytest.mark.parametrize("hardware_class, tier, count", [("cpu", "toy", 100), ("cpu", "real", 2),
                                                         ("cuda-sm90", "toy", 100), ("cuda-sm90", "real", 16)])
def test_item1_the_committed_goldens_verify(hardware_class, tier, count):
    """Every committed golden verifies, of every class and tier: the toys' scenarios in both dtypes (100) of each
    class, 2 real-shape ones recorded on a CPU, 16 on the H200."""
    files = committed_tier(hardware_class, tier)
    results = verify(files)
    assert [r.line() for r in results if not r.ok] == []
    assert len(results) == count


# --- item 2: coverage -----------------------------------------------------------------------------

def _keep_only(*kept: str):  # noqa: ANN202
    def edit(g: Golden) -> None:
        g.tensors = {n: t for n, t in g.tensors.items() if n.startswith("inputs.") or n in kept}
        g.manifest.tolerance = {n: t for n, t in g.manifest.tolerance.items() if n in kept}

    return edit


def _drop(*names: str, layers: tuple[int, ...] = ()):  # noqa: ANN202
    def edit(g: Golden) -> None:
        gone = set(names) | {f"routes.{layer}.{part}" for layer in layers for part in ("experts", "weights", "margin")}
        g.tensors = {n: t for n, t in g.tensors.items() if n not in gone}
        g.manifest.tolerance = {n: t for n, t in g.manifest.tolerance.items() if n not in gone}
        g.manifest.min_margin = {layer: v for layer, v in g.manifest.min_margin.items() if layer not in layers}

    return edit


def test_item2_a_golden_emptied_with_recomputed_hashes_is_refused_before_any_number(capsys, goldens):
    path = goldens / LLAMA.relpath
    path.write_bytes(forged(LLAMA, _keep_only("loss", "logits")))

    # The dropped-gradient bug would pass against it ("all 2 tensors bit-identical"): the check refuses first.
    code, out, err = check(capsys, goldens, "llama", "--backend", f"{FAULTS}:dropped_norm_gradient")
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"veosnap: error: {path}: does not cover what the model produces (")
    assert "no gradient for 21 of 21 trainable parameters (grad.lm_head.weight, " in err
    assert "no output of decoder layers 0, 1" in err
    assert "re-record it, or say in its manifest why a tensor is absent" in err
    problem = verify_file(path).problem
    assert problem.startswith("does not cover what the model produces (no gradient for 21 of 21")


@pytest.mark.parametrize("edit, part", [
    (_drop("grad.model.norm.weight"), "no gradient for 1 of 25 trainable parameters (grad.model.norm.weight)"),
    (_drop("layers.1.output"), "no output of decoder layer 1"),
    (_drop(layers=(1,)), "no routes for MoE layer 1 (expert ids, weights, margins)"),
])
def test_item2_one_missing_gradient_layer_or_router_is_refused(capsys, goldens, edit, part):
    path = goldens / MOE.relpath
    path.write_bytes(forged(MOE, edit))
    code, _, err = check(capsys, goldens, "qwen3_moe")
    assert code == 2 and part in err, err
    assert part in verify_file(path).problem


def test_item2_a_golden_that_says_why_a_tensor_is_absent_is_accepted(capsys, goldens):
    from veosnap.golden.manifest import Absence

    path = goldens / LLAMA.relpath

    def frozen_norm(g: Golden) -> None:
        _drop("grad.model.norm.weight")(g)
        g.manifest.absent = [Absence("frozen", ("model.norm.weight",), "the final norm does not train in this recipe")]

    path.write_bytes(forged(LLAMA, frozen_norm))
    assert verify_file(path).ok
    code, out, _ = check(capsys, goldens)
    assert code == 0 and out.split("\n", 2)[2].startswith("PASS")  # after the project header
    # An exemption for something the model does not have is not an excuse: it is refused.
    nope = [Absence("frozen", ("model.nope.weight",), "x")]
    path.write_bytes(forged(LLAMA, lambda g: setattr(g.manifest, "absent", nope)))
    assert "excuses model.nope.weight, which the model does not have" in verify_file(path).problem


# --- item 3: diff and refresh ---------------------------------------------------------------------

def _loosen(factor: float):  # noqa: ANN202
    # A bound is alpha x noise + floor, and the reader refuses one edited apart from its noise: a forger scales
    # the noise and remakes the bound (a bound scaled alone is refused; test_trust_schema.py).
    def edit(g: Golden) -> None:
        m = g.manifest
        g.manifest.tolerance = {n: Tolerance(noise, float(m.alpha * noise + m.floor)) for n, t in m.tolerance.items()
                                for noise in [max(0.0, (t.bound * factor - m.floor) / m.alpha)]}

    return edit


def two_trees(tmp_path: Path, edit) -> tuple[Path, Path]:  # noqa: ANN001
    base, head = tmp_path / "base", tmp_path / "head"
    for root in (base, head):
        (root / LLAMA.relpath).parent.mkdir(parents=True)
        shutil.copyfile(REPO / "goldens" / LLAMA.relpath, root / LLAMA.relpath)
    (head / LLAMA.relpath).write_bytes(forged(LLAMA, edit))
    return base, head


def test_item3_loosened_bounds_are_material_and_listed(tmp_path, capsys):
    base, head = two_trees(tmp_path, _loosen(1000))
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    out = capsys.readouterr().out
    bounds = len(committed(LLAMA).manifest.tolerance)
    assert f"changed  {CLASS}/llama/step-float32  material; tensors bit-identical; {bounds} bounds loosened" in out
    loosened = [line for line in out.splitlines() if line.startswith("  loosened    ")]
    assert all(line.endswith(" (1e+03x)") for line in loosened[:-1]) and len(loosened) == 13
    assert loosened[-1] == f"  loosened    ... {bounds - 12} more bounds grew (--format json lists every one)"
    assert main(["diff", str(base), str(head), "--format", "json"]) == 0
    (changed,) = json.loads(capsys.readouterr().out)["changed"]
    assert changed["material"] and len(changed["loosened"]) == bounds
    assert changed["why"] == [f"{bounds} bounds loosened"]


def test_item3_a_tightened_bound_alone_is_metadata(tmp_path):
    base, head = two_trees(tmp_path, _loosen(0.5))
    d = diff_goldens(store.read(base / LLAMA.relpath), store.read(head / LLAMA.relpath))
    assert d.verdict == "metadata" and not d.material and len(d.tolerance) > 0


@pytest.mark.parametrize("field", ["alpha", "floor", "tie_epsilon"])
def test_item3_a_changed_tolerance_rule_is_material(tmp_path, capsys, field):
    def edit(g: Golden) -> None:
        setattr(g.manifest, field, getattr(g.manifest, field) * 2)
        _loosen(1.0)(g)  # the bounds made again from the noise under the new rule, as the reader requires

    base, head = two_trees(tmp_path, edit)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    assert f"tolerance rule changed ({field})" in capsys.readouterr().out


def test_item3_refresh_rewrites_a_golden_whose_bounds_were_loosened(tmp_path):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    path.write_bytes(forged(LLAMA, _loosen(1000)))

    outcome = refresh(project, "llama", "float32", reason="bounds were loosened by hand")

    assert outcome.action == "rewrote" and "looser than the reference measures" in outcome.why
    # the bounds the reference measures on this machine (the committed ones on the machine that recorded them)
    measured = codec.decode(recorded_here("llama"), "recorded here").manifest.tolerance
    assert store.read(path).manifest.tolerance == measured


# --- item 8: the approval trail -------------------------------------------------------------------

FIRST = Approval("new torch", "sha256:" + "1" * 64)
SECOND = Approval("new driver", "sha256:" + "2" * 64)


def _trail(*entries: Approval):  # noqa: ANN202
    return lambda g: setattr(g.manifest, "approvals", list(entries))


@pytest.mark.parametrize("old, new, change", [
    ((FIRST, SECOND), (SECOND,), "removed 'new torch'"),
    ((FIRST, SECOND), (), "removed 'new torch'"),
    ((FIRST, SECOND), (Approval("edited", FIRST.previous_payload_hash), SECOND), "edited 'new torch' -> 'edited'"),
    ((FIRST, SECOND), (SECOND, FIRST), "moved 'new"),
    ((FIRST,), (FIRST, Approval("forged", "sha256:" + "9" * 64)), "forged 'forged': it says it replaced"),
])
def test_item8_a_rewritten_trail_is_material_and_every_change_is_listed(tmp_path, capsys, old, new, change):
    base, head = tmp_path / "base", tmp_path / "head"
    store.write_bytes(forged(LLAMA, _trail(*old)), base / LLAMA.relpath)
    store.write_bytes(forged(LLAMA, _trail(*new)), head / LLAMA.relpath)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 1
    out = capsys.readouterr().out
    assert f"  trail       {change}" in out, out
    assert "approval trail rewritten" in out


def test_item8_appending_an_approval_with_a_reason_is_metadata(tmp_path, capsys):
    base_golden = forged(LLAMA, _trail(FIRST))
    payload = codec.decode(base_golden, "base").manifest.payload_hash
    base, head = tmp_path / "base", tmp_path / "head"
    store.write_bytes(base_golden, base / LLAMA.relpath)
    store.write_bytes(forged(LLAMA, _trail(FIRST, Approval("new driver", payload))), head / LLAMA.relpath)
    assert main(["diff", str(base), str(head), "--fail-on-change"]) == 0
    out = capsys.readouterr().out
    assert "metadata" in out and "  approved    'new driver'" in out


def test_item8_record_keeps_the_trail_of_an_unchanged_golden_and_refuses_to_change_a_trailed_one(tmp_path, capsys):
    project = copy_zoo(tmp_path)
    path = project.goldens / LLAMA.relpath
    refresh(project, "llama", "float32", reason="new torch", force=True)
    trailed = path.read_bytes()
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]

    assert main(["record", *dirs, "--model", "llama", "--dtype", "float32"]) == 0
    trail = len(store.read(path).manifest.approvals)  # the committed golden's own approvals, and "new torch"
    assert capsys.readouterr().out.startswith(f"unchanged {path}  (approval trail of {trail} kept)\n")
    assert path.read_bytes() == trailed

    config = project.configs / "llama" / "config.json"
    config.write_text(config.read_text().replace('"silu"', '"gelu"'))
    assert main(["record", *dirs, "--model", "llama", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"veosnap: error: {path}: has an approval trail ({trail} approval{'s' * (trail > 1)}, "
                          "last 'new torch')")
    assert "veosnap refresh --reason" in err and err.count("\n") == 1
    assert path.read_bytes() == trailed


# --- item 4: key and path, one reader --------------------------------------------------------------

def _other_class_golden(goldens: Path) -> Path:
    """A sound golden of another class (this class's one under the other key, hashes and all)."""
    other = GoldenKey(OTHER_CLASS, "llama", "step", "float32")
    store.write_bytes(forged(LLAMA, lambda g: setattr(g.manifest, "key", other)), goldens / other.relpath)
    return goldens / other.relpath


def test_item4_a_symlink_to_another_class_or_scenario_is_refused_naming_both(capsys, goldens):
    path = goldens / LLAMA.relpath
    target = _other_class_golden(goldens)
    path.unlink()
    path.symlink_to(os.path.relpath(target, path.parent))
    cause = (f"is a symlink to {target.resolve()} ({OTHER_CLASS}/llama/step-float32), another golden than its path "
             f"names ({CLASS}/llama/step-float32)")

    code, out, err = check(capsys, goldens)
    assert (code, out, err) == (2, "", f"veosnap: error: {path}: {cause}\n")
    assert verify_file(path).problem == cause
    assert [r.problem for r in verify([goldens]) if r.path == path] == [cause]
    assert main(["show", str(path)]) == 2 and capsys.readouterr().err == f"veosnap: error: {path}: {cause}\n"
    assert main(["diff", str(REPO / "goldens"), str(goldens)]) == 2
    assert capsys.readouterr().err == f"veosnap: error: {path}: {cause}\n"

    train = goldens / CLASS / "llama" / "train-float32.safetensors.zst"
    shutil.copyfile(REPO / "goldens" / CLASS / "llama" / "train-float32.safetensors.zst", train)
    path.unlink()
    path.symlink_to(train.name)
    code, _, err = check(capsys, goldens)
    assert code == 2 and (f"({CLASS}/llama/train-float32), another golden than its path names "
                          f"({CLASS}/llama/step-float32)") in err


# --- item 9: special files ------------------------------------------------------------------------

SPECIAL = textwrap.dedent('''
    import json, signal, sys
    from veosnap.surfaces.cli import main

    def alarm(*_):
        raise TimeoutError("hung")

    signal.signal(signal.SIGALRM, alarm)
    results = []
    for argv in json.loads(sys.argv[1]):
        signal.alarm(30)
        try:
            code = main(argv)
        except TimeoutError:
            code = "hung"
        signal.alarm(0)
        results.append(code)
    print(json.dumps(results))
''')


def special_files(root: Path) -> dict[str, Path]:
    """A FIFO, a socket and a directory named like goldens under `root`, and a link to /dev/zero."""
    made = {}
    fifo = root / CLASS / "llama" / "step-float32.safetensors.zst"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    made["FIFO"] = fifo
    sock_path = root / CLASS / "qwen2" / "step-float32.safetensors.zst"
    sock_path.parent.mkdir(parents=True)
    sock, cwd = socket.socket(socket.AF_UNIX), os.getcwd()
    os.chdir(sock_path.parent)  # a socket's path is limited to about 100 bytes: bind it by its name
    try:
        sock.bind(sock_path.name)
    finally:
        os.chdir(cwd)
        sock.close()
    made["socket"] = sock_path
    directory = root / CLASS / "qwen3" / "step-float32.safetensors.zst"
    directory.mkdir(parents=True)
    made["directory"] = directory
    return made


def test_item9_special_files_are_never_read(tmp_path):
    root = tmp_path / "goldens"
    made = special_files(root)
    zero = tmp_path / "elsewhere" / "cpu" / "mixtral" / "step-float32.safetensors.zst"
    zero.parent.mkdir(parents=True)
    zero.symlink_to("/dev/zero")
    dirs = ["--configs", str(REPO / "toy_configs"), "--testdata", str(REPO / "testdata"), "--hardware-class", CLASS]
    commands = [["verify", str(root)], ["ls", "--goldens", str(root), *dirs], ["show", str(made["FIFO"])],
                ["show", str(zero)], ["verify", str(zero)], ["diff", str(REPO / "goldens"), str(root)],
                ["check", "--goldens", str(root), *dirs, "--model", "llama", "--dtype", "float32"]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", SPECIAL, json.dumps(commands)], capture_output=True, text=True,
                          env=env, timeout=600)
    codes = json.loads(done.stdout.splitlines()[-1])
    err = done.stderr.splitlines()
    assert codes == [1, 0, 2, 2, 1, 2, 2], (codes, done.stderr)
    assert f"veosnap: error: {made['FIFO']}: not a regular file (FIFO); a golden is a regular file" in err
    assert f"veosnap: error: {zero}: not a regular file (character device); a golden is a regular file" in err
    for kind in ("FIFO", "socket", "directory"):  # ls skips and reports each
        assert f"veosnap: skipped {made[kind]}: not a regular file ({kind}); a golden is a regular file" in err
    assert f"{made['FIFO']}: not a regular file (FIFO); a golden is a regular file" in done.stdout


def test_item9_the_plugin_reads_through_the_same_reader(tmp_path):
    import signal

    from veosnap.surfaces.golden_snapshot import GoldenExtension

    root = tmp_path / "goldens"
    fifo = special_files(root)["FIFO"]

    def hung(*_):  # noqa: ANN002, ANN202
        raise TimeoutError("the plugin blocked on a FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        with pytest.raises(GoldenError, match=r"not a regular file \(FIFO\)"):
            GoldenExtension.at(root)().read_snapshot_data_from_location(
                snapshot_location=str(fifo), snapshot_name=f"{CLASS}/llama/step-float32", session_id="")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
