"""Throughput of the row-sketch kernel against the device's copy bandwidth, and a sweep of its launch
parameters (docs/sketch.md, "The kernel").

On CUDA, in one unattended run (about 3 minutes on an H200, Triton compiles included):

1. checks the kernel against the torch path: values bit for bit (both add a row's stripes in the same
   pairwise order), sums of squares within 1e-6 of the largest row's, the same bytes on a re-run,
   row shards equal to the whole, on odd shapes and on the first and last rows of every benchmark
   tensor; and in the sweep, every configuration's values equal to the table's;
2. times a copy of each benchmark tensor (bandwidth: bytes read + written per second) and its sketch
   with the table's configuration (bytes read per second) through CUDA graphs, so Python's launch
   overhead is left out (`call ms` is one eager call, overhead included), and their ratio (issue
   10's target: >= 0.5);
3. sweeps the launch parameters (`CONFIGS` in veosnap/numerics/sketch_triton.py) per (dtype, width):
   a grid of lane bytes x stripes per step x warps, then rows per program, stages, levels and a
   register cap around the best; prints the best per shape and the CONFIGS line to adopt per
   (dtype, width). The sweep stops at --budget seconds (compiles are done ahead, in parallel).

Exit status 1 if any check disagrees (after writing the results). On the CPU it times the torch
path instead.

    python tools/bench/bench_sketch.py [--quick] [--budget SECONDS]

Writes $OUT/bench_sketch.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

import torch

try:
    from rich.console import Console
    from rich.table import Table
except ImportError:  # a bare GPU image: plain text tables

    class Table:  # type: ignore[no-redef]
        def __init__(self, title: str = "") -> None:
            self.title, self.columns, self.rows = title, [], []

        def add_column(self, name: str, **_: object) -> None:
            self.columns.append(name)

        def add_row(self, *cells: str) -> None:
            self.rows.append(cells)

    class Console:  # type: ignore[no-redef]
        def __init__(self, **_: object) -> None:
            pass

        def print(self, item: object, **_: object) -> None:
            if not isinstance(item, Table):
                print(item, flush=True)
                return
            widths = [max(len(str(c)) for c in col) for col in zip(item.columns, *item.rows)]
            print(item.title)
            for row in (item.columns, *item.rows):
                print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)), flush=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from veosnap.numerics import sketch  # noqa: E402

console = Console(width=180)

# (label, shape, dtype, width): golden-like tensors and the widths the planner gives them at 1B.
GPU_CASES = [
    ("logits", (8192, 151936), torch.bfloat16, 32),
    ("logits", (8192, 151936), torch.bfloat16, 64),
    ("logits", (8192, 151936), torch.float32, 32),
    ("logits", (8192, 151936), torch.float32, 64),
    ("layer output", (8192, 2048), torch.bfloat16, 64),
    ("layer output", (8192, 2048), torch.float32, 64),
    ("layer output", (8192, 2048), torch.float64, 64),
    ("expert grad", (128, 1536, 2048), torch.bfloat16, 32),
    ("expert grad", (128, 1536, 2048), torch.float32, 32),
    ("lm_head grad", (151936, 2048), torch.bfloat16, 32),
]
QUICK_CASES = [0, 1, 3, 4, 6]
SMOKE_CASES = [  # --smoke: tiny tensors through Triton's interpreter on the CPU (this script's own test)
    ("logits", (6, 700), torch.bfloat16, 32),
    ("logits", (6, 700), torch.bfloat16, 64),
    ("layer output", (20, 256), torch.float32, 64),
    ("layer output", (20, 256), torch.float64, 64),
]
SMOKE_VERIFY = [(9, 300, 64, 0, 13), (5, 70, 1, 2, 5)]
CPU_CASES = [
    ("layer output", (2048, 2048), torch.bfloat16, 64),
    ("layer output", (2048, 2048), torch.float32, 64),
    ("layer output", (2048, 2048), torch.float64, 64),
    ("logits", (256, 151936), torch.bfloat16, 64),
    ("expert grad", (16, 1536, 2048), torch.float32, 32),
]
VERIFY = [  # (rows, columns, width, row offset, column offset): odd sizes, column splits, offsets, 1-D
    (37, 70, 32, 7, 0), (9, 300, 64, 0, 13), (3, 25000, 8, 0, 0), (6, 1, 16, 0, 0),
    (64, 151936, 64, 0, 0), (1000, 768, 16, 12345, 0), (300, 4096, 256, 0, 4096), (5, 3000, 1, 2, 5),
]
VERIFY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SUMSQ_TOLERANCE = 1e-6  # relative to the largest row's sum of squares (16-bit inputs add in float32)

# The sweep, by element size: a grid, then refinements around the best of the grid.
GRID = {
    2: {"vec_bytes": (8, 16, 32), "s": (2, 4, 8), "warps": (4, 8)},
    4: {"vec_bytes": (8, 16, 32), "s": (2, 4), "warps": (4, 8)},
    8: {"vec_bytes": (16, 32), "s": (1, 2, 4), "warps": (4, 8)},
}
QUICK_GRID = {
    2: {"vec_bytes": (8, 16), "s": (2, 4), "warps": (4,)},
    4: {"vec_bytes": (16,), "s": (2, 4), "warps": (4,)},
    8: {"vec_bytes": (32,), "s": (1, 2), "warps": (4,)},
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    if dtype == torch.float64:  # genuinely float64 numbers, so the order of the sums shows
        return torch.randn(shape, generator=g, device=device, dtype=torch.float64)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def copier(x: torch.Tensor):  # noqa: ANN201
    """A function that copies `x` into a buffer of its own (the copy bandwidth's measure)."""
    dst = torch.empty_like(x)
    return lambda: dst.copy_(x)


def cuda_median_ms(fn, reps: int) -> float:  # noqa: ANN001
    """One eager call between CUDA events (Python's launch overhead included when it dominates)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def graph_ms(fn, calls: int, rounds: int) -> float:  # noqa: ANN001
    """Milliseconds per call of `fn`, replayed from a CUDA graph of `calls` calls (the GPU's time, not
    Python's); falls back to back-to-back eager calls if capture fails."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run = graph.replay
    except Exception:  # noqa: BLE001 - a capture problem must not stop the benchmark
        graph = None

        def run() -> None:
            for _ in range(calls):
                fn()

    per_call = cuda_median_ms(run, rounds) / calls
    del graph
    return per_call


def cpu_median_ms(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def timer(device: str):  # noqa: ANN201
    if device == "cuda":
        return graph_ms
    return lambda fn, calls, rounds: cpu_median_ms(fn, rounds)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def relative(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item() / (scale or 1.0)


def compare(ref: sketch.RowSketch, got: sketch.RowSketch, scale2: float) -> tuple[bool, float]:
    """(values equal, as numbers, to the reference; sums of squares' largest difference / scale2)."""
    return torch.equal(ref.values, got.values), relative(ref.sumsq, got.sumsq, scale2)


# --- 1. the kernel against the torch path --------------------------------------------------------------


def verify_gpu(device: str = "cuda", cases: list = VERIFY) -> list[dict]:
    from veosnap.numerics import sketch_triton  # noqa: PLC0415

    rows_out = []
    table = Table(title=f"Triton kernel vs torch path on {device} (values: bit for bit; sums of squares: difference / "
                        "largest row's; bytes equal on a re-run; row shards equal to the whole)")
    for col in ("rows x cols", "width", "offsets", "dtype", "values equal", "sumsq diff", "re-run same bytes",
                "shards equal"):
        table.add_column(col, justify="right")
    for n, (rows, columns, width, ro, co) in enumerate(cases):
        seed = (99, 4)[n % 2]  # 4: a key of 2**31 or more
        for dtype in VERIFY_DTYPES:
            x = make((rows, columns), dtype, device)
            ref = sketch.rowsketch_torch(x, width, seed, row_offset=ro, col_offset=co)
            got = sketch_triton.rowsketch(x, width, seed, row_offset=ro, col_offset=co)
            again = sketch_triton.rowsketch(x, width, seed, row_offset=ro, col_offset=co)
            cut = rows // 3
            top = sketch_triton.rowsketch(x[:cut], width, seed, row_offset=ro, col_offset=co)
            rest = sketch_triton.rowsketch(x[cut:], width, seed, row_offset=ro + cut, col_offset=co)
            equal, ds = compare(ref, got, x.double().pow(2).sum(1).max().item())
            same = same_bytes(got.values, again.values) and same_bytes(got.sumsq, again.sumsq)
            shards = torch.equal(torch.cat([top.values, rest.values]), got.values) and \
                torch.equal(torch.cat([top.sumsq, rest.sumsq]), got.sumsq)
            ok = equal and ds < SUMSQ_TOLERANCE and same and shards
            rows_out.append({"rows": rows, "columns": columns, "width": width, "row_offset": ro, "col_offset": co,
                             "dtype": dtype_name(dtype), "values_equal": equal, "sumsq": ds, "deterministic": same,
                             "shards_equal": shards, "ok": ok})
            table.add_row(f"{rows} x {columns}", str(width), f"{ro}/{co}", dtype_name(dtype),
                          "yes" if equal else "NO", f"{ds:.1e}", "yes" if same else "NO", "yes" if shards else "NO")
    console.print(table)
    return rows_out


def verify_rows(x2d: torch.Tensor, width: int, whole: sketch.RowSketch, label: str) -> dict:
    """The first and last 64 rows of a benchmark tensor against the torch path."""
    rows = x2d.shape[0]
    n = min(64, rows)
    result = {"tensor": label, "ok": True}
    for name, start in (("first", 0), ("last", rows - n)):
        part = x2d[start:start + n]
        ref = sketch.rowsketch_torch(part, width, 7, row_offset=start)
        got = sketch.RowSketch(whole.values[start:start + n], whole.sumsq[start:start + n])
        equal, ds = compare(ref, got, part.double().pow(2).sum(1).max().item())
        result[name] = {"values_equal": equal, "sumsq": ds}
        result["ok"] &= equal and ds < SUMSQ_TOLERANCE
    return result


# --- 2. and 3. timing and the sweep ------------------------------------------------------------------------


def candidates(element_size: int, base, quick: bool) -> list:  # noqa: ANN001
    grid = (QUICK_GRID if quick else GRID)[element_size]
    out = [base]
    for values in itertools.product(*grid.values()):
        config = replace(base, **dict(zip(grid, values)))
        if config not in out:
            out.append(config)
    return out


def refinements(best, registers: int | None, quick: bool) -> list:  # noqa: ANN001
    if quick:
        return [replace(best, block_r=0 if best.block_r else -2)]
    out = [replace(best, block_r=-2), replace(best, stages=2), replace(best, levels=best.levels + 1),
           replace(best, levels=max(1, best.levels - 1))]
    if registers and registers > 96:
        out.append(replace(best, maxnreg=96 if registers <= 128 else 128))
    return out


def resolve(config, width: int, element_size: int):  # noqa: ANN001, ANN201
    """block_r -2 stands for "twice the automatic rows" (two rows per lane group)."""
    if config.block_r == -2:
        return replace(config, block_r=2 * replace(config, block_r=0).tile(width, element_size)[2])
    return config


def warm(job: tuple[str, int, dict], device: str = "cuda") -> str:
    """In a worker process: compile (and run once, on a small tensor) one configuration, so the main
    process finds it in Triton's cache."""
    dtype_text, width, fields = job
    try:
        from veosnap.numerics import sketch_triton  # noqa: PLC0415

        config = resolve(sketch_triton.Config(**fields), width, torch.empty((), dtype=getattr(torch, dtype_text))
                         .element_size())
        x = torch.ones((4, 8 * width + 3), dtype=getattr(torch, dtype_text), device=device)
        sketch_triton.launch(x, width, 1, config=config)
        if device == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception:  # noqa: BLE001
        return f"{dtype_text} w{width} {fields}: {traceback.format_exc(limit=1).strip().splitlines()[-1]}"


def precompile(jobs: list[tuple[str, int, dict]], workers: int = 0, device: str = "cuda") -> tuple[float, list[str]]:
    """Compile configurations in parallel worker processes (Triton's on-disk cache is shared)."""
    started = time.perf_counter()
    workers = workers or max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 16))
    problems: list[str] = []
    if workers < 2 or not jobs:
        return 0.0, problems
    try:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            problems = [p for p in pool.map(functools.partial(warm, device=device), jobs) if p]
    except Exception as exc:  # noqa: BLE001 - compiling in the main process is the fallback
        problems.append(f"parallel compile unavailable ({type(exc).__name__}: {exc}); compiling as needed")
    return time.perf_counter() - started, problems


def sweep_grids(cases: list, quick: bool) -> dict:
    """{(dtype, width): the grid's configurations, the table's first}."""
    from veosnap.numerics import sketch_triton  # noqa: PLC0415

    keys = dict.fromkeys((dtype, width) for _, _, dtype, width in cases)
    return {key: candidates(torch.empty((), dtype=key[0]).element_size(), sketch_triton.config_for(*key), quick)
            for key in keys}


def bench_gpu(cases: list, grids: dict, quick: bool, budget: float, device: str = "cuda") -> dict:
    from veosnap.numerics import sketch_triton  # noqa: PLC0415

    calls, rounds = (3, 3) if quick else (5, 5)
    measure_ms = timer(device)
    classes: dict[tuple[torch.dtype, int], list[int]] = {}
    for i, (_, _, dtype, width) in enumerate(cases):
        classes.setdefault((dtype, width), []).append(i)

    tensors: dict[tuple, torch.Tensor] = {}
    shapes = []
    for label, shape, dtype, width in cases:
        key = (shape, dtype)
        if key not in tensors:
            tensors[key] = sketch.as_rows(make(shape, dtype, device))
        x2d = tensors[key]
        nbytes = x2d.numel() * x2d.element_size()
        copy_ms = measure_ms(copier(x2d), calls, rounds)
        shapes.append({"tensor": label, "shape": list(shape), "dtype": dtype_name(dtype), "width": width,
                       "bytes": nbytes, "copy_ms": copy_ms, "copy_gbps": 2 * nbytes / copy_ms / 1e6, "runs": []})

    started = time.perf_counter()
    reference: dict[int, sketch.RowSketch] = {}
    mismatches: list[str] = []
    checks = []

    def measure(i: int, config) -> dict:  # noqa: ANN001
        label, shape, dtype, width = cases[i]
        x2d = tensors[(shape, dtype)]
        info = shapes[i]
        run = {"config": asdict(config), "label": config.label()}
        try:
            result, kernel = sketch_triton.launch(x2d, width, 7, config=config)
            ms = measure_ms(lambda: sketch_triton.launch(x2d, width, 7, config=config), calls, rounds)  # noqa: B023
        except Exception as exc:  # noqa: BLE001 - a configuration that fails is reported, not fatal
            run["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            info["runs"].append(run)
            return run
        gbps = info["bytes"] / ms / 1e6
        run.update(ms=ms, gbps=gbps, ratio=gbps / info["copy_gbps"], registers=getattr(kernel, "n_regs", None),
                   spills=getattr(kernel, "n_spills", None))
        if i not in reference:
            reference[i] = result
            checks.append(verify_rows(x2d, width, result, f"{label} {dtype_name(dtype)} w{width}"))
        else:
            equal, ds = compare(reference[i], result, reference[i].sumsq.abs().max().item())
            run["values_equal_table"], run["sumsq_vs_table"] = equal, ds
            if not equal or ds > SUMSQ_TOLERANCE:
                mismatches.append(f"{label} {dtype_name(dtype)} w{width} {config.label()}: values equal {equal}, "
                                  f"sumsq {ds:.1e}")
        info["runs"].append(run)
        return run

    # The table's configuration first (the reference every other configuration must equal), with
    # one eager call's time as well.
    for i, (label, shape, dtype, width) in enumerate(cases):
        run = measure(i, sketch_triton.config_for(dtype, width))
        if "ms" in run and device == "cuda":
            x2d = tensors[(shape, dtype)]
            shapes[i]["call_ms"] = cuda_median_ms(lambda: sketch_triton.rowsketch(x2d, width, 7), 5)  # noqa: B023
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            sketch_triton.rowsketch(x2d, width, 7)
            shapes[i]["extra_peak_over_input"] = (torch.cuda.max_memory_allocated() - base) / shapes[i]["bytes"]
    # The grid for every (dtype, width) first, then refinements around each best; each class gets
    # its share of what is left of the stage's time.
    def total_ms(config, members: list[int]) -> float:  # noqa: ANN001
        runs = [next((r for r in shapes[i]["runs"] if r["config"] == asdict(config) and "ms" in r), None)
                for i in members]
        return sum(r["ms"] for r in runs) if all(runs) else float("inf")

    skipped = 0
    tried: dict[tuple, list] = {key: [grids[key][0]] for key in classes}  # the table's, timed above
    for stage, share in (("grid", 0.7), ("refine", 1.0)):
        stage_end = started + share * budget
        for k, ((dtype, width), members) in enumerate(classes.items()):
            class_end = time.perf_counter() + (stage_end - time.perf_counter()) / (len(classes) - k)
            if stage == "grid":
                todo = grids[(dtype, width)]
            else:
                best = min(tried[(dtype, width)], key=lambda c: total_ms(c, members))  # noqa: B023
                registers = next((r.get("registers") for r in shapes[members[0]]["runs"]
                                  if r["config"] == asdict(best)), None)
                element_size = torch.empty((), dtype=dtype).element_size()
                todo = [resolve(c, width, element_size) for c in refinements(best, registers, quick)]
            for config in todo:
                if config in tried[(dtype, width)]:
                    continue
                if time.perf_counter() > class_end:
                    skipped += len(members)
                    continue
                tried[(dtype, width)].append(config)
                for i in members:
                    if not any(r["config"] == asdict(config) for r in shapes[i]["runs"]):
                        measure(i, config)
    recommended = {}
    for (dtype, width), members in classes.items():
        best = min(tried[(dtype, width)], key=lambda c: total_ms(c, members))  # noqa: B023
        recommended[f"{dtype_name(dtype)} w{width}"] = {
            "config": asdict(best), "label": best.label(), "total_ms": total_ms(best, members),
            "line": f"(torch.{dtype_name(dtype)}, {width}): {best!r},",
        }
    return {"shapes": shapes, "checks": checks, "mismatches": mismatches, "recommended": recommended,
            "skipped_runs": skipped, "sweep_s": time.perf_counter() - started}


def report_gpu(out: dict, device_name: str) -> None:
    table = Table(title=f"row sketch on {device_name} (CUDA-graph medians; copy bandwidth counts "
                        "read + write, the sketch's what it reads; ratio = sketch / copy, target >= 0.5)")
    for col in ("tensor", "shape", "dtype", "width", "GB", "copy GB/s", "table ms", "table GB/s", "ratio",
                "call ms", "extra mem", "best ms", "best GB/s", "best ratio", "best configuration", "regs"):
        table.add_column(col, justify="right")
    for info in out["shapes"]:
        runs = [r for r in info["runs"] if "ms" in r]
        if not runs:
            table.add_row(info["tensor"], "x".join(map(str, info["shape"])), info["dtype"], str(info["width"]),
                          "", "", "failed", *[""] * 9)
            continue
        table_run, best = runs[0], min(runs, key=lambda r: r["ms"])
        info["best"] = best
        table.add_row(info["tensor"], " x ".join(map(str, info["shape"])), info["dtype"], str(info["width"]),
                      f"{info['bytes'] / 1e9:.2f}", f"{info['copy_gbps']:.0f}", f"{table_run['ms']:.3f}",
                      f"{table_run['gbps']:.0f}", f"{table_run['ratio']:.2f}", f"{info.get('call_ms', 0):.3f}",
                      f"{info.get('extra_peak_over_input', 0):.3f}",
                      f"{best['ms']:.3f}", f"{best['gbps']:.0f}", f"{best['ratio']:.2f}", best["label"],
                      str(best.get("registers")))
    console.print(table)
    console.print("CONFIGS entries to adopt (veosnap/numerics/sketch_triton.py), best total time per (dtype, width):")
    for key, rec in out["recommended"].items():
        console.print(f"    {rec['line']}    # {key}")
    if out["skipped_runs"]:
        console.print(f"sweep budget reached: {out['skipped_runs']} runs skipped (--budget)")
    errors = [(info["tensor"], info["dtype"], r["label"], r["error"]) for info in out["shapes"] for r in info["runs"]
              if "error" in r]
    for error in errors:
        console.print(f"configuration failed: {error}")


def bench_cpu(quick: bool) -> list[dict]:
    # One thread, as record and check run (veosnap.record.deterministic); more threads on a shared
    # 2-core machine mostly wait for each other.
    torch.set_num_threads(1)
    reps = 2 if quick else 3
    results = []
    table = Table(title=f"row sketch, torch path on the CPU (1 thread; medians of {reps})")
    for col in ("tensor", "shape", "dtype", "width", "MB", "copy GB/s", "sketch ms", "sketch GB/s", "ratio"):
        table.add_column(col, justify="right")
    for label, shape, dtype, width in CPU_CASES[: 2 if quick else None]:
        x = make(shape, dtype, "cpu")
        nbytes = x.numel() * x.element_size()
        copy_ms = cpu_median_ms(copier(x), 5)
        x2d = sketch.as_rows(x)
        ms = cpu_median_ms(lambda: sketch.rowsketch(x2d, width, 7), reps)  # noqa: B023
        copy_bw, bw = 2 * nbytes / copy_ms / 1e6, nbytes / ms / 1e6
        results.append({"tensor": label, "shape": list(shape), "dtype": str(dtype), "width": width, "bytes": nbytes,
                        "copy_gbps": copy_bw, "sketch_ms": ms, "sketch_gbps": bw})
        table.add_row(label, " x ".join(map(str, shape)), dtype_name(dtype), str(width),
                      f"{nbytes / 1e6:.0f}", f"{copy_bw:.1f}", f"{ms:.0f}", f"{bw:.2f}", f"{bw / copy_bw:.3f}")
    console.print(table)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, configurations and repetitions")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds for the sweep (default 120)")
    parser.add_argument("--smoke", action="store_true",
                        help="this script's own test without a GPU: tiny shapes through Triton's interpreter")
    args = parser.parse_args()
    started = time.perf_counter()
    out: dict = {"torch": torch.__version__}
    failures: list[str] = []
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1")
        grids = sweep_grids(SMOKE_CASES, True)
        jobs = [(dtype_name(d), w, asdict(configs[0])) for (d, w), configs in grids.items()]
        seconds, problems = precompile(jobs, workers=2, device="cpu")  # the pool, as on the GPU
        out["precompile"] = {"configurations": len(jobs), "seconds": seconds, "problems": problems}
        failures += [f"precompile: {p}" for p in problems]
        out["verify"] = verify_gpu("cpu", SMOKE_VERIFY)
        out["gpu"] = bench_gpu(SMOKE_CASES, grids, True, args.budget, "cpu")
        report_gpu(out["gpu"], "the CPU (Triton's interpreter; times mean nothing)")
    elif torch.cuda.is_available() and sketch.triton_available():
        import triton  # noqa: PLC0415

        from veosnap.numerics import sketch_triton  # noqa: PLC0415

        out.update(triton=triton.__version__, device=torch.cuda.get_device_name(),
                   table={f"{dtype_name(d)} w{w}": asdict(c) for (d, w), c in sketch_triton.CONFIGS.items()})
        cases = [GPU_CASES[i] for i in QUICK_CASES] if args.quick else GPU_CASES
        grids = sweep_grids(cases, args.quick)
        jobs = [(dtype_name(d), w, asdict(c)) for (d, w), configs in grids.items() for c in configs]
        jobs += [(dtype_name(d), w, asdict(sketch_triton.config_for(d, w)))
                 for w in sorted({case[2] for case in VERIFY}) for d in VERIFY_DTYPES]
        jobs = list({json.dumps(job, sort_keys=True): job for job in jobs}.values())
        seconds, problems = precompile(jobs)
        out["precompile"] = {"configurations": len(jobs), "seconds": seconds, "problems": problems}
        console.print(f"compiled {len(jobs)} configurations in {seconds:.0f}s in parallel"
                      + (f"; problems: {problems}" if problems else ""))
        out["verify"] = verify_gpu()
        out["gpu"] = bench_gpu(cases, grids, args.quick, args.budget)
        report_gpu(out["gpu"], torch.cuda.get_device_name())
    else:
        reason = "no CUDA device" if not torch.cuda.is_available() else "triton does not import"
        console.print(f"CUDA kernel skipped: {reason}; timing the torch path on the CPU")
    if "gpu" in out:
        failures += [f"verify: {r['rows']}x{r['columns']} w{r['width']} {r['dtype']}" for r in out["verify"]
                     if not r["ok"]]
        failures += [f"rows vs torch path: {c['tensor']} {c}" for c in out["gpu"]["checks"] if not c["ok"]]
        failures += out["gpu"]["mismatches"]
    if not args.smoke:
        out["cpu"] = bench_cpu(args.quick or torch.cuda.is_available())
    out["seconds"] = time.perf_counter() - started
    out["failures"] = failures
    console.print(f"kernel check: {'OK' if not failures else 'MISMATCH'} ({len(failures)} disagreements)")
    for failure in failures[:20]:
        console.print(f"  {failure}")
    console.print(f"{out['seconds']:.0f}s")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_sketch.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str))
        console.print(f"wrote {path}")
    if failures:
        raise SystemExit("the Triton kernel disagrees with the torch path (see above)")


if __name__ == "__main__":
    main()
