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

    On a GPU these kernels run after the candidate's backward, on the check's path, so the pairs of one dtype
    share them: both sides of up to `BATCH_CUDA` values a side laid end to end and converted to float64 at once,
    the differences taken in place, and then one matrix-vector product a pair on a view of that buffer (both
    of its dot products); the quotients for all pairs at once. Four kernels a pair before (round 15's trace:
    8 gradients, 38 kernels), a dozen before that."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if not items:
        return Later.known([])
    for candidate, golden in items:
        if candidate.shape != golden.shape:  # laid end to end below: another shape must not pass as a reshaped one
            raise ValueError(f"projection of a {tuple(candidate.shape)} tensor onto a {tuple(golden.shape)} one")
    products: list[torch.Tensor | None] = [None] * len(items)
    for batch in _batches(items, BATCH_CUDA if device.type == "cuda" else BATCH):
        c, g = ([items[i][side].detach().to(device, non_blocking=True).reshape(-1) for i in batch] for side in (0, 1))
        # Both sides in one buffer, [2, n]: row 0 the candidates' values, row 1 the goldens' (a batch is of one
        # candidate dtype and one golden dtype).
        same = c[0].dtype == g[0].dtype
        both = (torch.cat(c + g) if same else torch.cat([t.to(torch.float64) for t in c + g])).to(torch.float64)
        both = both.view(2, -1)
        both[0].sub_(both[1])  # c - g, exact in float64 for the narrower dtypes a check compares
        at = 0
        for i in batch:
            n = items[i][0].numel()
            products[i] = torch.mv(both[:, at:at + n], both[1, at:at + n])  # (<c - g, g>, <g, g>)
            at += n
    dots = torch.stack(products)  # type: ignore[arg-type]
    energy = dots[:, 1]
    scales = torch.where(energy > 0, dots[:, 0] / energy.clamp_min(torch.finfo(torch.float64).tiny),
                         torch.zeros_like(energy))
    return Later([scales], lambda read: list(read[0]))


# Values a side converted to float64 together; a larger gradient goes alone. On the host 256 KiB a side, a
# buffer the cache holds while the products read it (at 32 MiB, llama-12l-narrow's projections took 76 ms
# against 9; at 2 MiB, 32 against 12); on a GPU, where the launches are the cost, 32 MiB.
BATCH = 1 << 15
BATCH_CUDA = 1 << 22


def _batches(items: Sequence[tuple[torch.Tensor, torch.Tensor]], limit: int) -> list[list[int]]:
    """The pairs' indices in batches of one (candidate dtype, golden dtype), each under `limit` values a side
    unless it holds a single pair."""
    batches: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.dtype], tuple[list[int], int]] = {}
    for i, (candidate, golden) in enumerate(items):
        key, n = (candidate.dtype, golden.dtype), candidate.numel()
        members, size = open_.get(key, ([], 0))
        if members and size + n > limit:
            batches.append(members)
            members, size = [], 0
        open_[key] = (members + [i], size + n)
    return batches + [members for members, _ in open_.values()]
