"""The CPU side of tools/gpu/gpu_session.py's real-shape phases: what comes back from the GPU machine
(tars of at most 15 MiB, at most 8 files, failing cells' reports) and the table for docs/gpu.md.
The phases themselves need CUDA and say so here."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "gpu"))
gpu_session = pytest.importorskip("gpu_session")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the phases would run (minutes each), not skip")
def test_without_cuda_the_real_phases_skip_with_the_reason(tmp_path, capsys):
    script = ROOT / "tools" / "gpu" / "gpu_session.py"
    done = subprocess.run([sys.executable, str(script), "record-real", "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0 and "skipped, no CUDA device" in done.stdout, done.stderr
    for phase in ("matrix-real", "layouts-real"):  # the same main, in this process (a fresh interpreter is ~9 s)
        gpu_session.main([phase, "--out", str(tmp_path)])
        assert f"gpu_session {phase}: skipped, no CUDA device" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_goldens_are_packed_into_tars_under_the_limit(tmp_path):
    root = tmp_path / "goldens"
    files = []
    for i, size in enumerate([6000, 3000, 6000, 20000]):
        f = root / "cuda-sm90" / f"m{i}" / "step-float32.safetensors.zst"
        f.parent.mkdir(parents=True)
        f.write_bytes(bytes(size))
        files.append(f)
    out = tmp_path / "out"
    out.mkdir()
    made = gpu_session.pack_tars(files, root, out, "goldens", limit=12000)
    assert made[-1].startswith("LEFT OUT cuda-sm90/m3/") and len(made) == 3, made
    packed = []
    for name in made[:-1]:
        assert (out / name).stat().st_size <= 12000 + 10240  # tar's own end blocks
        with tarfile.open(out / name) as tar:
            packed += tar.getnames()
    assert sorted(packed) == [f"cuda-sm90/m{i}/step-float32.safetensors.zst" for i in range(3)]


def test_the_budgeted_matrix_names_failures_and_what_it_did_not_reach(tmp_path, repo_project):
    import time

    from veosnap.runs import matrix

    faults = f"{ROOT}/tests/faults.py:kv_groups_swapped"
    start = time.perf_counter()
    result = matrix.run_matrix(repo_project, ["llama", "qwen2"], ["float32"], ["eager", faults],
                               check_cells=_first_two(gpu_session._budgeted(3600, start)))
    data = gpu_session._finish_matrix(result, tmp_path, "single")
    status = {(c.model, c.backend): c.status for c in result.cells}
    assert status == {("llama", "eager"): "pass", ("llama", faults): "fail", ("qwen2", "eager"): "skip",
                      ("qwen2", faults): "skip"}
    assert data["counts"] == {"pass": 1, "fail": 1, "skip": 2, "error": 0}
    (saved,) = (tmp_path / "failures").iterdir()
    assert "llama-float32" in saved.name and '"passed": false' in saved.read_text()
    table = gpu_session._worst_table(result)
    # eager's worst ratio is 0 only where this machine recorded the golden: its counts say it passed
    assert "| eager/single | 1/0/1/0 | " in table and "kv_groups_swapped/single | 0/1/1/0 |" in table and "| llama float32 grad." in table


def _first_two(inner):  # noqa: ANN001, ANN202 - the budget runs out after two cells
    done = []

    def run(project, key, backend, layouts):  # noqa: ANN001, ANN202
        if len(done) >= 2:
            raise gpu_session.NotRun("not run: over --budget-s 0")
        done.append(key)
        return inner(project, key, backend, layouts)

    return run


# --- tools/gpu/gpu_real.py: the real tier recorded and checked in one command, worker processes sharing a GPU ---

gpu_real = pytest.importorskip("gpu_real")


def plan_of(capsys, *args: str) -> tuple[int, str]:
    """`tools/gpu/gpu_real.py --plan ARGS` (no GPU needed): its exit status and what it printed."""
    code = gpu_real.main(["--plan", *args])
    return code, capsys.readouterr().out


def test_gpu_real_without_cuda_skips_and_plans(tmp_path, capsys):
    # "without CUDA" on every machine: on a GPU box the bare command would record the whole real tier
    no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "gpu_real.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, cwd=ROOT, env=no_gpu)
    assert done.returncode == 0 and "skipped, no CUDA device" in done.stdout, done.stderr
    assert list(tmp_path.iterdir()) == []
    plan = ["--model", "qwen3-real", "--dtype", "float32", "--jobs", "2"]
    code, out = plan_of(capsys, *plan, "--rerecord")
    assert code == 0
    assert "| record qwen3-real float32 |" in out and "| check qwen3-real float32 compile |" in out
    # the record (which runs eager and sdpa too), 7 other backends and compile; 1 of the 2 workers records
    assert "9 units" in out and "on 2 workers (1 recording)" in out
    # by default a cuda-sm90 golden in goldens/ (the H200's, committed) is kept and only checked
    from golden_repo import WHY_ABSENT, has_goldens

    if not has_goldens("cuda-sm90", "qwen3-real"):
        pytest.skip(f"the rest plans around the committed cuda-sm90 qwen3-real golden, which this checkout lacks: "
                    f"{WHY_ABSENT}")
    code, out = plan_of(capsys, *plan)
    assert "| record qwen3-real float32 |" not in out and "8 units" in out, out[-500:]
    code, out = plan_of(capsys, *plan, "--exclude", "qwen3-real/float32")
    assert "0 units" in out, out[-500:]


def test_units_wait_for_their_golden_and_share_the_memory():
    U = gpu_real.Unit
    units = [U("record", "big", "float32", gib=100, est_s=10), U("check", "big", "float32", "eager", gib=40, est_s=5),
             U("check", "big", "float32", "sdpa", gib=40, est_s=5), U("record", "small", "float32", gib=20, est_s=2),
             U("check", "small", "float32", "eager", gib=5, est_s=1)]
    # while big's record runs (100 of 120 GiB), small's record fits beside it; big's checks wait for it
    assert gpu_real.next_unit(units[1:], set(), [units[0]], 120, {("big", "float32")}) == units[3]
    assert gpu_real.next_unit(units[1:], set(), [units[0]], 120, {("big", "float32")}, free=("check",)) is None
    assert gpu_real.next_unit(units[1:3], set(), [units[0]], 120, set()) is None
    # recorded: one check of a (model, dtype) at a time, so the next one reuses the worker's weights
    assert gpu_real.next_unit(units[1:3], {("big", "float32")}, [], 120, set()) == units[1]
    assert gpu_real.next_unit(units[2:3], {("big", "float32")}, [units[1]], 120, {("big", "float32")}) is None
    plan = gpu_real.simulate(units, {"record": 2, "check": 1}, capacity_gib=120)
    starts = {r["unit"]: r["start"] for r in plan["started"]}
    assert starts["record small float32"] == starts["record big float32"]  # side by side
    assert starts["check big float32 eager"] >= starts["record big float32"] + 10
    assert plan["not_reached"] == []
    one = gpu_real.simulate(units, {"record": 1, "check": 1}, capacity_gib=120)
    assert one["end_s"] > plan["end_s"]  # one recording worker: the records one after the other
    assert gpu_real.simulate(units, {"record": 2, "check": 1}, 120, budget_s=0)["not_reached"]  # nothing starts late


@pytest.mark.heavy
def test_gpu_real_records_then_checks_on_worker_processes(tmp_path):
    """The whole phase on the CPU with two toys: a recording worker records each golden and judges it with
    the recorder's variants (their reports are the matrix's cells), a checking worker runs the other
    backends, and a planted fault's whole report comes back in details.tar."""
    import shutil

    from golden_repo import CLASS

    from veosnap.reference.zoo import Project

    shutil.copytree(ROOT / "toy_configs", tmp_path / "toy_configs")
    project = Project.resolve(goldens=tmp_path / "goldens", configs=tmp_path / "toy_configs",
                              testdata=ROOT / "testdata", hardware_class=CLASS)
    out = tmp_path / "out"
    out.mkdir()
    faults = f"{ROOT}/tests/faults.py:kv_groups_swapped"
    result = gpu_real.phase_real(project, out, ["llama", "qwen3_moe"], ["float32"], ["eager", "sdpa_math", faults],
                                 [], {"record": 1, "check": 1}, capacity_gib=1000, budget_s=3600)
    goldens = {g["model"]: g for g in result["goldens"]}
    assert {m: (g["status"], g["fragile"], g["written"]) for m, g in goldens.items()} == {
        "llama": ("recorded", [], True), "qwen3_moe": ("recorded", [], True)}
    status = {(c["model"], c["backend"]): c["status"] for c in result["single"]["cells"]}
    assert status == {("llama", "eager"): "pass", ("llama", "sdpa"): "pass", ("llama", "sdpa_math"): "pass",
                      ("llama", faults): "fail", ("qwen3_moe", "eager"): "pass", ("qwen3_moe", "sdpa"): "pass",
                      ("qwen3_moe", "grouped_mm"): "pass", ("qwen3_moe", "batched_mm"): "pass",
                      ("qwen3_moe", "sdpa_math"): "pass", ("qwen3_moe", faults): "fail"}, status
    pids = {u["unit"].split(" ")[0]: u["pid"] for u in result["units"] if "pid" in u}
    assert pids["record"] != pids["check"]  # records on their own (pristine) worker
    files = sorted(f.name for f in out.iterdir())
    assert files == ["details.tar", f"goldens-real-{CLASS}-1.tar", "real.json", "real.txt"], files
    with tarfile.open(out / f"goldens-real-{CLASS}-1.tar") as tar:
        assert sorted(tar.getnames()) == [f"{CLASS}/llama/step-float32.safetensors.zst",
                                          f"{CLASS}/qwen3_moe/step-float32.safetensors.zst"]
    with tarfile.open(out / "details.tar") as tar:
        assert any("llama-float32" in name and "kv_groups_swapped" in name for name in tar.getnames())
    assert "| eager/single | 2/0/0/0 |" in (out / "real.txt").read_text()


