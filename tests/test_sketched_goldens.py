"""Goldens of bounded size: sketched goldens recorded, read, checked, diffed and shown like whole ones.

Read top to bottom as usage: the toy zoo stays whole and byte-identical; `--sketch always` stores every
sketchable tensor as a sketch (schema 2) and loses no power (every planted bug the exact check catches
is still caught, no legitimate backend or layout fails); `--sketch auto` sketches a model too large for
the target and `never` refuses it with the limit; reports say when a figure is an estimate; a corrupt
sketch is refused in one line; limits agree between record and check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faults
import pytest
import torch
import zstandard
from golden_repo import alike_everywhere, built_once, skip_on_other_versions, skip_unless_reproduced

from veosnap.candidates import backends
from veosnap.errors import GoldenError, VeosnapError
from veosnap.golden import codec, limits, store
from veosnap.golden.key import GoldenKey
from veosnap.numerics.sketch import rowsketch, rowsketch_at
from veosnap.reference import hardware
from veosnap.reference.zoo import Project
from veosnap.render import html as render_html
from veosnap.render import json as render_json
from veosnap.render import markdown as render_markdown
from veosnap.render import text as render_text
from veosnap.runs.check import check, check_layouts
from veosnap.runs.diff import DirTree, diff_goldens, diff_trees
from veosnap.runs.record import record
from veosnap.surfaces.cli import main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FAULTS_FILE = HERE / "faults.py"
MODELS = ("llama", "qwen3_moe", "deepseek_v3")  # dense GQA; MoE with routes; MLA, sigmoid routing, a float32 router
DTYPES = ("float32", "bfloat16")
LEGIT = ("sdpa", "grouped_mm", "batched_mm")
CANDIDATES = (*LEGIT, *(f"{FAULTS_FILE}:{name}" for name in (*faults.FAULTS, *faults.PRECISION_FAULTS)))
CLASS = hardware.detect()


def project_at(goldens: Path, configs: Path = ROOT / "toy_configs") -> Project:
    return Project.resolve(goldens=goldens, configs=configs, testdata=ROOT / "testdata", hardware_class=CLASS)


def record_twins(root: Path) -> None:
    for mode in ("never", "always"):
        for model in MODELS:
            for dtype in DTYPES:
                record(project_at(root / mode), model, dtype, sketch=mode)


@pytest.fixture(scope="session")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Project]:
    """The same goldens recorded twice on this machine: every tensor whole, and every sketchable one sketched.
    Recorded once per run, under xdist too (`built_once`; the tests only read and check them)."""
    root = built_once(tmp_path_factory, "twins", record_twins)
    return {mode: project_at(root / mode) for mode in ("never", "always")}


def key(model: str, dtype: str = "float32") -> GoldenKey:
    return GoldenKey(CLASS, model, "step", dtype)


def read(project: Project, model: str, dtype: str = "float32") -> codec.Golden:
    return store.read(store.path_for(project.goldens, key(model, dtype)))


def layer_of(report) -> str | None:  # noqa: ANN001
    return report.first_divergence and report.first_divergence.split(" (")[0]


# --- the format -------------------------------------------------------------------------------------------


@pytest.mark.heavy
def test_sketch_always_stores_every_sketchable_tensor_as_a_sketch_in_schema_2(twins):
    whole, sketched = read(twins["never"], "qwen3_moe"), read(twins["always"], "qwen3_moe")
    assert whole.manifest.schema_version == 1 and whole.manifest.sketch is None and not whole.sketches
    m = sketched.manifest
    assert m.schema_version == 2 and m.sketch.mode == "always"
    assert set(sketched.sketches) == set(m.sketch.tensors) == {n for n in m.tolerance
                                                               if n.startswith(("grad.", "layers.")) or n == "logits"}
    assert {"loss", "routes.0.weights", "routes.0.experts", "inputs.input_ids"} <= set(sketched.tensors)
    embed = sketched.sketches["grad.model.embed_tokens.weight"]
    assert embed.support is not None and embed.spec.support == embed.support.numel() < embed.spec.rows  # batch tokens
    assert set(m.tolerance) == set(whole.manifest.tolerance)
    # The file stays a zstd frame around plain safetensors: any reader sees N#sketch, N#norms, N#support.
    stored = sketched.stored_tensors()
    assert "logits" not in stored and {"logits#sketch", "logits#norms"} <= set(stored)
    assert codec.encode(codec.decode(codec.encode(sketched), "x")) == codec.encode(sketched)


def test_the_toy_zoo_stays_whole_and_byte_identical_under_auto(tmp_path):
    skip_on_other_versions()
    fresh = project_at(tmp_path / "fresh")
    for model in ("llama", "qwen3_moe"):
        golden = store.read(record(fresh, model, "float32").path)  # auto
        assert golden.manifest.schema_version == 1 and golden.manifest.sketch is None and not golden.sketches
        committed = ROOT / "goldens" / CLASS / model / "step-float32.safetensors.zst"
        if committed.is_file():  # on any machine, the committed golden's tensors and manifest but for the figures
            assert alike_everywhere(golden) == alike_everywhere(store.read(committed))

    skip_unless_reproduced()  # the bytes themselves: where this machine computes the committed ones
    scratch = project_at(tmp_path / "goldens")
    for model in ("llama", "qwen3_moe"):
        committed = ROOT / "goldens" / CLASS / model / "step-float32.safetensors.zst"
        if committed.is_file():  # this class's, recorded over a copy, as `veosnap record` over the committed
            # goldens: a refreshed golden's approval trail is kept, and its bytes must come out the same
            copy = store.path_for(scratch.goldens, GoldenKey(CLASS, model, "step", "float32"))
            copy.parent.mkdir(parents=True)
            copy.write_bytes(committed.read_bytes())
            outcome = record(scratch, model, "float32")  # auto
            assert not outcome.written and outcome.path.read_bytes() == committed.read_bytes()


def test_a_golden_too_large_for_the_target_is_sketched_by_auto_and_refused_by_never(tmp_path, capsys):
    """A llama at hidden 256 and vocabulary 32000: 91 MB whole, over the 64 MiB hard limit."""
    configs = tmp_path / "toy_configs"
    shutil.copytree(ROOT / "toy_configs" / "llama", configs / "llama_wide")
    config = json.loads((configs / "llama_wide" / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=32000)
    (configs / "llama_wide" / "config.json").write_text(json.dumps(config))
    goldens = tmp_path / "goldens"
    argv = ["record", "--goldens", str(goldens), "--configs", str(configs), "--testdata", str(ROOT / "testdata"),
            "--hardware-class", CLASS, "--model", "llama_wide", "--dtype", "float32"]
    assert main([*argv, "--sketch", "never"]) == 2
    err = capsys.readouterr().err
    assert f"over the {limits.HARD_LIMIT} byte limit" in err and "use --sketch auto" in err
    assert not goldens.exists() or not any(goldens.rglob("*.zst"))  # nothing written
    assert main(argv) == 0
    capsys.readouterr()
    project = project_at(goldens, configs)
    g = store.read(store.path_for(goldens, key("llama_wide")))
    assert g.manifest.sketch.mode == "auto" and g.path.stat().st_size < limits.TARGET_BYTES
    assert {"grad.lm_head.weight", "grad.model.embed_tokens.weight"} <= set(g.sketches)
    assert "layers.0.output" in g.tensors and "grad.model.norm.weight" in g.tensors  # small tensors stay whole
    assert check(project, key("llama_wide"), backends.resolve("sdpa")).passed
    bug = check(project, key("llama_wide"), backends.resolve(f"{FAULTS_FILE}:dropped_norm_gradient"))
    assert {t.name for t in bug.tensors if not t.passed} == {"grad.model.layers.1.input_layernorm.weight"}


# --- no loss of power -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_every_bug_the_exact_check_catches_is_caught_sketched_and_no_legitimate_backend_fails(twins, model, dtype):
    for spec in CANDIDATES:
        candidate = backends.resolve(spec)
        exact = check(twins["never"], key(model, dtype), candidate)
        sketched = check(twins["always"], key(model, dtype), candidate)
        name = spec.rsplit(":", 1)[-1]
        assert not exact.error and not sketched.error, (name, exact.error, sketched.error)
        if exact.skipped:
            assert sketched.skipped == exact.skipped
            continue
        assert sketched.passed == exact.passed, (name, exact.worst, sketched.worst)
        assert sketched.routes_passed == exact.routes_passed, name
        if name in LEGIT:
            assert sketched.passed and sketched.worst.ratio < 1, (name, sketched.worst)
        failing = {t.name for t in exact.tensors if not t.passed}
        if failing:  # the same place named: the first diverging layer, and a failing tensor in common
            assert layer_of(sketched) == layer_of(exact), name
            assert {t.name for t in sketched.tensors if not t.passed} & failing, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_the_batched_compare_gives_the_per_tensor_compares_numbers(twins, model, dtype, monkeypatch):
    """A check compares all its sketched tensors in one batched pass with one host transfer
    (`compare_sketches`), and all its whole tensors in one pass per row width (`row_errors`); every figure
    of every tensor is the one `compare_sketch` or `row_error` gives for it alone, for every legitimate
    backend and planted bug, against the exact and the sketch-forced golden."""
    from veosnap.numerics import compare as compare_module
    from veosnap.numerics.readback import Later
    from veosnap.numerics.sketch import compare_sketch, compare_sketches

    seen = []

    def both(pairs):  # noqa: ANN001, ANN202
        batched = compare_sketches(pairs)
        alone = [compare_sketch(gold, cand, bound=bound, name=name) for gold, cand, bound, name in pairs]
        assert batched == alone
        seen.append(len(pairs))
        return Later.known(batched)

    from veosnap.numerics.metric import row_error, row_errors

    whole = []

    def both_whole(items, device=None):  # noqa: ANN001, ANN202
        # The bits are the host's claim: on CUDA a float64 row norm may sum in another order (the next test
        # holds the device's figures to 1e-12 of the host's), so the batched pass is also run on the host.
        batched = row_errors(items, device=device)
        on_host = batched if device is None or torch.device(device).type == "cpu" else row_errors(
            [(name, cand.cpu(), gold.cpu(), mask, bound) for name, cand, gold, mask, bound in items])
        alone = [row_error(name, cand, gold, mask, bound) for name, cand, gold, mask, bound in items]
        assert on_host == alone
        whole.append(len(items))
        return Later.known(batched)

    monkeypatch.setattr(compare_module, "compare_sketches_later", both)
    monkeypatch.setattr(compare_module, "row_errors_later", both_whole)
    for spec in CANDIDATES:
        for mode in ("never", "always"):
            report = check(twins[mode], key(model, dtype), backends.resolve(spec))
            assert not report.error, (spec, report.error)
    assert seen and max(seen) >= 10 and min(seen) == 0  # the sketch-forced goldens' tensors; the exact: none
    assert whole and max(whole) >= 20 and min(whole) >= 1  # every tensor of the exact goldens; the loss at least


def test_whole_tensors_with_nan_and_infinite_rows_get_row_errors_numbers_in_one_pass():
    # A NaN or infinite row is an infinite row error; rows of tensors of one width laid end to end (a chunk may
    # hold several tensors' rows, a tensor span chunks), token tensors on their real tokens only.
    from veosnap.numerics import metric

    torch.manual_seed(1)
    mask = torch.tensor([True, True, False, True, True, True])
    items = []
    for k, (name, shape) in enumerate((("logits", (2, 3, 4)), ("grad.w", (7, 4)), ("grad.v", (1, 4)),
                                       ("layers.0.output", (2, 3, 4)), ("grad.b", (5,)), ("loss", ()))):
        golden = torch.randn(shape)
        cand = golden + 1e-3 * torch.randn(shape)
        if k == 1:
            cand[2, 1] = float("nan")
        if k == 3:
            cand[0, 2, 3] = float("inf")  # on a real token
        items.append((name, cand, golden, mask if "grad" not in name and name != "loss" else None, 0.5))
    for chunk in (metric.CHUNK, 8):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(metric, "CHUNK", chunk)
            # repr: the NaN candidate value is the same NaN, which == does not say
            assert list(map(repr, metric.row_errors(items))) == [repr(metric.row_error(*item)) for item in items]


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="whole tensors compared on a CUDA device against the host: "
                    "on the CPU both are one code path (the test above asserts its bits)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_tensors_compared_on_the_gpu_give_the_hosts_figures_and_verdicts(tmp_path, dtype, monkeypatch):
    """On a GPU a check compares its whole tensors on the device (`row_errors(device=)`): a float64 norm may
    sum in another order there, so each figure is the host's within 1e-12 relative (not to the bit), and
    every verdict (within the bound or not, rows over it, how many rows) is the host's. The MoE model (routes,
    route weights on the tokens routed as the golden), every backend and planted bug, exact and
    sketch-forced goldens (their own: recording the whole twins costs a GPU minute)."""
    model = "qwen3_moe"
    twins = {mode: project_at(tmp_path / mode) for mode in ("never", "always")}
    for mode, project in twins.items():
        record(project, model, dtype, sketch=mode)
    from veosnap.numerics import compare as compare_module
    from veosnap.numerics.metric import row_errors
    from veosnap.numerics.readback import Later

    devices = []

    def device_and_host(items, device=None):  # noqa: ANN001, ANN202
        on_device = row_errors(items, device=device)
        host = row_errors([(name, cand.cpu(), gold.cpu(), mask, bound) for name, cand, gold, mask, bound in items])
        for (name, _, _, _, bound), d, h in zip(items, on_device, host):
            assert (d.rows, d.rows_over, d.error <= bound) == (h.rows, h.rows_over, h.error <= bound), name
            for a, b in ((d.error, h.error), (d.golden_value, h.golden_value), (d.candidate_value, h.candidate_value)):
                assert _close(a, b), (name, a, b)
            assert all(_close(a, b) for (_, a), (_, b) in zip(d.worst_rows, h.worst_rows)), name
        devices.append(torch.device(device).type if device is not None else "cpu")
        return Later.known(on_device)

    monkeypatch.setattr(compare_module, "row_errors_later", device_and_host)
    for spec in CANDIDATES:
        for mode in ("never", "always"):
            report = check(twins[mode], key(model, dtype), backends.resolve(spec))
            assert not report.error, (spec, report.error)
    assert devices and set(devices) == {"cuda"}


LEGIT_LAYOUTS = ("packed", "microbatch", "ddp", "fsdp2", "sp")
LAYOUT_FAULTS = ("packed_no_restart", "ddp_sum_grads", "sp_grads_unreduced", "sp_boundary_off_by_one")


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="two ranks, one GPU each: this machine has one GPU (on the CPU they run on gloo)")
@pytest.mark.heavy
def test_layouts_pass_and_planted_layout_bugs_fail_against_a_sketched_golden(twins):
    """Packed and micro-batched passes, DDP, FSDP2 and sequence parallel on gloo: token rows are sketched
    at their golden positions in each pass, FSDP2's Shard(0) gradients shard by shard; the planted
    layout bugs of tests/layout_faults.py still fail where they fail against a whole golden."""
    specs = [*LEGIT_LAYOUTS, *(f"{HERE / 'layout_faults.py'}:{name}" for name in LAYOUT_FAULTS)]
    reports = dict(zip([*LEGIT_LAYOUTS, *LAYOUT_FAULTS],
                       check_layouts(twins["always"], key("qwen3_moe"), backends.resolve("eager"), specs, nproc=2,
                                     timeout_s=300)))
    for name in LEGIT_LAYOUTS:
        report = reports[name]
        assert report.passed and not report.skipped, (name, report.error, report.worst)
        assert report.routes and all(r.clear_flips == 0 for r in report.routes)
    # FSDP2 sketched its gradient shards where they lived: the same numbers as DDP's full gradients.
    grads = lambda r: {t.name: t.error for t in r.tensors if t.name.startswith("grad.")}  # noqa: E731
    assert grads(reports["fsdp2"]) == grads(reports["ddp"])
    for name in LAYOUT_FAULTS:
        assert reports[name].status == "FAIL", (name, reports[name].error, reports[name].worst)
    failing = lambda r: {t.name for t in r.tensors if not t.passed}  # noqa: E731
    assert failing(reports["ddp_sum_grads"]) and all(n.startswith("grad.") for n in failing(reports["ddp_sum_grads"]))
    assert all(n.startswith("grad.") for n in failing(reports["sp_grads_unreduced"]))
    assert reports["sp_boundary_off_by_one"].first_divergence.startswith("layer 0 ")
    logits = next(t for t in reports["sp_boundary_off_by_one"].tensors if t.name == "logits")
    assert not logits.passed and logits.where.startswith("row 0 pos ")  # the worst group: in row 0, as exactly


def test_a_layouts_padding_slots_are_not_sketched():
    """A sequence-parallel slice padded to an even length: its pad slots (position -1) stand for no
    golden row and are left out; the others are the golden rows' own sketches."""
    from veosnap.golden.sketches import GoldenSketch, SketchSpec
    from veosnap.reference.reduce import CandidateReducer

    spec = SketchSpec(seed=3, width=16, group=1, shape=(2, 4, 40))
    gold = GoldenSketch(spec, torch.zeros(8, 16), torch.zeros(8), None, 1.0, 8, "float32")
    reducer = CandidateReducer({"logits": gold}, torch.ones(8, dtype=torch.bool))
    x = torch.randn(1, 6, 40)
    kept = reducer.keep_tokens("logits", x, torch.tensor([4, 5, 6, -1, 7, -1]))
    assert kept.positions.tolist() == [4, 5, 6, 7]
    whole = rowsketch(x[0, [0, 1, 2, 4]], 16, 3, row_offset=4)
    assert torch.equal(kept.sketch.values, whole.values)


