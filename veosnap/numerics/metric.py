"""The error metric, "row error": how far a candidate's tensor is from the golden's.

A tensor is cut into rows (a token's vector for activations and logits, an output row for weight
gradients, one element for 1-D tensors, the value for the loss). Each row's L2 distance from the
golden row is divided by the tensor's typical row norm (the RMS of the golden's row norms); the
tensor's error is the largest row error. A bug confined to one token, one row or one parameter
therefore shows at full size instead of being averaged away by a tensor-wide norm, while rows whose
values are small by nature don't inflate the error. Token tensors (see `golden.names`) are compared
on the batch's real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..golden import names

WORST_ROWS = 5  # rows a comparison keeps for reports, besides its count of rows over the bound


def is_token_tensor(name: str) -> bool:
    """Tensors with one row per token of the batch (compared on real tokens only)."""
    parsed = names.try_parse(name)
    return parsed is not None and parsed.token_rows


def rows_of(name: str, tensor: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` as float64 rows, and the original row index of each (token tensors: real tokens only)."""
    t = tensor.detach().to("cpu", torch.float64)
    token = token_mask is not None and is_token_tensor(name)
    if t.ndim == 0:
        rows = t.reshape(1, 1)
    elif t.ndim == 1:
        rows = t.reshape(-1, 1)
    elif token and t.ndim > 2 and t.numel() % token_mask.numel() == 0 and t.shape[0] * t.shape[1] == token_mask.numel():
        # [rows, positions, ...]: one row per token, whatever a token's shape (DeepSeek-V4's layer outputs
        # are [rows, positions, 4 residual streams, hidden])
        rows = t.reshape(token_mask.numel(), -1)
    else:
        rows = t.reshape(-1, t.shape[-1])
    index = torch.arange(rows.shape[0])
    if token and token_mask.numel() == rows.shape[0]:
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
    rows_over: int  # rows whose error exceeds the bound given
    rows: int
    worst_rows: tuple[tuple[int, float], ...] = ()  # (original row index, row error): the WORST_ROWS worst first


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
    # A stable sort, so equal errors keep row order and a report is the same on every run.
    top = errors.sort(descending=True, stable=True).indices[:WORST_ROWS].tolist() if errors.numel() > 1 else []
    return RowError(
        error=float(errors[worst]) if errors.numel() else 0.0,
        row=int(index[worst]) if errors.numel() else 0,
        column=column,
        golden_value=float(g_rows[worst, column]) if errors.numel() else 0.0,
        candidate_value=float(c_rows[worst, column]) if errors.numel() else 0.0,
        rows_over=int((errors > bound).sum()),
        rows=int(errors.numel()),
        worst_rows=tuple((int(index[i]), float(errors[i])) for i in top),
    )
