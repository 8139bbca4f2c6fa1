"""What a backend returns: the candidate model, and what veosnap must know to run it (`Candidate`).

Below `backends`, which resolves and applies backends, and the kernel libraries' backends (`kernels/`),
which it registers: both make candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch
from torch import nn

from . import context

if TYPE_CHECKING:
    from ..reference.inputs import Batch


@dataclass(frozen=True)
class Adapted:
    """A batch in a candidate's own form: the model's keyword arguments, and where each output token
    stands in the batch it was adapted from.

    `positions[i]` is, for token slot `i` of the adapted call's outputs (row-major over its
    `[rows, positions]`), the flat index `row * width + position` in the batch the adapter was given,
    or -1 for a slot that stands for none (padding the adapted form added). Logits, layer outputs and
    routes are put back through it, so the comparison stays on the golden's tokens; the loss is the
    model's own, over the same predictions (labels in `kwargs`, pre-shifted if the framework wants).
    """

    kwargs: dict[str, Any]
    positions: torch.Tensor  # [adapted rows * adapted positions] int64


# fn(batch, ctx) -> Adapted: the batch (on the candidate's device) in the candidate's own form.
AdaptBatch = Callable[["Batch", context.Context], Adapted]
# fn(model) -> {parameter name: full gradient}: a collective every rank calls.
FullGradients = Callable[[nn.Module], Mapping[str, torch.Tensor]]


@dataclass(frozen=True)
class Candidate:
    """The model a backend made, and what veosnap must know to run it.

    - `forward_only`: why it cannot run backward here ('' when it can); gradients are then unchecked.
    - `adapt_batch`: `fn(batch, ctx) -> Adapted`, called once per pass of the layout with the batch that
      pass runs; the model is called with the adapted kwargs.
    - `full_gradients`: `fn(model) -> {parameter name: full gradient}`, for parameters the candidate
      shards outside DTensor (a framework's expert-parallel shards held as plain local tensors); every
      rank calls it, rank 0's answer is compared. Parameters it leaves out are read as usual
      (`DTensor.full_tensor()`, or the tensor itself).
    - `reference_path`: why this candidate computes the reference's own function, op for op ('' when it swaps
      something in): a bit-identical result is then what it should give, and the report says so (a note
      starting `REFERENCE_PATH`) instead of asking whether a swapped kernel was applied.
    - `notes` go into the check's report (what the backend replaced, what its kernels ran); a generator
      backend may append to the list after its `yield`, when the check's passes have run.
    """

    model: nn.Module
    forward_only: str = ""
    adapt_batch: AdaptBatch | None = None
    full_gradients: FullGradients | None = None
    notes: list[str] = field(default_factory=list)
    reference_path: str = ""


REFERENCE_PATH = "runs the reference path: "  # the note a candidate's `reference_path` becomes


def forward_only(model: nn.Module, reason: str) -> Candidate:
    """What a backend returns when `model` runs forward but not backward here (say why)."""
    return Candidate(model, forward_only=reason)
