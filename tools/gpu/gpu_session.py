"""Everything veosnap does on a GPU machine, in phases that fit one device command each.

    python tools/gpu/gpu_session.py record  --out DIR   # this class's goldens, float32 and bfloat16, verified:
                                                    # every scenario each model runs (step, train, vision, audio)
    python tools/gpu/gpu_session.py matrix  --out DIR   # GPU backends x zoo; precision regression; cross-class
    python tools/gpu/gpu_session.py matrix --scenario vision --scenario audio --out DIR   # the multimodal goldens
    python tools/gpu/gpu_session.py layouts --out DIR   # layouts on this machine's GPUs (NCCL), all models

The real-shape tier (`toy_configs/*-real*`, declared by their veosnap.json): `tools/gpu/gpu_real.py` records
and checks it in one command, several processes sharing the GPU (docs/gpu.md says what fits); or here,
one command each, one unit at a time:

    python tools/gpu/gpu_session.py record-real --dtype float32 --out DIR    # its cuda goldens, in tars of <= 15 MiB
    python tools/gpu/gpu_session.py record-real --dtype bfloat16 --out DIR
    python tools/gpu/gpu_session.py matrix-real --out DIR     # every built-in backend x real-shape goldens
    python tools/gpu/gpu_session.py layouts-real --out DIR    # on 2 GPUs: the layouts that apply, real shapes

The real-shape phases stop starting new work after --budget-s seconds (default 480, so a command fits
a 9-minute device call) and list what they did not reach; --model picks models. Each saves, for
every failing or erroring cell, the whole check report (JSON) under DIR/failures/, enough to write a
minimal reproduction; the real-shape phases pack DIR's detail files so at most 8 files come back.

Each phase writes JSON and a text table under DIR (and `record` a tar of the goldens) so a lent
machine's results come back whole. It runs with the machine's own torch/triton and whichever
transformers is first on the path (a newer wheel can be carried); the versions are recorded. The ten
models of issue 15 need transformers 5.24 (carry its wheel): 5.17's omni thinkers name their parameters
differently and its rotary embeddings break the float64 noise run (docs/models.md).

`record --model M --scenario S` narrows a run (--model repeats; default: the whole toy tier); `--jobs N`
records in N processes on the one GPU, costliest goldens first; past `--budget-s` (default 420 s) the rest
is left out and printed as the command that records it, so each command stays under the device's limit.
The goldens it recorded come back in tars of <= 15 MiB (goldens-<class>-N.tar, paths under goldens/).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import re
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import transformers  # noqa: E402

from veosnap.candidates import backends  # noqa: E402
from veosnap.errors import VeosnapError  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference import hardware, scenarios  # noqa: E402
from veosnap.reference.zoo import Project, load_config  # noqa: E402
from veosnap.runs.verdict import CheckReport  # noqa: E402
from veosnap.render import json as render_json  # noqa: E402
from veosnap.render import text as render_text  # noqa: E402
from veosnap.runs import matrix, record, verify  # noqa: E402
from veosnap.runs.check import check  # noqa: E402

GPU_BACKENDS = ["eager", "sdpa", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention",
                "grouped_mm", "batched_mm", "sdpa+grouped_mm", "liger", "flash_attention_2"]
COMPILE_MODELS = ["llama", "qwen3_moe"]  # inductor compiles take tens of seconds per model
LAYOUTS = ["packed", "microbatch", "ddp", "fsdp2", "hsdp", "ep", "sp", "sp_packed", "sp_fsdp2", "sp_ep", "cp", "cp_packed",
           "tp"]  # tp last: a tp crash ends the torchrun


KERNEL_SWITCHES = ("LIGER_FUSED_MOE_AUTOTUNE", "TRITON_F32_DEFAULT", "NVIDIA_TF32_OVERRIDE")


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "hardware_class": hardware.detect()}
    if torch.cuda.is_available():  # the record phase also runs on the CPU (tools/gpu/simulate_class.py)
        import triton

        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                   cuda=torch.version.cuda, triton=triton.__version__)
    # Switches that change which kernels a library runs, so a table can say how its cells ran.
    switches = {name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ}
    if switches:
        env["switches"] = switches
    return env


def save(out: Path, name: str, data: object) -> None:
    (out / name).write_text(json.dumps(data, indent=2, default=str))


def record_keys(project: Project, models: list[str], chosen: list[str]) -> list[tuple[str, str, str]]:
    """(model, scenario, dtype) of every golden `record` writes: each scenario a model can run (or those
    `chosen` it can), in the form that has a golden file (frozen_vision is checked against vision's)."""
    keys = []
    for model in models or project.models():
        config = load_config(project.configs, model).config
        names = [s.name for s in scenarios.applicable(config) if not chosen or s.name in chosen]
        for name in dict.fromkeys(GoldenKey(project.hardware_class, model, n).recorded.scenario for n in names):
            keys += [(model, name, dtype) for dtype in ("float32", "bfloat16")]
    return keys


# Rough relative cost of a golden, so that parallel jobs start the longest first (a scenario's step count and
# batch: train runs 3 steps; vision and audio run the encoders on a bigger batch).
SCENARIO_COST = {"step": 1, "train": 3, "vision": 3, "audio": 3}


def _cost(project: Project, key: tuple[str, str, str]) -> tuple[int, str]:
    model, scenario, _ = key
    multimodal = bool(scenarios.encoders_of(load_config(project.configs, model).config))
    return (SCENARIO_COST.get(scenario, 1) * (2 if multimodal else 1), model)


def record_one(roots: tuple[Path, Path, Path], hardware_class: str, key: tuple[str, str, str], deadline: float,
               threads: int = 0, stacks_after_s: float = 0) -> dict:
    """Record one golden (model, scenario, dtype) unless the wall-clock `deadline` passed; a row of record.json.
    Runs in a worker process with --jobs (so it takes paths, not a Project, and catches everything: one
    golden's failure must not end the others). With `stacks_after_s`, a recording still running after that
    many seconds prints the worker's stacks to stderr (and goes on): what a hung worker was waiting for."""
    if stacks_after_s > 0:
        import faulthandler

        faulthandler.dump_traceback_later(stacks_after_s, exit=False)
    try:
        return _record_one(roots, hardware_class, key, deadline, threads)
    finally:
        if stacks_after_s > 0:
            faulthandler.cancel_dump_traceback_later()


def _record_one(roots: tuple[Path, Path, Path], hardware_class: str, key: tuple[str, str, str], deadline: float,
                threads: int) -> dict:
    model, scenario, dtype = key
    row: dict = {"model": model, "scenario": scenario, "dtype": dtype}
    if time.time() > deadline:
        return {**row, "left": True}
    if threads:
        torch.set_num_threads(threads)
    goldens, configs, testdata = roots
    project = Project.resolve(goldens=goldens, configs=configs, testdata=testdata, hardware_class=hardware_class)
    t = time.perf_counter()
    try:
        outcome = record.record(project, model, dtype, scenario=scenario)
    except VeosnapError as exc:  # a fragile or near-tie golden: said, and the others still recorded
        return {**row, "error": str(exc), "seconds": round(time.perf_counter() - t, 2)}
    except Exception as exc:  # noqa: BLE001 - an OOM or a library error in one golden
        return {**row, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                "seconds": round(time.perf_counter() - t, 2)}
    return {**row, "written": outcome.written, "seconds": round(time.perf_counter() - t, 2),
            "min_margin": outcome.min_margin, "bytes": outcome.path.stat().st_size,
            "path": str(outcome.path.relative_to(project.goldens))}


def _said(row: dict) -> str:
    where = f"{row['model']} {row['scenario']} {row['dtype']}"
    if row.get("left"):
        return f"left out {where} (over --budget-s)"
    if "error" in row:
        return f"NOT recorded {where}: {row['error']}"
    return f"{'recorded' if row['written'] else 'unchanged'} {where} in {row['seconds']} s, min margin {row['min_margin']}"


def phase_record(project: Project, out: Path, models: list[str], chosen: list[str], budget_s: float,
                 jobs: int = 1) -> None:
    """Record this class's goldens of `models` (default: the toy tier), every scenario each runs (or those
    `chosen`), float32 and bfloat16; verify them; tar the ones this run recorded (<= 15 MiB a tar).

    `jobs` > 1 records in that many processes on the one GPU (spawned: CUDA does not survive a fork), the
    costliest goldens first, each process with its share of the CPU threads. No golden is started after
    `budget_s`; the ones left are printed as the command that records them."""
    keys = sorted(record_keys(project, models, chosen), key=lambda k: _cost(project, k), reverse=True)
    started, deadline = time.perf_counter(), time.time() + budget_s
    roots = (project.goldens, project.configs, project.testdata)
    rows: list[dict] = []
    if jobs <= 1:
        for key in keys:
            rows.append(record_one(roots, project.hardware_class, key, deadline))
            print(_said(rows[-1]), flush=True)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # this process's thread share (OMP_NUM_THREADS under gpu_pytest.sh --jobs), not the whole machine's
        threads = max(1, torch.get_num_threads() // jobs)
        stacks_after_s = float(os.environ.get("GPU_SESSION_STACKS_AFTER_S") or 0)  # set by gpu_pytest.sh
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = [pool.submit(record_one, roots, project.hardware_class, key, deadline, threads, stacks_after_s)
                       for key in keys]
            for future in as_completed(futures):
                rows.append(future.result())
                print(_said(rows[-1]), flush=True)
        except BaseException:
            # Interrupted (Ctrl-C, a test's timeout): a shutdown that waits would wait on a hung worker for
            # ever, so the workers are killed (the pool has no public way to) and the error goes on.
            for worker in list(getattr(pool, "_processes", {}).values()):
                worker.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
    wall = round(time.perf_counter() - started, 1)
    left = [(r["model"], r["scenario"]) for r in rows if r.get("left")]
    if left:
        rest = " ".join(f"--model {m}" for m in dict.fromkeys(m for m, _ in left))
        print(f"budget of {budget_s:g} s spent: {len(left)} goldens left; record them with\n"
              f"  python tools/gpu/gpu_session.py record {rest}", flush=True)
    # verify takes goldens roots (<class>/<model>/<file> under them): the root, then this class's results
    results = [r for r in verify.verify([project.goldens]) if r.key and r.key.hardware_class == project.hardware_class] \
        if project.goldens.is_dir() else []  # nothing recorded into a new project
    bad = [r.line() for r in results if not r.ok]
    print(f"verified {len(results)} goldens: {len(bad)} bad", *bad, sep="\n", flush=True)
    made = [project.goldens / r["path"] for r in rows if "path" in r]
    tars = pack_tars(made, project.goldens, out, f"goldens-{project.hardware_class}") if made else []
    save(out, "record.json", {"env": environment(), "jobs": jobs, "wall_s": wall, "goldens": rows,
                              "verify_bad": bad, "left": [list(k) for k in dict.fromkeys(left)], "tars": tars})
    table = ["| model | scenario | dtype | status | seconds | KiB | min margin |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["model"], r["scenario"], r["dtype"])):
        status = "left out" if r.get("left") else ("error" if "error" in r else
                                                   ("recorded" if r["written"] else "unchanged"))
        table.append(f"| {r['model']} | {r['scenario']} | {r['dtype']} | {status} | {r.get('seconds', '')} | "
                     f"{round(r['bytes'] / 1024) if 'bytes' in r else ''} | {r.get('min_margin', '')} |")
    (out / "record.md").write_text("\n".join(table) + "\n")
    print("\n".join(table), f"{len(rows)} goldens in {wall} s wall with --jobs {jobs}; tars: {tars}", sep="\n",
          flush=True)
    if len(tars) + 2 > MAX_FILES:
        print(f"WARNING: {len(tars) + 2} files to bring back, over {MAX_FILES}: run again with fewer --model", flush=True)


def phase_scenarios(project: Project, out: Path, chosen: list[str]) -> None:
    """matrix --scenario S: the GPU backends on every model that runs S (the multimodal goldens)."""
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:100]}", flush=True)
    results: dict = {"env": environment()}
    for name in chosen:
        models = [m for m in project.models() if scenarios.get(name).applies(load_config(project.configs, m).config)]
        result = matrix.run_matrix(project, models, ["float32", "bfloat16"], GPU_BACKENDS, on_cell=progress,
                                   scenario=name)
        results[name] = render_json.matrix_dict(result)
        with open(out / "matrix-scenarios.txt", "a") as fh:
            fh.write(f"scenario {name}\n{render_text.matrix(result)}\n")
        save(out, "matrix-scenarios.json", results)
        print(render_text.matrix(result), flush=True)


def phase_matrix(project: Project, out: Path) -> None:
    models = project.models()
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:100]}", flush=True)
    results: dict = {"env": environment()}
    single = matrix.run_matrix(project, models, ["float32", "bfloat16"], GPU_BACKENDS, on_cell=progress)
    results["single"] = render_json.matrix_dict(single)
    (out / "matrix.txt").write_text(render_text.matrix(single))
    save(out, "matrix.json", results)  # saved as each part ends: a run cut short still brings back the rest
    print(render_text.matrix(single), flush=True)

    # A precision regression: exact in float32, it must fail the bfloat16 goldens.
    precision = []
    for model in models:
        for dtype in ("float32", "bfloat16"):
            for fault in ("fp8_attention_probabilities", "low_precision_attention"):
                r = check(project, GoldenKey(project.hardware_class, model, "step", dtype),
                                backends.resolve(f"{ROOT}/tests/faults.py:{fault}"))
                precision.append(render_json.check_dict(r))
                print(f"precision {fault} {model} {dtype}: {r.status} {r.worst.ratio if r.worst else ''}", flush=True)
    results["precision"] = precision
    save(out, "matrix.json", results)

    # Cross-class: the cpu goldens checked here, explicitly (the default refuses).
    cross = []
    cpu = Project.resolve(goldens=project.goldens, configs=project.configs, testdata=project.testdata,
                          hardware_class="cpu")
    for model in models:
        for dtype in ("float32", "bfloat16"):
            r = check(cpu, GoldenKey("cpu", model, "step", dtype), backends.resolve("eager"), cross_class=True)
            cross.append(render_json.check_dict(r))
            print(f"cross-class cpu golden {model} {dtype}: {r.status} worst {r.worst.name if r.worst else ''} "
                  f"{r.worst.ratio if r.worst else ''}", flush=True)
    results["cross_class"] = cross
    save(out, "matrix.json", results)

    compiled = matrix.run_matrix(project, COMPILE_MODELS, ["float32", "bfloat16"], ["compile"], on_cell=progress)
    results["compile"] = render_json.matrix_dict(compiled)
    save(out, "matrix.json", results)
    with open(out / "matrix.txt", "a") as fh:
        fh.write("\n" + render_text.matrix(compiled))
    print(render_text.matrix(compiled), flush=True)


