"""Recording goldens from the HF eager reference and checking candidates against them.

These read as the first session a user has with veosnap: record into a project, check, read the
report, and meet the errors that guard against checking against the wrong thing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import zstandard
from golden_repo import CLASS, alike_everywhere, needs_goldens, skip_unless_reproduced
from safetensors import safe_open

from veosnap.errors import VeosnapError
from veosnap.golden import store
from veosnap.golden.key import GoldenKey
from veosnap.reference import models, weights
from veosnap.reference.inputs import Batch
from veosnap.reference.zoo import load_config
from veosnap.runs.record import build_golden, encode_checked, record
from veosnap.surfaces.cli import main

ROOT = Path(__file__).resolve().parent.parent


def cli(project, *args: str) -> int:  # noqa: ANN001
    dirs = ["--goldens", str(project.goldens), "--configs", str(project.configs), "--testdata", str(project.testdata)]
    return main([args[0], *dirs, *args[1:]])


def test_record_then_check_passes_and_rerecording_gives_identical_bytes(scratch_project, capsys):
    assert cli(scratch_project, "record", "--model", "qwen3_moe", "--dtype", "float32") == 0
    path = scratch_project.goldens / CLASS / "qwen3_moe" / "step-float32.safetensors.zst"
    first = path.read_bytes()
    assert "wrote" in capsys.readouterr().out

    assert cli(scratch_project, "record", "--model", "qwen3_moe", "--dtype", "float32") == 0
    assert "unchanged" in capsys.readouterr().out
    assert path.read_bytes() == first

    assert cli(scratch_project, "check", "--model", "qwen3_moe", "--dtype", "float32", "--backend", "sdpa") == 0
    out = capsys.readouterr().out
    assert f"PASS  {CLASS}/qwen3_moe/step-float32  backend=sdpa" in out
    assert "1 passed, 0 failed" in out


def test_rerecording_on_another_machine_of_the_class_keeps_the_golden_it_measures_in_other_digits(scratch_project,
                                                                                                   capsys):
    # The canaries' ratios are measured figures: two CPUs of one class gave 138.55 and 138.58 for one golden
    # whose tensors were the same bits. Such a golden is the one on disk, and recording writes nothing.
    assert cli(scratch_project, "record", "--model", "llama", "--dtype", "float32") == 0
    path = scratch_project.goldens / CLASS / "llama" / "step-float32.safetensors.zst"
    golden = store.read(path)
    measured = golden.manifest.reference.sensitivity
    assert measured, "a recorded golden is certified by its canaries"
    elsewhere = {name: ratio * 1.0003 for name, ratio in measured.items()}
    golden.manifest = replace(golden.manifest, reference=replace(golden.manifest.reference, sensitivity=elsewhere))
    path.write_bytes(encode_checked(golden, path))
    there = path.read_bytes()
    capsys.readouterr()

    assert cli(scratch_project, "record", "--model", "llama", "--dtype", "float32") == 0
    assert "unchanged" in capsys.readouterr().out
    assert path.read_bytes() == there


def test_golden_is_zstd_around_a_plain_safetensors_file(repo_project):
    path = repo_project.goldens / CLASS / "llama" / "step-float32.safetensors.zst"
    raw = zstandard.ZstdDecompressor().decompress(path.read_bytes())
    plain = Path(os.environ.get("TMPDIR", "/tmp")) / f"veosnap-plain-{os.getpid()}.safetensors"
    plain.write_bytes(raw)
    try:
        with safe_open(str(plain), framework="pt") as f:
            manifest = json.loads(f.metadata()["veosnap"])
            assert {"loss", "logits", "layers.0.output", "grad.lm_head.weight"} <= set(f.keys())
    finally:
        plain.unlink()
    assert manifest["key"] == {"hardware_class": CLASS, "model": "llama", "scenario": "step", "dtype": "float32"}
    assert manifest["reference"]["attn_implementation"] == "eager"
    assert manifest["provenance"]["torch"] and manifest["provenance"]["transformers"]
    assert manifest["tolerance"]["logits"][1] > manifest["tolerance"]["logits"][0] > 0  # bound > noise > 0


def test_json_report_lists_each_check(repo_project, capsys):
    assert cli(repo_project, "check", "--model", "llama", "--model", "mixtral", "--format", "json",
               "--hardware-class", CLASS) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is True
    assert [(r["model"], r["dtype"]) for r in doc["results"]] == [
        ("llama", "float32"), ("llama", "bfloat16"), ("mixtral", "float32"), ("mixtral", "bfloat16")]
    first = doc["results"][0]
    assert set(first) >= {"model", "dtype", "backend", "passed", "worst", "first_divergence"}
    assert set(first["worst"]) == {"tensor", "ratio"}


def test_a_failing_check_exits_1_and_says_what_to_run_next(repo_project, capsys):
    fault = f"{ROOT / 'tests' / 'faults.py'}:swapped_activation"
    assert cli(repo_project, "check", "--model", "llama", "--dtype", "float32", "--backend", fault) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {CLASS}/llama/step-float32" in out
    assert "first diverging layer: layer 1 (layers.1.output" in out
    assert "next: veosnap check --model llama --dtype float32" in out


def test_missing_golden_says_how_to_record_it_and_the_advice_runs_as_printed(scratch_project, capsys):
    record(scratch_project, "llama", "float32")
    assert cli(scratch_project, "check", "--model", "qwen3", "--dtype", "float32") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    advice = re.fullmatch(r".*; record it with `(veosnap record [^`]*)` on (\S+) hardware"
                          r"(?:; veosnap's bundled zoo has it: `(veosnap check [^`]*)` checks against it)?", err)
    assert advice and advice.group(2) == CLASS, err
    if advice.group(3):  # the bundled zoo's golden, checked as printed
        assert main(shlex.split(advice.group(3))[1:]) == 0, capsys.readouterr()
    assert shlex.split(advice.group(1))[:6] == ["veosnap", "record", "--model", "qwen3", "--dtype", "float32"]
    assert f"--goldens {scratch_project.goldens}" in advice.group(1)  # the project it was checked in

    assert main(shlex.split(advice.group(1))[1:]) == 0
    assert cli(scratch_project, "check", "--model", "qwen3", "--dtype", "float32") == 0


def test_no_goldens_for_a_hardware_class_never_falls_back(repo_project, capsys, monkeypatch):
    monkeypatch.setenv("VEOSNAP_HARDWARE_CLASS", "cuda-sm89")  # an Ada GPU: no goldens recorded for it
    assert main(["check", "--goldens", str(repo_project.goldens), "--model", "llama", "--dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "no goldens for hardware class cuda-sm89 (present: cpu, cuda-sm90)" in err


def test_recording_another_hardware_class_is_refused(scratch_project, capsys):
    other = "cuda-sm90" if CLASS != "cuda-sm90" else "cuda-sm89"
    assert cli(scratch_project, "record", "--model", "llama", "--hardware-class", other) == 2
    assert "only recorded on the hardware they describe" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../llama", "a/b", "..", ".hidden"])
def test_names_that_could_escape_the_goldens_dir_are_refused(repo_project, capsys, name):
    assert cli(repo_project, "check", "--model", name) == 2
    assert "invalid model name" in capsys.readouterr().err


def test_weights_depend_only_on_seed_and_parameter_name(repo_project):
    llama = models.build(load_config(repo_project.configs, "llama"), torch.float32)
    qwen3 = models.build(load_config(repo_project.configs, "qwen3"), torch.float32)
    name = "model.layers.1.mlp.up_proj.weight"  # same name and shape in both families
    assert torch.equal(llama.get_parameter(name), qwen3.get_parameter(name))
    again = models.build(load_config(repo_project.configs, "llama"), torch.float32, seed=0)
    other = models.build(load_config(repo_project.configs, "llama"), torch.float32, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(llama.state_dict().values(), again.state_dict().values()))
    assert not torch.equal(llama.get_parameter(name), other.get_parameter(name))
    # The bfloat16 model holds the float32 values rounded, nothing else.
    low = models.build(load_config(repo_project.configs, "llama"), torch.bfloat16)
    assert torch.equal(low.get_parameter(name), llama.get_parameter(name).to(torch.bfloat16))


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_committed_moe_goldens_route_clearly_and_use_every_expert(repo_project, model):
    for dtype in ("float32", "bfloat16"):
        g = store.read(store.path_for(repo_project.goldens, GoldenKey(CLASS, model, "step", dtype)))
        mask = Batch.from_golden(g).token_mask
        assert g.manifest.min_margin, "an MoE golden records its routers' margins"
        for layer, margin in g.manifest.min_margin.items():
            assert margin > 10 * g.manifest.tie_epsilon, f"layer {layer} margin {margin}"
            experts = g.tensors[f"routes.{layer}.experts"][mask]
            assert experts.unique().numel() == g.manifest.config.get("num_experts", g.manifest.config.get(
                "num_local_experts", g.manifest.config.get("n_routed_experts")))


def test_recorder_refuses_a_router_with_near_ties(scratch_project, monkeypatch):
    monkeypatch.setattr(weights, "TIER_LOGITS", (weights.TAIL_LOGIT,) * 3)  # no token code raises an expert
    monkeypatch.setattr(weights, "ROUTER_NOISE", 1e-4)
    # Recorded here, in this process (build_golden), for the patched weights to apply: `record` would move to
    # a fresh process, this one having run candidates.
    key = GoldenKey(CLASS, "qwen3_moe", "step", "float32")
    with pytest.raises(VeosnapError, match="under the tie epsilon"):
        build_golden(scratch_project, key)
    golden = build_golden(scratch_project, key, allow_near_ties=True)
    assert min(golden.manifest.min_margin.values()) < 1e-3


def test_committed_goldens_are_what_the_recorder_writes_here(repo_project, tmp_path):
    """This class's committed goldens are reproducible on this machine (if torch and transformers match)."""
    g = store.read(store.path_for(repo_project.goldens, GoldenKey(CLASS, "llama", "step", "float32")))
    import transformers

    if (g.manifest.provenance.torch, g.manifest.provenance.transformers) != (torch.__version__, transformers.__version__):
        pytest.skip("goldens were recorded with other torch/transformers versions")
    from dataclasses import replace

    project = replace(repo_project, goldens=tmp_path)
    record(project, "llama", "float32")
    fresh = store.read(tmp_path / CLASS / "llama" / "step-float32.safetensors.zst")
    # On any machine: the same tensors, inputs and manifest but for the figures this machine measures.
    assert alike_everywhere(fresh) == alike_everywhere(g)
    skip_unless_reproduced()  # the figures too, where this machine computes the reference in the committed bits
    assert fresh.manifest.payload_hash == g.manifest.payload_hash


@needs_goldens("cpu", "llama")
def test_another_class_is_refused_unless_cross_class_asked(repo_project, monkeypatch, capsys):
    """On a GPU the cpu goldens are refused by default; --cross-class measures the gap instead."""
    from veosnap.reference import hardware

    monkeypatch.setattr(hardware, "detect", lambda: "cuda-sm90")
    monkeypatch.setattr(hardware, "device_for", lambda _cls: torch.device("cpu"))
    args = ["check", "--goldens", str(repo_project.goldens), "--hardware-class", "cpu", "--model", "llama",
            "--dtype", "float32"]
    assert main(args) == 2
    assert "a cpu golden cannot check a candidate running on cuda-sm90" in capsys.readouterr().err
    assert main([*args, "--cross-class"]) == 0
    assert "note: cross-class: a cpu golden checked on cuda-sm90" in capsys.readouterr().out
