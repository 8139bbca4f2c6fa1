"""Terminal text: check reports (worst tensors first), goldens diffs, the support matrix, one golden."""

from __future__ import annotations

import io
from collections.abc import Callable

from rich.console import Console
from rich.table import Table

from ..golden.codec import Golden
from ..reference.zoo import Where, shown
from ..runs.diff import DiffReport, GoldenDiff
from ..runs.drift import DriftReport
from ..runs.matrix import Matrix
from ..runs.verdict import CheckReport
from . import view

_STYLE = {"pass": "green", "fail": "bold red", "skip": "dim", "error": "bold magenta"}


def _console(width: int, color: bool) -> tuple[Console, io.StringIO]:
    # No emoji codes: a report's names and specs are printed as they are (a `:name:` in one is not an emoji),
    # and a process's first report no longer imports rich's emoji table (~3 ms of a check's report).
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=color, no_color=not color, highlight=False,
                   emoji=False), buf


# The check table's columns: (header, alignment).
_CHECK_COLUMNS = (("tensor", "<"), ("error", ">"), ("bound", ">"), ("ratio", ">"), ("", "<"), ("worst at", "<"))


def checks(reports: list[CheckReport], width: int = 180, color: bool = False, shown: int = view.SHOWN_ROWS) -> str:
    """The terminal report for each check, then a one-line summary. Plain lines, no layout engine: a check's few
    rows in columns, every line whole however long (it copies as printed; a terminal wraps it). rich's table
    took 2-4 ms a report, a tenth of a check's own time at 1B parameters on an H200; this takes 0.05 ms.
    `width` is kept for callers; lines are not wrapped to it."""
    bold = (lambda text: f"\x1b[1m{text}\x1b[0m") if color else (lambda text: text)  # noqa: E731
    out: list[str] = []
    for report in reports:
        v = view.check_view(report, shown)
        out.append(f"{bold(v.status)}  {v.header}")
        out += [f"  {line}" for line in v.lines]
        if v.rows:
            cells = [[row.name, row.error, row.bound, row.ratio, row.status, row.where] for row in v.rows]
            widths = [max(len(header), *(len(row[i]) for row in cells)) for i, (header, _) in enumerate(_CHECK_COLUMNS)]

            def line(values: list[str], emphasis: Callable[[str], str] = lambda text: text) -> str:
                text = "  ".join(f"{value:{align}{w}}" for value, (_, align), w in zip(values, _CHECK_COLUMNS, widths))
                return emphasis(text.rstrip())

            out.append(line([header for header, _ in _CHECK_COLUMNS], bold))
            out += [line(row) for row in cells]
        if v.hidden:
            out.append(f"  {v.hidden}")
        if v.next:  # one line however long, so it copies and runs as printed
            out.append(f"  {v.next}")
        out.append("")
    note = view.versions_note(reports)
    if note:
        out.append(note)
    out.append(view.checks_summary(reports))
    return "\n".join(out) + "\n"


def where(w: Where) -> str:
    """A report's header: the project a command found (or that it found none) and the goldens it reads."""
    zoo = {"goldens": "goldens", "toy_configs": "toy configs", "testdata": "test data"}
    if w.root is None:
        return (f"no veosnap project in {w.start} or above it (none has goldens/, toy_configs/ or a pyproject.toml "
                f"with [tool.veosnap]): veosnap's bundled zoo, goldens {w.goldens}")
    if set(w.bundled) == set(zoo):
        return f"project {w.root} (veosnap's bundled zoo): goldens {shown(w.goldens)}"
    bundled = [zoo[kind] for kind in zoo if kind in w.bundled and kind != "goldens"]
    goldens = f"goldens {shown(w.goldens)}" + (" (veosnap's bundled zoo)" if "goldens" in w.bundled else "")
    rest = f"; {' and '.join(bundled)} from veosnap's bundled zoo" if bundled else ""
    return f"project {w.root}: {goldens}{rest}"


def diff(report: DiffReport, shown: int = view.SHOWN_TENSORS) -> str:
    """A goldens diff: a headline, then each added, removed and changed golden."""
    lines = [f"goldens {report.base} -> {report.head}: {view.diff_headline(report)}"]
    lines += [f"added    {key}" for key in report.added]
    lines += [f"removed  {key}" for key in report.removed]
    lines += [f"stale    {view.stale_text(key, by)}" for key, by in report.stale]
    for d in report.changed:
        change = view.golden_change(d, shown)
        lines.append(f"changed  {change.key}  {change.summary}")
        lines += _change_lines(change)
    if report.empty:
        lines.append("no golden changed")
    return "\n".join(lines) + "\n"


