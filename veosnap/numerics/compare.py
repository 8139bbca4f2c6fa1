"""Each tensor of a golden against a candidate's: typed results, routes first.

`compare_route_sets` says per MoE layer which tokens went to other experts; `compare_tensors` gives
every toleranced tensor's row error against its bound, and where the worst of it is. Token tensors are
compared on the batch's real tokens (`Tokens`); under route replay a layer's route weights are
compared on the tokens the candidate routed as the golden. A tensor the golden holds as a sketch is
compared sketch to sketch (`sketch.compare_sketches`: all of them at once, on the candidate's device, their
figures read with the whole tensors' in one transfer: `readback`): its error is an estimate and its worst
place a group of rows, which the result says (`estimate`, `width`, `group`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from ..golden import names
from ..golden.codec import Golden
from . import fmt
from .metric import RowError, is_token_tensor, row_errors_later, uncompared_rows
from .projection import projections_later
from .readback import read_together
from .routes import RouteDiff, compare_routes
from .sketch import CandidateSketch, SketchError, SketchProblem, compare_sketches_later


@dataclass(frozen=True)
class Tokens:
    """The golden batch's positions as a comparison sees them, flattened (`row * width + position`):
    which hold real tokens (the ones compared) and the token id at each (to name a row)."""

    mask: torch.Tensor  # [rows * width] bool
    width: int
    ids: torch.Tensor  # [rows * width] int64


@dataclass(frozen=True)
class WorstRow:
    """One of a tensor's worst rows: its row error and, for token tensors, which token it is."""

    row: int  # row index in the flattened tensor (row * width + position for token tensors)
    error: float
    batch: int | None = None
    pos: int | None = None
    token: int | None = None


@dataclass(frozen=True)
class TensorResult:
    """One tensor's verdict: its error against its bound, and where the worst of it is."""

    name: str
    error: float
    bound: float
    noise: float
    where: str = ""
    rows_over: int = 0  # rows over the bound (a sketched tensor: groups, and exact rows outside its support)
    rows: int = 0  # rows compared (a sketched tensor: groups)
    problem: str = ""  # non-finite values, wrong shape or dtype, missing tensor
    width: int = 0  # a sketched tensor: the sketch's width and rows per group (0: compared whole)
    group: int = 0
    estimate: bool = False  # the error is an estimate from the sketch (False: exact)
    worst_rows: tuple[WorstRow, ...] = ()  # the few worst rows, worst first (a sketched tensor: none)

    @property
    def sketched(self) -> bool:
        return self.width > 0

    @property
    def parsed(self) -> names.TensorName:
        """The typed name: where the tensor sits in the model (`stage`, `group`, `layer`)."""
        return names.parse(self.name)

    # a low-precision whole gradient: its projection onto the golden and that statistic's bound
    # (`numerics.projection`); None: not judged
    scale: float | None = None
    scale_bound: float | None = None

    @property
    def scale_ratio(self) -> float:
        if self.scale is None or self.scale_bound is None:
            return 0.0
        return abs(self.scale) / self.scale_bound if math.isfinite(self.scale) else float("inf")

    @property
    def ratio(self) -> float:
        if self.problem:
            return float("inf")
        rows = self.error / self.bound if self.bound > 0 else float("inf")
        return max(rows, self.scale_ratio)

    @property
    def passed(self) -> bool:
        return not self.problem and self.error <= self.bound and self.scale_ratio <= 1


def compare_route_sets(golden: Golden, experts: Mapping[int, torch.Tensor], tokens: Tokens,
                       unreadable: Mapping[int, str] | None = None) -> list[RouteDiff]:
    """Per MoE layer of the golden, tokens the candidate sent to other experts (clear flips and near-ties
    apart); a layer whose routes could not be read (`unreadable`: layer -> why) says so and compares
    nothing; a layer the candidate has no routes for, or routes of another shape, flips every token."""
    count = int(tokens.mask.sum())
    diffs = []
    unreadable = unreadable or {}
    for layer, gold in golden.experts().items():
        if layer in unreadable:
            diffs.append(RouteDiff(layer, count, 0, 0, None, unreadable=unreadable[layer]))
            continue
        candidate = experts.get(layer)
        if candidate is None or candidate.shape != gold.shape:
            diffs.append(RouteDiff(layer, count, count, 0, 0))
            continue
        margin = golden.tensors[str(names.Route(layer, "margin"))]
        diffs.append(compare_routes(layer, gold, margin, candidate, tokens.mask, golden.manifest.tie_epsilon))
    return diffs