def test_gpu_real_abandons_what_still_runs_at_stop_s_and_writes_what_it_has(tmp_path):
    import shutil

    from golden_repo import CLASS

    from veosnap.reference.zoo import Project

    shutil.copytree(ROOT / "toy_configs", tmp_path / "toy_configs")
    project = Project.resolve(goldens=tmp_path / "goldens", configs=tmp_path / "toy_configs",
                              testdata=ROOT / "testdata", hardware_class=CLASS)
    out = tmp_path / "out"
    out.mkdir()
    # a worker takes seconds to start: the record is still running at 1 s
    result = gpu_real.phase_real(project, out, ["llama"], ["float32"], ["eager", "sdpa_math"], [],
                                 {"record": 1, "check": 1}, capacity_gib=1000, budget_s=3600, stop_s=1)
    assert [g["status"] for g in result["goldens"]] == ["abandoned at --stop-s 1"]
    assert result["not_reached"] == ["check llama float32 sdpa_math"]
    assert sorted(f.name for f in out.iterdir()) == ["real.json", "real.txt"]


def fake_unit_oom_unless_alone(project, unit):
    """A worker's unit as the H200 saw it under sharing: out of memory beside others; 'always' models are
    out of memory even alone."""
    if unit.alone and unit.model != "always":
        return {"status": "recorded", "written": True, "alone": True}
    return {"status": "OutOfMemoryError: CUDA out of memory. Tried to allocate 348.00 MiB", "alone": unit.alone}