def phase_layouts(project: Project, out: Path, nproc: int, models: list[str]) -> None:
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.layout}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:120]}", flush=True)
    result = matrix.run_matrix(project, models or project.models(), ["float32", "bfloat16"], ["eager"], LAYOUTS,
                               check_cells=matrix.default_check(nproc), on_cell=progress)
    (out / "layouts.txt").write_text(render_text.matrix(result))
    print(render_text.matrix(result), flush=True)
    save(out, "layouts.json", {"env": environment(), "nproc": nproc, "layouts": render_json.matrix_dict(result)})


# --- the real-shape tier ---------------------------------------------------------------------------

REAL_BACKENDS = ["eager", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention", "grouped_mm",
                 "batched_mm", "sdpa+grouped_mm", "liger"]
REAL_COMPILE_MODELS = ["qwen3-real", "qwen3_moe-real-small"]  # the smallest dense and MoE: compiles take minutes
REAL_LAYOUTS = ["packed", "microbatch", "ddp", "fsdp2", "ep", "sp", "cp", "tp"]
TAR_LIMIT = 15 << 20  # what one returned file may hold
MAX_FILES = 8  # files one device command brings back


class NotRun(Exception):
    """A cell the phase's time budget did not reach."""


def _real_models(project: Project, chosen: list[str] | None) -> list[str]:
    """The real tier, smallest first (by parameter count), so a budget cut leaves out the largest."""
    from veosnap.reference import models as vmodels
    from veosnap.reference.zoo import load_config

    names = chosen or project.models("real")
    size = {n: sum(p.numel() for p in vmodels.skeleton(load_config(project.configs, n)).parameters()) for n in names}
    return sorted(names, key=lambda n: (size[n], n))


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else 0.0


