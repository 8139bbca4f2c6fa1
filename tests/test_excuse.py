"""A golden recorded despite a legitimate variant known to fail it (`veosnap record --excuse VARIANT=REASON`):
the recorder refuses it without the excuse, keeps {variant: reason, worst tensor, ratio} in the manifest with
it, and every check of that variant still fails, saying the reason. Goldens without an excuse keep their bytes.

The failing variant is planted: veosnap's own grouped_mm with the experts' bias gradients rounded to
bfloat16 (`faults.expert_bias_grad_in_bfloat16`), the transformers bug gpt_oss-real bfloat16 meets on the GPU
(docs/findings/transformers-grouped-mm-bias-grad-bf16.md), on the toy gpt_oss in float32.
"""

from __future__ import annotations

import html
import json
import re

import pytest
from faults import expert_bias_grad_in_bfloat16
from golden_repo import CLASS, committed_golden, recorded_here, skip_unless_reproduced

from veosnap.candidates import backends, pristine
from veosnap.errors import GoldenError, VeosnapError
from veosnap.golden import codec, store
from veosnap.golden.key import GoldenKey
from veosnap.golden.manifest import Excuse
from veosnap.runs.record import record
from veosnap.surfaces.cli import main

REASON = "transformers grouped_mm accumulates the expert bias gradients in bfloat16 (findings)"


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    """grouped_mm, as the recorder's fragility check and `--backend grouped_mm` run it, is the faulty one."""
    shipped = backends.shipped("grouped_mm").steps[0]
    faulty = backends.Registered(lambda model: expert_bias_grad_in_bfloat16(shipped(model)))
    monkeypatch.setitem(backends._SHIPPED, "grouped_mm", faulty)
    monkeypatch.setitem(backends._REGISTRY, "grouped_mm", faulty)


def pristine_here(monkeypatch: pytest.MonkeyPatch) -> None:
    # The planted variant exists in this process only, so it records here: as pristine as a fresh one for
    # this test, which patches nothing a candidate could (earlier checks ran only veosnap's own variants).
    monkeypatch.setattr(pristine, "_touched", False)


