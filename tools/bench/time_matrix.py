"""Time `veosnap check --matrix` over every built-in backend this machine runs (single layout).

Prints one table: per backend, the wall and CPU seconds summed over the models, the slowest cell,
and the cells' outcomes; then the whole run. torch.compile's cost depends on inductor's on-disk
cache: by default the run starts from an empty cache (what CI sees); --warm-cache keeps the user's.

    PYTHONPATH=$PWD python tools/bench/time_matrix.py [--dtype float32] [--backends a,b] [--model NAME ...]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict

import torch
from rich.console import Console
from rich.table import Table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    parser.add_argument("--backends", help="comma-separated specs (default: every built-in that runs here)")
    parser.add_argument("--model", action="append")
    parser.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache")
    args = parser.parse_args()
    if not args.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="veosnap-inductor-")

    from veosnap.reference.zoo import Project
    from veosnap.runs import matrix

    project = Project.resolve()
    specs, unavailable = matrix.default_backends()
    specs = args.backends.split(",") if args.backends else specs
    dtypes = args.dtype or ["float32"]
    models = args.model or project.models()
    cpu_seconds: dict[str, float] = defaultdict(float)
    inner = matrix.default_check()

    def timed(project, key, backend, layouts):  # noqa: ANN001, ANN202 - a matrix.LayoutsCheck
        start = time.process_time()
        try:
            return inner(project, key, backend, layouts)
        finally:
            cpu_seconds[backend.spec] += time.process_time() - start

    def progress(cell: matrix.Cell, done: int, total: int) -> None:
        print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}: {cell.status} ({cell.seconds:.1f} s)",
              file=sys.stderr, flush=True)

    result = matrix.run_matrix(project, models, dtypes, specs, check_cells=timed, on_cell=progress,
                               unavailable=unavailable)

    table = Table(title=f"veosnap check --matrix: {len(models)} models x {', '.join(dtypes)}, single layout")
    for col, justify in (("backend", "left"), ("cells", "right"), ("wall s", "right"), ("CPU s", "right"),
                         ("slowest cell", "left"), ("outcome", "left")):
        table.add_column(col, justify=justify)
    for spec in specs:
        cells = [c for c in result.cells if c.backend == spec]
        slowest = max(cells, key=lambda c: c.seconds)
        counts = {s: sum(c.status == s for c in cells) for s in matrix.STATUSES}
        table.add_row(spec, str(len(cells)), f"{sum(c.seconds for c in cells):.1f}", f"{cpu_seconds[spec]:.1f}",
                      f"{slowest.model} {slowest.seconds:.1f} s", ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    table.add_row("all", str(len(result.cells)), f"{result.seconds:.1f}", f"{sum(cpu_seconds.values()):.1f}", "",
                  ", ".join(f"{n} {s}" for s, n in result.counts().items() if n), style="bold")
    console = Console(width=140)
    console.print(table)
    console.print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
                  f"{torch.get_num_threads()} threads, inductor cache {'warm' if args.warm_cache else 'cold'}")
    for name, reason in unavailable.items():
        console.print(f"not run here: {name} ({reason})")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
