"""Render check reports: a terminal table (worst tensors first) or one JSON document."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console
from rich.table import Table

from .numerics.compare import TensorResult
from .runs.verdict import CheckReport

SHOWN_ROWS = 12  # rows of a failed check's table: every failing tensor, then the closest passing ones
SHOWN_PASSING = 3  # a passed check shows only its closest calls


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _status(t: TensorResult) -> str:
    return "ok" if t.passed else "FAIL"


def text(reports: list[CheckReport], width: int = 180, color: bool = False, shown: int = SHOWN_ROWS) -> str:
    """The terminal report for each check, then a one-line summary."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color, highlight=False)
    for report in reports:
        console.print(f"[bold]{report.status}[/bold]  {report.golden}  backend={report.backend}  layout={report.layout}")
        if report.skipped:
            console.print(f"  skipped: {report.skipped}")
            console.print()
            continue
        if report.error:
            console.print(f"  error: {report.error}")
            console.print()
            continue
        for route in report.routes:
            if not route.passed or route.near_tie_flips:
                console.print(f"  {route.message()}")
        if report.route_replay:
            console.print("  routes differ: tensors below compared under route replay (candidate forced onto the golden's experts)")
        if report.first_divergence:
            console.print(f"  first diverging layer: {report.first_divergence}")
        if report.first_gradient_divergence:
            console.print(f"  first diverging gradient: {report.first_gradient_divergence}")
        for note in report.notes:
            console.print(f"  note: {note}")
        if report.tensors and all(t.passed and t.error == 0 for t in report.tensors):
            hint = "" if report.backend == "eager" else " (a swapped kernel rarely reproduces every bit: is it applied?)"
            console.print(f"  all {len(report.tensors)} tensors bit-identical to the golden{hint}")
            console.print()
            continue
        table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
        for col, justify in (("tensor", "left"), ("error", "right"), ("bound", "right"), ("ratio", "right"),
                             ("", "left"), ("worst at", "left")):
            table.add_column(col, justify=justify, overflow="fold")
        ranked = report.ranked()
        failing = [t for t in ranked if not t.passed]
        room = shown if failing else min(shown, SHOWN_PASSING)
        rows = failing + [t for t in ranked if t.passed][: max(0, room - len(failing))]
        for t in rows:
            where = t.problem or t.where
            if t.rows_over and not t.problem:
                where = f"{t.rows_over}/{t.rows} rows over; {where}"
            elif t.error == 0 and not t.problem:
                where = "bit-identical to the golden"
            table.add_row(t.name, _num(t.error), _num(t.bound), _num(t.ratio) + "x", _status(t), where)
        console.print(table)
        hidden = len(ranked) - len(rows)
        if hidden:
            console.print(f"  ... and {hidden} more tensors, all within bound (--format json lists every one)")
        if not report.passed:
            console.print(f"  next: {next_step(report)}")
        console.print()
    failed = sum(not r.passed for r in reports)
    skipped = sum(bool(r.skipped) for r in reports)
    console.print(f"{len(reports) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return buf.getvalue()


def next_step(report: CheckReport) -> str:
    """What to run next for a failed check."""
    layout = "" if report.layout == "single" else f" --layout {report.layout}"
    cmd = f"veosnap check --model {report.model} --dtype {report.dtype} --backend {report.backend}{layout} --format json"
    if report.error:
        return f"fix the backend error, then {cmd}"
    if not report.routes_passed:
        return f"look at the router inputs of the first flipped layer; full detail: {cmd}"
    return f"{cmd}  (every tensor, worst rows; start from the first diverging layer)"


def as_dict(report: CheckReport) -> dict:
    worst = report.worst
    return {
        "golden": report.golden,
        "model": report.model,
        "dtype": report.dtype,
        "backend": report.backend,
        "layout": report.layout,
        "passed": report.passed,
        "status": report.status,
        "error": report.error or None,
        "skipped": report.skipped or None,
        "worst": {"tensor": worst.name, "ratio": _json_num(worst.ratio)} if worst else None,
        "first_divergence": report.first_divergence,
        "first_gradient_divergence": report.first_gradient_divergence,
        "route_replay": report.route_replay,
        "routes": [
            {"layer": r.layer, "tokens": r.tokens, "clear_flips": r.clear_flips, "near_tie_flips": r.near_tie_flips,
             "passed": r.passed, "message": r.message()}
            for r in report.routes
        ],
        "notes": report.notes,
        "tensors": [
            {"name": t.name, "error": _json_num(t.error), "bound": t.bound, "noise": t.noise,
             "ratio": _json_num(t.ratio), "passed": t.passed, "where": t.where, "problem": t.problem or None}
            for t in report.ranked()
        ],
    }


def _json_num(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def json_text(reports: list[CheckReport]) -> str:
    """One JSON document: `passed` and `results` (one entry per check)."""
    doc = {"passed": all(r.passed for r in reports), "results": [as_dict(r) for r in reports]}
    return json.dumps(doc, indent=2)