def test_a_unit_out_of_memory_beside_others_is_taken_again_alone_once():
    U = gpu_real.Unit
    units = [U("record", m, "float32", gib=1) for m in ("a", "always")]
    # both record workers are given a unit at once (no wait between): each ran beside the other
    done = gpu_real.run(None, units, {"record": 2, "check": 1}, capacity_gib=100, budget_s=3600,
                        weight_cache=False, work=fake_unit_oom_unless_alone)
    outcome = {r["unit"].model: (r["status"].split(".")[0], r["alone"]) for r in done["results"]}
    assert outcome == {"a": ("recorded", True),
                       "always": ("OutOfMemoryError: CUDA out of memory", True)}  # retried once, then reported
    assert len(done["results"]) == 2 and done["not_reached"] == []


def test_a_unit_out_of_memory_alone_is_not_taken_again():
    done = gpu_real.run(None, [gpu_real.Unit("record", "always", "float32", gib=1)], {"record": 1, "check": 1},
                        capacity_gib=100, budget_s=3600, weight_cache=False, work=fake_unit_oom_unless_alone)
    assert [(r["status"].split(":")[0], r["alone"]) for r in done["results"]] == [("OutOfMemoryError", False)]


def test_a_unit_marked_alone_waits_for_the_gpu_to_drain_and_nothing_starts_beside_it():
    U = gpu_real.Unit
    alone, other = U("check", "m", "float32", "sdpa", gib=1, alone=True), U("check", "n", "float32", "eager", gib=1)
    recorded = {("m", "float32"), ("n", "float32")}
    assert gpu_real.next_unit([alone, other], recorded, [U("check", "x", "float32", "eager")], 100, set()) is None
    assert gpu_real.next_unit([alone, other], recorded, [], 100, set()) == alone
    assert gpu_real.next_unit([other], recorded, [alone], 100, {("m", "float32")}) is None
    assert gpu_real.out_of_memory({"status": "OutOfMemoryError: CUDA out of memory."})
    assert not gpu_real.out_of_memory({"status": "recorded"})