def same_route_tokens(golden: Golden, experts: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per MoE layer, [tokens] bool: the tokens the candidate routed as the golden."""
    gold = golden.experts()
    return {layer: (gold[layer] == chosen).all(dim=-1) for layer, chosen in experts.items()
            if layer in gold and chosen.shape == gold[layer].shape}


def whole_on_device(golden: Golden, device: torch.device | str | None) -> dict[str, torch.Tensor]:
    """The golden's whole compared tensors copied to `device` for `compare_tensors(golden_on=)`, to be called
    before the candidate runs (the copies overlap nothing else then); none for the host, which compares them
    where they are."""
    if device is None or torch.device(device).type == "cpu":
        return {}
    return {name: golden.tensors[name].to(device, non_blocking=True) for name in golden.compared_names()
            if name not in golden.sketches and name in golden.tensors}


def compare_tensors(golden: Golden, produced: Mapping[str, torch.Tensor], tokens: Tokens, *, gradients: bool = True,
                    same_routes: Mapping[int, torch.Tensor] | None = None,
                    sketches: Mapping[str, CandidateSketch | SketchProblem] | None = None,
                    absent: Mapping[str, str] | None = None,
                    skip: set[str] | frozenset[str] = frozenset(),
                    device: torch.device | str | None = None,
                    golden_on: Mapping[str, torch.Tensor] | None = None) -> list[TensorResult]:
    """Every toleranced tensor of the golden (but those in `skip`) against `produced` (whole) or `sketches`
    (the candidate's tensors the golden holds as sketches, reduced with their spec), by row error.

    `gradients=False`: a forward-only candidate, whose gradients are not compared (the report says so).
    `same_routes`: per MoE layer, the tokens whose route weights are comparable (see `same_route_tokens`).
    `absent`: tensors the candidate says it does not produce, and why (not compared; the report says so).
    `device`: where whole tensors are compared (`row_errors`; None: the host), `golden_on` the golden's whole
    tensors already there (`whole_on_device`).
    """
    results: list[TensorResult | None] = []
    sketches = sketches or {}
    absent = absent or {}
    pending: list[tuple[int, str, CandidateSketch]] = []  # sketched tensors, compared together below
    whole: list[tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []  # likewise, whole ones
    for name in golden.compared_names():
        parsed = names.parse(name)
        if (isinstance(parsed, names.Grad) and not gradients) or name in absent or name in skip:
            continue
        tol = golden.manifest.tolerance[name]
        if name in golden.sketches:
            cand = sketches.get(name)
            if isinstance(cand, CandidateSketch):
                pending.append((len(results), name, cand))
                results.append(None)
            else:
                results.append(_unmeasured_sketch(golden, name, cand))
            continue
        gold = golden.tensors[name]
        cand = produced.get(name)
        problem = _problem(name, cand, gold)
        if problem:
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise, problem=problem))
            continue
        token_mask = None
        if is_token_tensor(name):
            token_mask = tokens.mask
            if isinstance(parsed, names.Route) and same_routes is not None:
                token_mask = token_mask & same_routes.get(parsed.layer, torch.ones_like(token_mask))
        whole.append((len(results), name, cand, gold, token_mask))
        results.append(None)
    # Whole tensors: every row error in one pass per row width (`row_errors`: row_error's numbers). A
    # candidate with a NaN/Inf is the tensor's problem instead, searched value by value only where there can
    # be one: a tensor whose error came out infinite (a compared row with a non-finite value: finite values
    # of float32 and narrower never give one), or with one in the rows not compared (a token tensor's padding).
    golden_on = golden_on or {}
    # Both passes are queued before either is read: on a GPU the host queues them behind the candidate's
    # backward, and one transfer per device then waits for all of it (`readback`).
    projected = [i for i, (_, name, *_) in enumerate(whole) if golden.manifest.tolerance[name].scale_bound is not None]
    errors, sketched, scales = read_together([
        row_errors_later([(name, cand, golden_on.get(name, gold), token_mask, golden.manifest.tolerance[name].bound)
                          for _, name, cand, gold, token_mask in whole], device=device),
        compare_sketches_later([(golden.sketches[name], cand, golden.manifest.tolerance[name].bound, name)
                                for _, name, cand in pending]),
        projections_later([(whole[i][2], golden_on.get(whole[i][1], whole[i][3])) for i in projected], device=device)])
    scale_of = dict(zip(projected, scales))
    for i, ((at, name, cand, gold, token_mask), err) in enumerate(zip(whole, errors)):
        suspect = err.error == float("inf") or (
            token_mask is not None and not bool(torch.isfinite(uncompared_rows(name, cand, token_mask)).all()))
        if suspect and _nonfinite(golden, name, cand, at, results):
            continue
        tol = golden.manifest.tolerance[name]
        where = _where(name, err, gold, tokens, tol.bound)
        scale = scale_of.get(i)
        if scale is not None and not abs(scale) <= tol.scale_bound:  # a systematic share: said first
            where = (f"scaled {scale:+.2%}: projection onto the golden {fmt.num(scale)} vs bound "
                     f"{fmt.num(tol.scale_bound)} ({fmt.times(abs(scale) / tol.scale_bound)}); worst row: {where}")
        results[at] = TensorResult(name, err.error, tol.bound, tol.noise, where=where,
                                   rows_over=err.rows_over, rows=err.rows,
                                   worst_rows=tuple(_worst_row(name, row, e, tokens) for row, e in err.worst_rows),
                                   scale=scale, scale_bound=tol.scale_bound if scale is not None else None)
    # Sketched tensors: one batched pass (a sync per tensor cost more on a GPU than the arithmetic).
    for (at, name, _), err in zip(pending, sketched):
        results[at] = _sketched_result(golden, name, err, tokens)
    return results


def _nonfinite(golden: Golden, name: str, cand: torch.Tensor, at: int, results: list) -> bool:
    """Whether `cand` holds a NaN/Inf (then `results[at]` says where, as the tensor's problem)."""
    bad = ~torch.isfinite(cand.double())
    if not bad.any():
        return False
    tol = golden.manifest.tolerance[name]
    first = tuple(int(i) for i in bad.nonzero()[0])
    results[at] = TensorResult(name, float("inf"), tol.bound, tol.noise, where=f"element {first}",
                               problem=f"{int(bad.sum())} non-finite value(s) (NaN/Inf), first at {first}")
    return True


def _problem(name: str, cand: torch.Tensor | None, gold: torch.Tensor) -> str:
    """Why `cand` cannot be measured against `gold` at all ('' when it can)."""
    if cand is None:
        return "missing from the candidate"
    if tuple(cand.shape) != tuple(gold.shape):
        return f"shape {tuple(cand.shape)} but golden {tuple(gold.shape)}"
    if cand.dtype != gold.dtype and names.parse(name) != names.LOSS:
        return f"dtype {_dt(cand)} but golden {_dt(gold)}"
    return ""


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _worst_row(name: str, row: int, error: float, tokens: Tokens) -> WorstRow:
    if not is_token_tensor(name):
        return WorstRow(row, error)
    b, s = divmod(row, tokens.width)
    token = int(tokens.ids[row]) if row < tokens.ids.numel() else -1
    return WorstRow(row, error, b, s, token)


def _where(name: str, err: RowError, gold: torch.Tensor, tokens: Tokens, bound: float = math.inf) -> str:
    """Where the worst row is: a token's batch row, position and id; a gradient's output row; an element."""
    if gold.ndim == 0:
        return f"golden {fmt.value(err.golden_value, 6)}, candidate {fmt.value(err.candidate_value, 6)}"
    values = f"[{err.column}] golden {fmt.value(err.golden_value)} vs {fmt.value(err.candidate_value)}"
    if is_token_tensor(name):
        b, s = divmod(err.row, tokens.width)
        token = int(tokens.ids[err.row]) if err.row < tokens.ids.numel() else -1
        return f"row {b} pos {s} (token {token}) {values}"
    if names.try_parse(name) in names.PER_STEP:  # one element per train step: say which step diverged first
        over = sorted(row for row, error in err.worst_rows if error > bound)
        first = f"; first over its bound at step {over[0] + 1}" if over and over[0] != err.row else ""
        return (f"step {err.row + 1} of {gold.numel()}: golden {fmt.value(err.golden_value)} vs "
                f"{fmt.value(err.candidate_value)}{first}")
    if gold.ndim == 1:
        return f"element {err.row}: golden {fmt.value(err.golden_value)} vs {fmt.value(err.candidate_value)}"
    expert = _expert_of(name, err.row, tuple(gold.shape))
    return f"{expert} {values}" if expert else f"row {err.row} {values}"


def _expert_of(name: str, row: int, shape: tuple[int, ...]) -> str:
    """A stacked experts tensor's row ([experts, rows, columns], flattened to rows) as its expert:
    `expert 3 of layer 1, row 12`; '' for any other tensor."""
    if len(shape) != 3 or ".experts." not in name:
        return ""
    layer = names.parse(name).layer
    expert, within = divmod(row, shape[1])
    return f"expert {expert}{'' if layer is None else f' of layer {layer}'}, row {within}"


def _unmeasured_sketch(golden: Golden, name: str, cand: SketchProblem | None) -> TensorResult:
    """A sketched golden tensor the candidate has no sketch of: missing, or of another shape or dtype."""
    tol, spec = golden.manifest.tolerance[name], golden.sketches[name].spec
    problem = "missing from the candidate" if cand is None else cand.problem
    return TensorResult(name, float("inf"), tol.bound, tol.noise, problem=problem, width=spec.width, group=spec.group)


def _sketched_result(golden: Golden, name: str, err: SketchError, tokens: Tokens) -> TensorResult:
    """A sketched tensor's result from its `SketchError`."""
    tol, spec = golden.manifest.tolerance[name], golden.sketches[name].spec
    kind = {"width": spec.width, "group": spec.group}
    if err.nonfinite_rows:
        row = err.first_nonfinite_row
        where = _row_place(name, row, row, tuple(spec.shape), tokens)
        return TensorResult(name, float("inf"), tol.bound, tol.noise, where=where, **kind,
                            problem=f"{err.nonfinite_rows} row(s) with non-finite values (NaN/Inf), first at {where}")
    where = _where_sketched(name, err, tuple(spec.shape), tokens)
    return TensorResult(name, err.error, tol.bound, tol.noise, where=where, rows_over=err.rows_over, rows=err.groups,
                        estimate=err.estimate, **kind)


def _where_sketched(name: str, err: SketchError, shape: tuple[int, ...], tokens: Tokens) -> str:
    """Where the worst group is: its rows (a token tensor's batch rows, positions and tokens)."""
    place = _row_place(name, err.first_row, err.last_row, shape, tokens)
    return place if err.group >= 0 else f"{place}, outside the golden's non-zero rows"


def _row_place(name: str, first: int, last: int, shape: tuple[int, ...], tokens: Tokens) -> str:
    """Rows `first`..`last` of a tensor (of `shape`), named as a report names a row."""
    if is_token_tensor(name):
        (b0, s0), (b1, s1) = divmod(first, tokens.width), divmod(last, tokens.width)
        ids = [int(tokens.ids[r]) for r in range(first, last + 1)
               if r < tokens.ids.numel() and bool(tokens.mask[r])][:4]
        shown = ", ".join(map(str, ids)) + (", ..." if last - first + 1 > len(ids) and ids else "")
        token = f" (token{'s' if len(ids) > 1 else ''} {shown})" if ids else ""
        if first == last:
            return f"row {b0} pos {s0}{token}"
        if b0 == b1:
            return f"row {b0} pos {s0}-{s1}{token}"
        return f"row {b0} pos {s0} to row {b1} pos {s1}{token}"
    expert = _expert_of(name, first, shape)
    if expert and _expert_of(name, last, shape).split(",")[0] == expert.split(",")[0]:  # one expert's rows
        if first == last:
            return expert
        within = first % shape[1]
        return f"{expert.split(',')[0]}, rows {within}-{within + last - first}"
    unit = "element" if len(shape) <= 1 else "row"
    return f"{unit} {first}" if first == last else f"{unit}s {first}-{last}"


SHOWN_NAMES = 3  # names a structure line lists before "and N more"


def structure_changes(golden: Golden, produced: Mapping[str, torch.Tensor], route_layers: Iterable[int], *,
                      parameters: bool = True) -> list[str]:
    """How the candidate model's structure differs from the golden's, one line per kind ([] when it does not):
    parameters missing, extra, or of another shape or dtype (from the gradients or updates each side has),
    decoder layers, MoE blocks (`route_layers`: the MoE layers the candidate has, readable or not).

    A report says these before any numbers: a model-structure change (a transformers version that keeps a
    router weight in another dtype, a renamed parameter) is not a numerics failure.
    """
    lines = []
    # What the golden's manifest says it leaves out on purpose (frozen parameters, unread routers) is the
    # golden's structure too: a candidate that has it is not changed.
    excused = {a.kind: set(a.names) for a in golden.manifest.absent}
    if parameters:
        gold, cand = _parameters(golden.tensors), _parameters(produced)
        lines += _named("parameters missing from the candidate", sorted(set(gold) - set(cand)))
        lines += _named("parameters the golden does not have",
                        sorted(set(cand) - set(gold) - excused.get("frozen", set())))
        dtypes = [f"{p} {_dt(cand[p])}, golden {_dt(gold[p])}" for p in sorted(set(gold) & set(cand))
                  if cand[p].dtype != gold[p].dtype]
        shapes = [f"{p} {tuple(cand[p].shape)}, golden {tuple(gold[p].shape)}" for p in sorted(set(gold) & set(cand))
                  if tuple(cand[p].shape) != tuple(gold[p].shape)]
        lines += _named("parameter dtype differs", dtypes) + _named("parameter shape differs", shapes)
    gold_layers = {p.layer for n in golden.tensors if isinstance(p := names.try_parse(n), names.LayerOutput)}
    cand_layers = {p.layer for n in produced if isinstance(p := names.try_parse(n), names.LayerOutput)}
    if gold_layers != cand_layers:
        lines.append(f"decoder layers: the candidate has {len(cand_layers)}, the golden {len(gold_layers)}")
    # Layers whose router the golden excuses as unread are neither asked for nor unexpected.
    unread = {int(m[1]) for block in excused.get("router_unread", ()) if (m := _LAYER.search(block))}
    gold_moe, cand_moe = set(golden.route_layers()) - unread, set(route_layers) - unread
    lines += _named("MoE blocks missing from the candidate in layers", sorted(map(str, gold_moe - cand_moe)))
    lines += _named("MoE blocks the golden has no routes for in layers", sorted(map(str, cand_moe - gold_moe)))
    return lines


_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the layer index in a module path ("model.layers.3.mlp")


def _parameters(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {parsed.param: t for name, t in tensors.items()
            if isinstance(parsed := names.try_parse(name), (names.Grad, names.Update))}


def _named(what: str, items: list[str]) -> list[str]:
    if not items:
        return []
    more = f" (and {len(items) - SHOWN_NAMES} more)" if len(items) > SHOWN_NAMES else ""
    return [f"{what}: {', '.join(items[:SHOWN_NAMES])}{more}"]
