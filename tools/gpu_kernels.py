"""Kernel libraries on a GPU: each library backend against every golden of this machine, and the
float32 reproductions, in one unattended command.

    python3 tools/gpu_kernels.py --out $OUT                  # everything, within --budget seconds (420)
    python3 tools/gpu_kernels.py --out DIR --backends fa4,quack --models llama,qwen3_moe --jobs 2
    python3 tools/gpu_kernels.py --out DIR --backends liger,liger@ieee --dtypes float32 --no-repro

What it runs (all of it under the budget; cells it cannot reach in time are listed as not run):

1. The reproductions (`tools/repro_tf32.py liger|fla`), each twice in a fresh process: with Triton's
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
3. The table (model x dtype x backend: single and packed status and worst error/bound ratio, the first
   divergence or the reason), printed and written to table.md; results.json holds every cell with its
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
         dtypes: list[str] | None = None) -> tuple[dict[str, list[dict]], list[dict]]:
    """Cells per backend label (ordered: toy width first, bfloat16 first) and the cells not run.

    `projects` are (Project, the dirs that resolve it in a worker): the machine's goldens, and a
    scratch project this run recorded (see `scratch_linear_attention`)."""
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
                layouts = ["single"] if control else ["single", "packed"]
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


# --- one worker: one backend's cells, in this process --------------------------------------------------


def project_from(dirs: dict):
    from veosnap.reference.zoo import Project

    return Project.resolve(**{k: v for k, v in dirs.items() if v})


def worker(label: str, cells_file: Path, results_file: Path, deadline: float) -> None:
    from veosnap.candidates import backends
    from veosnap.errors import describe
    from veosnap.golden.key import GoldenKey
    from veosnap.render import json as render_json
    from veosnap.runs.check import check_layouts

    backend = backends.resolve(label.split("@")[0])
    cells = json.loads(cells_file.read_text())
    projects: dict[str, object] = {}
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
            try:
                for report in check_layouts(project, key, backend, cell["layouts"]):
                    rows.append(row(report, render_json.check_dict(report)))
            except Exception as exc:  # noqa: BLE001 - a bad golden or config is this cell's error
                rows = [dict(layout=layout, status="ERROR", reason=describe(exc)) for layout in cell["layouts"]]
            seconds = round(time.perf_counter() - t0, 2)
            for r in rows:
                print(f"[{label}] {cell['model']} {cell['dtype']} {r['layout']}: {r['status']} "
                      f"{fmt_ratio(r.get('ratio'))} {r.get('reason') or r.get('first_divergence') or ''}"[:240],
                      flush=True)
            out.write(json.dumps({"event": "done", **cell, "rows": rows, "seconds": seconds}) + "\n")
            out.flush()


def row(report, full: dict) -> dict:
    worst = report.worst
    found = dict(layout=report.layout, status=report.status, ratio=worst.ratio if worst else None,
                 worst=worst.name if worst else None, first_divergence=report.first_divergence,
                 first_gradient_divergence=report.first_gradient_divergence,
                 reason=report.skipped or report.error, notes=list(report.notes))
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
        for which, extra in repros:  # quick, and decisive for the findings: first, beside the workers
            proc, log = self.spawn(f"repro-{which}{'-ieee' if extra else ''}",
                                   [sys.executable, str(ROOT / "tools" / "repro_tf32.py"), which], extra)
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
    header = f"{'model':24s} {'dtype':9s} {'backend':18s} {'single':14s} {'packed':14s} first divergence, or why"
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
        lines.append(f"{name:24s} {dtype:9s} {backend:18s} {shown['single']:14s} {shown['packed']:14s} {why[:150]}")
        md.append(f"| {name} | {dtype} | {backend} | {shown['single']} | {shown['packed']} | {why[:200]} |")
    for reason, count in sorted(not_applicable.items()):
        lines.append(f"not applicable, {count} model/dtype rows: {reason}")
        md.append(f"\nnot applicable, {count} model/dtype rows: {reason}")
    return "\n".join(lines), "\n".join(md)


def show(r: dict | None) -> str:
    if r is None:
        return "-"
    status = {"PASS": "pass", "FAIL": "FAIL", "ERROR": "ERROR", "skip": "skip"}.get(r["status"], r["status"])
    return f"{status} {fmt_ratio(r.get('ratio'))}".strip()


def explain(r: dict) -> str:
    if r["status"] == "FAIL":
        return r.get("first_divergence") or r.get("first_gradient_divergence") or f"worst {r.get('worst')}"
    if r["status"] in ("ERROR", "skip", "n/a", "not run"):
        return r.get("reason") or ""
    return ""


def main() -> None:
    read_pythonpath_pth_files()  # before any library is imported, here and (through the env) in workers
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        _, _, label, cells_file, results_file, deadline = sys.argv
        worker(label, Path(cells_file), Path(results_file), float(deadline))
        return
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
    args = parser.parse_args()
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
    labels = [b.strip() for b in args.backends.split(",") if b.strip()]
    if any("fla" in label for label in labels) and not args.models:
        try:
            scratch = scratch_linear_attention(project, Path(tempfile.mkdtemp(prefix="gpu_kernels_scratch_")))
        except Exception as exc:  # noqa: BLE001 - without it, fla has no model here: say so, run the rest
            print(f"could not record scratch Qwen3.5 goldens: {type(exc).__name__}: {exc}"[:300], flush=True)
            scratch = None
        if scratch is not None:
            projects.append(scratch)
    groups, not_applicable = plan(projects, labels, [m for m in args.models.split(",") if m] or None,
                                  [d for d in args.dtypes.split(",") if d] or None)
    print(f"{sum(len(c) for c in groups.values())} cells to run on {project.hardware_class} goldens in "
          f"{project.goldens}; {len(not_applicable)} not applicable", flush=True)
    repros = [] if args.no_repro else [(w, e) for w in ("liger", "fla") for e in ({}, IEEE)]
    runner = Runner(args.out, args.jobs, start + args.budget - 25)
    results, repro = runner.run(groups, repros)
    rows = results + not_applicable
    text, md = table(rows)
    (args.out / "results.json").write_text(json.dumps({"env": env, "cells": rows}, indent=1, default=str))
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


if __name__ == "__main__":
    main()