@pytest.mark.heavy
def test_gpu_real_passes_excuses_to_its_records_and_refuses_a_stale_one(tmp_path):
    """`--excuse MODEL/DTYPE:VARIANT=REASON` reaches the record unit, which decides as `veosnap record
    --excuse` does: here grouped_mm passes the toy qwen3_moe, so the excuse is stale and nothing is written."""
    import shutil

    from golden_repo import CLASS

    from veosnap.reference.zoo import Project

    parser = gpu_real.argparse.ArgumentParser()
    excuses = gpu_real.parse_excuses(["qwen3_moe/float32:grouped_mm=known bug"], parser)
    assert excuses == {("qwen3_moe", "float32"): {"grouped_mm": "known bug"}}
    with pytest.raises(SystemExit):
        gpu_real.parse_excuses(["qwen3_moe/float32:eager=x"], parser)
    shutil.copytree(ROOT / "toy_configs", tmp_path / "toy_configs")
    project = Project.resolve(goldens=tmp_path / "goldens", configs=tmp_path / "toy_configs",
                              testdata=ROOT / "testdata", hardware_class=CLASS)
    out = tmp_path / "out"
    out.mkdir()
    result = gpu_real.phase_real(project, out, ["qwen3_moe"], ["float32"], ["eager"], [], {"record": 1, "check": 1},
                                 capacity_gib=1000, budget_s=3600, excuses=excuses)
    (golden,) = result["goldens"]
    assert golden["status"] == (f"refused: {CLASS}/qwen3_moe/step-float32: --excuse grouped_mm: grouped_mm passes "
                                "it; a stale excuse hides nothing, drop it")
    assert not golden["written"] and not (tmp_path / "goldens" / CLASS).exists()


def test_a_record_waiting_for_memory_keeps_its_room_from_new_checks():
    """Records first: checks of another golden do not start into the room a waiting record needs (on the
    H200 they did, and mixtral-real float32's record started too late to finish)."""
    U = gpu_real.Unit
    record = U("record", "big", "float32", gib=80)
    check, small = U("check", "done", "float32", "sdpa", gib=40), U("check", "done", "float32", "eager", gib=5)
    running = [U("check", "other", "float32", "sdpa", gib=40)]
    recorded = {("done", "float32"), ("other", "float32")}
    # 40 running + 80 fits 128, but not with the other 40 too: the record starts first, a 5 GiB check beside
    assert gpu_real.next_unit([check, record], recorded, running, 128, {("other", "float32")}) == record
    assert gpu_real.next_unit([check, small, record], recorded, running, 128, {("other", "float32")}) == small
    # 60 running: the record waits for memory, and no 40 GiB check takes its room meanwhile
    busy = [U("check", "other", "float32", "sdpa", gib=60)]
    assert gpu_real.next_unit([check, record], recorded, busy, 128, {("other", "float32")}) is None
    # without a free record worker nothing is reserved
    assert gpu_real.next_unit([check, record], recorded, busy, 128, {("other", "float32")}, free=("check",)) == check
    assert gpu_real.next_unit([check, record], recorded, [], 128, set()) == check  # nothing running: list order


