"""Throughput of the row-sketch kernel against the device's copy bandwidth (docs/sketch.md).

On CUDA it first checks the Triton kernel against the torch path (max difference relative to the
rows' norms, and that two runs give the same bytes), then times, with CUDA events and medians:
a device-to-device copy of each tensor (bandwidth = bytes read + bytes written, per second) and the
sketch of it (bytes read per second), for golden-like shapes: logits 8192 x 151936 (bfloat16), a
layer output 8192 x 2048 (bfloat16, float32, float64), an expert weight gradient 128 x 1536 x 2048
(bfloat16, float32). The target is sketch read bandwidth >= 0.5 x copy bandwidth. A short sweep of
tile sizes and warps follows, for whoever tunes the kernel (goldens always use the defaults).
On the CPU it times the torch path against a memory copy instead.

    python tools/bench_sketch.py [--quick]

Unattended, under 3 minutes on an H200; prints tables, and writes $OUT/bench_sketch.json when
$OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
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
                print(item)
                return
            widths = [max(len(str(c)) for c in col) for col in zip(item.columns, *item.rows)]
            print(item.title)
            for row in (item.columns, *item.rows):
                print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from veosnap.numerics import sketch  # noqa: E402

console = Console(width=160)

# (label, shape, dtype, width): golden-like tensors and the widths the planner gives them at 1B.
GPU_CASES = [
    ("logits", (8192, 151936), torch.bfloat16, 32),
    ("logits", (8192, 151936), torch.bfloat16, 64),
    ("logits", (8192, 151936), torch.float32, 64),
    ("layer output", (8192, 2048), torch.bfloat16, 64),
    ("layer output", (8192, 2048), torch.float32, 64),
    ("layer output", (8192, 2048), torch.float64, 64),
    ("expert grad", (128, 1536, 2048), torch.bfloat16, 32),
    ("expert grad", (128, 1536, 2048), torch.float32, 32),
    ("expert grad", (128, 1536, 2048), torch.bfloat16, 16),
    ("lm_head grad", (151936, 2048), torch.bfloat16, 32),
]
CPU_CASES = [
    ("layer output", (2048, 2048), torch.bfloat16, 64),
    ("layer output", (2048, 2048), torch.float32, 64),
    ("layer output", (2048, 2048), torch.float64, 64),
    ("logits", (256, 151936), torch.bfloat16, 64),
    ("expert grad", (16, 1536, 2048), torch.float32, 32),
]
VERIFY = [  # (rows, columns, width, row offset, column offset): odd sizes, column splits, offsets, 1-D
    (37, 70, 32, 7, 0), (9, 300, 64, 0, 13), (3, 25000, 8, 0, 0), (6, 1, 16, 0, 0),
    (64, 151936, 64, 0, 0), (1000, 768, 16, 12345, 0), (300, 4096, 256, 0, 4096),
]
SWEEP = [(tile, warps) for tile in (1024, 2048, 4096) for warps in (4, 8)]


def make(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(dtype)


def copier(x: torch.Tensor):  # noqa: ANN201
    """A function that copies `x` into a buffer of its own (the copy bandwidth's measure)."""
    dst = torch.empty_like(x)
    return lambda: dst.copy_(x)


def cuda_median_ms(fn, reps: int) -> float:  # noqa: ANN001
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


def cpu_median_ms(fn, reps: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def verify_gpu() -> list[dict]:
    from veosnap.numerics import sketch_triton  # noqa: PLC0415

    rows_out = []
    table = Table(title="Triton kernel vs torch path on CUDA (difference / largest row norm; bytes equal on a re-run)")
    for col in ("rows x cols", "width", "offsets", "dtype", "max |values diff|", "max |sumsq diff|", "re-run same bytes"):
        table.add_column(col, justify="right")
    worst = 0.0
    for rows, columns, width, ro, co in VERIFY:
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            x = make((rows, columns), dtype, "cuda")
            ref = sketch.rowsketch_torch(x, width, 99, row_offset=ro, col_offset=co)
            got = sketch_triton.rowsketch(x, width, 99, row_offset=ro, col_offset=co)
            again = sketch_triton.rowsketch(x, width, 99, row_offset=ro, col_offset=co)
            scale = x.double().norm(dim=1).max().item() or 1.0
            dv = (ref.values.double() - got.values.double()).abs().max().item() / scale
            ds = (ref.sumsq.double() - got.sumsq.double()).abs().max().item() / scale**2
            same = torch.equal(got.values, again.values) and torch.equal(got.sumsq, again.sumsq)
            worst = max(worst, dv, ds)
            rows_out.append({"rows": rows, "columns": columns, "width": width, "dtype": str(dtype), "values": dv,
                             "sumsq": ds, "deterministic": same})
            table.add_row(f"{rows} x {columns}", str(width), f"{ro}/{co}", str(dtype).removeprefix("torch."),
                          f"{dv:.2e}", f"{ds:.2e}", "yes" if same else "NO")
    console.print(table)
    verdict = "OK" if kernel_ok(rows_out) else "MISMATCH"
    console.print(f"kernel check: {verdict} (worst relative difference {worst:.2e}; float32 accumulation of "
                  "bfloat16 rounds near 1e-6)")
    return rows_out


def kernel_ok(rows: list[dict]) -> bool:
    return all(r["values"] < 1e-5 and r["sumsq"] < 1e-5 and r["deterministic"] for r in rows)


def bench_gpu(quick: bool) -> tuple[list[dict], list[dict]]:
    from veosnap.numerics import sketch_triton  # noqa: PLC0415

    reps = 5 if quick else 15
    results = []
    table = Table(title=f"row sketch on {torch.cuda.get_device_name()} (medians of {reps}; copy bandwidth counts "
                        "read + write, the sketch's counts what it reads)")
    for col in ("tensor", "shape", "dtype", "width", "GB", "copy ms", "copy GB/s", "sketch ms", "sketch GB/s",
                "ratio", "extra peak / input"):
        table.add_column(col, justify="right")
    for label, shape, dtype, width in GPU_CASES[: 4 if quick else None]:
        x = make(shape, dtype, "cuda")
        nbytes = x.numel() * x.element_size()
        x2d = sketch.as_rows(x)
        copy_ms = cuda_median_ms(copier(x), reps)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sketch_ms = cuda_median_ms(lambda: sketch.rowsketch(x2d, width, 7), reps)  # noqa: B023
        extra = (torch.cuda.max_memory_allocated() - base) / nbytes
        copy_bw = 2 * nbytes / copy_ms / 1e6
        sketch_bw = nbytes / sketch_ms / 1e6
        results.append({"tensor": label, "shape": list(shape), "dtype": str(dtype), "width": width, "bytes": nbytes,
                        "copy_ms": copy_ms, "copy_gbps": copy_bw, "sketch_ms": sketch_ms, "sketch_gbps": sketch_bw,
                        "ratio": sketch_bw / copy_bw, "extra_peak_over_input": extra})
        table.add_row(label, " x ".join(map(str, shape)), str(dtype).removeprefix("torch."), str(width),
                      f"{nbytes / 1e9:.2f}", f"{copy_ms:.3f}", f"{copy_bw:.0f}", f"{sketch_ms:.3f}", f"{sketch_bw:.0f}",
                      f"{sketch_bw / copy_bw:.2f}", f"{extra:.3f}")
        del x, x2d
        torch.cuda.empty_cache()
    console.print(table)
    sweep = []
    if not quick:
        table = Table(title="tile / warps sweep (sketch GB/s; the default is tile 2048, 4 warps)")
        cases = [("logits", (8192, 151936), torch.bfloat16, 64)]
        table.add_column("tensor")
        for tile, warps in SWEEP:
            table.add_column(f"{tile}/{warps}w", justify="right")
        for label, shape, dtype, width in cases:
            x2d = sketch.as_rows(make(shape, dtype, "cuda"))
            nbytes = x2d.numel() * x2d.element_size()
            cells = []
            for tile, warps in SWEEP:
                ms = cuda_median_ms(lambda: sketch_triton.rowsketch(x2d, width, 7, tile=tile, num_warps=warps), 5)  # noqa: B023
                sweep.append({"tensor": label, "dtype": str(dtype), "tile": tile, "warps": warps, "gbps": nbytes / ms / 1e6})
                cells.append(f"{nbytes / ms / 1e6:.0f}")
            table.add_row(f"{label} {str(dtype).removeprefix('torch.')} w{width}", *cells)
            del x2d
            torch.cuda.empty_cache()
        console.print(table)
    return results, sweep


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
        table.add_row(label, " x ".join(map(str, shape)), str(dtype).removeprefix("torch."), str(width),
                      f"{nbytes / 1e6:.0f}", f"{copy_bw:.1f}", f"{ms:.0f}", f"{bw:.2f}", f"{bw / copy_bw:.3f}")
    console.print(table)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    args = parser.parse_args()
    started = time.perf_counter()
    out: dict = {"torch": torch.__version__}
    if torch.cuda.is_available() and sketch.triton_available():
        import triton  # noqa: PLC0415

        out["triton"] = triton.__version__
        out["device"] = torch.cuda.get_device_name()
        out["verify"] = verify_gpu()
        out["gpu"], out["sweep"] = bench_gpu(args.quick)
    else:
        reason = "no CUDA device" if not torch.cuda.is_available() else "triton does not import"
        console.print(f"CUDA kernel skipped: {reason}; timing the torch path on the CPU")
    out["cpu"] = bench_cpu(args.quick or torch.cuda.is_available())
    console.print(f"{time.perf_counter() - started:.0f}s")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "bench_sketch.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {path}")
    if "verify" in out and not kernel_ok(out["verify"]):
        raise SystemExit("the Triton kernel disagrees with the torch path (table above)")


if __name__ == "__main__":
    main()
