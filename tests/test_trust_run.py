"""Issue 35, the run's side: candidates stay contained, packed rows meet the caps, references are deterministic.

Each test is an attack that passed before: a backend whose thread re-applies a patch after veosnap's
restore (attack 3), a backend that leaves a non-daemon thread (attack 4), a `veosnap.json` that packs
thousands of short sequences into one row (attack 5), a config that keeps its dropout (attack 8).
Processes are real where exit behaviour is the point, and every wait is bounded.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from golden_repo import CLASS, REPO, eager_report

from veosnap.reference import limits
from veosnap.reference.zoo import Project
from veosnap.surfaces.cli import main

DIRS = ["--goldens", str(REPO / "goldens"), "--configs", str(REPO / "toy_configs"), "--testdata",
        str(REPO / "testdata"), "--hardware-class", CLASS, "--dtype", "float32"]

THREADS = textwrap.dedent('''
    import os, threading, time

    import torch.nn.functional as F

    _real = F.silu
    ENOUGH = os.path.join(os.path.dirname(__file__), "enough")  # the test's own way to end them


    def _patched(x, inplace=False):
        return _real(x) * 1.01


    def _patch_forever(swallow):
        while not os.path.exists(ENOUGH):
            try:
                F.silu = _patched
                time.sleep(0.005)
            except BaseException:
                if not swallow:
                    raise


    def patcher(model):
        # In place before the candidate runs, whenever its thread first gets the GIL (on a busy 2-core machine,
        # after the step: the cell then passed); the thread puts it back after veosnap's restore.
        F.silu = _patched
        threading.Thread(target=_patch_forever, args=(False,), daemon=True, name="patcher").start()
        return model


    def stubborn(model):
        threading.Thread(target=_patch_forever, args=(True,), daemon=True, name="stubborn").start()
        return model


    def lingers(model):
        threading.Thread(target=time.sleep, args=(3600,), name="lingerer").start()  # not a daemon
        return model
''')


@pytest.fixture
def threads_file(tmp_path: Path) -> Iterator[Path]:
    import threading

    import torch.nn.functional as F

    path = tmp_path / "threads.py"
    path.write_text(THREADS)
    silu = F.silu
    yield path
    # A thread that caught veosnap's stop still runs in this process: end it, and put back what it patched.
    (tmp_path / "enough").touch()
    for thread in threading.enumerate():
        if thread.name in ("patcher", "stubborn"):
            thread.join(60)
    F.silu = silu


def run_veosnap(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "veosnap", *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)


# --- item 2: containment --------------------------------------------------------------------------

def test_item2_a_thread_that_re_applies_a_patch_is_stopped_and_the_later_cells_are_the_reference(
        capsys, threads_file):
    reference = eager_report(Project(REPO / "goldens", REPO / "toy_configs", REPO / "testdata", CLASS), "llama").worst
    code = main(["check", *DIRS, "--model", "llama", "--matrix", "--backends", f"{threads_file}:patcher,eager,sdpa",
                 "--format", "json"])
    cells = {c["backend"]: c for c in json.loads(capsys.readouterr().out)["cells"]}
    patcher = f"{threads_file}:patcher"
    assert code == 1 and cells[patcher]["status"] == "fail"
    assert f"candidate {patcher} left 1 thread running after it returned ('patcher'): stopped by veosnap" \
        in cells[patcher]["notes"]
    assert cells["eager"]["status"] == cells["sdpa"]["status"] == "pass"
    assert (cells["eager"]["worst_tensor"], cells["eager"]["worst_ratio"]) == (reference.name, reference.ratio)
    assert cells["eager"]["notes"] == cells["sdpa"]["notes"] == []


def test_item2_a_thread_that_catches_the_stop_is_named_and_never_passes_its_patch_off_as_a_later_cells_failure(
        capsys, threads_file):
    main(["check", *DIRS, "--model", "llama", "--matrix", "--backends", f"{threads_file}:stubborn,eager",
          "--format", "json"])
    cells = {c["backend"]: c for c in json.loads(capsys.readouterr().out)["cells"]}
    stubborn = f"{threads_file}:stubborn"
    assert f"candidate {stubborn} left 1 thread running after it returned ('stubborn'): 'stubborn' caught " \
           "veosnap's stop and runs on" in cells[stubborn]["notes"]
    # It patches every 5 ms: the eager cell is void, blamed on it (or, had it not patched, the reference's pass).
    assert cells["eager"]["status"] in ("error", "pass")
    if cells["eager"]["status"] == "error":
        assert cells["eager"]["reason"] == ("the reference was not pristine: torch.nn.functional.silu patched while "
                                            f"a thread that would not stop ran ('stubborn' of candidate {stubborn}); "
                                            "restored")


@pytest.mark.heavy
def test_item2_a_non_daemon_thread_of_a_candidate_does_not_keep_the_process_alive(threads_file):
    done = run_veosnap("check", *DIRS, "--model", "llama", "--backend", f"{threads_file}:lingers", "--timeout", "5",
                       timeout=240)  # before the fix: never exits (TimeoutExpired)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 passed, 0 failed" in done.stdout


@pytest.mark.heavy
def test_item2_a_refused_golden_exits_with_status_2_while_veosnaps_background_work_is_in_flight(tmp_path):
    # A golden of this class whose config changed: refused once read, while its model is being built on a
    # thread and its tensors decoded on another; the process waits for them and exits orderly.
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    for _ in range(3):
        done = run_veosnap("check", "--goldens", str(REPO / "goldens"), "--configs", str(configs), "--testdata",
                           str(REPO / "testdata"), "--hardware-class", CLASS, "--dtype", "float32", "--model",
                           "llama", timeout=240)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
        assert done.stderr.count("\n") == 1 and done.stderr.startswith("veosnap: error: "), done.stderr[-2000:]


# --- item 3: caps on packed rows ------------------------------------------------------------------

def many_short_sequences(tmp_path: Path, rows: list[list[int]], length: int = 20) -> tuple[Path, Path]:
    """A project whose llama config (positions unbounded) packs `rows` of sequences of `length` tokens."""
    count = sum(map(len, rows))
    testdata = tmp_path / "testdata"
    testdata.mkdir()
    pq.write_table(pa.table({"id": pa.array(range(count), pa.int32()), "length": pa.array([length] * count, pa.int32()),
                             "seed": pa.array(range(count), pa.int64())}), testdata / "short.parquet")
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["max_position_embeddings"] = 10**6
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    (configs / "llama" / "veosnap.json").write_text(json.dumps({"batch": {"source": "short.parquet", "rows": rows}}))
    return configs, testdata


def record_limited(configs: Path, testdata: Path, goldens: Path) -> subprocess.CompletedProcess:
    """`veosnap record` in a process that may map at most 8 GiB: before the caps, this record grew past 24 GB."""
    def limit() -> None:
        # CUDA cannot start in 8 GiB of address space (not even with the GPU hidden): the limit is the cpu's
        if CLASS == "cpu":
            resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "veosnap", "record", "--goldens", str(goldens), "--configs",
                           str(configs), "--testdata", str(testdata), "--hardware-class", CLASS, "--model", "llama",
                           "--dtype", "float32"], capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=limit)


@pytest.mark.heavy
@pytest.mark.parametrize("rows, cause", [
    # attack 5: 6,400 short sequences packed into one row, 128,000 tokens
    ([list(range(6400))], f"a row of 128000 tokens (sequences packed into a row count together), over veosnap's "
                          f"cap of {limits.MAX_SEQUENCE_TOKENS} per row"),
    # as many, each in a row of its own: 128,000 positions in all
    ([[i] for i in range(6400)], f"6400 rows of 20 positions, 128000 in all, over veosnap's cap of "
                                 f"{limits.MAX_BATCH_TOKENS}"),
])
def test_item3_a_batch_over_the_caps_as_the_model_sees_it_is_refused_up_front_naming_the_file(tmp_path, rows, cause):
    configs, testdata = many_short_sequences(tmp_path, rows)
    done = record_limited(configs, testdata, tmp_path / "goldens")
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
    assert done.stderr == f"veosnap: error: {configs / 'llama' / 'veosnap.json'}: {cause} ({limits.WHERE})\n"
    assert not (tmp_path / "goldens").exists()


def test_item3_the_memory_estimate_counts_attention_over_a_rows_width(monkeypatch):
    from veosnap.reference.zoo import load_config

    toy = load_config(REPO / "toy_configs", "llama")
    parameters = limits.check_config(toy)
    monkeypatch.setattr(limits, "_memory", lambda device: (4 << 30, "memory"))
    import torch

    tokens = limits.MAX_SEQUENCE_TOKENS
    limits.check_memory(toy, parameters, tokens, torch.float32, torch.device("cpu"), recording=True, width=1)
    with pytest.raises(limits.VeosnapError, match=r"needs about \d+ GiB to record .* more than this machine's 4 GiB"):
        limits.check_memory(toy, parameters, tokens, torch.float32, torch.device("cpu"), recording=True, width=tokens)


def test_a_gpu_that_cuda_fails_to_start_is_an_error_not_a_cpu_machine(monkeypatch, capsys):
    # what torch says when CUDA cannot start (seen on the H200 in a process limited to 8 GiB of address space)
    import warnings

    import torch

    from veosnap.reference import hardware

    def failing() -> bool:
        warnings.warn("CUDA initialization: Unexpected error from cudaGetDeviceCount(). Error 2: out of memory "
                      "(Triggered internally at CUDAFunctions.cpp:119.)", UserWarning)
        return False

    monkeypatch.setattr(torch.cuda, "is_available", failing)
    monkeypatch.delenv(hardware.ENV_VAR, raising=False)
    with pytest.raises(hardware.VeosnapError, match=r"^this machine has a GPU but CUDA failed to start \(Unexpected "
                       r"error from cudaGetDeviceCount\(\). Error 2: out of memory\); .* \(CUDA_VISIBLE_DEVICES=\)"):
        hardware.detect()
    assert main(["check", "--model", "llama"]) == 2
    assert capsys.readouterr().err.startswith("veosnap: error: this machine has a GPU but CUDA failed to start")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU at all: a cpu machine
    assert hardware.detect() == "cpu"


# --- item 5: deterministic references -------------------------------------------------------------

ATTENTION_BUG = textwrap.dedent('''
    def attention_off_by_one_percent(model):
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(lambda module, args, out: (out[0] * 1.01, *out[1:]))
        return model
''')


@pytest.fixture
def with_dropout(tmp_path: Path) -> tuple[list[str], Path]:
    """A project whose llama config keeps an attention dropout of 0.1, recorded; the flags that reach it."""
    configs = tmp_path / "configs"
    shutil.copytree(REPO / "toy_configs" / "llama", configs / "llama")
    config = json.loads((configs / "llama" / "config.json").read_text())
    config["attention_dropout"] = 0.1
    (configs / "llama" / "config.json").write_text(json.dumps(config))
    flags = ["--goldens", str(tmp_path / "goldens"), "--configs", str(configs), "--testdata", str(REPO / "testdata"),
             "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32"]
    return flags, tmp_path / "goldens" / CLASS / "llama" / "step-float32.safetensors.zst"


def test_item5_a_config_with_dropout_records_without_it_says_so_and_a_one_percent_attention_bug_fails(
        capsys, tmp_path, with_dropout):
    flags, path = with_dropout
    assert main(["record", *flags]) == 0
    err = capsys.readouterr().err
    note = ("the config's randomness is off in the reference and the candidate (attention_dropout 0.1 set to 0): a "
            "random forward cannot be a reference")
    assert f"veosnap: note: {path}: {note}\n" in err
    from veosnap.golden import store

    assert store.read(path).manifest.reference.random_off == {"attention_dropout": 0.1}
    bug = tmp_path / "bug.py"
    bug.write_text(ATTENTION_BUG)
    assert main(["check", *flags, "--matrix", "--backends", f"eager,{bug}:attention_off_by_one_percent",
                 "--format", "json"]) == 1  # before: both passed, the bug hidden in the dropout's noise
    cells = {c["backend"]: c for c in json.loads(capsys.readouterr().out)["cells"]}
    assert cells["eager"]["status"] == "pass" and note in cells["eager"]["notes"]
    assert cells[f"{bug}:attention_off_by_one_percent"]["status"] == "fail"
    assert cells[f"{bug}:attention_off_by_one_percent"]["worst_ratio"] > 100


def test_item5_a_golden_recorded_with_its_dropout_on_is_refused(capsys, with_dropout):
    from veosnap.golden import codec, store
    from veosnap.golden.manifest import Manifest

    flags, path = with_dropout
    assert main(["record", *flags]) == 0
    golden = store.read(path)
    manifest = Manifest.from_json(golden.manifest.to_json(), "copy")
    golden.manifest = replace(manifest, reference=replace(manifest.reference, random_off=None))
    assert golden.manifest.reference.random_off is None  # as recorded before veosnap turned dropout off
    path.write_bytes(codec.encode(golden))
    capsys.readouterr()
    assert main(["check", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"veosnap: error: {path}: its reference ran with its config's randomness on "
                                 "(attention_dropout 0.1), so its bounds measure that noise; re-record it (veosnap "
                                 "runs every model without it now)\n")


@pytest.mark.parametrize("made_random, cause", [
    ("module", "model.layers.0.mlp.act_fn is Dropout(p=0.1), which no config field sets"),
    ("hook", "the model's training-mode forward is random (two forwards under different seeds differ by"),
])
def test_item5_randomness_no_config_field_turns_off_is_refused_in_one_line(made_random, cause):
    import torch

    from veosnap.errors import VeosnapError
    from veosnap.reference import determinism, inputs, models
    from veosnap.reference.zoo import load_config

    toy = load_config(REPO / "toy_configs", "llama")
    model = models.build(toy, torch.float32)
    if made_random == "module":
        model.model.layers[0].mlp.act_fn = torch.nn.Dropout(0.1)
    else:
        model.model.layers[1].register_forward_hook(lambda m, args, out: out + 0.1 * torch.randn_like(out))
    batch = inputs.padded(inputs.load_sequences(REPO / "testdata"))
    state = torch.random.get_rng_state()
    with pytest.raises(VeosnapError) as refused:
        determinism.require_deterministic(toy.path, model, batch.model_kwargs(with_labels=False))
    assert str(refused.value).startswith(f"{toy.path}: {cause}") and "\n" not in str(refused.value)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched


# --- item 6: goldens that certify their sensitivity -----------------------------------------------

def test_item6_record_certifies_by_default_keeps_the_sensitivity_in_the_manifest_and_every_report(capsys, tmp_path):
    from veosnap.golden import store

    flags = ["--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "llama",
             "--dtype", "float32"]
    assert main(["record", *flags]) == 0
    out = capsys.readouterr().out
    sensitivity = store.read(tmp_path / "goldens" / CLASS / "llama" / "step-float32.safetensors.zst"
                             ).manifest.reference.sensitivity
    assert set(sensitivity) == {"layer_output@0.001", "gradient@0.001"} and min(sensitivity.values()) > 10
    assert "certified: catches a 0.001 relative error planted in each of: layer_output " in out
    assert main(["check", *flags, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["sensitivity"] == sensitivity
    assert main(["check", *flags]) == 0
    assert "  sensitivity: certified: catches a 0.001 relative error planted in each of: " in capsys.readouterr().out


def test_item6_the_old_certify_flag_still_works_and_says_it_is_the_default(capsys, tmp_path):
    flags = ["--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "llama"]
    assert main(["record", *flags, "--dtype", "float32", "--certify"]) == 0
    out, err = capsys.readouterr()
    assert "certified: catches a 0.001 relative error" in out
    assert "--certify is the default now and the flag goes in the next release" in err


def test_item6_in_bfloat16_each_canary_is_certified_at_the_smallest_scale_it_fails(capsys, tmp_path):
    from veosnap.golden import store

    flags = ["--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "deepseek_v3",
             "--dtype", "bfloat16"]
    assert main(["record", *flags]) == 0
    sensitivity = store.read(tmp_path / "goldens" / CLASS / "deepseek_v3" / "step-bfloat16.safetensors.zst"
                             ).manifest.reference.sensitivity
    # a 1% error in one decoder layer's output fails in isolation; one expert's share of its tokens' output,
    # beside the shared expert and the other routed one, is caught from 10%; one gradient's projection onto
    # the golden from 3% (this model's backward rounds by more than llama's, caught at 1%)
    assert {name.partition("@")[0]: name.partition("@")[2] for name in sensitivity} == \
        {"layer_output": "0.01", "expert": "0.1", "gradient": "0.03"}
    assert min(sensitivity.values()) > 1
    assert "certified: catches the relative error planted in each of: layer_output 0.01 at " in capsys.readouterr().out


def test_item6_a_golden_recorded_without_certification_loads_and_says_not_certified(capsys, tmp_path):
    flags = ["--goldens", str(tmp_path / "goldens"), "--hardware-class", CLASS, "--model", "llama",
             "--dtype", "float32"]
    assert main(["record", *flags, "--no-certify"]) == 0
    out, err = capsys.readouterr()
    assert "certified" not in out and "recording without certification (--no-certify)" in err
    assert main(["check", *flags]) == 0
    assert "  sensitivity: not certified: no canary was planted when this golden was recorded\n" \
        in capsys.readouterr().out


def test_item6_a_refresh_certifies_an_uncertified_golden_and_diff_says_so(capsys, tmp_path):
    goldens = tmp_path / "goldens"
    flags = ["--goldens", str(goldens), "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32"]
    assert main(["record", *flags, "--no-certify"]) == 0
    shutil.copytree(goldens, tmp_path / "before")
    capsys.readouterr()
    assert main(["refresh", *flags, "--reason", "certify"]) == 0
    assert "rewrote" in (out := capsys.readouterr().out) and "(certified" in out
    assert main(["refresh", *flags, "--reason", "again"]) == 0
    assert capsys.readouterr().out.startswith("unchanged")
    assert main(["diff", str(tmp_path / "before"), str(goldens), "--fail-on-change"]) == 1
    assert "sensitivity" in capsys.readouterr().out


def test_item6_a_golden_that_a_canary_passes_is_refused(tmp_path):
    # a fresh process, where the recording and its canaries run in process: the ladder made too small to matter
    script = ("import sys; from veosnap.runs import canaries; canaries.LADDER['float32'] = (1e-12,); "
              "from veosnap.surfaces.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "record", "--goldens", str(tmp_path / "goldens"),
                           "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32"],
                          capture_output=True, text=True, timeout=600)
    code, out, err = done.returncode, done.stdout, done.stderr
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"veosnap: error: {CLASS}/llama/step-float32: not certified: a 1e-12 relative error in "
                          "one decoder layer's output passes this golden")
    assert "record with --no-certify to keep it, uncertified" in err
    assert not (tmp_path / "goldens" / CLASS / "llama").exists()
