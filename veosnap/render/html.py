"""A picture of a failure: one self-contained HTML page per `veosnap check` run.

`checks(reports)` is the page of a run's check reports. It is drawn (`page`) from the JSON document
`veosnap check --format json` prints (`{passed, results: [...]}`), the text report of the same run and,
per check, the tensors whose worst rows `view.worst_rows_sections` chose; nothing else, so the page
shows exactly what the JSON says. Output: one HTML string with inline CSS and SVG, no script and
nothing fetched, so it opens from a CI artifact or a mail attachment as it is.

Per check, top to bottom: the verdict, where it first diverged (layer, gradient, routes) and the
`next:` command; a chart of the forward tensors in forward order (each decoder layer's output and
routes, then logits and loss) and one of the gradients (or a train run's updates) in the order the
backward pass computes them (LM head, final norm, the last layer down to the first, embeddings),
each point one tensor at its error/bound ratio on a log scale, the bound (1x) a line, tensors over it
red; route flips per layer and expert; the worst rows of the worst tensors; every tensor in a
table. Then the text report. Every number drawn is also in the DOM as text or as a `data-`
attribute holding the JSON's value, so a browser test can hold the page to the JSON.

The first half of the module lays the charts out (`Chart`, `Band`, `Point` built from a result); the
second half only draws them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from html import escape
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from . import json as render_json
from . import text as render_text
from .view import RowsSection, worst_rows_sections

if TYPE_CHECKING:
    from ..reference.zoo import Where
    from ..runs.verdict import CheckReport

# --- what to show ------------------------------------------------------------------------------

# Within a layer, groups in the order their tensors are computed: forward, then backward.
FORWARD_GROUPS = ("routes", "output")
BACKWARD_GROUPS = ("mlp", "router", "norm", "attention", "other")
SHAPES = {"output": "circle", "routes": "diamond", "logits": "circle", "loss": "circle", "train": "circle",
          "mlp": "square", "router": "diamond", "norm": "triangle", "attention": "circle", "other": "cross",
          "lm_head": "circle", "embeddings": "circle"}
GROUP_LABELS = {"output": "layer output", "routes": "routing weights", "mlp": "MLP / experts", "router": "router",
                "norm": "norms", "attention": "attention", "other": "other", "logits": "logits", "loss": "loss",
                "train": "train curve", "lm_head": "LM head", "embeddings": "embeddings"}


@dataclass(frozen=True)
class Point:
    """One tensor on a chart."""

    tensor: Mapping[str, Any]  # the JSON entry
    slot: int  # which group column of its band

    @property
    def ratio(self) -> float:
        """error/bound; inf for a tensor with a problem (the JSON's null)."""
        ratio = self.tensor["ratio"]
        return math.inf if ratio is None else float(ratio)


@dataclass
class Band:
    """One column of a chart: a decoder layer, or a tensor outside the layers (logits, LM head)."""

    label: str
    title: str
    slots: list[str] = field(default_factory=list)  # group names, in drawing order
    flips: int = 0  # tokens routed elsewhere than the golden in this layer
    points: list[Point] = field(default_factory=list)

    def add(self, tensor: Mapping[str, Any], group: str) -> None:
        if group not in self.slots:
            self.slots.append(group)
        self.points.append(Point(tensor, self.slots.index(group)))

    @property
    def worst(self) -> float:
        return max(p.ratio for p in self.points)


@dataclass
class Chart:
    """A strip chart: bands left to right, points at their ratio, the bound a line at 1x."""

    key: str  # forward | gradient | update
    title: str
    caption: str
    bands: list[Band]

    @property
    def points(self) -> list[Point]:
        return [p for band in self.bands for p in band.points]


def layer_count(result: Mapping[str, Any]) -> int:
    """Decoder layers the check saw: one more than the highest layer any tensor or route names."""
    layers = [t["layer"] for t in result["tensors"] if t.get("layer") is not None]
    layers += [r["layer"] for r in result["routes"]]
    return max(layers) + 1 if layers else 0


def forward_chart(result: Mapping[str, Any]) -> Chart | None:
    """Forward tensors in forward order: per layer its routes and output, then logits, loss, train curves."""
    tensors = [t for t in result["tensors"] if t.get("stage", "forward") == "forward"]
    if not tensors:
        return None
    bands = [Band(f"L{i}", f"decoder layer {i}") for i in range(layer_count(result))]
    tail: dict[str, Band] = {}
    for t in _ordered(tensors, FORWARD_GROUPS):
        if t.get("layer") is not None:
            bands[t["layer"]].add(t, t["group"])
        else:
            label = t["name"].removeprefix("train.")
            tail.setdefault(label, Band(label, t["name"])).add(t, t["group"])
    for route in result["routes"]:
        if route["layer"] < len(bands):
            bands[route["layer"]].flips = route["clear_flips"]
    bands = [b for b in bands if b.points] + list(tail.values())
    caption = ("Each decoder layer's routing weights and output, then logits and loss, in the order the forward "
               "pass computes them.")
    if result.get("route_replay"):
        caption += " Routes differ: tensors downstream of routing were compared under route replay."
    return Chart("forward", "Forward, layer by layer", caption, bands)


def backward_chart(result: Mapping[str, Any], stage: str) -> Chart | None:
    """Per-parameter tensors (gradients or updates) grouped per layer, in the order backward computes them."""
    tensors = [t for t in result["tensors"] if t.get("stage") == stage]
    if not tensors:
        return None
    head = {"lm_head": Band("lm_head", "LM head"), "norm": Band("norm", "final norm"), "other": Band("other", "other")}
    layers = [Band(f"L{i}", f"decoder layer {i}") for i in range(layer_count(result))]
    embed = Band("embed", "embeddings")
    for t in _ordered(tensors, BACKWARD_GROUPS):
        if t.get("layer") is not None:
            layers[t["layer"]].add(t, t["group"])
        elif t["group"] == "embeddings":
            embed.add(t, t["group"])
        else:
            head.get(t["group"], head["other"]).add(t, t["group"])
    bands = [b for b in [*head.values(), *reversed(layers), embed] if b.points]
    if stage == "gradient":
        title, caption = "Backward, layer by layer", ("Every parameter's gradient, grouped per layer in the order the "
                                                      "backward pass computes them: LM head first, embeddings last.")
    else:
        title, caption = "Updates, layer by layer", ("Every parameter's update over the train steps, grouped per layer "
                                                     "from the LM head down to the embeddings.")
    return Chart(stage, title, caption, bands)


def _ordered(tensors: Iterable[Mapping[str, Any]], groups: Sequence[str]) -> list[Mapping[str, Any]]:
    order = {g: i for i, g in enumerate(groups)}
    return sorted(tensors, key=lambda t: (order.get(t["group"], len(order)), t["name"]))


def charts(result: Mapping[str, Any]) -> list[Chart]:
    return [c for c in (forward_chart(result), backward_chart(result, "gradient"), backward_chart(result, "update"))
            if c is not None]


def expert_count(result: Mapping[str, Any]) -> int:
    return max((len(r.get("gained") or ()) for r in result["routes"]), default=0)


# --- drawing -----------------------------------------------------------------------------------

def checks(reports: list[CheckReport], where: Where | None = None) -> str:
    """The HTML page of a run's check reports (what `veosnap check --html FILE` writes); with `where`, its
    text report opens with the project header, as the terminal's does."""
    text = render_text.checks(reports)
    return page(json.loads(render_json.checks(reports, where)),
                text if where is None else render_text.where(where) + "\n\n" + text,
                [worst_rows_sections(r) for r in reports])


def page(doc: Mapping[str, Any], text: str, sections: Sequence[Sequence[RowsSection]],
         title: str = "veosnap check") -> str:
    """The HTML page for one `veosnap check` JSON document, its text report and, per result, the tensors
    shown with their worst rows."""
    results = doc["results"]
    failed = sum(not r["passed"] for r in results)
    skipped = sum(bool(r.get("skipped")) for r in results)
    summary = f"{len(results) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}: {escape(summary)}</title>", f"<style>{_CSS}</style>", "</head>",
        f'<body data-passed="{_bool(doc["passed"])}">',
        f'<header><h1>{escape(title)}</h1><p class="summary" id="summary">{escape(summary)}</p>',
    ]
    if doc.get("versions_note"):
        parts.append(f'<p class="note" id="versions-note">{escape(doc["versions_note"])}</p>')
    if len(results) > 1:
        parts.append('<ul class="toc">' + "".join(
            f'<li><a href="#check-{i}"><span class="status {_status_class(r)}">{escape(r["status"])}</span> '
            f'{escape(r["golden"])} {escape(r["backend"])} {escape(r["layout"])}</a></li>'
            for i, r in enumerate(results)) + "</ul>")
    parts.append("</header>")
    parts += [_check(i, r, rows) for i, (r, rows) in enumerate(zip(results, sections))]
    parts.append(f'<section class="text-report"><h2>Text report</h2><pre id="text-report">{escape(text)}</pre>'
                 "</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _check(index: int, r: Mapping[str, Any], sections: Sequence[RowsSection]) -> str:
    out = [f'<section class="check" id="check-{index}" data-golden="{escape(r["golden"])}" '
           f'data-status="{escape(r["status"])}">']
    out.append(f'<h2 class="verdict"><span class="status {_status_class(r)}">{escape(r["status"])}</span> '
               f'<span class="golden">{escape(r["golden"])}</span> '
               f'<span class="what">backend={escape(r["backend"])} layout={escape(r["layout"])}</span></h2>')
    lines = []
    if r.get("skipped"):
        lines.append(("skipped", r["skipped"]))
    if r.get("error"):
        lines.append(("error", r["error"]))
    for route in r["routes"]:
        if not route["passed"] or route["near_tie_flips"]:
            lines.append(("routes", route["message"]))
    if r.get("route_replay"):
        lines.append(("route replay", "tensors compared under route replay (candidate forced onto the golden's "
                                      "experts)"))
    if r.get("first_divergence"):
        lines.append(("first diverging layer", r["first_divergence"]))
    if r.get("first_gradient_divergence"):
        lines.append(("first diverging gradient", r["first_gradient_divergence"]))
    for line in (r.get("isolated") or {}).get("lines") or ():
        label, _, text = line.partition(": ")
        lines.append((label, text))
    for note in r.get("notes") or ():
        lines.append(("note", note))
    if lines:
        out.append('<dl class="where">' + "".join(
            f'<dt>{escape(k)}</dt><dd data-key="{escape(k)}">{escape(v)}</dd>' for k, v in lines) + "</dl>")
    if r.get("next"):
        out.append(f'<p class="next"><span>next:</span> <code id="next-{index}">{escape(r["next"])}</code></p>')
    if r.get("skipped") or r.get("error"):
        out.append("</section>")
        return "\n".join(out)
    for chart in charts(r):
        out.append(_chart(index, chart))
    if r["routes"]:
        out.append(_routes(r))
    if r["tensors"]:
        out += [_rows_table(r, section) for section in sections]
        out.append(_all_tensors(r))
    out.append("</section>")
    return "\n".join(out)


# Chart geometry in SVG user units (the SVG scales to the page width).
_W, _H = 960, 290
_LEFT, _RIGHT, _TOP, _BOTTOM = 78, 60, 16, 44
_LANE = 32  # the lanes above and below the decades: non-finite (problem) and bit-identical (0) tensors


def _chart(index: int, chart: Chart) -> str:
    points = chart.points
    finite = [p.ratio for p in points if 0 < p.ratio < math.inf]
    lo = min(-1, math.floor(math.log10(min(finite)))) if finite else -1
    hi = max(1, math.ceil(math.log10(max(finite)))) if finite else 1
    if hi - lo > 14:
        lo = hi - 14  # deeper than 1e-14 of the bound is all the same "far inside"
    has_inf = any(p.ratio == math.inf for p in points)
    has_zero = any(p.ratio == 0 for p in points)
    top = _TOP + (_LANE if has_inf else 0)
    bottom = _H - _BOTTOM - (_LANE if has_zero else 0)

    def y_of(ratio: float) -> float:
        if ratio == math.inf:
            return _TOP + _LANE / 2
        if ratio <= 0:
            return _H - _BOTTOM - _LANE / 2
        lg = min(max(math.log10(ratio), lo), hi)
        return bottom - (lg - lo) / (hi - lo) * (bottom - top)

    x0, x1 = _LEFT, _W - _RIGHT
    width = (x1 - x0) / len(chart.bands)
    svg = [f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" aria-label="{escape(chart.title)}" '
           f'data-lo="{lo}" data-hi="{hi}" xmlns="http://www.w3.org/2000/svg">']
    y1 = y_of(1.0)
    svg.append(f'<rect class="over" x="{x0}" y="{top}" width="{x1 - x0}" height="{y1 - top:.1f}"/>')
    for k in range(lo, hi + 1):
        y = y_of(10.0 ** k)
        svg.append(f'<line class="grid{" bound" if k == 0 else ""}" data-decade="{k}" x1="{x0}" x2="{x1}" '
                   f'y1="{y:.1f}" y2="{y:.1f}"/>')
        svg.append(f'<text class="tick" data-decade="{k}" x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end">{_decade(k)}'
                   '</text>')
    svg.append(f'<text class="bound-label" x="{x1 + 6}" y="{y1 + 4:.1f}">bound</text>')
    svg.append(f'<text class="over-label" x="{x1 + 6}" y="{top + 10}">over</text>')
    if has_inf:
        svg.append(f'<text class="tick" x="{x0 - 6}" y="{y_of(math.inf) + 4:.1f}" text-anchor="end">inf</text>')
    if has_zero:
        svg.append(f'<text class="tick" x="{x0 - 6}" y="{y_of(0) + 4:.1f}" text-anchor="end">0 (exact)</text>')
    svg.append(f'<text class="axis" transform="translate(14 {(top + bottom) / 2:.0f}) rotate(-90)" '
               'text-anchor="middle">error / bound</text>')
    every = max(1, math.ceil(len(chart.bands) / 32))  # at most ~32 labels on the axis
    worst_line = []
    for i, band in enumerate(chart.bands):
        bx = x0 + i * width
        if i:
            svg.append(f'<line class="sep" x1="{bx:.1f}" x2="{bx:.1f}" y1="{_TOP}" y2="{_H - _BOTTOM}"/>')
        if i % every == 0:
            svg.append(f'<text class="band" x="{bx + width / 2:.1f}" y="{_H - _BOTTOM + 18}" text-anchor="middle">'
                       f'<title>{escape(band.title)}</title>{escape(band.label)}</text>')
        if band.flips:
            svg.append(f'<text class="flips" x="{bx + width / 2:.1f}" y="{_H - _BOTTOM + 34}" text-anchor="middle" '
                       f'data-flips="{band.flips}">\u21c4 {band.flips} route flip{"s" * (band.flips > 1)}</text>')
        worst_line.append(f"{bx + width / 2:.1f},{y_of(band.worst):.1f}")
    svg.append(f'<polyline class="worst-line" points="{" ".join(worst_line)}"/>')
    for i, band in enumerate(chart.bands):
        bx = x0 + i * width
        slot_w = width / len(band.slots)
        by_slot: dict[int, list[Point]] = {}
        for p in band.points:
            by_slot.setdefault(p.slot, []).append(p)
        for slot, members in by_slot.items():
            spread = min(slot_w * 0.6, 9.0 * (len(members) - 1))
            for j, p in enumerate(members):
                cx = bx + (slot + 0.5) * slot_w + (spread * (j / (len(members) - 1) - 0.5) if len(members) > 1 else 0)
                svg.append(_marker(p, cx, y_of(p.ratio)))
    svg.append("</svg>")
    groups = list(dict.fromkeys(g for band in chart.bands for g in band.slots))
    legend = "".join(f'<span class="key">{_icon(g)} {escape(GROUP_LABELS.get(g, g))}</span>' for g in groups)
    legend += ('<span class="key"><svg viewBox="0 0 12 12" class="icon"><g class="pt fail"><circle cx="6" cy="6" '
               'r="4.5"/></g></svg> over the bound</span><span class="key"><svg viewBox="0 0 12 12" class="icon">'
               '<g class="pt ok"><circle cx="6" cy="6" r="4.5"/></g></svg> within the bound</span><span class="key">'
               '<svg viewBox="0 0 16 12" class="icon"><polyline class="worst-line" points="0,9 8,3 16,6"/></svg> '
               'worst of each column</span>')
    return (f'<figure class="chart-box" data-chart="{chart.key}" id="chart-{index}-{chart.key}"><figcaption>'
            f'<h3>{escape(chart.title)}</h3><p>{escape(chart.caption)}</p></figcaption>{"".join(svg)}'
            f'<div class="legend">{legend}</div></figure>')


def _marker(p: Point, cx: float, cy: float) -> str:
    t = p.tensor
    state = "ok" if t["passed"] else "fail"
    tip = f'{t["name"]}: {_ratio(t["ratio"])} bound (error {_num(t["error"])}, bound {_num(t["bound"])})'
    if t.get("problem"):
        tip += f' {t["problem"]}'
    elif t.get("estimate"):
        tip += f' {t["estimate"]}'
    attrs = (f'class="pt {state}" data-tensor="{escape(t["name"])}" data-ratio="{_data(t["ratio"])}" '
             f'data-passed="{_bool(t["passed"])}"')
    return f"<g {attrs}><title>{escape(tip)}</title>{_shape(SHAPES.get(t['group'], 'circle'), cx, cy, 4.5)}</g>"


def _shape(kind: str, cx: float, cy: float, r: float) -> str:
    if kind == "square":
        return f'<rect x="{cx - r * 0.85:.1f}" y="{cy - r * 0.85:.1f}" width="{r * 1.7:.1f}" height="{r * 1.7:.1f}"/>'
    if kind == "diamond":
        return (f'<path d="M{cx:.1f} {cy - r * 1.2:.1f}L{cx + r:.1f} {cy:.1f}L{cx:.1f} {cy + r * 1.2:.1f}'
                f'L{cx - r:.1f} {cy:.1f}Z"/>')
    if kind == "triangle":
        return f'<path d="M{cx:.1f} {cy - r:.1f}L{cx + r:.1f} {cy + r:.1f}L{cx - r:.1f} {cy + r:.1f}Z"/>'
    if kind == "cross":
        return (f'<path d="M{cx - r:.1f} {cy - r:.1f}L{cx + r:.1f} {cy + r:.1f}'
                f'M{cx + r:.1f} {cy - r:.1f}L{cx - r:.1f} {cy + r:.1f}"/>')
    return f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r}"/>'


