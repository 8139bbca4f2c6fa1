"""A low-precision gradient's projection onto the golden: a systematic scale that rounding does not make.

A bfloat16 gradient's row error must cover the backward's rounding, a few percent of a row, so a kernel
whose gradient is 1% too large (or a share of it dropped) passes it. Its **projection onto the golden**,
`s = <c - g, g> / <g, g>` over the whole tensor, is that share itself, while rounding, which has no
direction, moves it by about its relative size over the square root of the rows, or by the reference's
own rounding bias along the tensor, if larger. At record time the reference's gradient `g` and its float64
twin `p` give the tensor's **projection noise**, `max(|<g - p, p>| / <p, p>, |g - p| / |p| / sqrt(rows))`,
or a legitimate kernel's projection onto `g` where larger (`record.PROJECTION_VARIANTS`: SDPA attention and grouped_mm
experts, run on the same weights and batch: a bound calibrated on eager's rounding alone was too tight for
SDPA's on Qwen2-VL's attention), and its bound, `SCALE_ALPHA x noise + SCALE_FLOOR` (the isolated parts' rule: `numerics.isolation`), both
stored in the golden's tolerance (`golden.manifest.Tolerance`) for every whole gradient of a low-precision
golden. A check measures `s` on the candidate's device with the row errors, in the same one read.

Calibrated with the toys on the CPU (docs/how-it-works.md): a 1% scale of one weight's gradient reaches
1.8-1.9x its bound on llama, qwen3_moe and mixtral (0.99x on deepseek_v3, 0.59x on qwen3_5, whose
linear-attention gradients round by 3%); sdpa, grouped_mm and another thread count stay at 0-0.4x.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..golden.manifest import SCALE_ALPHA, SCALE_FLOOR, Tolerance
from .readback import Later

LOW_PRECISION = ("bfloat16", "float16")


def rows(tensor: torch.Tensor) -> int:
    """The independent rows a gradient's rounding averages over: its first dimension (1 for a vector)."""
    return int(tensor.shape[0]) if tensor.ndim > 1 else 1


def noise(reference: torch.Tensor, exact: torch.Tensor) -> float:
    """The reference's projection noise for one gradient (see the module doc); 0 for an all-zero one."""
    g, p = reference.detach().double(), exact.detach().double()
    energy = float((p * p).sum())
    if energy == 0 or not math.isfinite(energy):
        return 0.0
    bias = abs(float(((g - p) * p).sum()) / energy)
    relative = math.sqrt(float(((g - p) ** 2).sum()) / energy)
    return rounded(max(bias, relative / math.sqrt(rows(g))))


def rounded(value: float) -> float:
    """A projection noise as stored: three significant digits (a float64 twin computed on another CPU of the
    class differs in its last bits, and a golden recorded there must still be the same bytes)."""
    return float(f"{value:.3g}")


def projection(candidate: torch.Tensor, golden: torch.Tensor) -> float:
    """`<c - g, g> / <g, g>` on the host (0 for an all-zero golden): one tensor, as a check measures it."""
    c, g = candidate.detach().double(), golden.detach().double()
    energy = float((g * g).sum())
    return float(((c - g) * g).sum()) / energy if energy > 0 else 0.0


def with_projection(tol: Tolerance, scale_noise: float) -> Tolerance:
    """`tol` with its projection noise and the bound the rule makes of it."""
    return Tolerance(tol.noise, tol.bound, float(scale_noise), float(SCALE_ALPHA * scale_noise + SCALE_FLOOR))


def projections_later(items: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device | str | None = None) -> Later[list[float]]:
    """`<c - g, g> / <g, g>` of each (candidate, golden) pair, computed on `device` (None: the host) and left
    there until read (`readback.read_together`); 0 for an all-zero golden.

    On a GPU these kernels run after the candidate's backward, on the check's path: four a pair (both sides
    converted to float64 together, the difference taken in place, both products from one matrix-vector
    product), and the quotients for all pairs at once, instead of a dozen a pair."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if not items:
        return Later.known([])
    f64 = torch.float64
    products = []
    for candidate, golden in items:
        if candidate.shape != golden.shape:  # stacked below: another shape must not pass as a reshaped one
            raise ValueError(f"projection of a {tuple(candidate.shape)} tensor onto a {tuple(golden.shape)} one")
        c, g = (t.detach().to(device, non_blocking=True).reshape(-1) for t in (candidate, golden))
        both = torch.cat([c, g] if c.dtype == g.dtype else [c.to(f64), g.to(f64)]).to(f64).view(2, -1)
        both[0].sub_(both[1])  # c - g, exact in float64 for the narrower dtypes a check compares
        products.append(torch.mv(both, both[1]))  # (<c - g, g>, <g, g>)
    dots = torch.stack(products)
    energy = dots[:, 1]
    scales = torch.where(energy > 0, dots[:, 0] / energy.clamp_min(torch.finfo(f64).tiny), torch.zeros_like(energy))
    return Later([scales], lambda read: list(read[0]))