def test_the_time_model_takes_measured_records_then_their_sibling_dtype(monkeypatch):
    assert gpu_real.record_seconds("deepseek_v3-real", "bfloat16", 4.04, 2.0) == 174.7  # measured
    assert gpu_real.record_seconds("deepseek_v3-real", "float32", 4.04, 2.0) == 191.5  # measured (2026-12-02)
    # a dtype never measured: its sibling x 1.4 (not the first fit's 99 s, which was abandoned)
    monkeypatch.delitem(gpu_real.H200_RECORD_S, ("deepseek_v3-real", "float32"))
    assert gpu_real.record_seconds("deepseek_v3-real", "float32", 4.04, 2.0) == pytest.approx(174.7 * 1.4)
    assert gpu_real.record_seconds("new-model", "float32", 1.0, 1.0) == pytest.approx(9.2 + 41 + 0.84)


def fake_unit_pid(project, unit):
    time.sleep(0.2)
    return {"status": "skip", "reason": "stand-in", "worker": os.getpid()}


def test_a_goldens_checks_stay_on_the_worker_that_holds_its_weights():
    U = gpu_real.Unit
    units = [U("check", m, "float32", b, gib=1) for m in ("a", "b") for b in ("x", "y", "z")]
    done = gpu_real.run(None, units, {"record": 1, "check": 2}, capacity_gib=100, budget_s=3600,
                        weight_cache=False, work=fake_unit_pid, have=frozenset({("a", "float32"), ("b", "float32")}))
    workers = {m: {r["worker"] for r in done["results"] if r["unit"].model == m} for m in ("a", "b")}
    assert workers["a"] and len(workers["a"]) == 1 and len(workers["b"]) == 1, workers
    assert all(r["end_s"] >= r["start_s"] >= 0 for r in done["results"])  # the timeline, for real.json


def test_plan_says_whether_a_command_fits(capsys):
    plan = ["--model", "deepseek_v3-real", "--dtype", "float32", "--backends", "sdpa_flash,sdpa_efficient,sdpa_cudnn,"
            "sdpa_math,flex_attention,sdpa+grouped_mm", "--no-compile", "--rerecord", "--stop-s", "470"]
    code, out = plan_of(capsys, *plan)
    assert code == 0 and "\nfits: " in out, out[-600:]
    code, out = plan_of(capsys, *plan, "--dtype", "bfloat16")
    assert "DOES NOT FIT" in out, out[-600:]  # both dtypes: 2 records of 175-192 s, as on the H200


def test_liger_is_timed_as_its_fused_moe_only_where_liger_replaces_the_experts():
    from veosnap.reference.zoo import Project

    # gpu_real plans the H200's runs: its class, whatever machine plans them (no golden is read for a plan).
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata",
                              hardware_class="cuda-sm90")
    pairs = frozenset({("gpt_oss-real", "bfloat16"), ("mixtral-real", "bfloat16")})
    units = gpu_real.plan_units(project, ["gpt_oss-real", "mixtral-real"], ["bfloat16"], ["liger"], [], have=pairs)
    seconds = {u.model: u.est_s for u in units}
    assert seconds["mixtral-real"] > gpu_real.LIGER_MOE_S > seconds["gpt_oss-real"]  # gpt-oss keeps HF's experts
    fixed = gpu_real.plan_units(project, ["mixtral-real"], ["bfloat16"], ["liger"], [], have=pairs,
                                liger_autotune=False)  # LIGER_FUSED_MOE_AUTOTUNE=0: one fixed configuration
    assert fixed[0].est_s == pytest.approx(seconds["mixtral-real"] - gpu_real.LIGER_MOE_S + gpu_real.LIGER_FIXED_CONFIG_S)