def pack_tars(files: list[Path], root: Path, out: Path, stem: str, limit: int = TAR_LIMIT) -> list[str]:
    """Pack `files` (paths under `root`) into `out/<stem>-N.tar` of at most `limit` bytes each; a file
    over the limit alone is left out and named in the result."""
    made, batch, size, problems = [], [], 0, []

    def flush() -> None:
        nonlocal batch, size
        if batch:
            name = out / f"{stem}-{len(made) + 1}.tar"
            with tarfile.open(name, "w") as tar:
                for f in batch:
                    tar.add(f, arcname=str(f.relative_to(root)))
            made.append(name.name)
        batch, size = [], 0

    for f in sorted(files):
        n = f.stat().st_size + 1024  # a tar header and padding
        if n > limit:
            problems.append(f"{f.relative_to(root)}: {n} bytes, over the {limit} byte limit of one returned file")
            continue
        if size + n > limit:
            flush()
        batch.append(f)
        size += n
    flush()
    return made + [f"LEFT OUT {p}" for p in problems]


def _bundle_details(out: Path, keep: set[str]) -> None:
    """Everything under `out` but `keep` goes into details.tar, so at most MAX_FILES files come back."""
    extra = [f for f in out.rglob("*") if f.is_file() and f.name not in keep and f.name != "details.tar"]
    if not extra:
        return
    with tarfile.open(out / "details.tar", "w") as tar:
        for f in extra:
            tar.add(f, arcname=str(f.relative_to(out)))
    for f in extra:
        f.unlink()