def _icon(group: str) -> str:
    shape = _shape(SHAPES.get(group, "circle"), 6, 6, 4.5)
    return f'<svg viewBox="0 0 12 12" class="icon"><g class="pt key">{shape}</g></svg>'


def _routes(r: Mapping[str, Any]) -> str:
    experts = expert_count(r)
    flips = sum(route["clear_flips"] for route in r["routes"])
    ties = sum(route["near_tie_flips"] for route in r["routes"])
    if not flips and not ties:
        tokens = ", ".join(str(t) for t in sorted({route["tokens"] for route in r["routes"]}))
        return (f'<section class="routes" data-flips="0"><h3>Route flips per layer and expert</h3><p>None: every '
                f'token ({tokens} per layer) routed as the golden in all {len(r["routes"])} MoE layers.</p></section>')
    peak = max((g + lost for route in r["routes"] for g, lost in zip(route["gained"], route["lost"])), default=0)
    rows = []
    for route in r["routes"]:
        gained, lost = list(route.get("gained") or ()), list(route.get("lost") or ())
        cells = []
        for e in range(experts):
            g = gained[e] if e < len(gained) else 0
            lo = lost[e] if e < len(lost) else 0
            heat = (g + lo) / peak if peak else 0.0
            text = " ".join(s for s in (f"+{g}" if g else "", f"\u2212{lo}" if lo else "") if s)
            cells.append(f'<td class="heat" data-expert="{e}" data-gained="{g}" data-lost="{lo}" '
                         f'style="--heat:{heat:.3f}">{text}</td>')
        rows.append(f'<tr data-layer="{route["layer"]}" data-flips="{route["clear_flips"]}" '
                    f'data-near-ties="{route["near_tie_flips"]}" data-tokens="{route["tokens"]}" '
                    f'class="{"ok" if route["passed"] else "fail"}"><th>L{route["layer"]}</th>'
                    f'<td class="num">{route["clear_flips"]}</td><td class="num">{route["near_tie_flips"]}</td>'
                    f'<td class="num">{route["tokens"]}</td>{"".join(cells)}</tr>')
    verdict = (f"{flips} token(s) sent to other experts than the golden" + (f", {ties} near-tie flip(s) (reported, "
               "not failed)" if ties else "") + ". Per expert, over the clear flips: +n tokens the candidate sends "
               "there and the golden does not, \u2212n the golden sends there and the candidate does not.")
    head = "".join(f"<th>{e}</th>" for e in range(experts))
    return (f'<section class="routes" data-flips="{flips}"><h3>Route flips per layer and expert</h3>'
            f'<p>{escape(verdict)}</p><div class="scroll"><table class="route-table"><thead><tr>'
            '<th rowspan="2">layer</th><th rowspan="2">flips</th><th rowspan="2">near-ties</th>'
            f'<th rowspan="2">tokens</th><th class="experts" colspan="{max(experts, 1)}">expert</th></tr>'
            f'<tr class="ids">{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div></section>')


