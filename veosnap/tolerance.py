"""The tolerance model: per-tensor error metric, reference noise, and bounds.

Error metric ("row error"): a tensor is cut into rows (a token's vector for activations and logits,
an output row for weight gradients, one element for 1-D tensors, the value for the loss). Each row's
L2 distance from the golden row is divided by the tensor's typical row norm (the RMS of the golden's
row norms); the tensor's error is the largest row error. A bug confined to one token, one row or one
parameter therefore shows at full size instead of being averaged away by a tensor-wide norm, while
rows whose values are small by nature don't inflate the error.

Noise: at record time the reference runs again in float64 from the same weights and inputs; the row
error of the reference against that run is the reference's own noise for the tensor. The bound is
`alpha * noise + floor[dtype]` (FlashAttention's rule: a kernel may be a small factor less accurate
than the reference), stored in the golden so every check uses the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .golden.manifest import Tolerance

# Chosen from tools/calibrate_tolerance.py (figures in the README): legitimate candidates stay far
# below 1.0x their bound and planted bugs far above it.
ALPHA = {"float32": 10.0, "bfloat16": 4.0}
FLOOR = {"float32": 1e-6, "bfloat16": 2e-3}
# Router margins below this (in the router's own score units) are near-ties: a flip there is
# reported, not failed, and the recorder refuses goldens that have any.
TIE_EPSILON = {"float32": 1e-3, "bfloat16": 5e-2}

TOKEN_ROWS = "tokens"


def tolerance_for(noise: float, dtype: str, alpha: float | None = None, floor: float | None = None) -> Tolerance:
    """The tolerance of a tensor whose reference noise is `noise`: bound = alpha x noise + floor."""
    alpha = ALPHA[dtype] if alpha is None else alpha
    floor = FLOOR[dtype] if floor is None else floor
    return Tolerance(noise=float(noise), bound=float(alpha * noise + floor))


def is_token_tensor(name: str) -> bool:
    """Tensors with one row per token of the batch (compared on real tokens only)."""
    return name == "logits" or name.startswith("layers.") or name.startswith("routes.")


def rows_of(name: str, tensor: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` as float64 rows, and the original row index of each (token tensors: real tokens only)."""
    t = tensor.detach().to("cpu", torch.float64)
    if t.ndim == 0:
        rows = t.reshape(1, 1)
    elif t.ndim == 1:
        rows = t.reshape(-1, 1)
    else:
        rows = t.reshape(-1, t.shape[-1])
    index = torch.arange(rows.shape[0])
    if token_mask is not None and is_token_tensor(name) and token_mask.numel() == rows.shape[0]:
        rows, index = rows[token_mask], index[token_mask]
    return rows, index


@dataclass(frozen=True)
class RowError:
    """The worst row of a comparison: its error, where it is, and its worst element."""

    error: float  # largest row error (row distance / typical row norm)
    row: int  # original (flattened) row index of the worst row
    column: int  # worst element within that row
    golden_value: float
    candidate_value: float
    rows_over: int  # rows whose error exceeds the bound (filled by `exceeding`)
    rows: int


def row_error(name: str, candidate: torch.Tensor, golden: torch.Tensor, token_mask: torch.Tensor | None,
              bound: float = float("inf")) -> RowError:
    """The row error of `candidate` against `golden` (see the module doc)."""
    c_rows, index = rows_of(name, candidate, token_mask)
    g_rows, _ = rows_of(name, golden, token_mask)
    diff = c_rows - g_rows
    per_row = diff.norm(dim=1)
    typical = g_rows.norm(dim=1).pow(2).mean().sqrt().item()
    scale = typical if typical > 0 else 1.0  # an all-zero golden: absolute error
    errors = per_row / scale
    errors = torch.where(torch.isfinite(errors), errors, torch.full_like(errors, float("inf")))
    worst = int(errors.argmax()) if errors.numel() else 0
    column = int(diff[worst].abs().nan_to_num(nan=float("inf")).argmax()) if errors.numel() else 0
    return RowError(
        error=float(errors[worst]) if errors.numel() else 0.0,
        row=int(index[worst]) if errors.numel() else 0,
        column=column,
        golden_value=float(g_rows[worst, column]) if errors.numel() else 0.0,
        candidate_value=float(c_rows[worst, column]) if errors.numel() else 0.0,
        rows_over=int((errors > bound).sum()),
        rows=int(errors.numel()),
    )


def noise(name: str, reference: torch.Tensor, high_precision: torch.Tensor, token_mask: torch.Tensor | None) -> RowError:
    """The reference's own noise for one tensor: its row error against the float64 run."""
    return row_error(name, reference, high_precision, token_mask)


# A maximum over a handful of rows is a poor estimate of a tensor's noise: a 4-element sink gradient
# can land near its float64 value by luck and leave a bound no equally good kernel meets. Gradients
# with fewer rows than this take at least the median noise of the well-sampled gradients.
MIN_SAMPLED_ROWS = 32


PER_PARAMETER = ("grad.", "update.")  # one tensor per parameter: gradients (step), updates (train)


def pooled_noises(measured: dict[str, RowError]) -> dict[str, float]:
    """Each tensor's noise, with few-row per-parameter tensors (gradients, updates) raised to the median
    of the well-sampled ones of their kind."""
    medians = {}
    for prefix in PER_PARAMETER:
        sampled = sorted(e.error for n, e in measured.items() if n.startswith(prefix) and e.rows >= MIN_SAMPLED_ROWS)
        medians[prefix] = sampled[len(sampled) // 2] if sampled else 0.0
    pooled = {}
    for name, err in measured.items():
        prefix = next((p for p in PER_PARAMETER if name.startswith(p)), None)
        few = prefix is not None and err.rows < MIN_SAMPLED_ROWS
        pooled[name] = max(err.error, medians[prefix]) if few else err.error
    return pooled
