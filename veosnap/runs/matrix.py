"""The support matrix: every model (rows) checked with every (backend, layout) (columns), in one run.

Each cell is one check against the model's golden, reduced to a status (pass, fail, skip, error),
the worst tensor's error-to-bound ratio and a one-line reason. A cell that raises becomes an error
cell and the other cells still run. How cells are checked is a `LayoutsCheck` (a golden key, a backend
and the layouts to run -> one `CheckReport` per layout), so every layout of one (model, backend) shares
one torchrun start-up, and anything else with that shape plugs in.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..candidates import backends as backends_mod
from ..candidates.backends import Backend
from ..golden.key import GoldenKey
from ..reference.zoo import Project
from .check import DEFAULT_TIMEOUT_S, check_layouts
from .verdict import CheckReport

SINGLE = "single"  # the golden's own layout: one process, padded batch
LayoutsCheck = Callable[[Project, GoldenKey, Backend, list[str]], list[CheckReport]]
STATUSES = ("pass", "fail", "skip", "error")


def default_check(nproc: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S, isolate: bool = False) -> LayoutsCheck:
    """`runs.check.check_layouts`: in-process layouts here, the multi-process ones under one torchrun."""

    def run(project: Project, key: GoldenKey, backend: Backend, layouts: list[str]) -> list[CheckReport]:
        return check_layouts(project, key, backend, layouts, nproc=nproc, timeout_s=timeout_s, isolate=isolate)

    return run


@dataclass(frozen=True)
class Column:
    backend: str
    layout: str = SINGLE

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.layout}"


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str


@dataclass(frozen=True)
class Cell:
    """One check's verdict in the matrix."""

    model: str
    dtype: str
    backend: str
    layout: str
    status: str  # one of STATUSES
    worst_ratio: float | None = None  # worst tensor's error / bound; None when nothing was compared
    worst_tensor: str = ""
    reason: str = ""  # why it failed, errored or was skipped
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    report: CheckReport | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status in ("pass", "skip")

    @property
    def forward_only(self) -> bool:
        return any(note.startswith("forward only") for note in self.notes)

    @classmethod
    def from_report(cls, report: CheckReport, seconds: float = 0.0) -> Cell:
        status = {"PASS": "pass", "FAIL": "fail", "ERROR": "error", "skip": "skip"}[report.status]
        worst = report.worst
        return cls(
            model=report.model, dtype=report.dtype, backend=report.backend, layout=report.layout,
            status=status,
            worst_ratio=None if worst is None or math.isinf(worst.ratio) else worst.ratio,
            worst_tensor=worst.name if worst else "",
            reason=report.skipped or report.error or (_failure(report) if status == "fail" else ""),
            notes=tuple(report.notes), seconds=seconds, report=report,
        )


def _failure(report: CheckReport) -> str:
    """The one line a matrix shows for a failed check: structure first, routes, then the earliest divergence."""
    if report.structure_line:
        return report.structure_line
    for route in report.routes:
        if not route.passed:
            return route.message()
    worst = report.worst
    where = report.first_divergence or report.first_gradient_divergence
    if worst is not None and worst.problem:
        return f"{worst.name}: {worst.problem}"
    if where:
        return f"first divergence: {where}"
    return f"{worst.name} over its bound" if worst else "failed"


@dataclass
class Matrix:
    """Rows (model, dtype) by columns (backend, layout); `unavailable` lists backends left out, and why."""

    rows: list[Row]
    columns: list[Column]
    cells: list[Cell]
    unavailable: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def cell(self, row: Row, column: Column) -> Cell | None:
        for c in self.cells:
            if (c.model, c.dtype, c.backend, c.layout) == (row.model, row.dtype, column.backend, column.layout):
                return c
        return None

    @property
    def passed(self) -> bool:
        """True when no cell failed or errored (skipped cells say why, and pass)."""
        return all(c.ok for c in self.cells)

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.cells) for s in STATUSES}


def default_backends() -> tuple[list[str], dict[str, str]]:
    """The built-in backends this machine can run, and those it cannot with the reason."""
    unavailable = {n: r for n in backends_mod.builtin_names() if (r := backends_mod.unavailable_here(n))}
    return backends_mod.runnable_builtins(), unavailable


def run_matrix(
    project: Project,
    models: list[str],
    dtypes: list[str],
    backend_specs: list[str],
    layouts: list[str] = (SINGLE,),  # type: ignore[assignment]
    check_cells: LayoutsCheck | None = None,
    on_cell: Callable[[Cell, int, int], None] | None = None,
    unavailable: dict[str, str] | None = None,
    scenario: str = "step",
    rows: Sequence[tuple[str, str]] | None = None,
) -> Matrix:
    """Check every (model, dtype) with every (backend, layout); `on_cell(cell, done, total)` reports progress.

    `rows`: the (model, dtype) pairs to check, when not every model has every dtype (default: all pairs).

    Backend specs are resolved first, so a misspelt one is a usage error before anything runs.
    """
    resolved = {spec: backends_mod.resolve(spec) for spec in backend_specs}
    check_cells = check_cells or default_check()
    layouts = list(layouts)
    rows = [Row(m, d) for m, d in rows] if rows is not None else [Row(m, d) for m in models for d in dtypes]
    columns = [Column(b, layout) for b in backend_specs for layout in layouts]
    cells: list[Cell] = []
    start = time.perf_counter()
    total = len(rows) * len(columns)
    for row in rows:
        key = GoldenKey(project.hardware_class, row.model, scenario, row.dtype)
        for spec in backend_specs:
            t0 = time.perf_counter()
            try:
                reports = check_cells(project, key, resolved[spec], layouts)
                share = (time.perf_counter() - t0) / max(1, len(reports))
                group = [Cell.from_report(report, share) for report in reports]
            except Exception as exc:  # noqa: BLE001 - one group's failure (a bad golden too) must not end the run
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
                share = (time.perf_counter() - t0) / max(1, len(layouts))
                group = [Cell(row.model, row.dtype, spec, layout, "error", reason=reason, seconds=share)
                         for layout in layouts]
            for cell in group:
                cells.append(cell)
                if on_cell:
                    on_cell(cell, len(cells), total)
    return Matrix(rows, columns, cells, dict(unavailable or {}), time.perf_counter() - start)
