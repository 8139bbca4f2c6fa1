"""The one view model: what a report says and which rows it shows, decided once for every renderer.

`check_view`, `golden_change`, `matrix_view` and `golden_view` turn typed results into lines and rows
of text (numbers formatted by `numerics.fmt`); `text`, `markdown` and `html` only lay them out.
A failed check shows every failing tensor then its closest passing ones, a passed one its closest calls;
its worst rows (`worst_rows_sections`) are shown for the failing forward tensors in forward order, then
for the failing gradients or updates worst first;
a diff's terminal text cuts long lists where markdown folds them; a matrix groups repeated skips.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

from ..candidates.candidate import REFERENCE_PATH
from ..golden import names
from ..golden.codec import Golden
from ..golden.manifest import Approval, Excuse, json_object
from ..numerics import fmt
from ..numerics.compare import TensorResult
from ..numerics.isolation import IsolatedResult
from ..reference.coverage import routes_not_captured
from ..runs.canaries import sensitivity_note
from ..runs.check import excuse_figures
from ..runs.diff import DiffReport, FieldChange, GoldenDiff, TrailChange
from ..runs.drift import DriftReport
from ..runs.matrix import Cell, Matrix
from ..runs.verdict import CheckReport

SHOWN_ROWS = 12  # rows of a failed check's table: every failing tensor, then the closest passing ones
SHOWN_PASSING = 3  # a passed check shows only its closest calls
SHOWN_TENSORS = 12  # moved tensors a diff's text lists per golden
SHOWN_FIELDS = 8  # manifest fields a diff's text lists per golden
HASH_CHARS = 19  # "sha256:" and 12 hex digits: enough to tell payloads apart by eye


# --- one check ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRow:
    """One row of a check's table."""

    name: str
    error: str
    bound: str
    ratio: str
    passed: bool
    where: str

    @property
    def status(self) -> str:
        return "ok" if self.passed else "FAIL"


@dataclass
class CheckView:
    """One check as a report shows it: a header, lines, a table (none: nothing to tabulate), what next."""

    status: str
    header: str
    lines: list[str]
    rows: list[TensorRow] = field(default_factory=list)
    hidden: str = ""  # the line for tensors the table leaves out
    next: str = ""


def estimate_note(width: int, group: int) -> str:
    """What every renderer says where a figure is an estimate from a sketch."""
    return f"estimate from a {width}-wide sketch (groups of {group} row{'s' if group != 1 else ''})"


def sketch_note(t: TensorResult) -> str:
    """A tensor result's estimate note ('' when its figure is exact: a whole tensor, or a sketched one's
    worst row outside the golden's support, measured exactly)."""
    return estimate_note(t.width, t.group) if t.sketched and t.estimate and not t.problem else ""


def check_view(report: CheckReport, shown: int = SHOWN_ROWS) -> CheckView:
    view = CheckView(report.status, f"{report.golden}  backend={report.backend}  layout={report.layout}", [])
    if report.skipped:
        view.lines.append(f"skipped: {report.skipped}")
        return view
    if not report.passed:  # every failed report says what to run next, however it failed
        view.next = f"next: {next_step(report)}"
    if report.error:
        view.lines.append(f"error: {report.error}")
        return view
    if report.structure_line:  # a structure change names the versions where they differ; numbers say it once a run
        view.lines.append(report.structure_line)
    view.lines += [route.message() for route in report.routes
                   if not route.passed or route.near_tie_flips or route.unreadable]
    if report.route_replay:
        view.lines.append("routes differ: tensors below compared under route replay "
                          "(candidate forced onto the golden's experts)")
    if report.first_divergence:
        view.lines.append(f"first diverging layer: {report.first_divergence}")
    if report.first_gradient_divergence:
        view.lines.append(f"first diverging gradient: {report.first_gradient_divergence}")
    view.lines += isolation_lines(report)
    view.lines += [f"note: {note}" for note in report.notes]
    view.lines.append(f"sensitivity: {sensitivity_note(report.sensitivity)}")
    if report.tensors and all(t.passed and t.error == 0 for t in report.tensors):
        declared = any(note.startswith(REFERENCE_PATH) for note in report.notes)  # `Candidate(reference_path=...)`
        hint = "" if report.backend == "eager" or declared else \
            " (a swapped kernel rarely reproduces every bit: is it applied?)"
        view.lines.append(f"all {len(report.tensors)} tensors bit-identical to the golden{hint}")
        return view
    ranked = report.ranked()
    failing = [t for t in ranked if not t.passed]
    room = shown if failing else min(shown, SHOWN_PASSING)
    for t in failing + [t for t in ranked if t.passed][: max(0, room - len(failing))]:
        where = t.problem or t.where
        unit = "groups" if t.sketched else "steps" if names.try_parse(t.name) in names.PER_STEP else "rows"
        if t.rows_over and not t.problem:
            where = f"{t.rows_over}/{t.rows} {unit} over; {where}"
        elif t.error == 0 and not t.problem:
            where = "bit-identical to the golden"
        if sketch_note(t) and t.error != 0:
            where = f"{where}; {sketch_note(t)}"
        view.rows.append(TensorRow(t.name, fmt.num(t.error), fmt.num(t.bound), fmt.num(t.ratio) + "x", t.passed, where))
    hidden = len(ranked) - len(view.rows)
    if hidden:
        view.hidden = f"... and {hidden} more tensors, all within bound (--format json lists every one)"
    return view


