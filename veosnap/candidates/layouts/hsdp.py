"""`hsdp`: FSDP2 `fully_shard` on a 2-D (replicate, shard) mesh, the golden's rows split across ranks."""

from __future__ import annotations

from torch import nn

from .fsdp2 import shard_layers
from .protocol import DataGroup, Layout, LayoutContext, Setup


def hsdp_mesh(world: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the HSDP mesh: shard over 2 where there are 4+ ranks, replicate the rest."""
    shard = 2 if world >= 4 and world % 2 == 0 else 1
    return world // shard, shard


class HSDP(Layout):
    name = "hsdp"
    description = "FSDP2 fully_shard on a 2-D (replicate, shard) mesh; 2 ranks: (2, 1), 4 ranks: (2, 2)"
    distributed = True

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        from torch.distributed.device_mesh import init_device_mesh

        replicate, shard = hsdp_mesh(ctx.world)
        mesh = init_device_mesh(ctx.device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
        shard_layers(model, mesh)
        return Setup(model, data=DataGroup(ctx.world, ctx.rank),
                     notes=[f"fully_shard on a (replicate={replicate}, shard={shard}) mesh"])


LAYOUT = HSDP()