def _rows_table(r: Mapping[str, Any], table: RowsSection) -> str:
    by_name = {t["name"]: t for t in r["tensors"]}
    rows = []
    for t in (by_name[name] for name in table.tensors):
        chips = "".join(
            f'<span class="chip" data-row="{w["row"]}" data-ratio="{_data(w["ratio"])}">{escape(_row_label(w))} '
            f'<b>{_ratio(w["ratio"])}</b></span>' for w in t.get("worst_rows") or ())
        over = f'{t["rows_over"]}/{t["rows"]}' if t.get("rows") else ""  # none for a tensor with a problem
        rows.append(f'<tr data-tensor="{escape(t["name"])}" class="{"ok" if t["passed"] else "fail"}">'
                    f'<td class="name">{escape(t["name"])}</td><td class="num">{_ratio(t["ratio"])}</td>'
                    f'<td class="num">{over}</td><td class="rows">{chips or escape(_where(t))}'
                    "</td></tr>")
    note = f'<p class="more">... and {table.more} more (all tensors below)</p>' if table.more > 0 else ""
    return (f'<section class="worst-rows"><h3>{escape(table.title)}</h3><p>{escape(table.caption)}</p>'
            '<table class="worst-table">'
            '<thead><tr><th>tensor</th><th>ratio</th><th>rows over</th><th>worst rows (error / bound)</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>{note}</section>')