SHOWN_ISOLATED = 3  # failing isolated statistics a text report lists


def isolation_lines(report: CheckReport, shown: int = SHOWN_ISOLATED) -> list[str]:
    """The isolated parts' lines: each failing statistic (worst first) by its place, or the worst of a pass,
    or why the parts were not isolated (low precision only)."""
    if not report.isolated:
        return [f"isolated parts: not checked ({report.not_isolated})"] if report.not_isolated else []
    ranked = report.isolated_ranked()
    failing = [i for i in ranked if not i.passed]
    lines = [f"isolated: {isolated_text(i)}" for i in failing[:shown]]
    if len(failing) > shown:
        lines.append(f"isolated: ... and {len(failing) - shown} more statistics over their bound (--format json lists them)")
    if not failing:
        lines.append(f"isolated parts: {len(ranked)} statistics within bound, closest {isolated_text(ranked[0])}")
    if report.not_isolated:
        lines.append(f"isolated parts: {report.not_isolated}")
    return lines


def isolated_text(i: IsolatedResult) -> str:
    """`layer 1 attention, head 0: scale 9.8e-03 vs bound 2.0e-03 (4.9x)`."""
    what = "projection onto the reference" if i.statistic == "scale" else "row error"
    return f"{i.place}: {what} {fmt.num(i.error)} vs bound {fmt.num(i.bound)} ({fmt.times(i.ratio)}, {i.rows} tokens)"


def next_step(report: CheckReport) -> str:
    """What to run next for a failed check: a command that runs as printed (the check's own selection)."""
    layout = [] if report.layout == "single" else ["--layout", report.layout]
    cmd = shlex.join(["veosnap", "check", "--model", report.model, "--dtype", report.dtype, *report.selection,
                      "--backend", report.portable_backend or report.backend, *layout, "--format", "json"])
    if report.error:
        return f"fix the backend error, then {cmd}"
    if report.structure:
        return (f"make the candidate's parameters, layers and MoE blocks match the golden's (or record the golden "
                f"with these versions); full detail: {cmd}")
    if not report.routes_passed:
        return f"look at the router inputs of the first flipped layer; full detail: {cmd}"
    failing = [i for i in report.isolated_ranked() if not i.passed]
    if failing and all(t.passed for t in report.tensors):
        # the first layer that fails, and in it a narrower part than the whole layer where one fails too
        first = min(failing, key=lambda i: (i.layer, i.part == "layer", -i.ratio))
        return f"{cmd}  (every isolated statistic by place; start from {first.place})"
    return f"{cmd}  (every tensor, worst rows; start from the first diverging layer)"


@dataclass(frozen=True)
class RowsSection:
    """Tensors a report shows with their worst rows (by name, in order), and how many more there were."""

    title: str
    caption: str
    tensors: list[str]
    more: int = 0


def forward_order(name: names.TensorName) -> tuple:
    """Sort key: the order a forward pass computes tensors (the encoders' outputs first; per layer its routes
    then its output; then logits, loss and the train curves)."""
    if isinstance(name, names.EncoderOutput):
        return (-1, *name.forward_order, str(name))
    layer = name.layer
    return (layer is None, layer if layer is not None else 0, {"routes": 0, "output": 1}.get(name.group, 2), str(name))


