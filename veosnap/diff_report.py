"""Render a goldens diff: terminal text, a pull-request comment (markdown), or one JSON document."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from .runs.diff import DiffReport, FieldChange, GoldenDiff, TensorMove
from .golden.manifest import Approval

SHOWN_TENSORS = 12
SHOWN_FIELDS = 8
HASH_CHARS = 19  # "sha256:" and 12 hex digits: enough to tell payloads apart by eye


def _num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _times(ratio: float) -> str:
    return "inf x" if math.isinf(ratio) else f"{ratio:.3g}x"


def _short(value: str | None) -> str:
    if value is None:
        return "(absent)"
    return value[:HASH_CHARS] + "..." if value.startswith("sha256:") and len(value) > HASH_CHARS else value


def _change(c: FieldChange) -> str:
    return f"{c.field}: {_short(c.old)} -> {_short(c.new)}"


def _approval(a: Approval) -> str:
    previous = a.previous_payload_hash
    return f"{a.reason!r} (replaced {_short(previous) if previous else 'nothing'})"


def headline(report: DiffReport) -> str:
    material = sum(d.material for d in report.changed)
    return (f"{len(report.changed)} changed ({material} material), {len(report.added)} added, "
            f"{len(report.removed)} removed, {len(report.unchanged)} unchanged")


def summary(d: GoldenDiff) -> str:
    """One line for one changed golden: verdict, how many tensors moved and the largest move."""
    parts = [d.verdict]
    worst = d.worst
    if d.tensors:
        over = sum(t.material for t in d.tensors)
        parts.append(f"{len(d.tensors)} of {d.compared} tensors moved ({over} over 1x bound), "
                     f"largest {worst.name} {_times(worst.ratio)} bound")
    else:
        parts.append("tensors bit-identical")
    if d.tensors_added or d.tensors_removed:
        parts.append(f"tensors +{len(d.tensors_added)} -{len(d.tensors_removed)}")
    if d.routes:
        parts.append(f"routes changed in {len(d.routes)} of {d.route_layers} MoE layers")
    if d.identity_changed:
        parts.append(" and ".join(c.field.removesuffix("_hash") for c in d.identity_changed) + " changed")
    return "; ".join(parts)


def _tolerance_line(d: GoldenDiff) -> str:
    if not d.tolerance and not d.tolerance_rule:
        return ""
    text = f"{len(d.tolerance)} bounds changed"
    if d.tolerance:
        biggest = max(d.tolerance, key=lambda t: abs(math.log(t.factor)) if 0 < t.factor < math.inf else math.inf)
        text += f" (largest: {biggest.name} {_num(biggest.old_bound)} -> {_num(biggest.new_bound)})"
    if d.tolerance_rule:
        text += "; rule " + ", ".join(_change(c) for c in d.tolerance_rule)
    return text


# --------------------------------------------------------------------------------------------
# text


def text(report: DiffReport, shown: int = SHOWN_TENSORS) -> str:
    """The terminal report: a headline, then each added, removed and changed golden."""
    lines = [f"goldens {report.base} -> {report.head}: {headline(report)}"]
    lines += [f"added    {key}" for key in report.added]
    lines += [f"removed  {key}" for key in report.removed]
    for d in report.changed:
        lines.append(f"changed  {d.key}  {summary(d)}")
        lines += golden_text(d, shown)
    if report.empty:
        lines.append("no golden changed")
    return "\n".join(lines) + "\n"


def golden_text(d: GoldenDiff, shown: int = SHOWN_TENSORS) -> list[str]:
    """The detail lines of one changed golden (indented)."""
    lines = [f"  approved    {_approval(a)}" for a in d.approvals]
    lines += [f"  manifest    {_change(c)}" for c in d.manifest[:SHOWN_FIELDS]]
    if len(d.manifest) > SHOWN_FIELDS:
        lines.append(f"  manifest    ... {len(d.manifest) - SHOWN_FIELDS} more fields (--format json lists every one)")
    lines += [f"  routes      {r.message()}" for r in d.routes]
    if d.tensors_added:
        lines.append("  tensors +   " + ", ".join(d.tensors_added))
    if d.tensors_removed:
        lines.append("  tensors -   " + ", ".join(d.tensors_removed))
    ranked = d.ranked()
    if ranked:
        lines.append(f"  {'tensor':55s} {'moved':>10s} {'row error':>10s} {'old bound':>10s}")
        for t in ranked[:shown]:
            lines.append(f"  {t.name:55s} {_times(t.ratio):>10s} {_num(t.error):>10s} {_num(t.bound):>10s}"
                         + (f"  {t.problem}" if t.problem else ""))
        if len(ranked) > shown:
            rest = ranked[shown:]
            lines.append(f"  ... {len(rest)} more moved, at most {_times(rest[0].ratio)} bound (--format json lists every one)")
    tol = _tolerance_line(d)
    if tol:
        lines.append(f"  tolerance   {tol}")
    lines += [f"  provenance  {_change(c)}" for c in d.provenance]
    return lines


# --------------------------------------------------------------------------------------------
# markdown (a pull-request comment)


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def markdown(report: DiffReport) -> str:
    """A pull-request comment: a verdict and one table row per golden first, details folded below."""
    out = [f"### veosnap: goldens `{report.base}` → `{report.head}`", ""]
    if report.empty:
        out += [f"No golden changed ({len(report.unchanged)} compared).", ""]
        return "\n".join(out)
    verdict = ("**Material changes**: goldens added, removed, or moved beyond their noise."
               if report.material else "No material change: every moved tensor is within its bound.")
    out += [verdict, "", headline(report) + ".", ""]
    out += ["| golden | change | tensors moved | largest move | routes | reason |", "|---|---|---|---|---|---|"]
    for key in report.added:
        out.append(f"| `{key}` | **added** | | | | |")
    for key in report.removed:
        out.append(f"| `{key}` | **removed** | | | | |")
    for d in report.changed:
        worst = d.worst
        largest = f"`{worst.name}` {_times(worst.ratio)} bound" if worst else "—"
        routes = f"{len(d.routes)} of {d.route_layers} layers changed" if d.routes else ("same" if d.route_layers else "—")
        reasons = "; ".join(a.reason for a in d.approvals) or "—"
        change = f"**{d.verdict}**" if d.material else d.verdict
        out.append(f"| `{d.key}` | {change} | {len(d.tensors)} / {d.compared} | {_cell(largest)} | {routes} | {_cell(reasons)} |")
    out.append("")
    for d in report.changed:
        out += [f"<details><summary><code>{d.key}</code>: {_html(summary(d))}</summary>", ""]
        out += _golden_markdown(d)
        out += ["</details>", ""]
    return "\n".join(out)


def _html(value: str) -> str:
    return value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _golden_markdown(d: GoldenDiff) -> list[str]:
    out: list[str] = []
    for a in d.approvals:
        out.append(f"- approved: {_cell(_approval(a))}")
    for c in d.manifest:
        out.append(f"- manifest `{c.field}`: `{_short(c.old)}` → `{_short(c.new)}`")
    for r in d.routes:
        out.append(f"- routes: {r.message()}")
    if d.tensors_added:
        out.append("- tensors added: " + ", ".join(f"`{n}`" for n in d.tensors_added))
    if d.tensors_removed:
        out.append("- tensors removed: " + ", ".join(f"`{n}`" for n in d.tensors_removed))
    tol = _tolerance_line(d)
    if tol:
        out.append(f"- tolerance: {_cell(tol)}")
    for c in d.provenance:
        out.append(f"- provenance `{c.field}`: `{_short(c.old)}` → `{_short(c.new)}`")
    if d.tensors:
        out += ["", "| tensor | moved (x old bound) | row error | old bound |", "|---|---:|---:|---:|"]
        for t in d.ranked():
            moved = _times(t.ratio) + (f" ({t.problem})" if t.problem else "")
            out.append(f"| `{t.name}` | {_cell(moved)} | {_num(t.error)} | {_num(t.bound)} |")
    out.append("")
    return out


# --------------------------------------------------------------------------------------------
# json


def _json_num(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def _move(t: TensorMove) -> dict:
    return {"name": t.name, "ratio": _json_num(t.ratio), "error": _json_num(t.error), "bound": t.bound,
            "problem": t.problem or None}


def _fields(changes: list[FieldChange]) -> list[dict]:
    return [{"field": c.field, "old": c.old, "new": c.new} for c in changes]


def golden_dict(d: GoldenDiff) -> dict:
    return {
        "key": str(d.key),
        "verdict": d.verdict,
        "material": d.material,
        "compared": d.compared,
        "tensors": [_move(t) for t in d.ranked()],
        "tensors_added": d.tensors_added,
        "tensors_removed": d.tensors_removed,
        "routes": [{"layer": r.layer, "tokens": r.tokens, "flipped": r.flipped, "near_tie": r.near_tie,
                    "status": r.status} for r in d.routes],
        "route_layers": d.route_layers,
        "tolerance": [{"name": t.name, "old_bound": t.old_bound, "new_bound": t.new_bound,
                       "old_noise": t.old_noise, "new_noise": t.new_noise} for t in d.tolerance],
        "tolerance_rule": _fields(d.tolerance_rule),
        "manifest": _fields(d.manifest),
        "provenance": _fields(d.provenance),
        "approvals": [asdict(a) for a in d.approvals],
    }


def as_dict(report: DiffReport) -> dict:
    return {
        "base": report.base,
        "head": report.head,
        "material": report.material,
        "added": [str(k) for k in report.added],
        "removed": [str(k) for k in report.removed],
        "unchanged": [str(k) for k in report.unchanged],
        "changed": [golden_dict(d) for d in report.changed],
    }


def json_text(report: DiffReport) -> str:
    return json.dumps(as_dict(report), indent=2)