def test_a_shard_of_rows_sketches_to_the_same_bits_as_the_whole():
    x = torch.randn(12, 300)
    positions = torch.tensor([5, 6, 7, 0, 1, 9, 10, 11, 2, 3, 4, 8])  # packed and out of order
    whole = rowsketch(x, 32, 11)
    piece = rowsketch_at(x[positions], 32, 11, positions)
    assert torch.equal(piece.values, whole.values[positions]) and torch.equal(piece.sumsq, whole.sumsq[positions])


# --- reports --------------------------------------------------------------------------------------------


def test_reports_say_when_a_figure_is_an_estimate(twins):
    report = check(twins["always"], key("llama"), backends.resolve(f"{FAULTS_FILE}:pad_leak"))
    logits = next(t for t in report.tensors if t.name == "logits")
    assert logits.sketched and logits.estimate and (logits.width, logits.group) == (64, 1)  # 256 > 64 columns
    assert logits.where.startswith("row 1 pos")  # the worst group is named by batch row and position
    text = render_text.checks([report], width=250)
    assert "estimate from a 64-wide sketch (groups of 1 row)" in text and "groups over" in text
    doc = json.loads(render_json.checks([report]))["results"][0]
    row = next(t for t in doc["tensors"] if t["name"] == "logits")
    assert row["estimate"] == "estimate from a 64-wide sketch (groups of 1 row)"
    assert row["sketch"] == {"width": 64, "group": 1}
    loss = next(t for t in doc["tensors"] if t["name"] == "loss")
    assert loss["estimate"] is None and loss["sketch"] is None
    page = render_html.checks([report])
    assert "estimate from a 64-wide sketch (groups of 1 row)" in page  # the all-tensors table and tooltips


