"""A check reads its golden's manifest and batch first and decodes the rest on a thread
(`veosnap.golden.background`): the same golden, and the same one-line errors, as the one reader."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import zstandard
from golden_repo import CLASS, committed_golden
from safetensors.torch import save as st_save

from veosnap.errors import GoldenError
from veosnap.golden import background, codec, store
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]


def copy_golden(tmp_path: Path, model: str = "llama", dtype: str = "float32") -> tuple[Path, Path]:
    """A goldens directory holding a copy of this class's committed golden (the test skips without one)."""
    source = committed_golden(model, dtype)
    root = tmp_path / "goldens"
    path = root / source.relative_to(REPO / "goldens")
    path.parent.mkdir(parents=True)
    shutil.copyfile(source, path)
    return root, path


def edited_logits(path: Path) -> None:
    """Rewrite the golden with its logits changed and its hashes left as recorded: the head (manifest,
    inputs) is sound, the payload is not."""
    g = codec.decode(path.read_bytes(), path)
    g.tensors["logits"] = g.tensors["logits"] * 1.001
    raw = st_save(g.tensors, metadata={codec.METADATA_KEY: g.manifest.to_json()})
    path.write_bytes(zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(raw))


def reader_error(path: Path, root: Path) -> str:
    with pytest.raises(GoldenError) as exc:
        store.read(path, root)
    return str(exc.value)


@pytest.mark.parametrize(("model", "dtype"), [("llama", "float32"), ("qwen3_moe", "bfloat16"),
                                               ("qwen3_moe-real-small", "float32")])  # the last one sketched
def test_a_pending_golden_is_the_golden_the_reader_gives(tmp_path, model, dtype):
    root, path = copy_golden(tmp_path, model, dtype)
    pending = background.read(path, root)
    assert isinstance(pending, background.PendingGolden)
    full = store.read(path, root)
    # Answered from the head, before the decode is waited for.
    assert pending.key == full.key and pending.manifest == full.manifest and pending.path == path
    assert pending.route_layers() == full.route_layers() and pending.is_moe == full.is_moe
    assert pending.held_names() == full.held_names()
    assert pending.inputs().keys() == full.inputs().keys()
    for name, tensor in full.inputs().items():
        assert tensor.dtype == pending.inputs()[name].dtype and tensor.equal(pending.inputs()[name])
    # The rest from the thread.
    assert pending.tensors.keys() == full.tensors.keys()
    assert all(pending.tensors[name].equal(t) for name, t in full.tensors.items())
    assert pending.sketches.keys() == full.sketches.keys()
    for name, sketch in full.sketches.items():
        ours = pending.sketches[name]
        assert ours.entry == sketch.entry and all(
            t.equal(ours.tensors(name)[part]) for part, t in sketch.tensors(name).items())
    assert pending.result().manifest == full.manifest


def test_a_payload_edited_after_recording_is_refused_when_its_tensors_are_first_used(tmp_path):
    root, path = copy_golden(tmp_path)
    edited_logits(path)
    expected = reader_error(path, root)
    assert "payload hash mismatch" in expected
    pending = background.read(path, root)  # the head is sound: refused where the tensors are used
    assert isinstance(pending, background.PendingGolden)
    for use in (lambda: pending.tensors, lambda: pending.sketches, pending.result):
        with pytest.raises(GoldenError) as exc:
            use()
        assert str(exc.value) == expected


