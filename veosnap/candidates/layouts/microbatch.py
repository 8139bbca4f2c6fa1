"""`microbatch`: gradient accumulation over one-row micro-batches, each loss weighted by its share of
the batch's predicted tokens."""

from __future__ import annotations

import torch

from .protocol import Layout, LayoutContext, Setup, Shard


class Microbatch(Layout):
    name = "microbatch"
    description = "gradient accumulation over one-row micro-batches, each loss weighted by its token share"

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        return [Shard.rows(ctx.batch, torch.tensor([row])) for row in range(ctx.batch.rows)]


LAYOUT = Microbatch()