def worst_rows_sections(report: CheckReport, shown: int = SHOWN_ROWS) -> list[RowsSection]:
    """Which tensors a report shows with their worst rows: the failing forward tensors in forward order
    (their worst rows are tokens), then the failing gradients or updates worst first (output rows); a
    passed check, its closest calls."""
    ranked = report.ranked()
    failing = [t for t in ranked if not t.passed]
    if not failing:
        return [RowsSection("Closest calls", "The tensors nearest their bound, and their worst rows.",
                            [t.name for t in ranked[:SHOWN_PASSING]])] if ranked else []
    forward = sorted((t.parsed for t in failing if t.parsed.stage == "forward"), key=forward_order)
    params = [t.name for t in failing if t.parsed.stage != "forward"]
    sections = []
    if forward:
        sections.append(RowsSection("Worst tokens", "Failing forward tensors in forward order, each with its worst "
                                    "tokens (b = batch row, p = position, t = token id).",
                                    [str(n) for n in forward[:shown]], len(forward) - shown))
    if params:
        sections.append(RowsSection("Worst parameter rows", "Failing gradients or updates, worst first, each with its "
                                    "worst output rows.", params[:shown], len(params) - shown))
    return sections


def versions_note(reports: list[CheckReport]) -> str:
    """Once a run: which checks ran on other versions than their goldens were recorded with, and what to do
    ('' when none did)."""
    drifted = [r for r in reports if r.versions and not r.skipped]
    return versions_line(len(drifted), len(reports), [str(v) for r in drifted for v in r.versions])


def versions_line(drifted: int, checks: int, versions: list[str]) -> str:
    """The version note of a run in which `drifted` of `checks` checks ran on other versions than their goldens
    (`versions`: `transformers 5.25.0 here, 5.24.0 in the golden`, repeats allowed)."""
    if not drifted:
        return ""
    return (f"note: {drifted} of {checks} checks ran on other versions than their goldens: "
            f"{'; '.join(sorted(dict.fromkeys(versions)))}. To tell an upstream change from a bug in your candidate: "
            "`veosnap drift` (what these versions move in the reference, docs/versions.md); to adopt them: "
            "`veosnap refresh --reason ...`")


def checks_summary(reports: list[CheckReport]) -> str:
    failed = sum(not r.passed for r in reports)
    skipped = sum(bool(r.skipped) for r in reports)
    return f"{len(reports) - failed - skipped} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")


# --- a goldens diff -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MoveRow:
    name: str
    moved: str  # in units of the old bound
    error: str
    bound: str
    problem: str
    estimate: str = ""  # the estimate note when the move is measured sketch to sketch


@dataclass
class GoldenChange:
    """One changed golden as a diff shows it."""

    key: str
    verdict: str
    material: bool
    summary: str
    approvals: list[str]
    manifest: list[FieldChange]
    manifest_hidden: int
    routes: list[str]
    tensors_added: list[str]
    tensors_removed: list[str]
    tensors: list[MoveRow]
    tensors_hidden: str  # the line for moved tensors left out
    tolerance: str
    provenance: list[FieldChange]
    loosened: list[str]  # bounds that grew, largest factor first (cut to `shown`)
    loosened_hidden: int
    trail: list[str]  # changes to the approval trail other than appended approvals
    absent: list[FieldChange]
    fields: list[str]  # schema fields loosened or changed (`GoldenDiff.fields`), as `where: detail`
    largest: str  # the largest move, for a summary table
    route_cell: str  # routes, for a summary table
    reasons: str  # the approvals' reasons, for a summary table
    moved: str  # "moved / compared", for a summary table


def short(value: str | None) -> str:
    """A manifest value as a diff shows it: hashes cut to `HASH_CHARS`, absence said."""
    if value is None:
        return "(absent)"
    return value[:HASH_CHARS] + "..." if value.startswith("sha256:") and len(value) > HASH_CHARS else value


def change_text(c: FieldChange) -> str:
    return f"{c.field}: {short(c.old)} -> {short(c.new)}"


def approval_text(a: Approval) -> str:
    previous = a.previous_payload_hash
    return f"{a.reason!r} (replaced {short(previous) if previous else 'nothing'})"


