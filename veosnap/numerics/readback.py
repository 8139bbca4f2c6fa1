"""Figures computed on a device and read to the host together: a check's one wait for its device.

On a GPU a check's compare queues its arithmetic behind the candidate's backward, which the device is still
running when the host gets there; the first read of any figure waits for all of it. So every comparison
(whole tensors by row width, sketches) hands back a `Later`: its figures still on the device, and how to turn
them into results. `read_together` reads every `Later` of a compare in one transfer per device, then finishes
each: no comparison's host work waits for another's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class Later(Generic[T]):
    """A result whose figures are `parts` (tensors, any device), finished on the host from their values
    (`finish`: one list of floats per part, in order)."""

    def __init__(self, parts: Sequence[torch.Tensor], finish: Callable[[list[list[float]]], T]) -> None:
        self.parts, self.finish = list(parts), finish

    @classmethod
    def known(cls, value: T) -> Later[T]:
        """A result there is nothing left to read for."""
        return cls([], lambda _: value)

    @classmethod
    def all(cls, laters: Sequence[Later], combine: Callable[[list], T]) -> Later[T]:
        """One `Later` of several: `combine` gets their results, in order."""
        counts = [len(later.parts) for later in laters]

        def finish(read: list[list[float]]) -> T:
            results, at = [], 0
            for later, n in zip(laters, counts):
                results.append(later.finish(read[at:at + n]))
                at += n
            return combine(results)

        return cls([part for later in laters for part in later.parts], finish)

    def read(self) -> T:
        """The result, reading its figures now."""
        return read_together([self])[0]


def read_together(laters: Sequence[Later]) -> list:
    """Each `Later`'s result, its figures read in one transfer per device (float64: integers below 2**53 and
    every float figure are exact)."""
    parts = [part for later in laters for part in later.parts]
    values: list[list[float]] = [[] for _ in parts]
    by_device: dict[torch.device, list[int]] = {}
    for i, part in enumerate(parts):
        by_device.setdefault(part.device, []).append(i)
    for members in by_device.values():
        flat = torch.cat([parts[i].reshape(-1).to(torch.float64) for i in members]).tolist()
        at = 0
        for i in members:
            n = parts[i].numel()
            values[i], at = flat[at:at + n], at + n
    results, at = [], 0
    for later in laters:
        n = len(later.parts)
        results.append(later.finish(values[at:at + n]))
        at += n
    return results
