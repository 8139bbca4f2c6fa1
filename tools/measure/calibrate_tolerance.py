"""Measure how far legitimate candidates and planted bugs land from the goldens, to choose alpha and floors.

For every zoo model and dtype it checks each candidate against the committed goldens and prints, per
(candidate, dtype), the worst ratio err/bound over all tensors and models. Legitimate candidates
(other kernels, another thread count) must stay well under 1.0 (in bfloat16 also in each layer's
isolated parts, `numerics.isolation`); planted bugs ("large" ones in both
dtypes, "small" ones in float32) must land well over it; precision regressions are exact in float32
and are judged by the bfloat16 goldens.

    python tools/measure/calibrate_tolerance.py [--model NAME]...
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import faults  # noqa: E402

from veosnap.candidates import backends  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.numerics import tolerance  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402
from veosnap.runs.check import check  # noqa: E402

LEGIT = ["sdpa", "grouped_mm", "batched_mm", "sdpa+grouped_mm"]


def run(project: Project, models: list[str]) -> list[tuple[str, str, str, str, float, str]]:
    rows = []
    candidates = [(b, "legit", b) for b in LEGIT]
    candidates += [(f"tests/faults.py:{name}", size, name) for name, (size, _) in faults.FAULTS.items()]
    candidates += [(f"tests/faults.py:{name}", "precision", name) for name in faults.PRECISION_FAULTS]
    # Bugs in the MoE load-balancing loss: only the `*_aux` models have one (the others decline them).
    candidates += [(f"tests/faults.py:{name}", "aux bug", name) for name in faults.AUX_LOSS_FAULTS]
    for model in models:
        for dtype in ("float32", "bfloat16"):
            key = GoldenKey(project.hardware_class, model, "step", dtype)
            for spec, kind, label in candidates:
                rows.append(_one(project, key, spec, kind, label))
            saved = torch.get_num_threads()
            torch.set_num_threads(1 if saved > 1 else 2)
            rows.append(_one(project, key, "eager", "legit", f"eager@{torch.get_num_threads()}threads"))
            torch.set_num_threads(saved)
    return rows


def _one(project: Project, key: GoldenKey, spec: str, kind: str, label: str) -> tuple:
    report = check(project, key, backends.resolve(spec))
    if report.skipped or report.error:
        return (label, kind, key.model, key.dtype, float("nan"), report.skipped or report.error)
    worst = report.worst
    ratio = float("inf") if not report.routes_passed else worst.ratio
    where = "routes" if not report.routes_passed else worst.name
    isolated = report.isolated_ranked()[0] if report.isolated else None  # bfloat16: the parts in isolation
    if isolated is not None and isolated.ratio > ratio:
        ratio, where = isolated.ratio, f"isolated {isolated.place} ({isolated.statistic})"
    return (label, kind, key.model, key.dtype, ratio, where)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append")
    args = parser.parse_args()
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    models = args.model or project.models()
    rows = run(project, models)
    table = Table(title=f"worst err/bound over {len(models)} models (alpha: {tolerance.ALPHA}, floor: {tolerance.FLOOR})")
    for col in ("candidate", "kind", "dtype", "worst ratio", "min ratio", "at (worst)", "models failed"):
        table.add_column(col)
    grouped = defaultdict(list)
    for label, kind, model, dtype, ratio, where in rows:
        if ratio == ratio:  # skip NaN (skipped cells)
            grouped[(label, kind, dtype)].append((ratio, model, where))
    for (label, kind, dtype), items in grouped.items():
        worst = max(items)
        least = min(items)
        failed = sum(r > 1.0 for r, _, _ in items)
        table.add_row(label, kind, dtype, f"{worst[0]:.3g}", f"{least[0]:.3g}", f"{worst[1]}: {worst[2]}",
                      f"{failed}/{len(items)}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
