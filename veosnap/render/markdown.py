"""Pull-request comments: a goldens diff (a verdict and one table row per golden first, details folded) and a\ndrift report (one table row per golden)."""

from __future__ import annotations

from ..runs.diff import DiffReport
from ..runs.drift import DriftReport
from . import view


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def _html(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def diff(report: DiffReport) -> str:
    """The comment: a verdict and one table row per golden first, each changed golden's details folded below."""
    out = [f"### veosnap: goldens `{report.base}` → `{report.head}`", ""]
    if report.empty:
        out += [f"No golden changed ({len(report.unchanged)} compared).", ""]
        return "\n".join(out)
    verdict = ("**Material changes**: goldens added, removed or moved beyond their noise, or bounds loosened, the "
               "tolerance rule or the approval trail rewritten."
               if report.material else "No material change: every moved tensor is within its bound.")
    out += [verdict, "", view.diff_headline(report) + ".", ""]
    out += ["| golden | change | tensors moved | largest move | routes | reason |", "|---|---|---|---|---|---|"]
    for key in report.added:
        out.append(f"| `{key}` | **added** | | | | |")
    for key in report.removed:
        out.append(f"| `{key}` | **removed** | | | | |")
    for key, by in report.stale:
        out.append(f"| `{key}` | **stale**: recorded from the config `{by}` moved away from | | | | |")
    changes = [view.golden_change(d, shown=None, fields=None) for d in report.changed]
    for c in changes:
        verdict = f"**{c.verdict}**" if c.material else c.verdict
        out.append(f"| `{c.key}` | {verdict} | {c.moved} | {_cell(c.largest)} | {c.route_cell} | {_cell(c.reasons)} |")
    out.append("")
    for c in changes:
        out += [f"<details><summary><code>{c.key}</code>: {_html(c.summary)}</summary>", ""]
        out += _details(c)
        out += ["</details>", ""]
    return "\n".join(out)


def _details(c: view.GoldenChange) -> list[str]:
    out = [f"- approved: {_cell(a)}" for a in c.approvals]
    out += [f"- **trail**: {_cell(t)}" for t in c.trail]
    out += [f"- **bound loosened**: {_cell(t)}" for t in c.loosened]
    out += [f"- **material**: {_cell(line)}" for line in c.fields]
    out += [f"- **absent** `{f.field}`: `{view.short(f.old)}` → `{view.short(f.new)}`" for f in c.absent]
    out += [f"- manifest `{f.field}`: `{view.short(f.old)}` → `{view.short(f.new)}`" for f in c.manifest]
    out += [f"- routes: {r}" for r in c.routes]
    if c.tensors_added:
        out.append("- tensors added: " + ", ".join(f"`{n}`" for n in c.tensors_added))
    if c.tensors_removed:
        out.append("- tensors removed: " + ", ".join(f"`{n}`" for n in c.tensors_removed))
    if c.tolerance:
        out.append(f"- tolerance: {_cell(c.tolerance)}")
    out += [f"- provenance `{f.field}`: `{view.short(f.old)}` → `{view.short(f.new)}`" for f in c.provenance]
    if c.tensors:
        out += ["", "| tensor | moved (x old bound) | row error | old bound |", "|---|---:|---:|---:|"]
        for t in c.tensors:
            moved = t.moved + (f" ({t.problem})" if t.problem else f" ({t.estimate})" if t.estimate else "")
            out.append(f"| `{t.name}` | {_cell(moved)} | {t.error} | {t.bound} |")
    out.append("")
    return out


def drift(report: DriftReport) -> str:
    """A drift report as a table: one row per golden, moved ones first."""
    rows = sorted(view.drift_rows(report), key=lambda r: (view.DRIFT_ORDER.index(r.status), r.golden))
    out = [f"### veosnap: {_cell(view.drift_headline(report))}", "",
           "| golden | drift | worst tensor (x stored bound) | first moved layer | routes |", "|---|---|---|---|---|"]
    for r in rows:
        status = f"**{r.status}**" if r.status == "moved" else r.status
        out.append(f"| `{r.golden}` | {status} | {_cell(r.worst)} | {_cell(r.first_layer)} | {_cell(r.routes)} |")
    return "\n".join(out) + "\n"
