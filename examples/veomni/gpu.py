"""VeOmni's production GPU kernels against goldens this GPU records, in one unattended command (issue 38, item 4).

    python examples/veomni/gpu.py --out $OUT          # on one H100/H200: record, check, table (--budget 420 s)
    python examples/veomni/gpu.py --plan              # the cells it would run, and a rough estimate (no GPU needed)
    python examples/veomni/gpu.py --out DIR --models qwen3_moe --backends veomni,veomni_fused_moe --jobs 2

What a client does on a GPU (issue 38, item 5), in order:

1. a scratch project (`--scratch`, default a new directory under /tmp; never the repository's goldens/): the toy
   configs of `--models` copied from toy_configs/, and `<model>-hd64` for those of `--hd64`, the same config with
   attention head dim 64. flash-attn 4.0.0b36's sm90 backward is wrong for head dims not a multiple of 32 and the
   toys' is 16 (docs/findings/fa4-sm90-backward-head-dim.md): on the toys the flash-attention cells meet that bug,
   on `-hd64` they check VeOmni's wiring of the kernel;
2. its goldens recorded here by veosnap's recorder (certified), with this environment's transformers (VeOmni pins
   5.22.2), `--jobs` processes at once (tools/gpu/gpu_session.py's `record_one`); the `-hd64` ones in bfloat16 only;
3. every backend of `--backends` against every golden in the `single` layout: `veomni` (VeOmni's model, every op
   eager) is the control; `veomni_fused_moe`, `veomni_quack`, `veomni_liger`, `veomni_liger_loss`, `veomni_fa4`,
   `veomni_fla` and `veomni_production` are VeOmni's GPU kernels (examples/veomni/veosnap_veomni/backends.py), each
   declining with its reason where it cannot run; on `-hd64` configs only the control and the backends with flash
   attention run. One worker process per backend, `--jobs` at once (tools/gpu/gpu_kernels.py's runner: a worker that
   dies costs its cell, the rest run in a new one); each cell's line is printed as it ends;
4. the table (model rows; a column per backend and dtype: status and worst error/bound ratio, `*` where the loss
   comes without logits), under it each non-PASS cell's reason or first divergence and what VeOmni ran per backend,
   printed and written to `$OUT/table.md`; `$OUT/results.json` holds every cell (worst tensor, ratio, first
   divergences, notes, the whole report of a failing or erroring one), the recordings and the versions;
   `$OUT/log.txt` every worker's output.

It stops starting work at `--budget` seconds; cells it did not reach are `not-run`. Without a CUDA GPU it says so,
writes results.json and table.md and exits 0; `--cpu` runs everything on the CPU anyway (every GPU backend then
declines: what tests/test_veomni_gpu.py does). Exit status 0 once the table is written; 2 where it cannot start
(VeOmni not importable, an unknown model or backend), with the cause in one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
for _path in (ROOT / "tools" / "gpu", HERE, ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import gpu_kernels  # noqa: E402 - tools/gpu/gpu_kernels.py: its runner, worker and table helpers

BACKENDS = ["veomni", "veomni_fused_moe", "veomni_quack", "veomni_liger", "veomni_liger_loss", "veomni_fa4",
            "veomni_fla", "veomni_production"]
FLASH_BACKENDS = ("veomni", "veomni_fa4", "veomni_production")  # what runs on the -hd64 configs
MODELS = ["qwen3_moe", "qwen3", "llama", "deepseek_v3", "qwen3_vl_moe", "qwen3_5", "qwen3_moe_aux", "gpt_oss"]
HD64 = ["qwen3_moe", "qwen3", "llama"]
VARIANT = "-hd64"
PACKAGE = "veosnap_veomni"  # backends are resolved as veosnap_veomni:<name> (examples/veomni on PYTHONPATH)
DISTRIBUTIONS = ["torch", "triton", "transformers", "veomni", "accelerate", "liger-kernel", "flash-attn-4",
                 "nvidia-cutlass-dsl", "quack-kernels", "flash-linear-attention", "fla-core", "veosnap"]
# --plan's rough model of a toy cell on an H100/H200 (tools/gpu/gpu_real.py: 12 s to start a worker; a toy check a
# few seconds with its bf16 layers isolated) and the libraries' first-call costs (gpu_kernels.LIB_FIRST_S), per
# backend; flash attention and quack compile again for each model's shapes (gpu_kernels.NEW_SHAPE_S).
CELL_S, DECLINE_S, RECORD_S = 3.0, 0.5, 4.0
FIRST_S = {"veomni_fused_moe": 10.0, "veomni_quack": 10.0, "veomni_liger": 5.0, "veomni_liger_loss": 5.0,
           "veomni_fa4": 10.0, "veomni_fla": 20.0, "veomni_production": 25.0}
NEW_SHAPE_S = {"veomni_quack": 10.0, "veomni_fa4": 10.0, "veomni_production": 10.0}


def environment() -> dict:
    found = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = None
    import torch

    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
        found["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return found


# --- the scratch project and its goldens ----------------------------------------------------------------


def scratch_project(scratch: Path, models: list[str], hd64: list[str]) -> dict[str, str]:
    """The toy configs of `models` and the `-hd64` variants of `hd64` in `scratch`/toy_configs; the dirs that
    resolve the project (goldens go to `scratch`/goldens, the batches are the repository's testdata)."""
    configs = scratch / "toy_configs"
    for model in models:
        source = ROOT / "toy_configs" / model
        if not (source / "config.json").is_file():
            known = ", ".join(sorted(p.name for p in (ROOT / "toy_configs").iterdir() if (p / "config.json").is_file()))
            raise SystemExit(f"examples/veomni/gpu.py: no toy config {model!r} in toy_configs/ (there: {known})")
        shutil.copytree(source, configs / model, dirs_exist_ok=True)
    for model in hd64:
        config = json.loads((ROOT / "toy_configs" / model / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config", config)
        was = text.get("head_dim")
        text["head_dim"] = 64
        target = configs / f"{model}{VARIANT}"
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (target / "README.md").write_text(
            f"# {model}{VARIANT} (toy, scratch)\n\ntoy_configs/{model} with attention head dim 64 (was {was}), written "
            "by examples/veomni/gpu.py: flash-attn 4.0.0b36's sm90 backward is wrong for head dims not a multiple of "
            "32 (docs/findings/fa4-sm90-backward-head-dim.md), so the flash-attention cells check VeOmni's wiring "
            "here.\n", encoding="utf-8")
    return {"goldens": str(scratch / "goldens"), "configs": str(configs), "testdata": str(ROOT / "testdata")}


def golden_keys(models: list[str], hd64: list[str], dtypes: list[str]) -> list[tuple[str, str, str]]:
    """(model, scenario, dtype) of every golden to record: bfloat16 first, the -hd64 variants in bfloat16 only."""
    keys = [(m, "step", d) for d in dtypes for m in models]
    keys += [(f"{m}{VARIANT}", "step", "bfloat16") for m in hd64 if "bfloat16" in dtypes]
    return sorted(keys, key=lambda k: k[2] != "bfloat16")


def record_one(roots: tuple[Path, Path, Path], hardware_class: str, key: tuple[str, str, str], deadline: float,
               threads: int) -> dict:
    """Record one golden (tools/gpu/gpu_session.py's `record_one`: a row, errors caught); one the canaries refuse to
    certify (a planted error it would not catch) is recorded again without certification, its row saying why."""
    import gpu_session

    row = gpu_session.record_one(roots, hardware_class, key, deadline, threads)
    if "not certified:" not in row.get("error", ""):
        return row
    from veosnap.reference.zoo import Project
    from veosnap.runs import record as recorder

    goldens, configs, testdata = roots
    project = Project.resolve(goldens=goldens, configs=configs, testdata=testdata, hardware_class=hardware_class)
    began = time.perf_counter()
    try:
        outcome = recorder.record(project, key[0], key[2], scenario=key[1], certify=False)
    except Exception as exc:  # noqa: BLE001 - this golden's failure, said in its row
        return {**row, "error": f"{row['error']}; uncertified too: {type(exc).__name__}: {exc}".splitlines()[0][:600]}
    return {**{k: v for k, v in row.items() if k != "error"}, "uncertified": row["error"][:400],
            "written": outcome.written, "path": str(outcome.path.relative_to(project.goldens)),
            "seconds": round(row.get("seconds", 0) + time.perf_counter() - began, 2)}


def record(dirs: dict[str, str], keys: list[tuple[str, str, str]], jobs: int, deadline: float) -> list[dict]:
    """Record `keys` into the scratch project, `jobs` spawned processes at once (CUDA does not survive a fork),
    none started after `deadline`; a row per golden (tools/gpu/gpu_session.py's `record_one`), printed as it ends."""
    import torch

    from veosnap.reference.zoo import Project

    hardware_class = Project.resolve(**dirs).hardware_class
    roots = (Path(dirs["goldens"]), Path(dirs["configs"]), Path(dirs["testdata"]))
    threads = max(1, torch.get_num_threads() // max(1, jobs))
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(record_one, roots, hardware_class, key, deadline, threads) for key in keys]
        for future in as_completed(futures):
            row = future.result()
            rows.append(row)
            where = f"{row['model']}/{row['dtype']}"
            said = ("left out (the time budget)" if row.get("left") else f"NOT recorded: {row['error']}"
                    if "error" in row else f"recorded in {row['seconds']} s"
                    + (f", NOT certified ({row['uncertified']})" if "uncertified" in row else ""))
            print(f"[record] {where}: {said}"[:300], flush=True)
    return rows


# --- the cells ----------------------------------------------------------------------------------------


def spec(backend: str) -> str:
    return f"{PACKAGE}:{backend}"


def plan(dirs: dict[str, str], goldens: list[tuple[str, str]], backends: list[str]) -> dict[str, list[dict]]:
    """Cells per backend spec, in gpu_kernels' form (one worker per backend runs them in order: bfloat16 first)."""
    from veosnap.reference.zoo import load_config

    cells: dict[str, list[dict]] = {spec(b): [] for b in backends}
    for model, dtype in sorted(goldens, key=lambda g: g[1] != "bfloat16"):
        width = gpu_kernels.width(load_config(Path(dirs["configs"]), model).config)
        for backend in backends:
            if model.endswith(VARIANT) and backend not in FLASH_BACKENDS:
                continue
            cells[spec(backend)].append(dict(model=model, dtype=dtype, scenario="step", backend=spec(backend),
                                             width=width, dirs=dirs, layouts=["single"], bytes=0))
    return cells


def estimate(cells: dict[str, list[dict]], jobs: int, recordings: int) -> float:
    """--plan's rough seconds for the run (see CELL_S): the recording, then the workers, `jobs` at once."""
    import gpu_real

    ends = []
    for label, todo in cells.items():
        backend = label.split(":", 1)[1]
        seconds = gpu_real.PROCESS_START_S + FIRST_S.get(backend, 0.0)
        seconds += sum(CELL_S if not (c["dtype"] == "float32" and backend in NEW_SHAPE_S) else DECLINE_S for c in todo)
        seconds += NEW_SHAPE_S.get(backend, 0.0) * max(0, len({c["model"] for c in todo}) - 1)
        ends.append(seconds)
    ends.sort(reverse=True)
    lanes = [0.0] * max(1, jobs)
    for seconds in ends:  # longest first onto the least loaded lane
        lanes[lanes.index(min(lanes))] += seconds
    record_s = gpu_real.PROCESS_START_S + RECORD_S * recordings / max(1, jobs)
    return record_s + max(lanes)


class LiveRunner(gpu_kernels.Runner):
    """tools/gpu/gpu_kernels.py's runner, each worker's cell lines printed as the worker writes them (the runner
    itself prints a worker's whole log when it ends: that goes to log.txt only)."""

    def __init__(self, out: Path, jobs: int, deadline: float) -> None:
        super().__init__(out, jobs, deadline)
        self.stdout = sys.stdout
        self.offsets: dict[Path, int] = {}

    def run(self, groups: dict[str, list[dict]], repros: list) -> tuple[list[dict], list[dict]]:
        stop = threading.Event()

        def tail() -> None:
            while not stop.wait(1.0):
                self.echo()

        thread = threading.Thread(target=tail, daemon=True)
        thread.start()
        try:
            return super().run(groups, repros)
        finally:
            stop.set()
            thread.join()
            self.echo()

    def echo(self) -> None:
        for _, log in list(self.logs):
            if not log.exists():
                continue
            with log.open("rb") as fh:
                fh.seek(self.offsets.get(log, 0))
                data = fh.read()
            complete = data[:data.rfind(b"\n") + 1]
            self.offsets[log] = self.offsets.get(log, 0) + len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if line.startswith(f"[{PACKAGE}:"):
                    self.stdout.write(f"[{line[len(PACKAGE) + 2:]}\n")
            self.stdout.flush()

    def collect(self, job: dict, pending: list) -> list[dict]:
        with contextlib.redirect_stdout(io.StringIO()):  # its lines were printed as they came (echo)
            return super().collect(job, pending)


# --- the table ----------------------------------------------------------------------------------------


def _example_run():  # noqa: ANN202 - examples/veomni/run.py, loaded by path (its name is a common one)
    spec_ = importlib.util.spec_from_file_location("veomni_example_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec_)
    sys.modules.setdefault("veomni_example_run", module)
    spec_.loader.exec_module(module)
    return module


KNOWN_FA4 = ("known flash-attn 4.0.0b36 sm90 backward bug for head dims not a multiple of 32 "
             "(docs/findings/fa4-sm90-backward-head-dim.md)")


def cells_of(rows: list[dict]) -> list:
    """The runner's rows as run.py's cells (its table and labels): the backend's short name, a reason for every
    non-PASS cell (a failing one's first divergence, and the known flash-attn 4 bug where its note says so)."""
    run = _example_run()
    out = []
    for r in rows:
        notes = list(r.get("notes") or [])
        status = "not-run" if r["status"] == "not run" else r["status"]
        reason = gpu_kernels.explain(r) or ""
        if r["status"] == "FAIL":
            divergence = [r.get("first_divergence"), r.get("first_gradient_divergence")]
            reason = "; ".join(d for d in divergence if d) or f"worst {r.get('worst')}"
            if any(n.startswith("known flash-attn") for n in notes):
                reason += f"; {KNOWN_FA4}"
        out.append(run.Cell(r["model"], r["dtype"], r["backend"].split(":", 1)[-1], r["layout"], status,
                            r.get("worst") or "", r.get("ratio"), reason, float(r.get("seconds") or 0.0), notes,
                            any(n.startswith("logits") and n.endswith("not compared") for n in notes)))
    return out


def table(cells: list, recorded: list[dict]) -> str:
    """run.py's table of `cells`, then what VeOmni ran (one cell's notes per backend) and the recordings."""
    run = _example_run()
    text = run.table(cells, grouped=True)
    ran = {}
    for cell in cells:
        said = [n for n in cell.notes if n.startswith(("VeOmni ran", "VeOmni's GPU defaults", "attention sdpa",
                                                         "attention flash_attention_4"))]
        if said and cell.backend not in ran:
            ran[cell.backend] = f"- {cell.backend} ({cell.model} {cell.dtype}): {' | '.join(said)}"
    lines = [text, "", "What VeOmni ran (one cell's report notes per backend; every cell's are in results.json):",
             *ran.values()]
    lines.append(f"\n`{VARIANT}`: the toy config with attention head dim 64, recorded here (examples/veomni/gpu.py): "
                 f"on the toys (head dim 16) flash attention meets the {KNOWN_FA4}; on `{VARIANT}` it checks VeOmni's "
                 "wiring. Goldens: recorded on this machine with this environment's transformers "
                 f"({sum('path' in r for r in recorded)} of {len(recorded)}).")
    failed = [r for r in recorded if "error" in r or r.get("left")]
    lines += [f"- not recorded {r['model']}/{r['dtype']}: {r.get('error') or 'the time budget'}" for r in failed]
    lines += [f"- recorded without certification {r['model']}/{r['dtype']}: {r['uncertified']}"
              for r in recorded if "uncertified" in r]
    return "\n".join(lines)


def summary(cells: list, seconds: float) -> str:
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell.status] = counts.get(cell.status, 0) + 1
    return (f"{len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) +
            f"; in {seconds:.0f} s")


def write(out: Path, text: str, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n", encoding="utf-8")
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


# --- main ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    gpu_kernels.read_pythonpath_pth_files()  # nvidia-cutlass-dsl's .pth (cutlass) here and in the workers
    parser = argparse.ArgumentParser(prog="examples/veomni/gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "veomni-gpu-out"))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the whole run (default 420)")
    parser.add_argument("--jobs", type=int, default=8, help="processes at once, recording and checking (default 8)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated toy models")
    parser.add_argument("--hd64", default=",".join(HD64), help="models that also get a head-dim-64 variant ('' none)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backends of veosnap_veomni")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--scratch", type=Path, help="the scratch project's directory (default: a new one in /tmp)")
    parser.add_argument("--cpu", action="store_true", help="run without a CUDA GPU too (the GPU backends decline)")
    parser.add_argument("--plan", action="store_true", help="print the cells and a rough estimate; run nothing")
    args = parser.parse_args(argv)
    start = time.time()
    models = [m for m in args.models.split(",") if m]
    hd64 = [m for m in args.hd64.split(",") if m]
    backends = [b for b in args.backends.split(",") if b]
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [b for b in backends if b not in BACKENDS] + [d for d in dtypes if d not in ("bfloat16", "float32")]
    if unknown:
        print(f"examples/veomni/gpu.py: unknown backend or dtype {', '.join(unknown)} (backends: "
              f"{', '.join(BACKENDS)}; dtypes: bfloat16, float32)", file=sys.stderr)
        return 2
    keys = golden_keys(models, hd64, dtypes)
    if args.plan:
        scratch = Path(tempfile.mkdtemp(prefix="veomni_gpu_plan_"))
        cells = plan(scratch_project(scratch, models, hd64), [(m, d) for m, _, d in keys], backends)
        for label, todo in cells.items():
            which = ", ".join(f"{c['model']} {c['dtype']}" for c in todo)
            print(f"{label.split(':', 1)[1]}: {len(todo)} cells ({which})")
        seconds = estimate(cells, args.jobs, len(keys))
        print(f"{len(keys)} goldens to record, {sum(map(len, cells.values()))} cells on {args.jobs} workers: about "
              f"{seconds:.0f} s by the rough model (CELL_S); the run stops starting work at --budget {args.budget:g} s")
        shutil.rmtree(scratch, ignore_errors=True)
        return 0
    env = environment()
    print(json.dumps(env), flush=True)
    if "gpu" not in env and not args.cpu:
        said = ("no CUDA GPU here (torch.cuda.is_available() is False): nothing recorded or checked; run it on one "
                "NVIDIA H100/H200 (examples/veomni/README.md, GPU), or pass --cpu to run it here, where every GPU "
                "backend declines")
        print(said, flush=True)
        write(args.out, said, {"env": env, "said": said, "cells": []})
        return 0
    with contextlib.redirect_stdout(sys.stderr):  # importing VeOmni prints a banner
        import veosnap_veomni
    if veosnap_veomni.MISSING:
        print(f"examples/veomni/gpu.py: {veosnap_veomni.MISSING}", file=sys.stderr)
        write(args.out, veosnap_veomni.MISSING, {"env": env, "said": veosnap_veomni.MISSING, "cells": []})
        return 2
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="veomni_gpu_"))
    dirs = scratch_project(scratch, models, hd64)
    print(f"scratch project {scratch}: {len(keys)} goldens to record ({', '.join(f'{m}/{d}' for m, _, d in keys)})",
          flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
        [str(ROOT), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, args.jobs))))
    recorded = record(dirs, keys, args.jobs, start + 0.4 * args.budget)
    goldens = [(r["model"], r["dtype"]) for r in recorded if "path" in r]
    groups = plan(dirs, goldens, backends)
    print(f"{sum(map(len, groups.values()))} cells on {len(goldens)} goldens, {len(backends)} workers, {args.jobs} at "
          f"once, until {args.budget:g} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    runner = LiveRunner(args.out, args.jobs, start + args.budget - gpu_kernels.DEADLINE_MARGIN_S)
    rows, _ = runner.run(groups, [])
    order = {m: i for i, m in enumerate([*models, *(f"{m}{VARIANT}" for m in hd64)])}
    cells = sorted(cells_of(rows), key=lambda c: (BACKENDS.index(c.backend) if c.backend in BACKENDS else 99,
                                                  c.dtype != "bfloat16", order.get(c.model, 99)))
    text = table(cells, recorded) + "\n\n" + summary(cells, time.time() - start)
    print("\n" + text, flush=True)
    write(args.out, text, {"env": env, "scratch": str(scratch), "budget_s": args.budget, "recorded": recorded,
                           "cells": [{**r, "cell": asdict(c)} for r, c in zip(rows, cells_of(rows))],
                           "wall_s": round(time.time() - start, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
