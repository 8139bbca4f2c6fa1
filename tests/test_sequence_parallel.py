"""Sequence and context parallel layouts checked against the single-process golden, and the uneven work
every parallel layout must take (positions, rows, parameters and tokens that do not divide by the
number of ranks).

Every multi-process check is a real torchrun (gloo on the CPU, NCCL on CUDA, one GPU per rank: they
skip, saying so, where fewer GPUs are visible); each fixture below is one torchrun shared by its tests.
Those marked `heavy` (3 and 4 processes, the train scenario, bfloat16) take 15-30 s each:
`pytest -m "not heavy"` leaves them out of a quick local run; CI runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from golden_repo import CLASS, committed_golden, gpus_for

from veosnap.candidates import backends
from veosnap.candidates.layouts import sequence
from veosnap.candidates.layouts.packed import pack
from veosnap.candidates.layouts.protocol import Shard
from veosnap.golden.key import GoldenKey
from veosnap.reference.inputs import IGNORE_INDEX, load_sequences, padded
from veosnap.reference.zoo import Project
from veosnap.runs.check import check_layouts

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAULTS = HERE / "layout_faults.py"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def project() -> Project:
    return Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                           hardware_class=CLASS)


def by_layout(reports: list) -> dict:
    return {r.layout.split(":")[-1]: r for r in reports}


def failing(report) -> set[str]:  # noqa: ANN001
    return {t.name for t in report.tensors if not t.passed}


def tensor(report, name: str):  # noqa: ANN001, ANN201
    return next(t for t in report.tensors if t.name == name)


# --- slicing a batch along positions (no processes) ------------------------------------------------


@pytest.fixture(scope="module")
def golden_batch():  # noqa: ANN201
    return padded(load_sequences(ROOT / "testdata"))  # the golden's batch: 4 left-padded rows of 32


def slices(batch, world: int) -> list[sequence.SequenceSlice]:  # noqa: ANN001
    whole = Shard.whole(batch)
    return [sequence.slice_positions(whole.batch, whole.positions, world, rank) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_slices_cover_every_golden_position_once_and_pad_the_rest(golden_batch, world: int) -> None:  # noqa: ANN001
    pieces = slices(golden_batch, world)
    positions = torch.cat([p.positions for p in pieces])
    real = positions[positions >= 0]
    assert sorted(real.tolist()) == list(range(golden_batch.rows * golden_batch.width))
    width = sequence.padded_width(golden_batch.width, world)  # 32 over 3 ranks: 33, one pad slot per row
    assert int((positions < 0).sum()) == golden_batch.rows * (width - golden_batch.width)
    assert {p.batch.width for p in pieces} == {width // world}


def test_a_slices_last_position_predicts_the_next_slices_first_token(golden_batch) -> None:  # noqa: ANN001
    first, second = slices(golden_batch, 2)
    # Labels are shifted once for the whole row: rank 0's last position (15) predicts the token at 16.
    assert torch.equal(first.batch.extra["shift_labels"][:, -1], golden_batch.labels[:, 16])
    assert (second.batch.extra["shift_labels"][:, -1] == IGNORE_INDEX).all()  # the row's last predicts nothing


def test_every_rank_divides_by_the_whole_batchs_prediction_count(golden_batch) -> None:  # noqa: ANN001
    pieces = slices(golden_batch, 2)
    assert [int(p.batch.extra["num_items_in_batch"]) for p in pieces] == [golden_batch.predictions] * 2 == [82, 82]
    local = [int((p.batch.extra["shift_labels"] != IGNORE_INDEX).sum()) for p in pieces]
    assert sum(local) == 82 and local == [30, 52]  # left padding leaves rank 0 fewer predictions


def test_a_packed_rows_pad_slots_are_a_sequence_of_their_own(golden_batch) -> None:  # noqa: ANN001
    whole = pack(golden_batch)  # 86 tokens in one row
    pieces = [sequence.slice_positions(whole.batch, whole.positions, 4, rank) for rank in range(4)]
    last = pieces[-1]
    assert last.batch.width == 22 and last.positions.tolist()[-2:] == [-1, -1]  # 88 slots, 2 of them padding
    assert last.batch.extra[sequence.SEQUENCE_POSITIONS][0, -3:].tolist() == [7, 0, 1]  # positions restart
    assert sequence.SEQUENCE_MASK not in last.batch.extra  # no padding mask: packed sequences stay detectable


# --- planted sequence-parallel bugs and uneven expert-parallel tokens (one torchrun, 2 processes) ----


@pytest.fixture(scope="module")
def planted(project: Project) -> dict:
    specs = [f"{FAULTS}:{name}" for name in
             ("sp_heads_reversed", "sp_grads_unreduced", "sp_local_loss", "sp_boundary_off_by_one")]
    specs.append(f"{HERE / 'uneven_layouts.py'}:ep_packed_rows")
    reports = check_layouts(project, GoldenKey(CLASS, "qwen3_moe", "step", "float32"), backends.resolve("eager"),
                            specs, nproc=2, timeout_s=TIMEOUT_S)
    return by_layout(reports)


@gpus_for(2)
@pytest.mark.heavy
def test_heads_resharded_in_the_wrong_order_fail_from_the_first_layer(planted: dict) -> None:
    report = planted["sp_heads_reversed"]
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 0 ")
    assert "reversed heads" in report.notes[0]  # given through the exchange hook


@gpus_for(2)
def test_a_replicated_weights_gradient_not_reduced_fails_on_the_gradients_only(planted: dict) -> None:
    report = planted["sp_grads_unreduced"]
    assert report.status == "FAIL" and report.first_divergence is None
    assert failing(report) and all(name.startswith("grad.") for name in failing(report))
    assert report.first_gradient_divergence.startswith("lm_head ")


@gpus_for(2)
def test_a_loss_divided_by_the_local_count_fails_on_the_loss(planted: dict) -> None:
    report = planted["sp_local_loss"]
    assert report.status == "FAIL"
    assert "loss" in failing(report)
    assert tensor(report, "logits").passed and tensor(report, "layers.1.output").passed  # the forward is right


@gpus_for(2)
def test_a_shard_boundary_off_by_one_fails_at_that_sequences_positions(planted: dict) -> None:
    report = planted["sp_boundary_off_by_one"]
    assert report.status == "FAIL"
    assert report.first_divergence.startswith("layer 0 ")
    logits = tensor(report, "logits")
    assert logits.where.startswith("row 0 pos ") and int(logits.where.split()[3]) >= 16  # the last rank's half
    assert (logits.rows_over, logits.rows) == (16, 86)  # row 0's 16 tokens there, nothing else


@gpus_for(2)
def test_expert_parallel_ranks_with_uneven_token_counts_pass(planted: dict) -> None:
    report = planted["ep_packed_rows"]
    assert report.passed and report.routes and all(r.clear_flips == 0 for r in report.routes)


# --- the exchange hook ----------------------------------------------------------------------------


@gpus_for(2)
@pytest.mark.heavy
def test_a_frameworks_own_exchange_is_used_through_the_hook(project: Project) -> None:
    backend = backends.resolve(f"{HERE / 'sequence_backends.py'}:list_exchange")
    reports = check_layouts(project, GoldenKey(CLASS, "llama", "step", "float32"), backend, ["sp", "sp_packed"],
                            nproc=2, timeout_s=TIMEOUT_S)
    for report in reports:
        assert report.passed, (report.layout, report.error, report.worst)
        assert "list all-to-all, VeOmni's shape" in report.notes[0]


@gpus_for(2)
@pytest.mark.heavy
def test_torch_and_veosnap_gather_a_strided_shard_alike() -> None:
    # The tp gradient gather for transformers' fused gate/up experts (torch 2.11 cannot; see probes.full).
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"veosnap-strided-{os.getpid()}"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tools" / "gpu" / "gpu_parallel.py"), "--repro", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # a hang, not a slow machine
    assert done.returncode == 0, done.stderr[-4000:]  # what the ranks said (one CI run saw exit 1 once)
    result = json.loads((out / "strided.json").read_text())
    (out / "strided.json").unlink()
    out.rmdir()
    assert result["veosnap gather"] == "ok"
    if torch.__version__ >= "2.12":
        assert result["torch full_tensor()"] == "ok"


# --- uneven work and more processes (heavy) --------------------------------------------------------


@pytest.mark.heavy
@gpus_for(3)
def test_three_ranks_take_positions_rows_and_parameters_that_do_not_divide(project: Project) -> None:
    # 32 positions and 86 packed tokens over 3 ranks (padded to 33 and 87), 4 rows over 3 ranks (2, 1, 1),
    # and hidden 64, vocab 256 parameters FSDP-sharded 3 ways; Ulysses cannot split 4 heads 3 ways.
    reports = by_layout(check_layouts(project, GoldenKey(CLASS, "llama", "step", "float32"), backends.resolve("eager"),
                                      ["cp", "cp_packed", "fsdp2", "ddp", "sp"], nproc=3, timeout_s=TIMEOUT_S))
    for name in ("cp", "cp_packed", "fsdp2", "ddp"):
        assert reports[name].passed, (name, reports[name].error, reports[name].worst)
    assert reports["sp"].status == "skip" and "3 ranks do not divide llama's 4 attention heads" in reports["sp"].skipped


@pytest.mark.heavy
@gpus_for(4)
def test_four_ranks_repeat_key_value_heads_and_pad_the_packed_row(project: Project) -> None:
    reports = by_layout(check_layouts(project, GoldenKey(CLASS, "qwen3_moe", "step", "float32"),
                                      backends.resolve("eager"), ["sp", "sp_packed", "sp_fsdp2", "sp_ep", "cp_packed"],
                                      nproc=4, timeout_s=TIMEOUT_S))
    for name, report in reports.items():
        assert report.passed, (name, report.error, report.worst)
    assert "key/value heads repeated x2" in reports["sp"].notes[0]  # 2 key/value heads over 4 ranks


@pytest.mark.heavy
@gpus_for(2)
def test_a_bfloat16_model_with_a_float32_router_is_sharded_and_sequence_parallel(project: Project) -> None:
    # DeepSeek-V3's router stays float32 in a bfloat16 model (as transformers builds it): fully_shard
    # refuses mixed dtypes in one group, so it gets its own.
    reports = by_layout(check_layouts(project, GoldenKey(CLASS, "deepseek_v3", "step", "bfloat16"),
                                      backends.resolve("eager"), ["fsdp2", "hsdp", "sp", "sp_fsdp2", "sp_ep", "cp"],
                                      nproc=2, timeout_s=TIMEOUT_S))
    for name, report in reports.items():
        assert report.passed, (name, report.error, report.worst)


@pytest.mark.heavy
@gpus_for(2)
def test_sequence_parallel_layouts_train(project: Project) -> None:
    committed_golden("llama", "float32", "train")
    reports = by_layout(check_layouts(project, GoldenKey(CLASS, "llama", "train", "float32"), backends.resolve("eager"),
                                      ["sp", "sp_fsdp2", "cp_packed", "sp_ep"], nproc=2, timeout_s=TIMEOUT_S))
    for name in ("sp", "sp_fsdp2", "cp_packed"):
        assert reports[name].passed, (name, reports[name].error, reports[name].worst)
        assert any(t.name.startswith("update.") for t in reports[name].tensors)
    assert reports["sp_ep"].status == "skip"