def test_show_lists_each_sketched_tensor_with_its_form(twins):
    out = render_text.golden(read(twins["always"], "llama"), full=True)
    assert "mode always" in out and "sketch 64x1 on" in out  # the embedding gradient, on its support
    assert "logits" in out and "sketch 64x1 (seed" in out


def test_diff_compares_sketches_and_calls_a_change_of_form_material(twins, tmp_path):
    old = read(twins["always"], "llama", "float32")
    new = codec.decode(codec.encode(old), "copy")
    sketch = new.sketches["logits"]
    sketch.values = sketch.values.clone()
    sketch.values[3] += 1e-3 * sketch.values[3].norm()  # a small move of one group
    d = diff_goldens(old, new)
    (move,) = d.tensors
    assert move.name == "logits" and move.estimate and 0 < move.error < 1e-2
    resketched = diff_goldens(read(twins["never"], "llama"), old)
    assert resketched.material and all(t.problem.startswith("re-sketched: whole -> sketch") for t in resketched.tensors)
    (tmp_path / "a" / CLASS / "llama").mkdir(parents=True)
    (tmp_path / "b" / CLASS / "llama").mkdir(parents=True)
    rel = key("llama").relpath
    (tmp_path / "a" / rel).write_bytes(codec.encode(old))
    (tmp_path / "b" / rel).write_bytes(codec.encode(new))
    report = diff_trees(DirTree(tmp_path / "a"), DirTree(tmp_path / "b"))
    assert "estimate from a 64-wide sketch (groups of 1 row)" in render_markdown.diff(report)
    assert "estimate from a 64-wide sketch" in render_text.diff(report)