@pytest.mark.parametrize("keep", [0.02, 0.5, 0.99])
def test_a_truncated_golden_gives_the_readers_error(tmp_path, keep):
    root, path = copy_golden(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    expected = reader_error(path, root)
    with pytest.raises(GoldenError) as exc:
        background.read(path, root).tensors  # noqa: B018 - the use that waits for the decode
    assert str(exc.value) == expected


def test_a_corrupt_head_falls_back_to_the_readers_error(tmp_path):
    root, path = copy_golden(tmp_path)
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # inside the first block: the manifest's bytes
    path.write_bytes(bytes(data))
    expected = reader_error(path, root)
    with pytest.raises(GoldenError) as exc:
        background.read(path, root)  # nothing to start from: the full decode's error, at once
    assert str(exc.value) == expected


def test_any_failure_in_the_thread_is_one_golden_error_naming_the_file(tmp_path, monkeypatch):
    root, path = copy_golden(tmp_path)

    def broken(data, where, root=None):  # noqa: ANN001, ANN202
        raise MemoryError("no room")

    monkeypatch.setattr(store, "decode_at", broken)
    pending = background.read(path, root)
    with pytest.raises(GoldenError) as exc:
        pending.result()
    assert str(exc.value).startswith(f"{path}: cannot be decoded (MemoryError: no room")


def test_the_callers_advice_is_added_to_errors_from_the_thread(tmp_path):
    root, path = copy_golden(tmp_path)
    edited_logits(path)

    def advise(exc: GoldenError) -> GoldenError:
        return GoldenError(exc.path, exc.problem, "re-record it with `advice`")

    with pytest.raises(GoldenError) as exc:
        background.read(path, root, advise).result()
    assert str(exc.value).endswith("; re-record it with `advice`")


@pytest.mark.parametrize("layout", ["single", "ep"])
def test_check_refuses_a_golden_edited_after_recording_even_when_no_layout_runs(tmp_path, capsys, layout):
    # `ep` declines a dense model: nothing waits for the decode but the check itself before it reports.
    root, path = copy_golden(tmp_path)
    edited_logits(path)
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "llama",
                 "--dtype", "float32", "--layout", layout])
    out, err = capsys.readouterr()
    # a torchrun layout says on stderr that it started; the error is the last line and the only one it says
    assert (code, err.splitlines()[-1]) == (2, f"veosnap: error: {reader_error(path, root)}")
    assert [line for line in err.splitlines() if line.startswith("veosnap:")] == [err.splitlines()[-1]]


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_a_check_first_waits_for_the_decode_after_the_model_is_built(tmp_path, capsys, monkeypatch, model):
    # The overlap is the point: config, limits, coverage and the layout's accept use only the head. The check's
    # own thread first waits for the decode once it has its model (built on the prebuild thread meanwhile);
    # before that only the staging thread does (the golden's device copies, made while the model is built).
    import threading

    from veosnap.golden.background import PendingGolden
    from veosnap.reference.prebuild import Prebuild

    root, _ = copy_golden(tmp_path, model)
    events: list[str] = []
    take, result = Prebuild.take, PendingGolden.result
    monkeypatch.setattr(Prebuild, "take", lambda self, *a: events.append("take") or take(self, *a))
    monkeypatch.setattr(PendingGolden, "result", lambda self: events.append(
        f"wait {threading.current_thread().name}") or result(self))
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", model, "--dtype", "float32"])
    assert code == 0, capsys.readouterr()
    mine = [e for e in events if e in ("take", "wait MainThread")]
    assert mine[0] == "take" and "wait MainThread" in mine
    assert "wait veosnap-stage" in events


def test_the_decode_starts_after_the_checks_setup_and_the_model_is_built_once_on_its_own_thread(
        tmp_path, capsys, monkeypatch):
    # Started with the head, the decode's Python parse took the GIL from the setup (the limits' skeleton thread).
    # The model is built from the check's start on the prebuild thread (reference.prebuild), and taken: once.
    import threading

    from veosnap.golden.background import _Decode
    from veosnap.reference import coverage, models

    root, _ = copy_golden(tmp_path, "qwen3_moe")
    events: list[str] = []
    builds: list[str] = []
    build, start, require = models.build, _Decode.start, coverage.require
    monkeypatch.setattr(models, "build", lambda *a, **k: builds.append(threading.current_thread().name)
                        or build(*a, **k))
    monkeypatch.setattr(_Decode, "start", lambda self: events.append("start") or start(self))
    monkeypatch.setattr(coverage, "require", lambda *a, **k: events.append("setup") or require(*a, **k))
    code = main(["check", "--goldens", str(root), "--hardware-class", CLASS, "--model", "qwen3_moe",
                 "--dtype", "float32"])
    assert code == 0, capsys.readouterr()
    assert events[:2] == ["setup", "start"]
    assert builds == ["veosnap-prebuild qwen3_moe"]


@pytest.mark.parametrize("edit", ["missing", "extra", "extra_route"])
def test_a_tensor_set_the_reader_refuses_is_refused_with_its_error_at_once(tmp_path, edit):
    # Hashes consistent, names wrong: the head's name checks send it to the reader before coverage or any
    # other check could say something else about it.
    import torch

    root, path = copy_golden(tmp_path)
    g = codec.decode(path.read_bytes(), path)
    if edit == "missing":
        g.tensors.pop(sorted(n for n in g.tensors if n.startswith("grad."))[0])
    else:
        name = "grad.model.extra.weight" if edit == "extra" else "routes.0.experts"
        g.tensors[name] = torch.zeros(2, dtype=torch.int32)
    path.write_bytes(codec.encode(g))
    expected = reader_error(path, root)
    with pytest.raises(GoldenError) as exc:
        background.read(path, root)
    assert str(exc.value) == expected


def test_a_corrupt_golden_is_refused_as_corrupt_whatever_else_the_check_finds_first(tmp_path, capsys):
    # Its config changed too: the serial reader refused the payload before looking at the config.
    import json

    root, path = copy_golden(tmp_path)
    edited_logits(path)
    configs = tmp_path / "toy_configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    code = main(["check", "--goldens", str(root), "--configs", str(configs), "--hardware-class", CLASS,
                 "--model", "llama", "--dtype", "float32"])
    assert (code, capsys.readouterr().err) == (2, f"veosnap: error: {reader_error(path, root)}\n")