def trail_text(c: TrailChange) -> str:
    """One change to the approval trail, as a diff lists it."""
    if c.kind == "edited" and c.old is not None:
        hashes = ("" if c.old.previous_payload_hash == c.approval.previous_payload_hash else
                  f" (replaced {short(c.old.previous_payload_hash)} -> {short(c.approval.previous_payload_hash)})")
        return f"edited {c.old.reason!r} -> {c.approval.reason!r}{hashes}"
    if c.kind == "forged":
        return f"forged {c.approval.reason!r}: {c.why}"
    return f"{c.kind} {approval_text(c.approval)}"


def loosened_text(t: object) -> str:
    return f"{t.name} {fmt.num(t.old_bound)} -> {fmt.num(t.new_bound)} ({fmt.times(t.factor)})"  # type: ignore[attr-defined]


def diff_headline(report: DiffReport) -> str:
    material = sum(d.material for d in report.changed)
    stale = f" ({len(report.stale)} stale: recorded from the old config)" if report.stale else ""
    return (f"{len(report.changed)} changed ({material} material), {len(report.added)} added, "
            f"{len(report.removed)} removed, {len(report.unchanged)} unchanged{stale}")


def stale_text(key: object, by: object) -> str:
    """An unchanged golden left recorded from the config another golden of its model moved away from."""
    return f"{key}  recorded from the config {by} moved away from (refresh it too)"


def golden_change(d: GoldenDiff, shown: int | None = SHOWN_TENSORS, fields: int | None = SHOWN_FIELDS) -> GoldenChange:
    """One changed golden; `shown`/`fields` cut the tensor and manifest lists (None: all of them)."""
    ranked = d.ranked()
    kept = ranked if shown is None else ranked[:shown]
    rest = ranked[len(kept):]
    worst = d.worst
    loosened = sorted(d.loosened, key=lambda t: (-t.factor, t.name))
    loose_kept = loosened if shown is None else loosened[:shown]
    return GoldenChange(
        key=str(d.key), verdict=d.verdict, material=d.material, summary=_summary(d),
        approvals=[approval_text(a) for a in d.approvals],
        manifest=d.manifest if fields is None else d.manifest[:fields],
        manifest_hidden=0 if fields is None else max(0, len(d.manifest) - fields),
        routes=[r.message() for r in d.routes], tensors_added=d.tensors_added, tensors_removed=d.tensors_removed,
        tensors=[MoveRow(t.name, fmt.times(t.ratio), fmt.num(t.error), fmt.num(t.bound), t.problem,
                         estimate_note(t.width, t.group) if t.estimate else "") for t in kept],
        tensors_hidden=(f"... {len(rest)} more moved, at most {fmt.times(rest[0].ratio)} bound "
                        "(--format json lists every one)") if rest else "",
        tolerance=_tolerance_line(d), provenance=d.provenance,
        loosened=[loosened_text(t) for t in loose_kept], loosened_hidden=len(loosened) - len(loose_kept),
        trail=[trail_text(c) for c in d.trail_rewritten], absent=d.absent,
        fields=[f"{f.where}: {f.detail}" for f in d.fields],
        largest=f"`{worst.name}` {fmt.times(worst.ratio)} bound" if worst else "—",
        route_cell=(f"{len(d.routes)} of {d.route_layers} layers changed" if d.routes
                    else "same" if d.route_layers else "—"),
        reasons="; ".join(a.reason for a in d.approvals) or "—",
        moved=f"{len(d.tensors)} / {d.compared}",
    )


def _summary(d: GoldenDiff) -> str:
    """One line for one changed golden: verdict, how many tensors moved and the largest move, then the other reasons
    the change is material, as the diff words them (`GoldenDiff.why_material`)."""
    parts = [d.verdict]
    worst = d.worst
    if d.tensors:
        over = sum(t.material for t in d.tensors)
        parts.append(f"{len(d.tensors)} of {d.compared} tensors moved ({over} over 1x bound), "
                     f"largest {worst.name} {fmt.times(worst.ratio)} bound")
    else:
        parts.append("tensors bit-identical")
    parts += [why for why in d.why_material() if not why.endswith("moved beyond 1x bound")]  # said above, with figures
    return "; ".join(parts)


def _tolerance_line(d: GoldenDiff) -> str:
    if not d.tolerance and not d.tolerance_rule:
        return ""
    text = f"{len(d.tolerance)} bounds changed"
    if d.tolerance:
        biggest = max(d.tolerance, key=lambda t: abs(math.log(t.factor)) if 0 < t.factor < math.inf else math.inf)
        text += f" (largest: {biggest.name} {fmt.num(biggest.old_bound)} -> {fmt.num(biggest.new_bound)})"
    if d.tolerance_rule:
        text += "; rule " + ", ".join(change_text(c) for c in d.tolerance_rule)
    return text