def diff_golden(d: GoldenDiff, shown: int = view.SHOWN_TENSORS) -> list[str]:
    """The detail lines of one changed golden (indented), as `veosnap refresh` prints them."""
    return _change_lines(view.golden_change(d, shown))


def _change_lines(change: view.GoldenChange) -> list[str]:
    lines = [f"  approved    {a}" for a in change.approvals]
    lines += [f"  trail       {t}" for t in change.trail]
    lines += [f"  loosened    {t}" for t in change.loosened]
    if change.loosened_hidden:
        lines.append(f"  loosened    ... {change.loosened_hidden} more bounds grew (--format json lists every one)")
    lines += [f"  material    {line}" for line in change.fields]
    lines += [f"  absent      {view.change_text(c)}" for c in change.absent]
    lines += [f"  manifest    {view.change_text(c)}" for c in change.manifest]
    if change.manifest_hidden:
        lines.append(f"  manifest    ... {change.manifest_hidden} more fields (--format json lists every one)")
    lines += [f"  routes      {r}" for r in change.routes]
    if change.tensors_added:
        lines.append("  tensors +   " + ", ".join(change.tensors_added))
    if change.tensors_removed:
        lines.append("  tensors -   " + ", ".join(change.tensors_removed))
    if change.tensors:
        lines.append(f"  {'tensor':55s} {'moved':>10s} {'row error':>10s} {'old bound':>10s}")
        for t in change.tensors:
            problem = f"  {t.problem}" if t.problem else f"  {t.estimate}" if t.estimate else ""
            lines.append(f"  {t.name:55s} {t.moved:>10s} {t.error:>10s} {t.bound:>10s}{problem}")
        if change.tensors_hidden:
            lines.append(f"  {change.tensors_hidden}")
    if change.tolerance:
        lines.append(f"  tolerance   {change.tolerance}")
    lines += [f"  provenance  {view.change_text(c)}" for c in change.provenance]
    return lines


def matrix(m: Matrix, width: int = 160, color: bool = False) -> str:
    """The support matrix as a table, then one line per cell that did not pass, then a summary."""
    v = view.matrix_view(m)
    console, buf = _console(width, color)
    table = Table(header_style="bold", show_lines=False)
    table.add_column("model", no_wrap=True)
    for label in v.columns:
        table.add_column(label, justify="left", no_wrap=True)
    for label, cells in v.rows:
        table.add_row(label, *("" if not status else f"[{_STYLE[status]}]{text}[/]" for status, text in cells))
    console.print(v.title)
    console.print(table)
    if v.footnote:
        console.print(v.footnote)
    for line in v.outcomes + v.unavailable:
        console.print(line, soft_wrap=True)
    console.print(v.summary)
    return buf.getvalue()


def golden(g: Golden, full: bool = False) -> str:
    """One golden (`veosnap show`): its manifest's key facts, its approvals, its tensors."""
    v = view.golden_view(g, full)
    lines = [f"{label:<12}{value}" for label, value in v.facts]
    lines.append(f"{'tensors':<12}{v.total}")
    lines += [f"  {name:55s} {dtype:9s} {shape:16s} {tolerance}" for name, dtype, shape, tolerance in v.tensors]
    if not v.full:
        lines.append(f"  ... {v.hidden} gradients or updates (--full lists them)")
    return "\n".join(lines)


def drift(report: DriftReport) -> str:
    """A drift report: a headline, then one line per golden (moved ones first)."""
    rows = sorted(view.drift_rows(report), key=lambda r: (view.DRIFT_ORDER.index(r.status), r.golden))
    lines = [view.drift_headline(report)]
    width = max((len(r.golden) for r in rows), default=0)
    for r in rows:
        where = f"; first moved: {r.first_layer}" if r.first_layer else ""
        routes = f"; routes: {r.routes}" if r.routes else ""
        lines.append(f"{r.status:12s} {r.golden:{width}s}  {r.worst}{where}{routes}")
    return "\n".join(lines) + "\n"
