"""The row-sketch rule's pieces that both of its implementations compute with: the torch path
(`sketch.rowsketch_torch`) and the CUDA kernel (`sketch_triton`, which compiles this very `mix32`).

Below both, so that neither imports the other for them (`sketch` imports the kernel lazily, on CUDA).
The rule itself is stated in `sketch`'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import VeosnapError
from ..golden.sketches import M32

SEED_SALT = 0x5EED5EED
STRIPE_MULT = 0x9E3779B9
WORD_MULT = 0x85EBCA6B


def mix32(x):  # noqa: ANN001, ANN201 - a Python int, a torch int64 tensor, or a Triton uint32 tensor
    """A bijective 32-bit mixer (Wellons' lowbias32). Operators only: the Triton kernel compiles this
    very function on uint32; here it runs on Python ints or int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x = x ^ (x >> 16)
    return x


def seed_key(seed: int) -> int:
    """S of the rule: the 32-bit key every row key derives from."""
    return mix32((seed ^ SEED_SALT) & M32)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float32/float64 inputs (a float32 sum over thousands of stripes would round at the
    float32 floor of the metric), float32 for 16-bit inputs."""
    if dtype in (torch.float32, torch.float64):
        return torch.float64
    if dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    raise VeosnapError(f"cannot sketch a {str(dtype).removeprefix('torch.')} tensor (floating tensors only)")


@dataclass(frozen=True)
class RowSketch:
    """Every row's sketch and exact sum of squares, in the accumulation dtype, on the input's device."""

    values: torch.Tensor  # (rows, width)
    sumsq: torch.Tensor  # (rows,)


def pairwise_sum(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by adding neighbours pairwise: a fixed order whatever the thread count, and
    rounding that grows with log2 of the length rather than with the length."""
    t = t.movedim(dim, 0)
    if t.shape[0] == 0:
        return torch.zeros(t.shape[1:], dtype=t.dtype, device=t.device)
    while t.shape[0] > 1:
        half = t.shape[0] // 2
        summed = t[0 : 2 * half : 2] + t[1 : 2 * half : 2]
        t = torch.cat([summed, t[2 * half :]]) if t.shape[0] % 2 else summed
    return t[0]
