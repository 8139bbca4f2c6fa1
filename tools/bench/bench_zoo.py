"""Time the zoo: one forward+backward per model and dtype, a record (the reference and its float64 twin,
then the legitimate variants it is checked with before it is written), a check; golden sizes.

    python tools/bench/bench_zoo.py
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from veosnap.candidates import backends
from veosnap.golden import store
from veosnap.golden.key import DTYPE_NAMES, GoldenKey
from veosnap.reference import inputs, models
from veosnap.reference.capture import run_step
from veosnap.reference.zoo import Project, load_config
from veosnap.runs import record
from veosnap.runs.check import check

ROOT = Path(__file__).resolve().parents[2]


def best_of(fn, repeat: int = 5) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    batch = inputs.padded(inputs.load_sequences(project.testdata))
    table = Table(title=f"zoo timings on {torch.get_num_threads()} CPU threads (best of 5; record/check: one run)")
    for col in ("model", "params", "dtype", "fwd+bwd", "record", "of it: variants", "check (eager)", "golden size"):
        table.add_column(col, justify="right" if col != "model" else "left")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = replace(project, goldens=Path(tmp))
        for name in project.models():
            toy = load_config(project.configs, name)
            for dtype in DTYPE_NAMES:
                model = models.build(toy, models.dtype_from_name(dtype))
                step = best_of(lambda: run_step(model, batch))
                t = time.perf_counter()
                record.record(scratch, name, dtype)
                rec = time.perf_counter() - t
                golden = store.read(store.path_for(scratch.goldens, GoldenKey(scratch.hardware_class, name, "step",
                                                                              dtype)))
                t = time.perf_counter()
                record.fragility(scratch, golden)  # what record spent on the variants before writing
                variants = time.perf_counter() - t
                t = time.perf_counter()
                check(project, GoldenKey(project.hardware_class, name, "step", dtype), backends.resolve("eager"))
                chk = time.perf_counter() - t
                key = GoldenKey(project.hardware_class, name, "step", dtype)
                size = store.path_for(project.goldens, key).stat().st_size
                table.add_row(name, f"{sum(p.numel() for p in model.parameters()):,}", dtype, f"{step * 1000:.0f} ms",
                              f"{rec:.2f} s", f"{variants:.2f} s", f"{chk:.2f} s", f"{size / 1024:.0f} KiB")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
