"""Each tensor of a golden against a candidate's: typed results, routes first.

`compare_route_sets` says per MoE layer which tokens went to other experts; `compare_tensors` gives
every toleranced tensor's row error against its bound, and where the worst of it is. Token tensors are
compared on the batch's real tokens (`Tokens`); under route replay a layer's route weights are
compared on the tokens the candidate routed as the golden.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..golden import names
from ..golden.codec import Golden
from . import fmt
from .metric import RowError, is_token_tensor, row_error
from .routes import RouteDiff, compare_routes


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
    rows_over: int = 0
    rows: int = 0
    problem: str = ""  # non-finite values, wrong shape or dtype, missing tensor
    worst_rows: tuple[WorstRow, ...] = ()  # the few worst rows, worst first

    @property
    def parsed(self) -> names.TensorName:
        """The typed name: where the tensor sits in the model (`stage`, `group`, `layer`)."""
        return names.parse(self.name)

    @property
    def ratio(self) -> float:
        return float("inf") if self.problem else self.error / self.bound if self.bound > 0 else float("inf")

    @property
    def passed(self) -> bool:
        return not self.problem and self.error <= self.bound


def compare_route_sets(golden: Golden, experts: Mapping[int, torch.Tensor], tokens: Tokens) -> list[RouteDiff]:
    """Per MoE layer of the golden, tokens the candidate sent to other experts (clear flips and near-ties
    apart); a layer the candidate has no routes for, or routes of another shape, flips every token."""
    count = int(tokens.mask.sum())
    diffs = []
    for layer, gold in golden.experts().items():
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


def compare_tensors(golden: Golden, produced: Mapping[str, torch.Tensor], tokens: Tokens, *, gradients: bool = True,
                    same_routes: Mapping[int, torch.Tensor] | None = None,
                    skip: set[str] | frozenset[str] = frozenset()) -> list[TensorResult]:
    """Every toleranced tensor of the golden (but those in `skip`) against `produced`, by row error.

    `gradients=False`: a forward-only candidate, whose gradients are not compared (the report says so).
    `same_routes`: per MoE layer, the tokens whose route weights are comparable (see `same_route_tokens`).
    """
    results = []
    for name in golden.compared_names():
        parsed = names.parse(name)
        if (isinstance(parsed, names.Grad) and not gradients) or name in skip:
            continue
        tol = golden.manifest.tolerance[name]
        gold = golden.tensors[name]
        cand = produced.get(name)
        problem = _problem(name, cand, gold)
        if problem:
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise, problem=problem))
            continue
        bad = ~torch.isfinite(cand.double())
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise, where=f"element {first}",
                                        problem=f"{int(bad.sum())} non-finite value(s) (NaN/Inf), first at {first}"))
            continue
        token_mask = tokens.mask
        if isinstance(parsed, names.Route) and same_routes is not None:
            token_mask = token_mask & same_routes.get(parsed.layer, torch.ones_like(token_mask))
        err = row_error(name, cand, gold, token_mask if is_token_tensor(name) else None, tol.bound)
        results.append(TensorResult(name, err.error, tol.bound, tol.noise, where=_where(name, err, gold, tokens),
                                    rows_over=err.rows_over, rows=err.rows,
                                    worst_rows=tuple(_worst_row(name, row, e, tokens) for row, e in err.worst_rows)))
    return results


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


def _where(name: str, err: RowError, gold: torch.Tensor, tokens: Tokens) -> str:
    """Where the worst row is: a token's batch row, position and id; a gradient's output row; an element."""
    if gold.ndim == 0:
        return f"golden {fmt.value(err.golden_value, 6)}, candidate {fmt.value(err.candidate_value, 6)}"
    values = f"[{err.column}] golden {fmt.value(err.golden_value)} vs {fmt.value(err.candidate_value)}"
    if is_token_tensor(name):
        b, s = divmod(err.row, tokens.width)
        token = int(tokens.ids[err.row]) if err.row < tokens.ids.numel() else -1
        return f"row {b} pos {s} (token {token}) {values}"
    if gold.ndim == 1:
        return f"element {err.row}: golden {fmt.value(err.golden_value)} vs {fmt.value(err.candidate_value)}"
    return f"row {err.row} {values}"
