"""The real-shape tier: how it is declared and selected, the batches it records on, and the bugs it
exists to catch.

The planted bugs of `tests/realshape_faults.py` each sit on a shape branch the toys never reach. Each
one passes the committed toy goldens (at toy shapes it is the reference, bit for bit) and fails a
golden whose batch reaches its branch, naming the tensor at fault. The goldens here are recorded in
the test from "narrow" variants: toy widths (hidden 64, so each records in seconds), real everything
else that these bugs depend on (sequences of 600 and 2049 tokens, 26 packed sequences in a row, a
vocabulary of 40000, 128 experts top-8 with experts left without tokens), using the real tier's own
batches (`batch` in `veosnap.json`, sequences from `testdata/realshape.parquet`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import realshape_faults
from golden_repo import CLASS, built_once, eager_figures, figures

from veosnap.candidates import backends
from veosnap.candidates.layouts.packed import pack
from veosnap.errors import VeosnapError
from veosnap.golden.key import GoldenKey
from veosnap.reference import inputs
from veosnap.reference.zoo import Project, list_models, load_config
from veosnap.runs.check import check
from veosnap.runs.record import golden_batch, record
from veosnap.runs.verdict import CheckReport

ROOT = Path(__file__).resolve().parent.parent
FAULTS_FILE = Path(__file__).with_name("realshape_faults.py")
REAL = ["deepseek_v3-real", "gpt_oss-real", "llama-real", "mixtral-real", "qwen2-real", "qwen3-real",
        "qwen3_moe-real", "qwen3_moe-real-small"]
TOYS = ["deepseek_v3", "deepseek_v4", "gpt_oss", "gpt_oss_aux", "llama", "mixtral", "mixtral_aux", "qwen2", "qwen2_5_omni",
        "qwen2_5_vl", "qwen2_vl", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_moe_aux", "qwen3_omni_moe",
        "qwen3_vl", "qwen3_vl_moe", "seed_oss"]  # issue 15's ten models are toys too


# --- the tier ------------------------------------------------------------------------------------

def test_the_toys_are_the_default_and_the_real_tier_is_declared_beside_the_config(repo_project):
    assert repo_project.models() == TOYS
    assert repo_project.models("real") == REAL
    assert list_models(repo_project.configs, "all") == sorted(TOYS + REAL)
    for name in REAL:
        toy = load_config(repo_project.configs, name)
        assert toy.tier == "real" and (toy.path.parent / "README.md").is_file()
        assert "veosnap" not in json.dumps(toy.config)  # the HF config stays a pure transformers config


def test_a_bad_sidecar_is_one_line_naming_the_file(tmp_path):
    shutil.copytree(ROOT / "toy_configs" / "llama", tmp_path / "llama")
    sidecar = tmp_path / "llama" / "veosnap.json"
    for text, cause in [('{"tier": "huge"}', "tier 'huge' is not one of toy, real"),
                        ('{"tier": "real", "colour": 1}', "unknown field 'colour'"),
                        ('{"batch": {"source": "../x.parquet", "rows": [[0]]}}', "must name a file in the test data"),
                        ('{"batch": {"source": "x.parquet", "rows": []}}', "non-empty list"),
                        ("{", "not valid JSON")]:
        sidecar.write_text(text)
        with pytest.raises(VeosnapError, match=cause) as info:
            load_config(tmp_path, "llama")
        assert str(sidecar) in str(info.value)


def test_cli_tier_selection(tmp_path):
    def veosnap(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "veosnap", *args], capture_output=True, text=True, cwd=ROOT)

    wrong = veosnap("check", "--tier", "real", "--model", "llama")
    assert wrong.returncode == 2 and "--model and --tier" in wrong.stderr
    # The real tier is recorded for the step scenario only, on every class: a train check says there is no golden,
    # naming the real-tier model (reached by --model).
    missing = veosnap("check", "--model", "gpt_oss-real", "--scenario", "train")
    assert missing.returncode == 2 and f"no golden for gpt_oss-real (train scenario) on {CLASS}" in missing.stderr, \
        missing.stderr


def test_the_plugin_matrix_takes_a_tier(tmp_path):
    (tmp_path / "test_zoo.py").write_text(
        "from veosnap.surfaces.pytest_plugin import matrix\n\n"
        "@matrix(dtypes=['float32'])\ndef test_toy(model, dtype):\n    pass\n\n"
        "@matrix(dtypes=['float32'], tier='real')\ndef test_real(model, dtype):\n    pass\n")
    from test_pytest_plugin import pytest_in

    run = pytest_in(tmp_path, "--collect-only", f"--veosnap-configs={ROOT / 'toy_configs'}")
    collected = {line.split("::")[1] for line in run.output.splitlines() if "::" in line}
    assert collected == {f"test_toy[{m}-float32]" for m in TOYS} | {f"test_real[{m}-float32]" for m in REAL}, run.output


# --- the batches ---------------------------------------------------------------------------------

def test_derived_sequences_are_deterministic_and_spread_over_the_vocabulary():
    first = inputs.derive_tokens(4096, 7, 151936)
    assert first == inputs.derive_tokens(4096, 7, 151936)
    assert min(first) >= inputs.FIRST_TOKEN and max(first) > 140000 and sum(t >= 32768 for t in first) > 3000
    pooled = inputs.derive_tokens(600, 7, 151936, distinct=12)
    assert len(set(pooled)) == 12 and max(pooled) == 151935


def test_the_testdata_script_reproduces_the_committed_table(tmp_path):
    out = tmp_path / "realshape.parquet"
    script = ROOT / "tools" / "data" / "make_realshape_testdata.py"
    subprocess.run([sys.executable, str(script), "--out", str(out)], check=True,
                   capture_output=True)
    assert pq.read_table(out).to_pydict() == pq.read_table(ROOT / "testdata" / "realshape.parquet").to_pydict()


def test_the_cpu_real_batches_reach_the_kernel_branches(repo_project):
    batch = golden_batch(repo_project, load_config(repo_project.configs, "qwen3-real"))
    assert tuple(batch.input_ids.shape) == (2, 600) and bool(batch.attention_mask.all())  # packed rows: no padding
    sequences = inputs.sequences_of(batch)
    assert len(sequences) == 27 and max(map(len, sequences)) == 600 and min(map(len, sequences)) == 1
    assert int(batch.labels.max()) >= 32768
    # The packed layout splits the packed row at its sequences, not at its rows.
    shard = pack(batch)
    assert (shard.batch.position_ids == 0).sum() == 27 and shard.batch.predictions == batch.predictions
    moe = golden_batch(repo_project, load_config(repo_project.configs, "qwen3_moe-real-small"))
    assert moe.input_ids.shape[-1] == 600 and moe.input_ids.unique().numel() == 12


def test_packed_rows_must_not_be_padded(tmp_path, repo_project):
    shutil.copytree(ROOT / "toy_configs" / "llama", tmp_path / "llama")
    (tmp_path / "llama" / "veosnap.json").write_text(json.dumps(
        {"batch": {"source": "realshape.parquet", "rows": [[13], [10, 11]]}}))  # 17 tokens beside 129 + 1
    project = Project(goldens=tmp_path / "g", configs=tmp_path, testdata=repo_project.testdata, hardware_class=CLASS)
    with pytest.raises(VeosnapError, match="same number of tokens"):
        golden_batch(project, load_config(tmp_path, "llama"))


# --- planted real-shape bugs: invisible at toy shapes, caught at real ones -------------------------

NARROW = {
    # llama at toy width, one sequence of 2049 tokens: a partial key block, a position past 2048.
    "narrow-long": ("llama", {"vocab_size": 512, "max_position_embeddings": 8192},
                    {"source": "realshape.parquet", "rows": [[2]]}),
    # llama at toy width, a vocabulary past int16, a 600-token row beside 26 packed sequences.
    "narrow-packed": ("llama", {"vocab_size": 40000, "max_position_embeddings": 8192},
                      {"source": "realshape.parquet", "rows": [[1], list(range(10, 36))]}),
    # Qwen3-MoE at a narrow width with the real router: 128 experts top-8, tokens from 12 ids.
    "narrow-moe": ("qwen3_moe", {"hidden_size": 256, "num_experts": 128, "num_experts_per_tok": 8,
                                 "vocab_size": 512, "max_position_embeddings": 8192},
                   {"source": "realshape.parquet", "rows": [[1]], "distinct": 12}),
}
# fault -> (narrow model whose batch reaches its branch, toy model it must pass)
CASES = {
    "tail_key_block_dropped": ("narrow-long", "llama"),
    "rope_low_precision_far": ("narrow-long", "llama"),
    "loss_int16_vocab": ("narrow-packed", "llama"),
    "varlen_boundary_late": ("narrow-packed", "llama"),
    "empty_expert_shifts_groups": ("narrow-moe", "qwen3_moe"),
}


def narrow_project(root: Path) -> Project:
    return Project(goldens=root / "goldens", configs=root / "configs", testdata=ROOT / "testdata", hardware_class=CLASS)


def record_narrow(root: Path) -> None:
    """The narrow variants' configs under `root`, and their float32 goldens recorded here."""
    for name, (toy, changes, batch) in NARROW.items():
        (root / "configs" / name).mkdir(parents=True)
        config = json.loads((ROOT / "toy_configs" / toy / "config.json").read_text())
        config.update(changes)
        (root / "configs" / name / "config.json").write_text(json.dumps(config))
        (root / "configs" / name / "veosnap.json").write_text(json.dumps({"tier": "real", "batch": batch}))
    for name in NARROW:
        record(narrow_project(root), name, "float32")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory) -> Project:
    """A project of narrow real-shape variants with their float32 goldens, recorded here: once per run, under
    xdist too (`built_once`; the tests only check against it)."""
    return narrow_project(built_once(tmp_path_factory, "narrow", record_narrow))


