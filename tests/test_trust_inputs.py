"""Bad test data and configs are refused up front, with one line naming the file (issue 12, item 10).

Token ids outside [0, vocab), negative or non-integer ids, empty sequences, sequences longer than the
config's max_position_embeddings or veosnap's cap, and configs whose size is absurd are refused before
anything is allocated; the limits live in `veosnap/reference/limits.py` and docs/errors.md.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from golden_repo import CLASS, REPO

from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.surfaces.cli import main

LLAMA = GoldenKey(CLASS, "llama", "step", "float32")


def data_with(tmp_path: Path, tokens: list, pa_type: pa.DataType = pa.int32()) -> Path:
    """The test data with sequence 2 (one of the golden's batch) replaced by `tokens`."""
    table = pq.read_table(REPO / "testdata" / "sequences.parquet").to_pydict()
    table["tokens"][2] = tokens
    table["length"][2] = len(tokens)
    schema = pa.schema([("id", pa.int32()), ("length", pa.int32()), ("tokens", pa.list_(pa_type))])
    out = tmp_path / "testdata"
    out.mkdir()
    pq.write_table(pa.Table.from_pydict(table, schema=schema), out / "sequences.parquet")
    return out


def record(capsys, tmp_path: Path, *extra: str) -> tuple[int, str, str]:  # noqa: ANN001
    code = main(["record", "--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "llama",
                 "--dtype", "float32", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("tokens, pa_type, cause", [
    ([5, 300, 7], pa.int32(), "sequence 2 holds token id 300 at position 1, outside the vocabulary [0, 256) of"),
    ([5, -1, 7], pa.int32(), "sequence 2 holds token id -1 at position 1, outside the vocabulary [0, 256) of"),
    # a float column: every sequence is read as floats, the first one is named
    ([5.0, 1.5, 7.0], pa.float64(), "sequence 0 holds 58.0 at position 0, not an integer token id"),
    ([], pa.int32(), "sequence 2 is empty"),
    ([5] * 600, pa.int32(), "sequence 2 has 600 tokens, over max_position_embeddings 512 of"),
])
def test_item10_bad_test_data_is_refused_in_one_line_naming_the_file(capsys, tmp_path, tokens, pa_type, cause):
    testdata = data_with(tmp_path, tokens, pa_type)
    code, out, err = record(capsys, tmp_path, "--testdata", str(testdata))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"veosnap: error: {testdata / 'sequences.parquet'}: {cause}"), err
    assert not (tmp_path / "goldens").exists()


def test_item10_a_sequence_over_veosnaps_cap_is_refused_whatever_the_config_allows(capsys, tmp_path):
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["max_position_embeddings"] = 10**6
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    testdata = data_with(tmp_path, [5] * 20_000)
    code, _, err = record(capsys, tmp_path, "--testdata", str(testdata), "--configs", str(configs))
    assert code == 2
    from veosnap.reference import limits

    assert err == (f"veosnap: error: {testdata / 'sequences.parquet'}: sequence 2 has 20000 tokens, over veosnap's "
                   f"cap of {limits.MAX_SEQUENCE_TOKENS} (veosnap/reference/limits.py)\n")


@pytest.mark.parametrize("field, value, cause", [
    ("num_hidden_layers", 10_000_000, "num_hidden_layers 10000000 is over veosnap's limit of {MAX_LAYERS}"),
    ("num_hidden_layers", 0, "num_hidden_layers 0 is not a positive integer"),
    ("vocab_size", 10**9, "about 1.28e+11 parameters, over veosnap's limit of"),
    ("intermediate_size", 10**8, "GiB to record (parameters, gradients, their float64 twins and activations)"),
])
def test_item10_absurd_configs_are_refused_before_anything_is_allocated(capsys, tmp_path, field, value, cause):
    from veosnap.reference import limits

    cause = cause.format(MAX_LAYERS=limits.MAX_LAYERS)
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config[field] = value
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    tracemalloc.start()
    try:
        code, out, err = record(capsys, tmp_path, "--configs", str(configs))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"veosnap: error: {configs / 'llama' / 'config.json'}: ") and cause in err, err
    assert peak < 256 << 20


def test_item10_a_golden_whose_inputs_leave_the_vocabulary_is_refused_before_the_candidate_runs(capsys, tmp_path):
    g = store.read(REPO / "goldens" / LLAMA.relpath)
    ids = g.tensors["inputs.input_ids"].clone()
    ids[1, -1] = 300
    g.tensors["inputs.input_ids"] = ids
    g.manifest.inputs_hash = codec.tensors_hash(g.input_tensors())
    path = tmp_path / "goldens" / LLAMA.relpath
    store.write(g, path)
    code = main(["check", "--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "llama",
                 "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == (f"veosnap: error: {path}: inputs.input_ids holds token id 300 at row 1 position "
                   f"{ids.shape[1] - 1}, outside the vocabulary [0, 256) of its config\n")
    assert torch.equal(store.read(path).tensors["inputs.input_ids"], ids)  # nothing lost