def phase_record_real(project: Project, out: Path, dtypes: list[str], chosen: list[str] | None, budget_s: float) -> None:
    """Record the real tier's goldens on this GPU, smallest model first, within the budget; tar them."""
    start, rows = time.perf_counter(), []
    for model in _real_models(project, chosen):
        for dtype in dtypes:
            if time.perf_counter() - start > budget_s:
                rows.append({"model": model, "dtype": dtype, "status": "not run (over --budget-s)"})
                print(f"not run: {model} {dtype} (over the budget)", flush=True)
                continue
            _free()
            torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            try:
                outcome = record.record(project, model, dtype)
                rows.append({"model": model, "dtype": dtype, "status": "recorded", "seconds": round(time.perf_counter() - t, 1),
                             "min_margin": outcome.min_margin, "bytes": outcome.path.stat().st_size,
                             "peak_gib": _peak_gib(), "path": str(outcome.path.relative_to(project.goldens))})
            except Exception as exc:  # noqa: BLE001 - one config's failure (an OOM, a near-tie) must not end the run
                rows.append({"model": model, "dtype": dtype, "status": f"{type(exc).__name__}: {exc}".splitlines()[0][:400],
                             "seconds": round(time.perf_counter() - t, 1), "peak_gib": _peak_gib()})
            print(json.dumps(rows[-1]), flush=True)
            save(out, "record-real.json", {"env": environment(), "goldens": rows})
    recorded = [project.goldens / r["path"] for r in rows if r["status"] == "recorded"]
    mine = {(r["model"], r["dtype"]) for r in rows if r["status"] == "recorded"}
    results = [r for r in verify.verify([project.goldens]) if r.key and r.key.hardware_class == project.hardware_class
               and (r.key.model, r.key.dtype) in mine and r.key.scenario == "step"]
    bad = [r.line() for r in results if not r.ok]
    tars = pack_tars(recorded, project.goldens, out, f"goldens-real-{project.hardware_class}-{'-'.join(dtypes)}",
                     limit=TAR_LIMIT)
    save(out, "record-real.json", {"env": environment(), "goldens": rows, "verify_bad": bad, "tars": tars})
    table = ["| model | dtype | status | seconds | peak GiB | golden KiB | min margin |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['model']} | {r['dtype']} | {r['status']} | {r.get('seconds', '')} | {r.get('peak_gib', '')} | "
                     f"{round(r['bytes'] / 1024) if 'bytes' in r else ''} | {r.get('min_margin', '')} |")
    (out / "record-real.md").write_text("\n".join(table) + "\n")
    print("\n".join(table), f"verified {len(results)}: {len(bad)} bad", *bad, f"tars: {tars}", sep="\n", flush=True)
    if len(tars) + 2 > MAX_FILES:
        print(f"WARNING: {len(tars) + 2} files to bring back, over {MAX_FILES}: run again with fewer --model", flush=True)