def run(project: Project, model: str, fault: str, layout: str | None = None) -> CheckReport:
    backend = backends.resolve(f"{FAULTS_FILE}:{fault}")
    key = GoldenKey(CLASS, model, "step", "float32")
    if layout is None:
        report = check(project, key, backend)
    else:
        from veosnap.runs.check import check_layouts

        (report,) = check_layouts(project, key, backend, [layout])
    assert not report.error, report.error
    return report


def failing(report: CheckReport) -> set[str]:
    return {t.name for t in report.tensors if not t.passed}


@pytest.mark.heavy
@pytest.mark.parametrize("fault", sorted(CASES))
def test_a_real_shape_bug_passes_the_toy_golden_and_fails_the_real_shape_one(fault, narrow, repo_project):
    model, toy = CASES[fault]
    named, _reach = realshape_faults.FAULTS[fault]

    at_toy = run(repo_project, toy, fault)
    # Invisible at toy shapes: the reference's own bits there, every tensor's figures the eager backend's
    # on this machine (all 0 on the machine that recorded the toy golden).
    assert at_toy.passed, (at_toy.worst.name, at_toy.worst.ratio)
    assert figures(at_toy) == eager_figures(repo_project, toy)

    at_real = run(narrow, model, fault)
    assert not at_real.passed
    bad = failing(at_real)
    if named == "moe":
        assert at_real.routes_passed, "routes come from the router, before the experts"
        assert "layers.0.output" in bad and any(".experts." in n for n in bad), sorted(bad)
    else:
        assert named in bad, sorted(bad)


