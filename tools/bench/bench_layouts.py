"""Wall time of layout checks: one 2-process FSDP2 check, then every layout of every zoo model.

    PYTHONPATH=. python tools/bench/bench_layouts.py [--models llama,qwen3_moe] [--dtype float32] [--nproc 2]

Prints two tables: the single FSDP2 check (torchrun start-up included), and per model the status of
each layout (worst ratio to its bound, or why it skipped) with the wall time of that model's checks
(in-process layouts one by one, all multi-process layouts in one shared torchrun).
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from veosnap.candidates import backends
from veosnap.candidates.layouts import registry
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.render.view import cell_text
from veosnap.runs.check import check, check_layouts
from veosnap.runs.matrix import Cell


def cell(report) -> str:  # noqa: ANN001
    """A report as the support matrix draws its cell."""
    return cell_text(Cell.from_report(report))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated (default: every zoo model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--fsdp-model", default="llama")
    args = p.parse_args()
    project = Project.resolve()
    eager = backends.resolve("eager")
    console = Console(width=200)

    start = time.perf_counter()
    report = check(project, GoldenKey(project.hardware_class, args.fsdp_model, "step", args.dtype), eager, "fsdp2",
                   nproc=args.nproc)
    single = Table(title=f"one {args.nproc}-process FSDP2 check")
    for col in ("model", "dtype", "status", "wall s"):
        single.add_column(col)
    single.add_row(args.fsdp_model, args.dtype, cell(report), f"{time.perf_counter() - start:.1f}")
    console.print(single)

    models = args.models.split(",") if args.models else project.models()
    names = registry.names()
    table = Table(title=f"every layout, {args.dtype}, nproc {args.nproc} (cell: status and worst error/bound ratio)")
    for col in ("model", *names, "wall s"):
        table.add_column(col)
    skips: dict[str, str] = {}
    errors: list[str] = []
    total = time.perf_counter()
    for model in models:
        start = time.perf_counter()
        reports = check_layouts(project, GoldenKey(project.hardware_class, model, "step", args.dtype), eager,
                                names, nproc=args.nproc)
        table.add_row(model, *(cell(r) for r in reports), f"{time.perf_counter() - start:.1f}")
        skips.update({r.layout: r.skipped for r in reports if r.skipped and r.layout not in skips})
        errors += [f"{model}/{r.layout}: {r.error}" for r in reports if r.error]
    table.add_row("all", *[""] * len(names), f"{time.perf_counter() - total:.1f}")
    console.print(table)
    for name, why in skips.items():
        console.print(f"skip {name}: {why}")
    for line in errors:
        console.print(f"error {line}")


if __name__ == "__main__":
    main()
