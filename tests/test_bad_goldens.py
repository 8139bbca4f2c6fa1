"""Bad golden files: each is refused with one line naming the file and the cause, exit 2, no traceback.

Every corrupted file is crafted from a real golden with the golden codec and the safetensors and
zstandard libraries, then checked through the CLI exactly as a user would.
"""

from __future__ import annotations

import json
import shlex
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch
import zstandard
from golden_repo import CLASS, golden_path
from safetensors.torch import save as st_save

from veosnap.errors import GoldenError
from veosnap.golden import codec
from veosnap.surfaces.cli import main

REPO = Path(__file__).resolve().parents[1]
SOURCE = golden_path("llama")  # this machine's class: the good golden is checked, not refused for its class
REL = SOURCE.relative_to(REPO / "goldens")


@pytest.fixture
def goldens(tmp_path: Path) -> Path:
    """A goldens directory holding one good golden (llama, float32)."""
    root = tmp_path / "goldens"
    (root / REL).parent.mkdir(parents=True)
    shutil.copyfile(SOURCE, root / REL)
    return root


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def check_llama(capsys: pytest.CaptureFixture, goldens: Path, *extra: str) -> tuple[int, str]:
    code, _, err = run_cli(capsys, "check", "--goldens", str(goldens), "--hardware-class", CLASS,
                           "--model", "llama", "--dtype", "float32", *extra)
    return code, err


def assert_refused(capsys: pytest.CaptureFixture, goldens: Path, cause: str, path: Path | None = None) -> None:
    code, err = check_llama(capsys, goldens)
    assert (code, err) == (2, f"veosnap: error: {path or goldens / REL}: {cause}\n")


def raw_bytes() -> bytes:
    """The decompressed safetensors file inside the source golden."""
    return zstandard.ZstdDecompressor().decompress(SOURCE.read_bytes())