# --- the support matrix -------------------------------------------------------------------------------


@dataclass
class MatrixView:
    """The matrix as a table of (status, text) cells, then the lines below it."""

    title: str
    columns: list[str]
    rows: list[tuple[str, list[tuple[str, str]]]]  # label, (status, text) per column ('' status: no cell)
    footnote: str
    outcomes: list[str]  # one per failed or errored cell; skips grouped by column and reason
    unavailable: list[str]
    summary: str


def cell_text(cell: Cell) -> str:
    """`pass 0.061x`, `FAIL 3.2x`, `n/a` (skipped: the backend or layout does not apply, or changes nothing),
    `ERROR`; `pass*` when only the forward was checked."""
    if cell.status == "skip":
        return "n/a"
    if cell.status == "error":
        return "ERROR"
    mark = "*" if cell.forward_only else ""
    word = "pass" if cell.status == "pass" else "FAIL"
    return f"{word}{mark}" + ("" if cell.worst_ratio is None else f" {fmt.cell(cell.worst_ratio)}")


def matrix_view(matrix: Matrix) -> MatrixView:
    several_layouts = len({c.layout for c in matrix.columns}) > 1
    several_dtypes = len({r.dtype for r in matrix.rows}) > 1
    rows = []
    for row in matrix.rows:
        cells = [matrix.cell(row, column) for column in matrix.columns]
        rows.append((f"{row.model} {row.dtype}" if several_dtypes else row.model,
                     [("", "") if c is None else (c.status, cell_text(c)) for c in cells]))
    counts = matrix.counts()
    dtypes = ", ".join(sorted({r.dtype for r in matrix.rows}))
    return MatrixView(
        title=f"support matrix ({dtypes}; cell: status and worst error/bound ratio)",
        columns=[c.label if several_layouts else c.backend for c in matrix.columns], rows=rows,
        footnote="* forward only: loss, logits, layer outputs and routes checked; gradients not (see notes)"
        if any(c.forward_only for c in matrix.cells) else "",
        outcomes=_outcome_lines(matrix),
        unavailable=[f"not run here: {name} ({reason})" for name, reason in sorted(matrix.unavailable.items())],
        summary=f"{len(matrix.cells)} cells: " + ", ".join(f"{n} {'n/a' if s == 'skip' else s}"
                                                           for s, n in counts.items() if n)
        + f" in {matrix.seconds:.1f} s",
    )


def _outcome_lines(matrix: Matrix) -> list[str]:
    lines = []
    skipped: dict[tuple[str, str], list[str]] = {}
    for cell in matrix.cells:
        row = f"{cell.model} {cell.dtype}"
        if cell.status == "skip":
            skipped.setdefault((f"{cell.backend}/{cell.layout}", cell.reason), []).append(row)
        elif cell.status != "pass":
            lines.append(f"{cell.status.upper():5s} {row} {cell.backend}/{cell.layout}: {cell.reason}")
    for (column, reason), rows in skipped.items():
        where = "every row" if len(rows) == len(matrix.rows) > 1 else ", ".join(rows)
        lines.append(f"n/a   {column} on {where}: {reason}")
    return lines


# --- one golden (`veosnap show`) ----------------------------------------------------------------------


@dataclass
class GoldenView:
    facts: list[tuple[str, str]]  # label, value
    tensors: list[tuple[str, str, str, str]]  # name, dtype, shape, tolerance
    total: int
    full: bool
    hidden: int  # per-parameter tensors left out


def excuse_line(variant: str, excuse: Excuse) -> str:
    """A variant the golden was recorded despite (`record --excuse`), with its reason and figures then."""
    return f"{variant} fails it, known at record time: {excuse.reason} (then: {excuse_figures(excuse)}; its checks " \
           "still fail)"


