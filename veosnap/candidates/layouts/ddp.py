"""`ddp`: DistributedDataParallel on every rank, the golden's rows split across ranks."""

from __future__ import annotations

from torch import nn

from .protocol import Layout, LayoutContext, Setup


class DDP(Layout):
    name = "ddp"
    description = "DistributedDataParallel, rows split across ranks"
    distributed = True

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        from torch.nn.parallel import DistributedDataParallel

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return Setup(DistributedDataParallel(model, device_ids=ids), model)


LAYOUT = DDP()