@pytest.mark.heavy
def test_the_int16_loss_bug_is_named_in_the_loss_not_the_logits(narrow):
    report = run(narrow, "narrow-packed", "loss_int16_vocab")
    assert {"loss", "grad.lm_head.weight"} <= failing(report) and "logits" not in failing(report)


@pytest.mark.heavy
def test_the_late_varlen_boundary_shows_on_a_sequence_after_the_16th(narrow):
    report = run(narrow, "narrow-packed", "varlen_boundary_late")
    layer0 = next(t for t in report.tensors if t.name == "layers.0.output")
    assert layer0.where.startswith("row 1 "), layer0.where  # row 1 holds the packed sequences
    # and the toy batch packed into one row (4 sequences) does not reach it
    assert run(Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                               hardware_class=CLASS), "llama", "varlen_boundary_late", layout="packed").passed


@pytest.mark.heavy
def test_the_narrow_moe_golden_has_experts_without_tokens(narrow):
    from veosnap.golden import store

    gold = store.read(store.path_for(narrow.goldens, GoldenKey(CLASS, "narrow-moe", "step", "float32")), narrow.goldens)
    for layer in (0, 1):
        used = gold.tensors[f"routes.{layer}.experts"].unique().numel()
        assert used <= 12 * 8 < 128, used