def _row_label(w: Mapping[str, Any]) -> str:
    if w.get("batch") is not None:
        return f'b{w["batch"]} p{w["pos"]} t{w["token"]}'
    return f'row {w["row"]}'


def _all_tensors(r: Mapping[str, Any]) -> str:
    rows = []
    for t in r["tensors"]:
        layer = "" if t.get("layer") is None else str(t["layer"])
        rows.append(
            f'<tr data-tensor="{escape(t["name"])}" data-error="{_data(t["error"])}" data-bound="{_data(t["bound"])}" '
            f'data-noise="{_data(t["noise"])}" data-ratio="{_data(t["ratio"])}" data-passed="{_bool(t["passed"])}" '
            f'class="{"ok" if t["passed"] else "fail"}"><td class="name">{escape(t["name"])}</td>'
            f'<td>{escape(t.get("stage", ""))}</td><td class="num">{layer}</td><td>{escape(t.get("group", ""))}</td>'
            f'<td class="num">{_num(t["error"])}</td><td class="num">{_num(t["bound"])}</td>'
            f'<td class="num">{_num(t["noise"])}</td><td class="num">{_ratio(t["ratio"])}</td>'
            f'<td>{"ok" if t["passed"] else "FAIL"}</td><td class="where">{escape(_where(t))}</td>'
            "</tr>")
    return (f'<details class="all"><summary>All {len(r["tensors"])} tensors, worst first</summary>'
            '<div class="scroll"><table class="tensor-table"><thead><tr><th>tensor</th><th>stage</th><th>layer</th>'
            '<th>group</th><th>error</th><th>bound</th><th>noise</th><th>ratio</th><th></th><th>worst at</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table></div></details>')


