"""Tensors laid end to end in one flat tensor: which tensor each element belongs to, and narrow sort keys.

A check compares tens of tensors in one pass per kind (`metric.row_errors`, `sketch.compare_sketches`), so it
needs each element's tensor. `torch.repeat_interleave` makes it with one thread per tensor writing all of its
elements in turn: on an H100, 115 us for a few tensors of 100k rows (a round-15 trace). A binary search of each
element's index among the tensors' ends does the same in one short parallel pass, with no atomics (the same
under torch's deterministic mode) and no read of any length on the host.
"""

from __future__ import annotations

import torch


def segment_ids(ends: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: for elements 0..total-1 of tensors laid end to end, each one's tensor, from `ends` (each
    tensor's one-past-last element, nondecreasing, on the device the result is wanted on). An empty tensor
    holds no element."""
    return torch.searchsorted(ends, torch.arange(total, device=ends.device), right=True)


def narrow_ids(ids: torch.Tensor, count: int) -> torch.Tensor:
    """`ids` (values in 0..count-1) in the narrowest integer dtype that holds them: a radix sort on the device
    makes one pass per byte of its key, so sorting by tensor takes one pass instead of eight for up to 256."""
    for dtype in (torch.uint8, torch.int16, torch.int32):
        if count <= torch.iinfo(dtype).max + 1:
            return ids.to(dtype)
    return ids