def golden_view(g: Golden, full: bool = False) -> GoldenView:
    """The manifest's key facts, the approval trail, and the tensors (per-parameter ones with `full`)."""
    m = g.manifest
    facts = [
        ("golden", str(m.key)), ("file", str(g.path)), ("schema", str(m.schema_version)),
        ("config", f"{m.config.get('model_type')} ({m.config_hash[:HASH_CHARS]}...)"),
        ("inputs", f"{json_object(m.reference.batch)} ({m.inputs_hash[:HASH_CHARS]}...)"),
        ("reference", f"attn={m.reference.attn_implementation} experts={m.reference.experts_implementation} "
                      f"seed={m.reference.seed} noise run={m.reference.noise_run}"),
        ("provenance", ", ".join(f"{k}={v}" for k, v in sorted(json_object(m.provenance).items()))),
        ("tolerance", f"bound = {m.alpha:g} x noise + {m.floor:g}; tie epsilon {m.tie_epsilon:g}"),
        ("payload", m.payload_hash),
    ]
    if m.min_margin:
        margins = ", ".join(f"layer {layer}: {fmt.num(v)}" for layer, v in sorted(m.min_margin.items()))
        facts.append(("routers", f"min margin {margins}"))
    if m.sketch is not None:
        stored = sum(t.numel() * t.element_size() for t in g.stored_tensors().values())
        facts.append(("sketch", f"mode {m.sketch.mode}: {len(g.sketches)} of {len(m.tolerance)} compared tensors "
                                f"sketched (width x rows per group below); {stored} bytes stored, planned "
                                f"{m.sketch.planned_bytes} for a target of {m.sketch.budget} (hard limit "
                                f"{m.sketch.hard_limit})"))
    if m.absent:  # what the golden leaves out on purpose: routers as every report says it, the rest as stored
        unread = routes_not_captured(m)
        facts += [("routers", unread)] if unread else []
        facts += [("absent", f"{a.kind} {', '.join(a.names) or '(all)'}: {a.reason}") for a in m.absent
                  if a.kind != "router_unread"]
    facts += [("excused", excuse_line(variant, e)) for variant, e in sorted(m.excused.items())]
    facts += [("approved", f"{a.reason!r} (replaced {a.previous_payload_hash})") for a in m.approvals]
    every = sorted({*g.tensors, *g.sketches})
    shown = every if full else [n for n in every if not names.parse(n).per_parameter]
    tensors = []
    for name in shown:
        tol = m.tolerance.get(name)
        bound = f"noise {fmt.num(tol.noise)} bound {fmt.num(tol.bound)}" if tol else ""
        if tol and tol.scale_bound is not None:
            bound += f" projection bound {fmt.num(tol.scale_bound)}"
        if name in g.sketches:
            sketch = g.sketches[name]
            tensors.append((name, sketch.dtype, str(list(sketch.spec.shape)),
                            f"{bound}; sketch {sketch.spec.describe()} (seed {sketch.spec.seed})"))
            continue
        t = g.tensors[name]
        tensors.append((name, str(t.dtype).removeprefix("torch."), str(list(t.shape)), bound))
    return GoldenView(facts, tensors, len(every), full, len(every) - len(shown))


# --- a drift report -------------------------------------------------------------------------------------


DRIFT_ORDER = ("moved", "not recorded", "noise", "same")


@dataclass(frozen=True)
class DriftRow:
    """One golden of a drift report as every renderer shows it."""

    golden: str
    status: str  # same | noise | moved | not recorded
    worst: str  # the worst tensor and its move in units of its stored bound, or why it was not recorded
    first_layer: str
    routes: str


def drift_rows(report: DriftReport) -> list[DriftRow]:
    rows = []
    for d in report.drifts:
        worst = d.worst
        if d.problem:
            shown = d.problem
        elif worst is None:
            shown = "bit-identical"
        else:
            shown = f"{worst.name} {fmt.times(worst.ratio)} bound" + (f" ({worst.problem})" if worst.problem else "")
        routes = "; ".join(r.message() for r in d.diff.routes) if d.diff and d.diff.routes else ""
        rows.append(DriftRow(str(d.key), d.status, shown, d.first_layer or "", routes))
    return rows


def drift_headline(report: DriftReport) -> str:
    versions = "; ".join(map(str, report.versions)) or "the same versions as the goldens"
    counts = {status: sum(d.status == status for d in report.drifts) for status in ("moved", "noise", "same",
                                                                                    "not recorded")}
    shown = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    devices = "".join(f" (recorded on {old}, here {new}: their rounding differs, so noise is expected)"
                      for old, new in report.devices)
    return f"drift of {len(report.drifts)} goldens under {versions}{devices}: {shown or 'nothing selected'}"
