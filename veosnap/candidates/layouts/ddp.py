"""`ddp`: DistributedDataParallel on every rank, the golden's rows split across ranks.

A multimodal model leaves parameters out of a step (its encoders on a text-only batch, the audio tower on a
vision batch): DDP is told to find them (`find_unused_parameters`), as frameworks configure it for such
models; otherwise their gradient buckets would never be reduced and every rank keep its own gradients.
A text model can leave parameters out too (DeepSeek-V4's lightning indexer picks its top-k without a
gradient: frameworks train it with a loss of its own): a parameter whose golden gradient (or update) is
exactly zero got none in the reference, and DDP is told to find unused parameters for it as well.
"""

from __future__ import annotations

from torch import nn

from ...golden import names
from ...reference.probes import find_encoders
from .protocol import Layout, LayoutContext, Setup


class DDP(Layout):
    name = "ddp"
    description = "DistributedDataParallel, rows split across ranks"
    distributed = True

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        unused = bool(find_encoders(model)) or bool(_without_gradient(model, ctx))
        return Setup(DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused), model)


def _without_gradient(model: nn.Module, ctx: LayoutContext) -> list[str]:
    """The parameters the reference's step gave no gradient: all zeros in the golden."""
    kind = names.Grad if ctx.hyper is None else names.Update
    stored = (ctx.golden.tensors.get(str(kind(name))) for name, _ in model.named_parameters())
    return [name for (name, _), value in zip(model.named_parameters(), stored)
            if value is not None and not value.any()]


LAYOUT = DDP()