# --- what a reader refuses, and limits that agree ---------------------------------------------------------


@pytest.mark.parametrize("edit, cause", [
    (lambda g: g.sketches["logits"].__setattr__("norms", g.sketches["logits"].norms[:-1]),
     "sketched tensor 'logits': #norms is float32"),
    (lambda g: g.tensors.__setitem__("logits", torch.zeros(4, 32, 256)), "stored both whole and sketched"),
    (lambda g: g.tensors.__setitem__("loss#sketch", torch.zeros(1, 1)), "'loss#sketch' is not part of a golden"),
    (lambda g: g.tensors.__setitem__("grad.lm_head.weight#support", torch.arange(3)),
     "#support tensor present but the spec says support=None"),
])
def test_a_corrupt_sketched_golden_is_refused_with_one_line(twins, edit, cause):
    g = read(twins["always"], "llama")
    edit(g)
    # Encode as a recorder would (hashes recomputed), so only the reader's structural checks stand between.
    data = codec.encode(g)
    with pytest.raises(GoldenError, match=cause):
        codec.decode(data, "g.zst")


def test_an_edited_sketch_spec_is_caught_by_the_manifest_hash(twins):
    """A seed, width or tau edited by hand is caught like an edited bound."""
    inner = zstandard.ZstdDecompressor().decompress(codec.encode(read(twins["always"], "llama")))
    edited = inner.replace(b'\\"tau\\":0.', b'\\"tau\\":1.', 1)  # same length: the header stays valid
    assert edited != inner
    with pytest.raises(GoldenError, match="manifest hash mismatch"):
        codec.decode(zstandard.ZstdCompressor().compress(edited), "g.zst")


