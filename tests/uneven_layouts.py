"""Layouts that give ranks uneven work, to show the engine and the parallel code handle it.

`ep_packed_rows`: transformers' expert parallel where each rank packs its own rows' sequences into one
row, as a data-parallel packing collator does: rank 0 of 2 holds 46 tokens, rank 1 holds 40, so the
all-to-all token dispatch carries different counts each way.
"""

from __future__ import annotations

import torch

from veosnap.candidates.layouts.ep import EP
from veosnap.candidates.layouts.packed import pack
from veosnap.candidates.layouts.protocol import LayoutContext, Setup, Shard, shard_rows


class PackedRows(EP):
    name = "ep_packed_rows"
    description = "expert parallel, each rank's rows packed into one row (uneven token counts per rank)"

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        rows = shard_rows(ctx.batch.rows, setup.data.size, setup.data.rank)
        packed = pack(ctx.batch.select_rows(rows))
        # `pack` numbers positions within the selected rows; map them to the golden's batch.
        golden = (rows[:, None] * ctx.batch.width + torch.arange(ctx.batch.width)).reshape(-1)
        return [Shard(packed.batch, golden[packed.positions])]


ep_packed_rows = PackedRows()