def _budgeted(budget_s: float, start: float, nproc: int = 2):  # noqa: ANN202 - a matrix.LayoutsCheck
    inner = matrix.default_check(nproc)

    def run(project: Project, key: GoldenKey, backend, layouts: list[str]) -> list[CheckReport]:  # noqa: ANN001
        if time.perf_counter() - start > budget_s:
            raise NotRun(f"not run: over --budget-s {budget_s:g}")
        _free()
        return inner(project, key, backend, layouts)

    return run


def _finish_matrix(result: matrix.Matrix, out: Path, name: str) -> dict:
    """Cells the budget did not reach become skips saying so; failing cells' whole reports are saved."""
    result.cells = [dataclasses.replace(c, status="skip") if c.reason.startswith("NotRun") else c for c in result.cells]
    failures = out / "failures"
    for c in result.cells:
        if c.status in ("fail", "error") and c.report is not None:
            failures.mkdir(exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{name}-{c.model}-{c.dtype}-{c.backend}-{c.layout}")[-180:]
            (failures / f"{stem}.json").write_text(
                json.dumps(render_json.check_dict(c.report), indent=1, default=str))
    return render_json.matrix_dict(result)


def _worst_table(result: matrix.Matrix) -> str:
    """Worst ratio per (backend, layout) column over the models and dtypes it ran: the docs' table."""
    lines = ["| backend / layout | cells pass/fail/skip/error | worst ratio | at |", "|---|---|---|---|"]
    for col in result.columns:
        cells = [c for c in result.cells if (c.backend, c.layout) == (col.backend, col.layout)]
        counts = "/".join(str(sum(c.status == s for c in cells)) for s in matrix.STATUSES)
        ran = [c for c in cells if c.worst_ratio is not None and c.status in ("pass", "fail")]
        worst = max(ran, key=lambda c: c.worst_ratio, default=None)
        at = f"{worst.model} {worst.dtype} {worst.worst_tensor}" if worst else ""
        lines.append(f"| {col.label} | {counts} | {f'{worst.worst_ratio:.3g}' if worst else ''} | {at} |")
    return "\n".join(lines) + "\n"


def phase_matrix_real(project: Project, out: Path, dtypes: list[str], chosen: list[str] | None, budget_s: float,
                      backend_specs: list[str] | None) -> None:
    """Every built-in backend that runs here against the real-shape goldens of this machine's class."""
    start = time.perf_counter()
    here = set(backends.runnable_builtins())
    specs = [b for b in (backend_specs or REAL_BACKENDS) if all(part in here for part in b.split("+"))]
    left_out = sorted(set(backend_specs or REAL_BACKENDS) - set(specs))
    models = _real_models(project, chosen)
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:100]}", flush=True)
    results: dict = {"env": environment(), "backends": specs, "not_installed": left_out}
    single = matrix.run_matrix(project, models, dtypes, specs, check_cells=_budgeted(budget_s, start), on_cell=progress)
    results["single"] = _finish_matrix(single, out, "single")
    save(out, "matrix-real.json", results)
    compile_models = [m for m in REAL_COMPILE_MODELS if m in models]
    compiled = matrix.run_matrix(project, compile_models, dtypes, ["compile"], check_cells=_budgeted(budget_s, start),
                                 on_cell=progress)
    results["compile"] = _finish_matrix(compiled, out, "compile")
    save(out, "matrix-real.json", results)
    text = (render_text.matrix(single) + "\n" + render_text.matrix(compiled) + "\n" + _worst_table(single)
            + _worst_table(compiled))
    (out / "matrix-real.txt").write_text(text)
    print(text, f"not installed here: {left_out}", sep="\n", flush=True)
    _bundle_details(out, {"matrix-real.json", "matrix-real.txt"})