def test_a_golden_a_variant_fails_is_recorded_only_with_its_excuse_and_checks_of_it_still_fail(
        scratch_project, planted, capsys, monkeypatch):
    dirs = ["--goldens", str(scratch_project.goldens), "--configs", str(scratch_project.configs),
            "--testdata", str(scratch_project.testdata)]
    gpt_oss = ["--model", "gpt_oss", "--dtype", "float32"]
    path = store.path_for(scratch_project.goldens, GoldenKey(CLASS, "gpt_oss", "step", "float32"))

    pristine_here(monkeypatch)
    code, out, err = run(capsys, "record", *dirs, *gpt_oss)
    assert (code, out) == (2, "") and err.count("\n") == 1
    said = re.search(r"fragile golden, not written: legitimate variants of the reference exceed its bounds "
                     r"\(grouped_mm: (grad\.\S+_bias) (\S+)x", err)
    assert said and float(said.group(2)) > 1, err
    assert "--excuse VARIANT=REASON" in err and not path.exists()

    # (Still pristine: only veosnap's own variants ran, as record and refresh run them.)
    code, out, err = run(capsys, "record", *dirs, *gpt_oss, "--excuse", "grouped_mm=a known bug")
    assert code == 0 and out.startswith("wrote ")
    assert err.startswith(f"veosnap: warning: {path}: excused (--excuse), its checks still fail: grouped_mm: grad.")
    excuse = store.read(path).manifest.excused["grouped_mm"]
    assert excuse.reason == "a known bug" and excuse.tensor.endswith("_bias") and excuse.ratio > 1
    assert list(store.read(path).manifest.excused) == ["grouped_mm"]  # batched_mm and eager pass: nothing else
    # A refresh with another reason rewrites the golden for it, and its diff says so.
    code, out, _ = run(capsys, "refresh", *dirs, *gpt_oss, "--reason", "reworded", "--excuse", f"grouped_mm={REASON}")
    assert code == 0 and out.startswith(f"rewrote   {path}  (excused variants changed)") and "excused.grouped_mm" in out
    excuse = store.read(path).manifest.excused["grouped_mm"]
    assert excuse.reason == REASON
    code, out, _ = run(capsys, "record", *dirs, *gpt_oss, "--excuse", f"grouped_mm={REASON}")
    assert code == 0 and out.startswith("unchanged ")  # the excuse, its figures and the trail reproduce

    note = f"grouped_mm fails this golden, known at record time: {REASON} (then: {excuse.tensor} "
    for spec in ("grouped_mm", "eager+grouped_mm"):  # alone or joined with another backend
        code, out, _ = run(capsys, "check", *dirs, *gpt_oss, "--backend", spec)
        assert code == 1 and out.split("\n", 2)[2].startswith("FAIL") and f"note: {note}" in " ".join(out.split()), out
    page = scratch_project.goldens.parent / "report.html"
    code, out, _ = run(capsys, "check", *dirs, *gpt_oss, "--backend", "grouped_mm", "--format", "json", "--html",
                       str(page))
    assert code == 1 and any(n.startswith(note) for n in json.loads(out)["results"][0]["notes"])
    assert html.escape(note) in page.read_text()
    code, out, _ = run(capsys, "check", *dirs, *gpt_oss, "--backend", "batched_mm")
    assert code == 0 and "known at record time" not in out  # other backends: no note

    assert f"excused     grouped_mm fails it, known at record time: {REASON}" in run(capsys, "show", str(path))[1]
    code, out, _ = run(capsys, "ls", *dirs, *gpt_oss)
    assert out.rstrip().endswith(f"  excused grouped_mm: {REASON}")
    listed = json.loads(run(capsys, "ls", *dirs, *gpt_oss, "--format", "json")[1])
    assert [entry["excused"] for entry in listed] == [{"grouped_mm": REASON}]
    code, out, _ = run(capsys, "verify", str(scratch_project.goldens))
    assert code == 0 and out == f"{path}: ok; excused grouped_mm: {REASON}\nverified 1 golden(s): 0 bad\n"

    # Recorded in a fresh process (this one ran candidates), grouped_mm is veosnap's own and passes: the
    # excuse would hide nothing, so it is refused, and the golden on disk stays as it was.
    before = path.read_bytes()
    assert pristine.touched()
    code, out, err = run(capsys, "record", *dirs, *gpt_oss, "--excuse", f"grouped_mm={REASON}")
    assert (code, out, err) == (2, "", f"veosnap: error: {CLASS}/gpt_oss/step-float32: --excuse grouped_mm: "
                                       "grouped_mm passes it; a stale excuse hides nothing, drop it\n")
    assert path.read_bytes() == before
    # A refresh keeps a golden's excuses unless told otherwise, dropping one whose variant no longer fails.
    code, out, err = run(capsys, "refresh", *dirs, *gpt_oss, "--reason", "grouped_mm fixed")
    assert code == 0 and out.startswith(f"rewrote   {path}  (excuse for grouped_mm dropped (it no longer fails))")
    assert store.read(path).manifest.excused == {}


@pytest.mark.parametrize("excuse, said", [
    ("batched=x", "--excuse 'batched=x': unknown variant 'batched' (the fragility check's variants that can be "
                  "excused: sdpa, grouped_mm, batched_mm)"),
    ("eager=x", "--excuse 'eager=x': eager is the reference itself, run again; a golden it fails does not "
                "reproduce itself and cannot be excused (excusable: sdpa, grouped_mm, batched_mm)"),
    ("sdpa", "--excuse 'sdpa': give the reason, as --excuse sdpa=REASON (it is kept in the golden and shown by "
             "every check of that variant)"),
])
def test_a_bad_excuse_is_one_line_before_anything_runs(scratch_project, capsys, excuse, said):
    code, out, err = run(capsys, "record", "--goldens", str(scratch_project.goldens), "--model", "llama",
                         "--excuse", excuse)
    assert (code, out, err) == (2, "", f"veosnap: error: {said}\n")
    assert not scratch_project.goldens.exists()


def test_an_excuse_for_a_variant_that_does_not_run_is_refused(scratch_project, monkeypatch):
    pristine_here(monkeypatch)
    with pytest.raises(VeosnapError, match=r"--excuse grouped_mm: grouped_mm did not run on it \(a dense model "
                                           r"has no experts\); a stale excuse hides nothing"):
        record(scratch_project, "llama", "float32", excuses={"grouped_mm": REASON})
    assert not store.path_for(scratch_project.goldens, GoldenKey(CLASS, "llama", "step", "float32")).exists()