def _where(t: Mapping[str, Any]) -> str:
    """A tensor's problem, else where its worst is, and whether its figure is an estimate from a sketch."""
    if t.get("problem"):
        return t["problem"]
    return f'{t["where"]}; {t["estimate"]}' if t.get("estimate") else t["where"]


def _num(x: float | None) -> str:
    """A number as the text report prints it (the JSON's null is a non-finite value)."""
    return "inf" if x is None else f"{x:.3g}"


def _ratio(x: float | None) -> str:
    return _num(x) + "x"


def _data(x: float | None) -> str:
    return "inf" if x is None else repr(float(x))


def _bool(x: bool) -> str:
    return "true" if x else "false"


def _decade(k: int) -> str:
    return f"{10.0 ** k:g}x" if -2 <= k <= 3 else f"1e{k}x"


def _status_class(r: Mapping[str, Any]) -> str:
    return {"PASS": "pass", "FAIL": "fail", "ERROR": "fail"}.get(r["status"], "skip")


_CSS = """
:root { --fg:#1d2330; --muted:#5b6577; --bg:#fff; --panel:#f5f7fa; --line:#d8dde6; --fail:#d1242f; --failbg:#fde8e8;
  --ok:#3b6fb6; --pass:#1a7f37; --skip:#8a6d00; --over:rgba(209,36,47,.07); --heat:0; }
@media (prefers-color-scheme: dark) { :root { --fg:#e6e9ef; --muted:#9aa4b5; --bg:#14171c; --panel:#1d2128;
  --line:#343a45; --fail:#ff6b6b; --failbg:#3a1d20; --ok:#7aa7e6; --pass:#4cc26b; --skip:#e0b84a;
  --over:rgba(255,107,107,.08); } }
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 1100px; padding: 16px 24px 48px; font: 14px/1.45 system-ui, -apple-system,
  "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: var(--fg); background: var(--bg); }
h1 { font-size: 15px; font-weight: 600; color: var(--muted); margin: 0; }
h2 { font-size: 19px; margin: 6px 0 8px; }
h3 { font-size: 15px; margin: 0 0 2px; }
header { border-bottom: 1px solid var(--line); padding-bottom: 8px; margin-bottom: 12px; }
.summary { margin: 2px 0 0; font-weight: 600; }
.toc { margin: 6px 0 0; padding-left: 18px; } .toc a { color: inherit; }
.check { margin-bottom: 36px; }
.status { display: inline-block; padding: 1px 8px; border-radius: 4px; color: #fff; font-size: 0.9em; }
.status.fail { background: var(--fail); } .status.pass { background: var(--pass); }
.status.skip { background: var(--skip); }
.golden { font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
.what { color: var(--muted); font-weight: 400; font-size: 15px;
  font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
dl.where { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; margin: 0 0 8px; }
dl.where dt { color: var(--muted); } dl.where dd { margin: 0; font-weight: 600; }
.next { background: var(--panel); border-left: 3px solid var(--fail); padding: 6px 10px; margin: 0 0 14px;
  overflow-wrap: anywhere; }
.next span { color: var(--muted); }
code, pre, .num, .name, .where, .chip { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12.5px; }
figure { margin: 0 0 14px; }
figcaption p, section > p { margin: 0 0 4px; color: var(--muted); font-size: 13px; }
svg.chart { width: 100%; height: auto; display: block; background: var(--panel); border-radius: 6px; }
svg .over { fill: var(--over); }
svg .grid { stroke: var(--line); stroke-width: 1; }
svg .grid.bound { stroke: var(--fail); stroke-width: 1.6; stroke-dasharray: 6 4; }
svg .sep { stroke: var(--line); stroke-width: 1; stroke-dasharray: 2 4; }
svg text { fill: var(--muted); font: 12px system-ui, "DejaVu Sans", sans-serif; }
svg .bound-label, svg .over-label { fill: var(--fail); font-weight: 600; }
svg .band { fill: var(--fg); font-weight: 600; }
svg .flips { fill: var(--fail); font-weight: 600; }
svg .worst-line { fill: none; stroke: var(--muted); stroke-width: 1.2; opacity: .55; }
svg .pt > :not(title) { stroke-width: 1.3; }
svg .pt.fail > :not(title) { fill: var(--fail); stroke: var(--bg); }
svg .pt.ok > :not(title) { fill: var(--ok); stroke: var(--bg); opacity: .85; }
svg .pt.key > :not(title) { fill: none; stroke: var(--fg); }
svg .pt:hover > :not(title) { stroke: var(--fg); stroke-width: 2; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12.5px; color: var(--muted); margin-top: 4px; }
.icon { width: 13px; height: 13px; vertical-align: -2px; overflow: visible; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 8px; text-align: left; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; }
tr.fail td.name, tr.fail td.num:nth-child(2) { color: var(--fail); font-weight: 600; }
.scroll { overflow-x: auto; }
section.routes, section.worst-rows { margin: 0 0 16px; }
.route-table td.heat { text-align: center; min-width: 34px; white-space: nowrap;
  background: rgba(209, 36, 47, calc(var(--heat) * .55)); }
.route-table th.experts, .route-table tr.ids th { text-align: center; }
.route-table th.experts { border-bottom: 0; padding-bottom: 0; }
.chip { display: inline-block; background: var(--panel); border-radius: 4px; padding: 0 6px; margin: 1px 4px 1px 0;
  white-space: nowrap; }
tr.fail .chip b { color: var(--fail); }
.more { font-size: 13px; color: var(--muted); }
details.all { margin: 0 0 12px; } details.all summary { cursor: pointer; font-weight: 600; }
pre#text-report { background: var(--panel); padding: 10px 12px; border-radius: 6px; overflow-x: auto;
  font-size: 12px; line-height: 1.4; }
"""