def compress(raw: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(raw)


def frame_declaring(size: int, body: bytes) -> bytes:
    """A hand-built zstd frame whose header declares `size` bytes of content around a raw block `body`."""
    header = b"\x28\xb5\x2f\xfd" + bytes([0xC0, 10 << 3]) + struct.pack("<Q", size)  # 8-byte size, 1 MiB window
    block = struct.pack("<I", 1 | (len(body) << 3))[:3]  # last block, raw
    return header + block + body


def with_manifest(edit) -> bytes:  # noqa: ANN001
    """The source golden re-encoded after `edit(manifest_dict)`, tensors untouched."""
    g = codec.decode(SOURCE.read_bytes(), SOURCE)
    data = json.loads(g.manifest.to_json())
    edit(data)
    raw = st_save(g.tensors, metadata={codec.METADATA_KEY: json.dumps(data)})
    return compress(raw)


def with_tensors(edit) -> bytes:  # noqa: ANN001
    """The source golden after `edit(tensors)`, re-encoded (so its payload hash is consistent)."""
    g = codec.decode(SOURCE.read_bytes(), SOURCE)
    edit(g.tensors)
    return codec.encode(g)


# --- the container: zstd frame ------------------------------------------------------------------

def test_a_good_golden_is_checked(capsys, goldens):
    code, err = check_llama(capsys, goldens)
    assert (code, err) == (0, "")


def test_flipped_byte(capsys, goldens):
    data = bytearray(SOURCE.read_bytes())
    data[len(data) // 2] ^= 0x10
    (goldens / REL).write_bytes(data)
    assert_refused(capsys, goldens, "corrupt: the zstd data does not decode or fails its checksum "
                                    "(the file's bytes changed after it was written)")


def test_flipped_checksum_byte(capsys, goldens):
    data = bytearray(SOURCE.read_bytes())
    data[-1] ^= 0x01
    (goldens / REL).write_bytes(data)
    assert_refused(capsys, goldens, "corrupt: the zstd data does not decode or fails its checksum "
                                    "(the file's bytes changed after it was written)")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated(capsys, goldens, keep):
    data = SOURCE.read_bytes()
    (goldens / REL).write_bytes(data[: int(len(data) * keep)])
    assert_refused(capsys, goldens, "truncated: the zstd frame ends early (an interrupted copy or download?)")


def test_truncated_inside_the_frame_header(capsys, goldens):
    (goldens / REL).write_bytes(SOURCE.read_bytes()[:6])
    assert_refused(capsys, goldens, "truncated or corrupt zstd frame header")


def test_empty_file(capsys, goldens):
    (goldens / REL).write_bytes(b"")
    assert_refused(capsys, goldens, "not a zstd frame; a golden is zstd-compressed safetensors")


def test_not_zstd(capsys, goldens):
    (goldens / REL).write_text("version https://git-lfs.github.com/spec/v1\n")
    assert_refused(capsys, goldens, "not a zstd frame; a golden is zstd-compressed safetensors")


def test_uncompressed_safetensors(capsys, goldens):
    (goldens / REL).write_bytes(raw_bytes())
    assert_refused(capsys, goldens, "not a zstd frame; a golden is zstd-compressed safetensors "
                                    "(this looks like an uncompressed safetensors file)")


def test_trailing_bytes_after_the_frame(capsys, goldens):
    (goldens / REL).write_bytes(SOURCE.read_bytes() + SOURCE.read_bytes())
    assert_refused(capsys, goldens, "trailing bytes after the zstd frame (a golden is exactly one frame)")


def test_frame_without_content_size(capsys, goldens):
    writer = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    (goldens / REL).write_bytes(writer.compress(raw_bytes()) + writer.flush())
    assert_refused(capsys, goldens, "zstd frame does not declare its content size; refusing (veosnap always writes it)")


def test_decompression_bomb_over_the_cap(capsys, goldens):
    (goldens / REL).write_bytes(frame_declaring(1 << 40, b"x" * 1000))
    assert_refused(capsys, goldens, f"zstd frame declares {1 << 40} bytes of content, over the "
                                    f"{codec.MAX_DECOMPRESSED} byte cap; refusing (decompression bomb?)")


def test_decompression_bomb_under_the_cap_but_far_beyond_its_size(capsys, goldens):
    declared = codec.MAX_DECOMPRESSED - 1
    bomb = frame_declaring(declared, b"x" * 1000)
    (goldens / REL).write_bytes(bomb)
    assert_refused(capsys, goldens, f"zstd frame declares {declared} bytes of content from {len(bomb)} compressed bytes "
                                    f"(over {codec.MAX_RATIO}x); refusing (decompression bomb?)")


def test_bombs_are_refused_before_allocating():
    tracemalloc.start()
    try:
        for declared in (1 << 40, codec.MAX_DECOMPRESSED, 64 << 20):
            with pytest.raises(GoldenError, match="decompression bomb"):
                codec.decode(frame_declaring(declared, b"x" * 1000), "bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


# --- the safetensors file inside ----------------------------------------------------------------

def test_oversized_safetensors_header(capsys, goldens):
    declared = codec.MAX_HEADER + 1
    (goldens / REL).write_bytes(compress(struct.pack("<Q", declared) + b"{}"))
    assert_refused(capsys, goldens, f"safetensors header declares {declared} bytes, "
                                    f"over the {codec.MAX_HEADER} byte cap")


def test_safetensors_header_past_the_end(capsys, goldens):
    raw = raw_bytes()
    (goldens / REL).write_bytes(compress(struct.pack("<Q", len(raw)) + raw[8:]))
    assert_refused(capsys, goldens, f"safetensors header declares {len(raw)} bytes, past the end of the payload")


def test_malformed_safetensors_header(capsys, goldens):
    (goldens / REL).write_bytes(compress(struct.pack("<Q", 9) + b"{not json"))
    assert_refused(capsys, goldens, "malformed safetensors header (JSONDecodeError: Expecting property name "
                                    "enclosed in double quotes: line 1 column 2 (char 1))")


def test_safetensors_without_a_manifest(capsys, goldens):
    (goldens / REL).write_bytes(compress(st_save({"x": torch.zeros(2)})))
    assert_refused(capsys, goldens, "safetensors metadata has no 'veosnap' manifest (not a veosnap golden)")


def test_tensor_offsets_out_of_range(capsys, goldens):
    manifest = codec.decode(SOURCE.read_bytes(), SOURCE).manifest.to_json()
    header = json.dumps({"__metadata__": {"veosnap": manifest},
                         "x": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    (goldens / REL).write_bytes(compress(struct.pack("<Q", len(header)) + header + b"\0" * 16))
    code, err = check_llama(capsys, goldens)
    assert code == 2
    assert err.startswith(f"veosnap: error: {goldens / REL}: malformed safetensors payload (")
    assert err.count("\n") == 1


# --- the manifest --------------------------------------------------------------------------------

def test_unknown_schema_version(capsys, goldens):
    (goldens / REL).write_bytes(with_manifest(lambda m: m.update(schema_version=3)))
    assert_refused(capsys, goldens, "schema version 3 is not one this veosnap reads (it reads 1, 2); upgrade veosnap")


def test_manifest_is_not_json(capsys, goldens):
    g = codec.decode(SOURCE.read_bytes(), SOURCE)
    (goldens / REL).write_bytes(compress(st_save(g.tensors, metadata={"veosnap": "{oops"})))
    assert_refused(capsys, goldens, "malformed manifest (JSONDecodeError: Expecting property name enclosed in "
                                    "double quotes: line 1 column 2 (char 1))")


NOT_A_BOUND = ("tolerance of 'logits' is not [noise, bound] (or [noise, bound, projection noise, projection bound]) "
               "with finite numbers, noises >= 0 and bounds > 0")


@pytest.mark.parametrize("bound, cause", [
    ("Infinity", "Infinity is not allowed in a manifest"),
    ("NaN", "NaN is not allowed in a manifest"),
    ("1e400", NOT_A_BOUND),  # parses as inf
    ("-1.0", NOT_A_BOUND),
    ("true", NOT_A_BOUND),
])
def test_a_bound_that_would_pass_anything_is_refused(capsys, goldens, bound, cause):
    g = codec.decode(SOURCE.read_bytes(), SOURCE)
    data = json.loads(g.manifest.to_json())
    data["tolerance"]["logits"] = [0.0, "BOUND"]
    text = json.dumps(data).replace('"BOUND"', bound)
    (goldens / REL).write_bytes(compress(st_save(g.tensors, metadata={"veosnap": text})))
    assert_refused(capsys, goldens, f"malformed manifest (ValueError: {cause})")


def test_edited_config_in_the_manifest(capsys, goldens):
    (goldens / REL).write_bytes(with_manifest(lambda m: m["config"].update(num_hidden_layers=9)))
    assert_refused(capsys, goldens, "manifest config hash does not match its config (corrupt or edited)")


def test_manifest_key_disagrees_with_its_path(capsys, goldens):
    moved = goldens / CLASS / "qwen2" / "step-float32.safetensors.zst"
    moved.parent.mkdir()
    (goldens / REL).rename(moved)
    code, _, err = run_cli(capsys, "check", "--goldens", str(goldens), "--hardware-class", CLASS,
                           "--model", "qwen2", "--dtype", "float32")
    assert (code, err) == (2, f"veosnap: error: {moved}: manifest key {CLASS}/llama/step-float32 disagrees with "
                              f"its path ({CLASS}/qwen2/step-float32)\n")


def test_config_hash_disagrees_with_the_model_checked(capsys, goldens, tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 10
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    code, err = check_llama(capsys, goldens, "--configs", str(configs))
    refresh = (f"veosnap refresh --reason 'config changed: <why>' --model llama --dtype float32 --goldens {goldens} "
               f"--configs {configs}")
    assert (code, err) == (2, f"veosnap: error: {goldens / REL}: recorded from another config than "
                              f"{configs / 'llama' / 'config.json'} (config hash differs); if the change is intended, "
                              f"re-record it with `{refresh}`\n")
    # The advice runs as printed: an approved refresh, after which the check passes.
    assert main(shlex.split(refresh)[1:]) == 0
    assert "rewrote" in capsys.readouterr().out
    assert check_llama(capsys, goldens, "--configs", str(configs)) == (0, "")


# --- the tensors ---------------------------------------------------------------------------------

def first_gradient() -> str:
    return min(n for n in codec.decode(SOURCE.read_bytes(), SOURCE).tensors if n.startswith("grad."))


def test_tensor_missing(capsys, goldens):
    name = first_gradient()
    (goldens / REL).write_bytes(with_tensors(lambda t: t.pop(name)))
    assert_refused(capsys, goldens, f"tensor {name!r} has a tolerance but is missing from the payload")


@pytest.mark.parametrize("name", ["grad.model.extra.weight", "routes.0.experts", "inputs.extra"])
def test_tensor_extra(capsys, goldens, name):
    (goldens / REL).write_bytes(with_tensors(lambda t: t.update({name: torch.zeros(2, dtype=torch.int32)})))
    assert_refused(capsys, goldens, f"tensor {name!r} is not part of a golden (extra or hand-added)")


def test_tensor_edited_after_recording(capsys, goldens):
    g = codec.decode(SOURCE.read_bytes(), SOURCE)
    g.tensors["logits"] = g.tensors["logits"] * 1.001
    (goldens / REL).write_bytes(compress(st_save(g.tensors, metadata={"veosnap": g.manifest.to_json()})))
    assert_refused(capsys, goldens, "payload hash mismatch: the tensors are not the ones recorded (corrupt or edited)")


def test_golden_for_other_inputs(capsys, goldens):
    def other_inputs(tensors: dict[str, torch.Tensor]) -> None:
        tensors["inputs.input_ids"] = torch.where(tensors["inputs.attention_mask"].bool(),
                                                  (tensors["inputs.input_ids"] + 1) % 64, tensors["inputs.input_ids"])

    (goldens / REL).write_bytes(with_tensors(other_inputs))
    assert_refused(capsys, goldens, "inputs hash mismatch: the stored batch is not the one the manifest describes")


def test_inputs_of_the_wrong_dtype(capsys, goldens):
    def floats(tensors: dict[str, torch.Tensor]) -> None:
        tensors["inputs.labels"] = tensors["inputs.labels"].float()

    (goldens / REL).write_bytes(with_tensors(floats))
    shape = list(codec.decode(SOURCE.read_bytes(), SOURCE).tensors["inputs.labels"].shape)
    assert_refused(capsys, goldens, f"tensor 'inputs.labels' is float32 {shape}, expected int64 {shape} (2-D)")


# --- names and places ----------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["../llama", "llama/../../x", "/etc/passwd", "..", ".hidden"])
@pytest.mark.parametrize("command", ["check", "record"])
def test_names_that_could_escape_are_refused(capsys, goldens, tmp_path, model, command):
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = run_cli(capsys, command, "--goldens", str(goldens), "--hardware-class", CLASS,
                             "--model", model, "--dtype", "float32")
    assert (code, out) == (2, "")
    assert err == (f"veosnap: error: {model!r}: invalid model name (letters, digits, '_', '-', '.'; "
                   "no path separators or '..')\n")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_symlink_out_of_the_goldens_directory_is_not_followed(capsys, goldens, tmp_path):
    outside = tmp_path / "outside.safetensors.zst"
    shutil.copyfile(SOURCE, outside)
    (goldens / REL).unlink()
    (goldens / REL).symlink_to(outside)
    assert_refused(capsys, goldens, f"resolves to {outside.resolve()}, outside the goldens directory {goldens}")


def test_show_a_directory(capsys, goldens):
    code, out, err = run_cli(capsys, "show", str(goldens))
    assert (code, out, err) == (2, "", f"veosnap: error: {goldens}: not a regular file (directory); "
                                       "a golden is a regular file\n")


def test_show_a_missing_file(capsys, tmp_path):
    code, out, err = run_cli(capsys, "show", str(tmp_path / "nope.safetensors.zst"))
    assert (code, out, err) == (2, "", f"veosnap: error: {tmp_path / 'nope.safetensors.zst'}: no such file\n")


def test_show_a_bad_golden(capsys, tmp_path):
    path = tmp_path / "x.safetensors.zst"
    path.write_bytes(SOURCE.read_bytes()[:1000])
    code, out, err = run_cli(capsys, "show", str(path))
    assert (code, out) == (2, "")
    assert err == f"veosnap: error: {path}: truncated: the zstd frame ends early (an interrupted copy or download?)\n"


def test_record_into_a_goldens_path_that_is_a_file(capsys, tmp_path):
    blocker = tmp_path / "goldens"
    blocker.write_text("not a directory")
    code, out, err = run_cli(capsys, "record", "--goldens", str(blocker), "--hardware-class", CLASS,
                             "--model", "llama", "--dtype", "float32")
    assert (code, out) == (2, "")
    assert err.startswith(f"veosnap: error: {blocker / REL}: cannot write (") and err.count("\n") == 1
    assert blocker.read_text() == "not a directory"


def test_ls_lists_goldens_only(capsys, goldens):
    (goldens / REL.parent / f".{REL.name}.abc123.tmp").write_bytes(b"half a golden")
    (goldens / REL.parent / "notes.txt").write_text("hello")
    (goldens / f"{REL}.orig").write_bytes(b"x")
    code, out, err = run_cli(capsys, "ls", "--goldens", str(goldens), "--hardware-class", CLASS, "--format", "json")
    assert (code, err) == (0, "")
    assert [e["path"] for e in json.loads(out)] == [str(goldens / REL)]


# --- backends given on the command line ---------------------------------------------------------

@pytest.mark.parametrize("source, cause", [
    (None, "{file}: backend file not found"),
    ("def other(model):\n    return model\n", "backend '{file}:candidate': {file} has no callable 'candidate'"),
    ("def candidate(model:\n", "{file}: error while importing backend file (SyntaxError: '(' was never closed "
                               "({name}, line 1))"),
    ("raise RuntimeError('no GPU here')\n", "{file}: error while importing backend file (RuntimeError: no GPU here)"),
])
def test_bad_backend_file(capsys, goldens, tmp_path, source, cause):
    file = tmp_path / "my_backend.py"
    if source is not None:
        file.write_text(source)
    code, out, err = run_cli(capsys, "check", "--goldens", str(goldens), "--hardware-class", CLASS,
                             "--model", "llama", "--dtype", "float32", "--backend", f"{file}:candidate")
    assert (code, out) == (2, "")
    assert err == "veosnap: error: " + cause.format(file=file, name=file.name) + "\n"


def test_backend_module_that_fails_on_import(capsys, goldens, tmp_path, monkeypatch):
    (tmp_path / "broken_kernels.py").write_text("raise OSError('libcuda.so not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_cli(capsys, "check", "--goldens", str(goldens), "--hardware-class", CLASS,
                             "--model", "llama", "--dtype", "float32", "--backend", "broken_kernels:apply")
    assert (code, out) == (2, "")
    assert err == ("veosnap: error: backend 'broken_kernels:apply': error while importing broken_kernels "
                   "(OSError: libcuda.so not found)\n")


# --- other inputs of a command ---------------------------------------------------------------

def test_a_config_transformers_refuses_is_one_line(capsys, tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["num_attention_heads"] = 3
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "record", "--goldens", str(tmp_path / "goldens"), "--configs", str(configs),
                             "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32")
    assert (code, out) == (2, "")
    assert err == (f"veosnap: error: {configs / 'llama' / 'config.json'}: transformers cannot build this config "
                   f"(The hidden size ({config['hidden_size']}) is not a multiple of the number of attention heads (3).)\n")
    assert not (tmp_path / "goldens").exists()


def test_unreadable_token_table_is_one_line(capsys, tmp_path):
    testdata = tmp_path / "testdata"
    testdata.mkdir()
    (testdata / "sequences.parquet").write_text("not parquet")
    code, out, err = run_cli(capsys, "record", "--goldens", str(tmp_path / "goldens"), "--testdata", str(testdata),
                             "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32")
    assert (code, out) == (2, "")
    assert err.startswith(f"veosnap: error: {testdata / 'sequences.parquet'}: cannot read the token table (")
    assert err.count("\n") == 1


def test_an_unreadable_directory_is_one_line(capsys, goldens, monkeypatch):
    # Tests may run as root, which reads any directory: simulate what stat() raises for others.
    from veosnap.reference import zoo

    def denied(project, key, background=False):  # noqa: ANN001
        raise PermissionError(13, "Permission denied", str(goldens / CLASS))

    monkeypatch.setattr(zoo, "load_golden", denied)
    code, err = check_llama(capsys, goldens)
    assert (code, err) == (2, f"veosnap: error: {goldens / CLASS}: Permission denied\n")