def phase_layouts_real(project: Project, out: Path, dtypes: list[str], chosen: list[str] | None, budget_s: float,
                       nproc: int, layouts: list[str] | None) -> None:
    """The layouts that apply (each declines what it cannot run) on this machine's GPUs, real shapes."""
    start = time.perf_counter()
    progress = lambda cell, done, total: print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.layout}: "  # noqa: E731
                                              f"{cell.status} {cell.worst_ratio} {cell.reason[:120]}", flush=True)
    result = matrix.run_matrix(project, _real_models(project, chosen), dtypes, ["eager"], layouts or REAL_LAYOUTS,
                               check_cells=_budgeted(budget_s, start, nproc), on_cell=progress)
    data = {"env": environment(), "nproc": nproc, "layouts": _finish_matrix(result, out, "layouts")}
    save(out, "layouts-real.json", data)
    text = render_text.matrix(result) + "\n" + _worst_table(result)
    (out / "layouts-real.txt").write_text(text)
    print(text, flush=True)
    _bundle_details(out, {"layouts-real.json", "layouts-real.txt"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("record", "matrix", "layouts", "record-real", "matrix-real", "layouts-real"))
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"),
                        help="real-shape phases: dtypes (default: both; bfloat16 first)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="record and the real-shape phases: start nothing new after this many seconds "
                             "(default 420 for record, 480 for the real-shape phases)")
    parser.add_argument("--backends", help="matrix-real: backend specs, comma-separated (default: REAL_BACKENDS)")
    parser.add_argument("--layouts", help="layouts-real: layouts, comma-separated (default: REAL_LAYOUTS)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--nproc", type=int, default=0, help="layouts: processes (default: every GPU)")
    parser.add_argument("--model", action="append",
                        help="record, layouts and the real-shape phases: only these models (default: all of the tier)")
    parser.add_argument("--scenario", action="append",
                        help="record: only these scenarios (default: every one); matrix: the GPU backends on these "
                             "scenarios' goldens instead of the step matrix")
    parser.add_argument("--jobs", type=int, default=1,
                        help="record: record in this many processes on the one GPU (default 1)")
    args = parser.parse_args(argv)
    # tools/gpu/simulate_class.py makes a CPU answer a GPU class: its `record` runs there, on the CPU.
    simulated_record = args.phase == "record" and hardware.detect() != "cpu"
    if not torch.cuda.is_available() and not simulated_record:
        print(f"gpu_session {args.phase}: skipped, no CUDA device here (this script records and checks GPU goldens)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(environment()), flush=True)
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    dtypes = args.dtype or ["bfloat16", "float32"]
    budget_s = args.budget_s if args.budget_s is not None else (420.0 if args.phase == "record" else 480.0)
    if args.phase == "record-real":
        phase_record_real(project, args.out, dtypes, args.model, budget_s)
    elif args.phase == "matrix-real":
        phase_matrix_real(project, args.out, dtypes, args.model, budget_s,
                          args.backends.split(",") if args.backends else None)
    elif args.phase == "layouts-real":
        phase_layouts_real(project, args.out, dtypes, args.model, budget_s,
                           args.nproc or torch.cuda.device_count(), args.layouts.split(",") if args.layouts else None)
    elif args.phase == "record":
        phase_record(project, args.out, args.model or [], args.scenario or [], budget_s, args.jobs)
    elif args.phase == "matrix" and args.scenario:
        phase_scenarios(project, args.out, args.scenario)
    elif args.phase == "matrix":
        phase_matrix(project, args.out)
    else:
        phase_layouts(project, args.out, args.nproc or torch.cuda.device_count(), args.model or [])


if __name__ == "__main__":
    main()