# --- the committed cpu real-shape goldens ---------------------------------------------------------

# One planted bug per committed golden, each a branch only the real tier's batch reaches (ids past 32767 need
# the real vocabulary; an expert without tokens, 128 experts): every fault is caught at narrow real shapes above,
# and test_the_cpu_real_batches_reach_the_kernel_branches shows these batches reach every branch; a real-shape
# check costs 45-70 s on a 2-core CPU.
CPU_REAL = {"qwen3-real": ["loss_int16_vocab"], "qwen3_moe-real-small": ["empty_expert_shifts_groups"]}


@pytest.mark.heavy
@pytest.mark.parametrize("model", sorted(CPU_REAL))
def test_the_cpu_real_shape_golden_passes_the_reference_and_catches_its_planted_bugs(model, repo_project):
    golden = repo_project.goldens / CLASS / model / "step-float32.safetensors.zst"
    if not golden.is_file():
        pytest.skip(f"{golden} not recorded (veosnap record --model {model} --dtype float32)")
    (reference,) = check_layouts_single(repo_project, model, "eager")
    assert reference.passed and reference.worst.ratio < 0.5, (reference.worst.name, reference.worst.ratio)
    for fault in CPU_REAL[model]:
        named, _reach = realshape_faults.FAULTS[fault]
        report = run(repo_project, model, fault)
        assert not report.passed, fault
        bad = failing(report)
        assert (any(".experts." in n for n in bad) and "layers.0.output" in bad) if named == "moe" else named in bad, \
            (fault, sorted(bad))


def check_layouts_single(project: Project, model: str, spec: str) -> list[CheckReport]:
    from veosnap.runs.check import check_layouts

    return check_layouts(project, GoldenKey(CLASS, model, "step", "float32"), backends.resolve(spec), ["single"])


def test_the_fragility_check_leaves_out_batched_mm_where_its_copies_of_the_experts_are_too_large(repo_project):
    """batched_mm copies each chosen expert's weights per token: tens of MB at toy shapes, tens of GB at
    real ones (the 20 GB peak of a cpu real-shape refresh), so the recorder judges with it at toy shapes only."""
    from veosnap.reference import limits
    from veosnap.runs.record import BATCHED_MM_JUDGE_LIMIT

    def gathered(model: str) -> int:
        toy = load_config(repo_project.configs, model)
        batch = golden_batch(repo_project, toy)
        return limits.batched_mm_bytes(toy, batch.rows * batch.width, torch.float32)

    assert gathered("qwen3") == gathered("qwen3-real") == 0  # dense: nothing to gather
    assert 0 < gathered("qwen3_moe") < 2**26 < BATCHED_MM_JUDGE_LIMIT  # 24 MiB
    # 600 tokens x top-8 x (3 x 1024 x 128) values x 4 bytes x 2 (the copies and their gradient) x 2 layers
    assert gathered("qwen3_moe-real-small") == 600 * 8 * 3 * 1024 * 128 * 4 * 2 * 2 > BATCHED_MM_JUDGE_LIMIT


def test_the_recorder_judges_with_batched_mm_at_toy_shapes_only(repo_project):
    from golden_repo import golden_path

    from veosnap.golden import store
    from veosnap.runs.record import batched_mm_too_large

    toy, real = golden_path("qwen3_moe"), golden_path("qwen3_moe-real-small")
    if not toy.is_file():
        pytest.skip(f"no committed {CLASS} qwen3_moe golden")
    assert not batched_mm_too_large(repo_project, store.read(toy))
    if real.is_file():  # the cpu real tier has it; the H200's until its goldens are recorded does not
        assert batched_mm_too_large(repo_project, store.read(real))
