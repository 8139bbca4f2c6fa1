"""Kernel libraries on a GPU: each library backend against every golden of this machine, and the
float32 reproductions, in one unattended command.

    python3 tools/gpu/gpu_kernels.py --out $OUT                  # everything, within --budget seconds (420)
    python3 tools/gpu/gpu_kernels.py --out DIR --backends fa4,quack --models llama,qwen3_moe --jobs 2
    python3 tools/gpu/gpu_kernels.py --out DIR --backends liger,liger@ieee --dtypes float32 --no-repro
    python3 tools/gpu/gpu_kernels.py --plan --backends fa4,quack --models llama-real --jobs 2   # no GPU: fits?
    python3 tools/gpu/gpu_kernels.py --no-liger-autotune ...     # LIGER_FUSED_MOE_AUTOTUNE=0 (the table says so)
    python3 tools/gpu/gpu_kernels.py --isolate --dtypes bfloat16 --models llama-real \
        --backends eager,fa4,tests/realshape_faults.py:rope_angle_low_precision_far   # real shape, layers isolated

`--plan` prints, for the cuda-sm90 goldens, the schedule the run would follow if every cell took its estimated
seconds (the measured H200 figures: see "the time model" below), the memory of the cells running at once, and
`fits` or `DOES NOT FIT` (exit 1). docs/gpu.md has the commands it was used to split.

What it runs (all of it under the budget; cells it cannot reach in time are listed as not run):

1. The reproductions (`repro_tf32.py liger|fla`, the script of docs/findings/liger-fp32-moe.md), each twice in a
   fresh process: with Triton's
   default float32 dot precision and with TRITON_F32_DEFAULT=ieee (and a fresh TRITON_CACHE_DIR).
2. The cells: for every golden of this machine's hardware class (toy and real-shape; not the train
   scenario), each backend of --backends in the `single` and `packed` layouts (`eager`, the control,
   in `single` only, but for linear-attention models, which it fails packed by design). Where no
   golden has linear-attention layers yet, Qwen3.5 goldens from toy_configs_next/ are recorded into a
   scratch project first, so `fla` has a model (rows marked "(scratch)"). Backends whose kernels take 16-bit operands only (fa4, flash_attention_4,
   quack) are run on float32 goldens of toy width only, to show their own decline; `fla` only where the
   config has linear-attention layers, `quack` only where it has experts. `liger@ieee` and `fla@ieee`
   are the same backends under TRITON_F32_DEFAULT=ieee, on the float32 goldens they fail by default.
   One worker process per backend, --jobs at once, toy-width goldens first, bfloat16 first; a library
   that fails to import or compile is that cell's ERROR; a worker that dies (a CUDA fault) costs its
   current cell (ERROR, with its last stderr line) and is restarted for the rest.
3. The table (model x dtype x backend: single and packed status and worst error/bound ratio, then `iso`
   and the worst isolated statistic's ratio where the layers were isolated, the first divergence, the
   isolated place that failed, or the reason), printed and written to table.md; results.json holds every cell with its
   notes (what each library ran, for which modules) and, for failing cells, the whole check report;
   repro.json the reproductions' numbers; log.txt every worker's output.

Needs the machine's torch and triton and, first on PYTHONPATH, the carried wheels (flash-attn-4,
nvidia-cutlass-dsl and its libs, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops,
flash-linear-attention, fla-core, liger-kernel, transformers 5.24): see docs/gpu.md. Wheels installed
with `pip --target DIR` and put on PYTHONPATH lose their `.pth` files (Python reads those in
site-packages only), and nvidia-cutlass-dsl makes `cutlass` importable through one; this script reads
the `.pth` files of every PYTHONPATH entry itself, first thing, and hands what they add to its workers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "gpu"))  # realshape_memory and gpu_real, for --plan

BACKENDS = ["eager", "fa4", "flash_attention_4", "fla", "quack", "liger", "fa4+quack", "liger@ieee", "fla@ieee"]
SIXTEEN_BIT = {"fa4", "flash_attention_4", "quack", "fa4+quack"}  # backends whose kernels decline float32
IEEE = {"TRITON_F32_DEFAULT": "ieee"}
TOY_WIDTH = 256  # hidden sizes up to this are toys: quick enough to run every cell
DISTRIBUTIONS = ["torch", "triton", "transformers", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels",
                 "flash-linear-attention", "fla-core", "liger-kernel", "apache-tvm-ffi"]


def read_pythonpath_pth_files(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Process the `.pth` files of every PYTHONPATH entry, as Python does for site-packages only, and put
    the paths they add at the end of `environ["PYTHONPATH"]`, so processes started with it import the
    same; returns those paths. nvidia-cutlass-dsl exposes `cutlass` only through such a file
    (nvidia_cutlass_dsl_packages.pth adds nvidia_cutlass_dsl/dsl_packages), which `pip --target DIR`
    installs into DIR and a plain `PYTHONPATH=DIR` never reads. Safe to call again."""
    entries = [e for e in environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    before = set(sys.path)
    for entry in entries:
        if os.path.isdir(entry):
            site.addsitedir(entry)
    sys.path[:] = list(dict.fromkeys(sys.path))  # a .pth `import` line runs again on each call
    known = {os.path.abspath(e) for e in entries}
    added = [p for p in sys.path if p not in before and os.path.abspath(p) not in known]
    if added:
        environ["PYTHONPATH"] = os.pathsep.join([*entries, *added])
    return added


# --- the plan ------------------------------------------------------------------------------------------


def versions() -> dict:
    found = {}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    return found


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def width(config: dict) -> int:
    return int(text_config(config).get("hidden_size") or 0)


def has_experts(config: dict) -> bool:
    text = text_config(config)
    return any(int(text.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def has_linear_attention(config: dict) -> bool:
    return "linear_attention" in (text_config(config).get("layer_types") or [])


def applies(label: str, config: dict, dtype: str) -> str | None:
    """Why the script does not run backend `label` on a golden (None: it runs it)."""
    spec = label.split("@")[0]
    parts = spec.split("+")
    if "fla" in parts and not has_linear_attention(config):
        return "no linear-attention layers"
    if "quack" in parts and not has_experts(config):
        return "dense model (no experts)"
    if spec in SIXTEEN_BIT and dtype != "bfloat16" and width(config) > TOY_WIDTH:
        return "16-bit kernels: the backend declines float32 (shown on the toys)"
    if "@ieee" in label and dtype != "float32":
        return "the IEEE variant is for float32 goldens"
    if label == "liger@ieee" and not has_experts(config):
        return "liger fails float32 MoE models only"
    return None


def plan(projects: list[tuple[object, dict]], labels: list[str], models: list[str] | None,
         dtypes: list[str] | None = None, only: list[str] | None = None) -> tuple[dict[str, list[dict]], list[dict]]:
    """Cells per backend label (ordered: toy width first, bfloat16 first) and the cells not run.

    `projects` are (Project, the dirs that resolve it in a worker): the machine's goldens, and a
    scratch project this run recorded (see `scratch_linear_attention`). `only`: run just these of the
    layouts (--layouts)."""
    from veosnap.golden import store
    from veosnap.reference.zoo import load_config

    cells: dict[str, list[dict]] = {label: [] for label in labels}
    skipped = []
    for project, dirs in projects:
        for key, path in store.list_goldens(project.goldens):
            if key.hardware_class != project.hardware_class or key.scenario.startswith("train"):
                continue
            if (models and key.model not in models) or (dtypes and key.dtype not in dtypes):
                continue
            try:
                config = load_config(project.configs, key.model).config
            except Exception as exc:  # noqa: BLE001 - a golden without its config is reported, not fatal
                skipped.append(dict(model=key.model, dtype=key.dtype, scenario=key.scenario, backend="*",
                                    layout="*", status="not run", reason=str(exc)[:200]))
                continue
            for label in labels:
                # eager is the control, in single; and in packed where it fails by design (linear attention)
                control = label == "eager" and not has_linear_attention(config)
                layouts = [layout for layout in (["single"] if control else ["single", "packed"])
                           if not only or layout in only]
                why = applies(label, config, key.dtype)
                base = dict(model=key.model, dtype=key.dtype, scenario=key.scenario, backend=label,
                            width=width(config), dirs=dirs)
                if why:
                    skipped += [dict(base, layout=layout, status="n/a", reason=why) for layout in layouts]
                else:
                    cells[label].append(dict(base, layouts=layouts, bytes=path.stat().st_size))
    for label in labels:
        cells[label].sort(key=lambda c: (c["width"] > TOY_WIDTH, c["dtype"] != "bfloat16", c["bytes"], c["model"]))
    return cells, skipped


def scratch_linear_attention(project, scratch: Path) -> tuple[object, dict] | None:
    """When no golden here has linear-attention layers (the Qwen3.5 family not in the zoo yet), record
    this machine's goldens of the Qwen3.5 toy from toy_configs_next/ into a scratch project, so `fla`
    has something to run on. Its table rows say `(scratch)`."""
    from veosnap.golden import store
    from veosnap.reference.zoo import Project, load_config
    from veosnap.runs.record import record

    for key, _ in store.list_goldens(project.goldens):
        try:
            if key.hardware_class == project.hardware_class and has_linear_attention(
                    load_config(project.configs, key.model).config):
                return None
        except Exception:  # noqa: BLE001, S112 - a golden without its config is reported by plan()
            continue
    source = ROOT / "toy_configs_next" / "qwen3_5"
    if not source.is_dir():
        return None
    shutil.copytree(source, scratch / "toy_configs" / "qwen3_5")
    dirs = {"goldens": str(scratch / "goldens"), "configs": str(scratch / "toy_configs"),
            "testdata": str(project.testdata)}
    local = Project.resolve(**dirs)
    for dtype in ("bfloat16", "float32"):
        outcome = record(local, "qwen3_5", dtype)
        print(f"recorded a scratch golden {outcome.key} (no linear-attention golden in {project.goldens})", flush=True)
    return local, dirs


# --- the time model (--plan) -----------------------------------------------------------------------
# A cell is one backend against one golden, in each layout that runs (packed declines NO_PACKING families
# before building). Every layout builds the model afresh: a worker here has no weight cache. Build and step
# are tools/gpu/gpu_real.py's measured H200 model (first build 16 s per billion parameters; one step 0.012 s
# (bfloat16) / 0.09 s (float32) per billion parameters x thousand positions; 1 s fixed per check).
# The libraries' first-call costs, per worker process:
LIB_FIRST_S = {  # import and first JIT compile of the library (fa4's first call per shape: about 2.5 s per
    # kernel, measured by repro_fa4.py (docs/findings/fa4-sm90-backward-head-dim.md) on the H200; forward, backward,
    # postprocess and preprocess)
    "fa4": 10.0, "flash_attention_4": 10.0, "quack": 10.0, "fa4+quack": 20.0, "fla": 20.0, "liger": 5.0,
    "eager": 0.0,
}
NEW_SHAPE_S = {"fa4": 10.0, "flash_attention_4": 10.0, "quack": 10.0, "fa4+quack": 20.0}  # a later golden's shapes
# liger's fused MoE (`LigerExperts`, on LIGER_FUSED_MOE_TYPES): Triton autotunes every GEMM once per process,
# (H, I) and dtype (its autotune key is H_dim, I_dim; M, the token count, is not in it, so `packed` reuses what
# `single` tuned). Measured on the H200: the toy qwen3_moe 119 s (Triton's default dots) and 288 s (IEEE dots,
# fresh cache); qwen3_moe-real-small 131-135 s (tools/gpu/gpu_real.py, both dtypes); mixtral-real still running after
# 240 s (a lower bound: 360 s assumed). Real shapes not measured: REAL_AUTOTUNE_S.
LIGER_AUTOTUNE_S = {"qwen3_moe-real-small": 135.0, "mixtral-real": 360.0}
TOY_AUTOTUNE_S = 119.0
IEEE_AUTOTUNE_FACTOR = 288.0 / 119.0
REAL_AUTOTUNE_S = 300.0
# With LIGER_FUSED_MOE_AUTOTUNE=0 (liger's own switch: one fixed configuration per kernel) only the compiles
# remain: 5 kernels of a few seconds each. Not measured yet.
FIXED_CONFIG_S = 25.0
DEADLINE_MARGIN_S = 25.0  # the runner starts nothing after --budget minus this (see main)


def liger_autotune_off(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether liger's fused-MoE autotuning is switched off (as liger-kernel 0.8.5 reads it at import)."""
    return environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() in ("0", "false", "no")


def model_size(project, model: str) -> dict:
    """Parameters, rows and width of a model's golden batch, counted on the meta device
    (tools/gpu/realshape_memory.py), with the check's planned GPU memory per dtype and the family."""
    from realshape_memory import estimate, planned_gib

    from veosnap.reference.zoo import load_config

    e = estimate(project, model)
    text = text_config(load_config(project.configs, model).config)
    return dict(b=e["parameters"] / 1e9, kt=e["rows"] * e["width"] / 1000, model_type=text.get("model_type"),
                gib={d: planned_gib(e, "check", d) for d in ("bfloat16", "float32")})


def cell_seconds(cell: dict, size: dict, first: bool, autotune: bool, new_shape: bool = True) -> float:
    """A cell's estimated seconds on the H200: a build and a step per layout that runs, and the library's
    first-call costs (`first`: the worker's first cell; `new_shape`: shapes this worker has not compiled)."""
    import gpu_real

    from veosnap.candidates.layouts.packed import NO_PACKING

    label = cell["backend"]
    spec = label.split("@")[0]
    runs = [layout for layout in cell["layouts"] if not (layout == "packed" and size["model_type"] in NO_PACKING)]
    per_layout = (gpu_real.CHECK_FIXED_S + gpu_real.BUILD_S_PER_B * size["b"]
                  + gpu_real.STEP_S_PER_BKT[cell["dtype"]] * size["b"] * size["kt"])
    seconds = len(runs) * per_layout + (LIB_FIRST_S.get(spec, 0.0) if first else 0.0)
    seconds += NEW_SHAPE_S.get(spec, 0.0) if new_shape and not first else 0.0
    if spec.split("+")[0] == "liger" and size["model_type"] in gpu_real.LIGER_FUSED_MOE_TYPES and runs:
        if not autotune:
            seconds += FIXED_CONFIG_S
        else:
            tune = LIGER_AUTOTUNE_S.get(cell["model"], REAL_AUTOTUNE_S if cell["width"] > TOY_WIDTH
                                        else TOY_AUTOTUNE_S)
            seconds += tune * (IEEE_AUTOTUNE_FACTOR if label.endswith("@ieee") else 1.0)
    return seconds


def estimate_plan(groups: dict[str, list[dict]], sizes: dict[str, dict], jobs: int, budget: float,
                  capacity_gib: float, autotune: bool) -> dict:
    """The schedule the runner would follow if every cell took its estimate: one worker per backend label,
    `jobs` at once, each running its cells in order, none started after the deadline (`budget` minus the
    margin). It also sums the planned memory of the cells running at once: the runner does not wait for
    memory, so a plan whose peak is over `capacity_gib` does not fit either."""
    import gpu_real

    deadline = budget - DEADLINE_MARGIN_S
    queue = [(label, cells) for label, cells in groups.items() if cells]
    workers: list[dict] = []  # each: label, cells left, clock
    rows, not_reached, intervals = [], [], []
    clock = 0.0
    while queue or workers:
        while queue and len(workers) < jobs and clock < deadline:
            label, cells = queue.pop(0)
            workers.append(dict(label=label, cells=list(cells), clock=clock + gpu_real.PROCESS_START_S, seen=set()))
        if not workers:
            not_reached += [c for _, cells in queue for c in cells]
            break
        worker = min(workers, key=lambda w: w["clock"])
        if not worker["cells"] or worker["clock"] >= deadline:
            not_reached += worker["cells"]
            workers.remove(worker)
            clock = max(clock, worker["clock"])
            continue
        cell = worker["cells"].pop(0)
        size = sizes[cell["model"]]
        shape = (cell["model"], cell["dtype"])
        seconds = cell_seconds(cell, size, first=not worker["seen"], autotune=autotune,
                               new_shape=shape not in worker["seen"])
        worker["seen"].add(shape)
        start, end = worker["clock"], worker["clock"] + seconds
        worker["clock"] = end
        gib = 0.0 if size["b"] < 0.01 else size["gib"][cell["dtype"]]
        rows.append(dict(worker=worker["label"], model=cell["model"], dtype=cell["dtype"], start=start, end=end,
                         gib=gib))
        intervals.append((start, end, gib))
    end_s = max([r["end"] for r in rows], default=0.0)
    peak = max([sum(g for s, e, g in intervals if s <= t < e) for t, _, _ in intervals], default=0.0)
    late = [r for r in rows if r["end"] > deadline]
    fits = not not_reached and not late and peak <= capacity_gib
    return dict(rows=rows, not_reached=not_reached, late=late, end_s=end_s, peak_gib=peak, fits=fits,
                deadline=deadline)


def print_plan(plan: dict, jobs: int, budget: float, capacity_gib: float, autotune: bool) -> None:
    print("| worker | golden | start s | end s | GiB (est.) |\n|---|---|---|---|---|")
    for r in plan["rows"]:
        late = " (past the deadline: killed)" if r["end"] > plan["deadline"] else ""
        print(f"| {r['worker']} | {r['model']} {r['dtype']} | {r['start']:.0f} | {r['end']:.0f}{late} | {r['gib']:.0f} |")
    missing = [f"{c['backend']} {c['model']} {c['dtype']}" for c in plan["not_reached"]]
    print(f"\n{len(plan['rows']) + len(missing)} cells on {jobs} workers, liger's fused-MoE autotune "
          f"{'on' if autotune else 'off (LIGER_FUSED_MOE_AUTOTUNE=0)'}: the estimate ends at {plan['end_s']:.0f} s "
          f"(cells start until {plan['deadline']:.0f} s = --budget {budget:g} - {DEADLINE_MARGIN_S:g}); peak "
          f"{plan['peak_gib']:.0f} GiB of {capacity_gib:.0f}; not reached: {len(missing)}"
          + (f" ({', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''})" if missing else ""))
    why = []
    if missing or plan["late"]:
        why.append(f"{len(missing)} not started, {len(plan['late'])} cut at the deadline")
    if plan["peak_gib"] > capacity_gib:
        why.append(f"{plan['peak_gib']:.0f} GiB at once (fewer --jobs, or split the models)")
    print("fits" if plan["fits"] else f"DOES NOT FIT: {'; '.join(why)}")


# --- one worker: one backend's cells, in this process --------------------------------------------------


def project_from(dirs: dict):
    from veosnap.reference.zoo import Project

    return Project.resolve(**{k: v for k, v in dirs.items() if v})


def worker(label: str, cells_file: Path, results_file: Path, deadline: float) -> None:
    """Run one backend's cells in this process (`isolate` from $GPU_KERNELS_ISOLATE: the parent's --isolate)."""
    from veosnap.candidates import backends
    from veosnap.errors import describe
    from veosnap.golden.key import GoldenKey
    from veosnap.render import json as render_json
    from veosnap.runs.check import check_layouts

    backend = backends.resolve(label.split("@")[0])
    cells = json.loads(cells_file.read_text())
    projects: dict[str, object] = {}
    # A library that failed to import here fails every later cell alike: say so at once instead of building
    # each model first (a missing nvidia-cutlass-dsl-libs-core cost 48 cells and 222 s on the H200).
    unimportable: str | None = None
    with results_file.open("a") as out:
        for cell in cells:
            if time.time() > deadline:
                break
            out.write(json.dumps({"event": "start", **cell}) + "\n")
            out.flush()
            print(f"[{label}] {cell['model']} {cell['dtype']} {cell['scenario']} ...", flush=True)
            t0 = time.perf_counter()
            project = projects.setdefault(json.dumps(cell["dirs"]), project_from(cell["dirs"]))
            key = GoldenKey(project.hardware_class, cell["model"], cell["scenario"], cell["dtype"])
            rows = []
            if unimportable:
                rows = [dict(layout=layout, status="ERROR", reason=f"{unimportable} (not run: this library failed "
                             "to import in this worker's earlier cell)") for layout in cell["layouts"]]
            else:
                try:
                    for report in check_layouts(project, key, backend, cell["layouts"],
                                                isolate=os.environ.get("GPU_KERNELS_ISOLATE") == "1"):
                        rows.append(row(report, render_json.check_dict(report)))
                except Exception as exc:  # noqa: BLE001 - a bad golden or config is this cell's error
                    rows = [dict(layout=layout, status="ERROR", reason=describe(exc)) for layout in cell["layouts"]]
                unimportable = next((str(r["reason"]) for r in rows if r["status"] == "ERROR" and str(
                    r.get("reason") or "").startswith(("ModuleNotFoundError", "ImportError"))), None)
            seconds = round(time.perf_counter() - t0, 2)
            for r in rows:
                print(f"[{label}] {cell['model']} {cell['dtype']} {r['layout']}: {show(r)} "
                      f"{explain(r) or ''}"[:240],
                      flush=True)
            out.write(json.dumps({"event": "done", **cell, "rows": rows, "seconds": seconds}) + "\n")
            out.flush()


def row(report, full: dict) -> dict:
    worst = report.worst
    found = dict(layout=report.layout, status=report.status, ratio=worst.ratio if worst else None,
                 worst=worst.name if worst else None, first_divergence=report.first_divergence,
                 first_gradient_divergence=report.first_gradient_divergence,
                 reason=report.skipped or report.error, notes=list(report.notes))
    isolated = report.isolated_ranked()
    if isolated:  # the layers in isolation: the worst statistic, and where (a 1% bug shows here, not in `ratio`)
        found.update(isolated=isolated[0].ratio, isolated_place=f"{isolated[0].place} ({isolated[0].statistic})",
                     isolated_parts=len(isolated))
    elif report.not_isolated:
        found["not_isolated"] = report.not_isolated
    if report.status in ("FAIL", "ERROR"):
        found["report"] = full
    return found


def fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return ""
    return f"{ratio:.2g}x"


# --- the parent: workers, reproductions, the table -----------------------------------------------------


class Runner:
    """Starts workers and reproductions as subprocesses (each writing to its own log file), at most `jobs`
    workers at once, polling them, until every cell ran or the deadline passed."""

    def __init__(self, out: Path, jobs: int, deadline: float) -> None:
        self.out, self.jobs, self.deadline = out, jobs, deadline
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_kernels_"))
        self.logs: list[tuple[str, Path]] = []

    def env(self, extra: dict) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        if "TRITON_F32_DEFAULT" in extra:  # never reuse a kernel compiled with the other precision
            env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_ieee_", dir=self.scratch)
        return env

    def spawn(self, name: str, command: list[str], extra: dict) -> tuple[subprocess.Popen, Path]:
        log = self.scratch / f"{name}.log"
        self.logs.append((name, log))
        with log.open("w") as fh:
            proc = subprocess.Popen(command, cwd=ROOT, env=self.env(extra), stdout=fh, stderr=subprocess.STDOUT)
        return proc, log

    def run(self, groups: dict[str, list[dict]], repros: list[tuple[str, dict]]) -> tuple[list[dict], list[dict]]:
        pending = [(label, cells, 0) for label, cells in groups.items() if cells]
        running: list[dict] = []
        repro_procs = []
        if repros:  # the script as docs/findings/ shows it (tests/findings.py reads it from there, as the tests do)
            sys.path.insert(0, str(ROOT / "tests"))
            import findings

            script = findings.write("repro_tf32.py", self.scratch)
        for which, extra in repros:  # quick, and decisive for the findings: first, beside the workers
            proc, log = self.spawn(f"repro-{which}{'-ieee' if extra else ''}",
                                   [sys.executable, str(script), which], extra)
            repro_procs.append((which, extra, proc, log))
        results: list[dict] = []
        while pending or running:
            while pending and len(running) < self.jobs and time.time() < self.deadline:
                label, cells, attempt = pending.pop(0)
                name = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', label)}-{attempt}"
                cells_file, results_file = self.scratch / f"{name}.cells.json", self.scratch / f"{name}.jsonl"
                cells_file.write_text(json.dumps(cells))
                proc, log = self.spawn(name, [sys.executable, __file__, "_worker", label, str(cells_file),
                                              str(results_file), str(self.deadline)],
                                       IEEE if label.endswith("@ieee") else {})
                running.append(dict(proc=proc, label=label, cells=cells, attempt=attempt, results=results_file,
                                    log=log))
            if not pending and not running:
                break
            if not running:  # the deadline passed with work pending
                for label, cells, _ in pending:
                    results += [dict(c, layout=layout, status="not run", reason="time budget")
                                for c in cells for layout in c["layouts"]]
                break
            time.sleep(1.0)
            for job in list(running):
                proc = job["proc"]
                if proc.poll() is None and time.time() < self.deadline + 30:
                    continue
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                running.remove(job)
                results += self.collect(job, pending)
        repro = [self.repro_result(*item) for item in repro_procs]
        with (self.out / "log.txt").open("w") as out:
            for name, log in self.logs:
                out.write(f"===== {name}\n{log.read_text(errors='replace')}\n")
        return results, repro

    def collect(self, job: dict, pending: list) -> list[dict]:
        """A finished worker's rows; the cell it died in is an ERROR; the rest run again or are not run."""
        proc, cells = job["proc"], job["cells"]
        output = job["log"].read_text(errors="replace")
        print(output, end="", flush=True)
        done, started = read_results(job["results"], cells)
        finished = {cell_id(c) for c in done}
        rows = list(done)
        if started and cell_id(started) not in finished:  # it died (or was killed) inside this cell
            last = (output.strip().splitlines() or ["no output"])[-1][:300]
            why = ("killed at the time budget" if time.time() >= self.deadline
                   else f"the worker process died (exit {proc.returncode}): {last}")
            rows += [dict(started, layout=layout, status="ERROR", reason=why) for layout in started["layouts"]]
            finished.add(cell_id(started))
        rest = [c for c in cells if cell_id(c) not in finished]
        if rest and proc.returncode != 0 and time.time() < self.deadline and job["attempt"] < 3:
            pending.append((job["label"], rest, job["attempt"] + 1))
        elif rest:
            rows += [dict(c, layout=layout, status="not run", reason="time budget" if proc.returncode == 0
                          else f"the worker process ended (exit {proc.returncode})")
                     for c in rest for layout in c["layouts"]]
        return rows

    def repro_result(self, which: str, extra: dict, proc: subprocess.Popen, log: Path) -> dict:
        try:
            proc.wait(timeout=max(5.0, self.deadline - time.time() + 30))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        output = log.read_text(errors="replace")
        print(f"--- reproduction: {which}, {extra or 'Triton default (tf32)'}\n{output}", flush=True)
        lines = output.strip().splitlines()
        try:
            found = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            found = {"error": (lines or ["no output"])[-1][:300], "exit": proc.returncode}
        return {"library": which, "env": extra, **found}


def cell_id(cell: dict) -> tuple:
    return (cell["model"], cell["dtype"], cell["scenario"], cell["backend"])


def read_results(path: Path, cells: list[dict]) -> tuple[list[dict], dict | None]:
    """The rows of every finished cell in `path` (one per layout), and the cell started last."""
    mine = {cell_id(c) for c in cells}
    done, started = [], None
    if not path.exists():
        return done, started
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if cell_id(event) not in mine:
            continue
        if event["event"] == "start":
            started = {k: v for k, v in event.items() if k != "event"}
        else:
            base = {k: v for k, v in event.items() if k not in ("event", "rows")}
            done += [dict(base, **r) for r in event["rows"]]
    return done, started


def table(rows: list[dict]) -> tuple[str, str]:
    """The text and markdown tables: one line per (model, scenario, dtype, backend) that ran or was
    meant to; backends that do not apply to a model are counted below the table, by reason."""
    by_cell: dict[tuple, dict] = {}
    for r in rows:
        model = r["model"] + (" (scratch)" if "gpu_kernels_scratch_" in str((r.get("dirs") or {}).get("goldens")) else "")
        cell = by_cell.setdefault((model, r.get("scenario", "step"), r["dtype"], r["backend"]), {})
        cell[r["layout"]] = r
    lines, md = [], ["| model | dtype | backend | single | packed | first divergence, or why |", "|---|---|---|---|---|---|"]
    header = f"{'model':24s} {'dtype':9s} {'backend':18s} {'single':22s} {'packed':22s} first divergence, or why"
    lines.append(header)
    order = {label: i for i, label in enumerate(BACKENDS)}
    not_applicable: dict[str, int] = {}
    for (model, scenario, dtype, backend), layouts in sorted(by_cell.items(),
                                                            key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                            order.get(kv[0][3], 99), kv[0][3])):
        if all(r["status"] == "n/a" for r in layouts.values()):
            reason = next(iter(layouts.values()))["reason"]
            not_applicable[f"{backend}: {reason}"] = not_applicable.get(f"{backend}: {reason}", 0) + 1
            continue
        shown = {name: show(layouts.get(name) or layouts.get("*")) for name in ("single", "packed")}
        why = next((explain(r) for r in layouts.values() if explain(r)), "")
        name = model if scenario == "step" else f"{model} ({scenario})"
        backend = f"{backend.rsplit(':', 1)[1]} (bug)" if ":" in backend else backend
        lines.append(f"{name:24s} {dtype:9s} {backend:18s} {shown['single']:22s} {shown['packed']:22s} {why[:150]}")
        md.append(f"| {name} | {dtype} | {backend} | {shown['single']} | {shown['packed']} | {why[:200]} |")
    for reason, count in sorted(not_applicable.items()):
        lines.append(f"not applicable, {count} model/dtype rows: {reason}")
        md.append(f"\nnot applicable, {count} model/dtype rows: {reason}")
    return "\n".join(lines), "\n".join(md)


def show(r: dict | None) -> str:
    if r is None:
        return "-"
    status = {"PASS": "pass", "FAIL": "FAIL", "ERROR": "ERROR", "skip": "skip"}.get(r["status"], r["status"])
    iso = f" iso {fmt_ratio(r['isolated'])}" if r.get("isolated") is not None else ""
    return f"{status} {fmt_ratio(r.get('ratio'))}{iso}".strip()


def explain(r: dict) -> str:
    if r["status"] == "FAIL":
        if r.get("isolated") is not None and r["isolated"] > 1 and (r.get("ratio") or 0) <= 1:
            return f"isolated: {r['isolated_place']}"
        return r.get("first_divergence") or r.get("first_gradient_divergence") or f"worst {r.get('worst')}"
    if r["status"] in ("ERROR", "skip", "n/a", "not run"):
        return r.get("reason") or ""
    return ""


def show_plan(args: argparse.Namespace, labels: list[str], models: list[str] | None,
              dtypes: list[str] | None) -> int:
    """--plan: the cells, their estimated schedule on the H200, and `fits` or `DOES NOT FIT` (exit 1)."""
    from veosnap.reference.zoo import Project

    dirs = {"goldens": args.goldens, "configs": args.configs}
    project = Project.resolve(**{k: v for k, v in dirs.items() if v}, hardware_class="cuda-sm90")
    groups, skipped = plan([(project, dirs)], labels, models, dtypes)
    sizes = {c["model"]: model_size(project, c["model"]) for cells in groups.values() for c in cells}
    autotune = not liger_autotune_off()
    estimate = estimate_plan(groups, sizes, args.jobs, args.budget, args.capacity_gib, autotune)
    print_plan(estimate, args.jobs, args.budget, args.capacity_gib, autotune)
    reasons: dict[str, int] = {}
    for c in skipped:
        if c["layout"] in ("single", "*"):
            reasons[f"{c['backend']}: {c['reason']}"] = reasons.get(f"{c['backend']}: {c['reason']}", 0) + 1
    for reason, count in sorted(reasons.items()):
        print(f"not run, {count} golden(s): {reason}")
    if any(label.split("@")[0] == "fla" for label in labels):
        print("not planned: fla's scratch Qwen3.5 goldens (recorded at run time, where no golden has linear attention)")
    return 0 if estimate["fits"] else 1


def main(argv: list[str] | None = None) -> int:
    read_pythonpath_pth_files()  # before any library is imported, here and (through the env) in workers
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _, _, label, cells_file, results_file, deadline = sys.argv
        worker(label, Path(cells_file), Path(results_file), float(deadline))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-kernels-out")))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    parser.add_argument("--jobs", type=int, default=4, help="worker processes at once (default 4)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backend labels")
    parser.add_argument("--models", default="", help="comma-separated models (default: every golden here)")
    parser.add_argument("--dtypes", default="", help="comma-separated golden dtypes (default: all)")
    parser.add_argument("--no-repro", action="store_true", help="skip the float32 reproductions")
    parser.add_argument("--goldens", default="", help="goldens directory (default: ./goldens)")
    parser.add_argument("--configs", default="", help="model configs directory (default: ./toy_configs)")
    parser.add_argument("--plan", action="store_true",
                        help="print the estimated schedule for the cuda-sm90 goldens and whether it fits; run nothing")
    parser.add_argument("--capacity-gib", type=float, default=0.92 * 139.8,
                        help="--plan: GPU memory the cells running at once may share (default: 92%% of an H200)")
    parser.add_argument("--layouts", default="", help="comma-separated: single, packed (default: both)")
    parser.add_argument("--isolate", action="store_true",
                        help="check real-shape low-precision goldens' layers in isolation too (check --isolate); "
                             "the table's `iso` is the worst isolated statistic's ratio")
    parser.add_argument("--no-liger-autotune", action="store_true",
                        help="set LIGER_FUSED_MOE_AUTOTUNE=0 for the workers: liger's fused MoE runs one fixed "
                             "configuration per kernel instead of autotuning (the table says so)")
    args = parser.parse_args(argv)
    if args.no_liger_autotune:
        os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "0"
    if args.isolate:  # the workers inherit it
        os.environ["GPU_KERNELS_ISOLATE"] = "1"
    labels = [b.strip() for b in args.backends.split(",") if b.strip()]
    models = [m for m in args.models.split(",") if m] or None
    dtypes = [d for d in args.dtypes.split(",") if d] or None
    if args.plan:
        return show_plan(args, labels, models, dtypes)
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), **versions(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
           "capability": ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else None}
    print(json.dumps(env), flush=True)
    dirs = {"goldens": args.goldens, "configs": args.configs}
    project = project_from(dirs)
    projects = [(project, dirs)]
    if any("fla" in label for label in labels) and not args.models:
        try:
            scratch = scratch_linear_attention(project, Path(tempfile.mkdtemp(prefix="gpu_kernels_scratch_")))
        except Exception as exc:  # noqa: BLE001 - without it, fla has no model here: say so, run the rest
            print(f"could not record scratch Qwen3.5 goldens: {type(exc).__name__}: {exc}"[:300], flush=True)
            scratch = None
        if scratch is not None:
            projects.append(scratch)
    groups, not_applicable = plan(projects, labels, models, dtypes, args.layouts.split(",") if args.layouts else None)
    estimate = None
    try:  # the --plan estimate of this very run, beside what it measures (results.json), to refit the time model
        sizes = {c["model"]: model_size(project_from(c["dirs"]), c["model"]) for cs in groups.values() for c in cs}
        capacity = (0.92 * torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available()
                    else args.capacity_gib)
        estimate = estimate_plan(groups, sizes, args.jobs, args.budget, capacity, not liger_autotune_off())
        print_plan(estimate, args.jobs, args.budget, capacity, not liger_autotune_off())
    except Exception as exc:  # noqa: BLE001 - an estimate is no reason not to run
        print(f"no estimate: {type(exc).__name__}: {exc}"[:300], flush=True)
    print(f"{sum(len(c) for c in groups.values())} cells to run on {project.hardware_class} goldens in "
          f"{project.goldens}; {len(not_applicable)} not applicable", flush=True)
    repros = [] if args.no_repro else [(w, e) for w in ("liger", "fla") for e in ({}, IEEE)]
    runner = Runner(args.out, args.jobs, start + args.budget - 25)
    results, repro = runner.run(groups, repros)
    rows = results + not_applicable
    text, md = table(rows)
    if liger_autotune_off():
        said = ("liger ran with LIGER_FUSED_MOE_AUTOTUNE=0: its fused MoE used one fixed configuration per kernel, "
                "not autotuned (the autotune does not fit the time budget)")
        text, md = f"{text}\n{said}", f"{md}\n\n{said}"
        env["LIGER_FUSED_MOE_AUTOTUNE"] = "0"
    planned = [{k: r[k] for k in ("worker", "model", "dtype", "start", "end", "gib")} for r in (estimate or {}).get("rows", [])]
    (args.out / "results.json").write_text(json.dumps({"env": env, "cells": rows, "plan": planned}, indent=1,
                                                      default=str))
    (args.out / "repro.json").write_text(json.dumps(repro, indent=1))
    (args.out / "table.md").write_text(md + "\n")
    print("\n" + text)
    for r in repro:
        label = f"{r['library']} {'TRITON_F32_DEFAULT=ieee' if r['env'] else 'Triton default (tf32)'}"
        if "results" in r:
            for variant, errors in r["results"].items():
                print(f"repro {label:40s} {variant:32s} " + "  ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        else:
            print(f"repro {label}: {r.get('error')}")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    print(f"{len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) +
          f" in {time.time() - start:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