def test_the_hard_limit_stays_below_what_a_reader_accepts():
    assert limits.TARGET_BYTES < limits.HARD_LIMIT
    assert limits.HARD_LIMIT + limits.MAX_HEADER < limits.MAX_DECOMPRESSED
    assert limits.HARD_LIMIT < limits.MAX_COMPRESSED
    # Even incompressible, a golden at the hard limit is far from the reader's ratio check.
    assert limits.HARD_LIMIT <= limits.MAX_RATIO * (limits.HARD_LIMIT // 2) + limits.RATIO_SLACK


def test_record_never_writes_what_check_would_refuse(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(limits, "MAX_COMPRESSED", 100_000)  # a reader with a smaller cap than the golden
    goldens = tmp_path / "goldens"
    code = main(["record", "--goldens", str(goldens), "--hardware-class", CLASS, "--model", "llama",
                 "--dtype", "float32", "--configs", str(ROOT / "toy_configs"), "--testdata", str(ROOT / "testdata")])
    err = capsys.readouterr().err
    assert code == 2 and "not written: a check would refuse this golden (file is over the 100000 byte cap)" in err
    assert "--sketch auto" in err and not any(goldens.rglob("*.zst"))


def test_a_train_golden_is_never_sketched(tmp_path):
    with pytest.raises(VeosnapError, match="train goldens are stored whole"):
        record(project_at(tmp_path / "goldens"), "llama", "float32", scenario="train", sketch="always")