@pytest.mark.parametrize("excused, cause", [
    ({"eager": Excuse(REASON, "loss", 2.0)}, "excused.eager: 'eager' is not an excusable variant"),
    ({"grouped_mm": Excuse(" ", "loss", 2.0)}, "excused.grouped_mm has an empty reason"),
    ({"grouped_mm": Excuse(REASON, "grad.nope", 2.0)}, "excused.grouped_mm.tensor 'grad.nope' is not a tensor"),
    ({"grouped_mm": Excuse(REASON, "loss", 0.0)}, "field 'excused.grouped_mm.ratio' is not a finite positive"),
])
def test_a_malformed_excuse_is_refused_naming_the_file(tmp_path, excused, cause):
    golden = store.read(committed_golden("qwen3_moe"))
    golden.manifest.excused = excused
    path = tmp_path / "goldens" / CLASS / "qwen3_moe" / "step-float32.safetensors.zst"
    path.parent.mkdir(parents=True)
    path.write_bytes(codec.encode(golden))  # hashed as written: only the field itself is wrong
    with pytest.raises(GoldenError) as caught:
        store.read(path)
    assert str(caught.value).startswith(f"{path}: malformed manifest (ValueError: {cause}")
    assert "\n" not in str(caught.value)


def test_an_excuse_round_trips_and_a_golden_without_one_keeps_its_bytes(tmp_path):
    committed = committed_golden("qwen3_moe", "bfloat16")
    golden = store.read(committed)
    assert codec.encode(golden) == committed.read_bytes()  # no 'excused' field written when there is none
    golden.manifest.excused = {"batched_mm": Excuse(REASON, "routes.0.experts")}  # a routing difference
    again = codec.decode(codec.encode(golden), "excused")
    assert again.manifest.excused == golden.manifest.excused
    assert '"excused":{"batched_mm":{"reason":' in again.manifest.to_json()


@pytest.mark.parametrize("model, dtype", [("llama", "float32"), ("qwen3_moe", "bfloat16")])
def test_committed_goldens_record_again_byte_identical(scratch_project, monkeypatch, model, dtype):
    committed = committed_golden(model, dtype)
    copy = store.path_for(scratch_project.goldens, GoldenKey(CLASS, model, "step", dtype))
    copy.parent.mkdir(parents=True)
    # On any machine: its own recording, given the committed golden's approval trail, records again to the
    # same bytes (no 'excused' field appears, the trail is kept).
    here = codec.decode(recorded_here(model, dtype), "recorded here")
    here.manifest.approvals = store.read(committed).manifest.approvals
    copy.write_bytes(codec.encode(here))
    pristine_here(monkeypatch)
    outcome = record(scratch_project, model, dtype)
    assert not outcome.written and outcome.path.read_bytes() == codec.encode(here)

    skip_unless_reproduced()  # the committed bytes themselves: where this machine computes them
    copy.write_bytes(committed.read_bytes())  # with its approval trail, which a recording keeps
    outcome = record(scratch_project, model, dtype)
    assert not outcome.written and outcome.path.read_bytes() == committed.read_bytes()


def test_gpu_real_records_an_excused_golden_as_record_does(scratch_project, planted, monkeypatch):
    """tools/gpu/gpu_real.py's record unit (in this process: the planted variant exists here only) writes the
    golden with its excuse, and the variant's report, a cell of its matrix, still fails with the note."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools" / "gpu"))
    gpu_real = pytest.importorskip("gpu_real")
    pristine_here(monkeypatch)
    unit = gpu_real.Unit("record", "gpt_oss", "float32", excuses=(("grouped_mm", REASON),))
    row = gpu_real._run_unit(scratch_project, unit)
    assert (row["status"], row["fragile"], row["excused"], row["written"]) == ("recorded", [], ["grouped_mm"], True)
    assert row["judges"]["grouped_mm"].status == "FAIL"
    assert row["judges"]["grouped_mm"].notes[0].startswith("grouped_mm fails this golden, known at record time: ")
    golden = store.read(scratch_project.goldens / row["path"])
    assert golden.manifest.excused["grouped_mm"].reason == REASON
