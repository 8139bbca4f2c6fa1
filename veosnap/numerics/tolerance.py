"""The tolerance model: the reference's own noise per tensor, and the bound a candidate must meet.

Noise: at record time the reference runs again in float64 from the same weights and inputs; the row
error (`metric`) of the reference against that run is the reference's own noise for the tensor. The
bound is `alpha * noise + floor[dtype]` (FlashAttention's rule: a kernel may be a small factor less
accurate than the reference), stored in the golden so every check uses the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..golden import names
from ..golden.manifest import Tolerance
from .metric import RowError, row_error

# Chosen from tools/measure/calibrate_tolerance.py (figures in docs/how-it-works.md): legitimate candidates stay far
# below 1.0x their bound and planted bugs far above it.
ALPHA = {"float32": 10.0, "bfloat16": 4.0}
FLOOR = {"float32": 1e-6, "bfloat16": 2e-3}
# Router margins below this (in the router's own score units) are near-ties: a flip there is
# reported, not failed, and the recorder refuses goldens that have any.
TIE_EPSILON = {"float32": 1e-3, "bfloat16": 5e-2}


def tolerance_for(noise: float, dtype: str, alpha: float | None = None, floor: float | None = None) -> Tolerance:
    """The tolerance of a tensor whose reference noise is `noise`: bound = alpha x noise + floor."""
    alpha = ALPHA[dtype] if alpha is None else alpha
    floor = FLOOR[dtype] if floor is None else floor
    return Tolerance(noise=float(noise), bound=float(alpha * noise + floor))


def noise(name: str, reference: torch.Tensor, high_precision: torch.Tensor, token_mask: torch.Tensor | None) -> RowError:
    """The reference's own noise for one tensor: its row error against the float64 run."""
    return row_error(name, reference, high_precision, token_mask)


# A maximum over a handful of rows is a poor estimate of a tensor's noise: a 4-element sink gradient
# can land near its float64 value by luck and leave a bound no equally good kernel meets. Gradients
# with fewer rows than this take at least the median noise of the well-sampled gradients.
MIN_SAMPLED_ROWS = 32


@dataclass(frozen=True)
class Sample:
    """A measured noise and how many independent values its maximum is over: rows for a whole tensor,
    groups for a sketched one (a sketched tensor's noise is a maximum over its groups)."""

    error: float
    rows: int


def pooled_noises(measured: Mapping[str, RowError | Sample]) -> dict[str, float]:
    """Each tensor's noise, with few-row per-parameter tensors (gradients, updates) raised to the median
    of the well-sampled ones of their kind (rows, or groups for a sketched tensor)."""
    kinds = {name: type(parsed) for name in measured if (parsed := names.parse(name)).per_parameter}
    medians = {}
    for kind in set(kinds.values()):
        sampled = sorted(e.error for n, e in measured.items() if kinds.get(n) is kind and e.rows >= MIN_SAMPLED_ROWS)
        medians[kind] = sampled[len(sampled) // 2] if sampled else 0.0
    return {name: max(err.error, medians[kinds[name]]) if name in kinds and err.rows < MIN_SAMPLED_ROWS else err.error
            for name, err in measured.items()}
