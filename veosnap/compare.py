"""Compare a candidate's capture with a golden: routes first, then loss, logits, layers, gradients."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .capture import Capture
from .golden.codec import Golden
from .inputs import Batch
from .routing import RouteDiff, compare_routes
from .tolerance import is_token_tensor, row_error

_LAYER_RE = re.compile(r"layers\.(\d+)\.")


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

    @property
    def ratio(self) -> float:
        return float("inf") if self.problem else self.error / self.bound if self.bound > 0 else float("inf")

    @property
    def passed(self) -> bool:
        return not self.problem and self.error <= self.bound


@dataclass
class CheckReport:
    """The result of checking one candidate against one golden."""

    golden: str  # the golden's key, e.g. cpu/qwen3_moe/step-float32
    model: str
    dtype: str
    backend: str
    layout: str = "single"
    tensors: list[TensorResult] = field(default_factory=list)
    routes: list[RouteDiff] = field(default_factory=list)
    route_replay: bool = False
    error: str = ""  # the candidate could not run: why
    skipped: str = ""  # the backend does not apply to this model: why
    notes: list[str] = field(default_factory=list)

    @property
    def routes_passed(self) -> bool:
        return all(r.passed for r in self.routes)

    @property
    def passed(self) -> bool:
        """True when nothing failed; a skipped check passes (its reason is reported)."""
        return not self.error and self.routes_passed and all(t.passed for t in self.tensors)

    @property
    def status(self) -> str:
        return "skip" if self.skipped else "PASS" if self.passed else "ERROR" if self.error else "FAIL"

    def ranked(self) -> list[TensorResult]:
        """Tensors worst first."""
        return sorted(self.tensors, key=lambda t: (-t.ratio, t.name))

    @property
    def worst(self) -> TensorResult | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    @property
    def first_divergence(self) -> str | None:
        """The earliest decoder layer whose output exceeds its bound."""
        failing = [t for t in self.tensors if t.name.startswith("layers.") and not t.passed]
        if not failing:
            return None
        first = min(failing, key=lambda t: int(t.name.split(".")[1]))
        return f"layer {first.name.split('.')[1]} ({first.name}, {_ratio_text(first.ratio)} bound)"

    @property
    def first_gradient_divergence(self) -> str | None:
        """The first parameter group (layer, module), in the order backward computes them (the LM head
        first, the embeddings last), whose gradient exceeds its bound: where the backward pass first
        went wrong. After a forward divergence the whole backward differs, and the line says so."""
        failing = [t for t in self.tensors if t.name.startswith("grad.") and not t.passed]
        if not failing:
            return None

        def backward_order(t: TensorResult) -> tuple[int, int, str]:
            m = _LAYER_RE.search(t.name)
            if m:
                return (2, -int(m.group(1)), t.name)
            return (4 if "embed" in t.name else 0 if "lm_head" in t.name else 1, 0, t.name)

        first = min(failing, key=backward_order)
        m = _LAYER_RE.search(first.name)
        module = first.name.removeprefix("grad.").rsplit(".", 1)[0]
        group = module.split(f"layers.{m.group(1)}.", 1)[1] if m else module
        where = f"layer {m.group(1)} {group}" if m else group
        after = "; downstream of the forward divergence" if self.first_divergence or self._forward_failed() else ""
        return f"{where} ({first.name}, {_ratio_text(first.ratio)} bound{after})"

    def _forward_failed(self) -> bool:
        return any(not t.passed for t in self.tensors if t.name in ("loss", "logits"))


def _ratio_text(ratio: float) -> str:
    return "inf x" if ratio == float("inf") else f"{ratio:.3g}x"


def compare_route_sets(golden: Golden, capture: Capture) -> list[RouteDiff]:
    """Routes first: per MoE layer, tokens sent to other experts (clear flips and near-ties apart)."""
    mask = Batch.from_golden(golden).token_mask
    diffs = []
    for name in sorted(n for n in golden.tensors if n.startswith("routes.") and n.endswith(".experts")):
        layer = int(name.split(".")[1])
        record = capture.routes.get(layer)
        gold_experts = golden.tensors[name].long()
        if record is None or record.experts.shape != gold_experts.shape:
            diffs.append(RouteDiff(layer, int(mask.sum()), int(mask.sum()), 0, 0))
            continue
        diffs.append(
            compare_routes(layer, gold_experts, golden.tensors[f"routes.{layer}.margin"], record.experts,
                           mask, golden.manifest.tie_epsilon)
        )
    return diffs


def compare_tensors(golden: Golden, capture: Capture, same_route_tokens: dict[int, torch.Tensor] | None = None) -> list[TensorResult]:
    """Every toleranced tensor of the golden against the capture, by row error."""
    batch = Batch.from_golden(golden)
    mask = batch.token_mask
    seq_len = batch.input_ids.shape[-1]
    produced = capture.all_tensors()
    results = []
    for name in golden.compared_names():
        if name.startswith("grad.") and not capture.backward:
            continue  # a forward-only candidate: the report's notes say gradients were not checked
        tol = golden.manifest.tolerance[name]
        gold = golden.tensors[name]
        cand = produced.get(name)
        if cand is None:
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise, problem="missing from the candidate"))
            continue
        if tuple(cand.shape) != tuple(gold.shape):
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise,
                                        problem=f"shape {tuple(cand.shape)} but golden {tuple(gold.shape)}"))
            continue
        if cand.dtype != gold.dtype and name != "loss":
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise,
                                        problem=f"dtype {_dt(cand)} but golden {_dt(gold)}"))
            continue
        token_mask = mask
        if name.startswith("routes.") and same_route_tokens is not None:
            layer = int(name.split(".")[1])
            token_mask = mask & same_route_tokens.get(layer, torch.ones_like(mask))
        bad = ~torch.isfinite(cand.double())
        if bad.any():
            first = tuple(int(i) for i in bad.nonzero()[0])
            results.append(TensorResult(name, float("inf"), tol.bound, tol.noise, where=f"element {first}",
                                        problem=f"{int(bad.sum())} non-finite value(s) (NaN/Inf), first at {first}"))
            continue
        err = row_error(name, cand, gold, token_mask if is_token_tensor(name) else None, tol.bound)
        results.append(TensorResult(name, err.error, tol.bound, tol.noise, where=_where(name, err, gold, seq_len, batch),
                                    rows_over=err.rows_over, rows=err.rows))
    return results


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _where(name: str, err, gold: torch.Tensor, seq_len: int, batch) -> str:  # noqa: ANN001
    if gold.ndim == 0:
        return f"golden {err.golden_value:.6g}, candidate {err.candidate_value:.6g}"
    values = f"[{err.column}] golden {err.golden_value:.4g} vs {err.candidate_value:.4g}"
    if is_token_tensor(name):
        b, s = divmod(err.row, seq_len)
        token = int(batch.input_ids.reshape(-1)[err.row]) if err.row < batch.input_ids.numel() else -1
        return f"row {b} pos {s} (token {token}) {values}"
    if gold.ndim == 1:
        return f"element {err.row}: golden {err.golden_value:.4g} vs {err.candidate_value:.4g}"
    return f"row {err.row} {values}"


def compare(golden: Golden, capture: Capture, replayed: Capture | None = None, **report_fields: str) -> CheckReport:
    """Routes first; then every tensor. With `replayed` (the candidate re-run on the golden's routes),
    tensors downstream of routing are judged from the replayed run so a kernel error is never mistaken
    for a routing flip, or the other way round."""
    routes = compare_route_sets(golden, capture)
    source = replayed if replayed is not None else capture
    same = {layer: (golden.tensors[f"routes.{layer}.experts"].long() == rec.experts).all(dim=-1)
            for layer, rec in source.routes.items() if f"routes.{layer}.experts" in golden.tensors
            and rec.experts.shape == golden.tensors[f"routes.{layer}.experts"].shape}
    report = CheckReport(
        golden=str(golden.key), model=golden.key.model, dtype=golden.key.dtype,
        tensors=compare_tensors(golden, source, same), routes=routes, route_replay=replayed is not None,
        **report_fields,
    )
    return report
