"""`ddp`: DistributedDataParallel on every rank, the golden's rows split across ranks.

A multimodal model leaves parameters out of a step (its encoders on a text-only batch, the audio tower on a
vision batch): DDP is told to find them (`find_unused_parameters`), as frameworks configure it for such
models; otherwise their gradient buckets would never be reduced and every rank keep its own gradients.
"""

from __future__ import annotations

from torch import nn

from ...reference.probes import find_encoders
from .protocol import DataGroup, Layout, LayoutContext, Setup


class DDP(Layout):
    name = "ddp"
    description = "DistributedDataParallel, rows split across ranks"
    distributed = True

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        unused = bool(find_encoders(model))
        return Setup(DistributedDataParallel(model, device_ids=ids, find_unused_parameters=unused), model,
                     DataGroup(ctx.world, ctx.rank))


LAYOUT = DDP()
