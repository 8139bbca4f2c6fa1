"""`hsdp`: FSDP2 `fully_shard` on a 2-D (replicate, shard) mesh, the golden's rows split across ranks."""

from __future__ import annotations

from torch import nn

from .fsdp2 import shard_layers
from .protocol import Layout, LayoutContext, Setup


def hsdp_mesh(world: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the HSDP mesh: shard over 2 where there are 4+ ranks, replicate the rest."""
    shard = 2 if world >= 4 and world % 2 == 0 else 1
    return world // shard, shard


class HSDP(Layout):
    name = "hsdp"
    description = "FSDP2 fully_shard on a 2-D (replicate, shard) mesh; 2 ranks: (2, 1), 4 ranks: (2, 2)"
    distributed = True

    def mesh(self, ctx: LayoutContext) -> object:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, hsdp_mesh(ctx.world), mesh_dim_names=("replicate", "shard"))

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        replicate, shard = hsdp_mesh(ctx.world)
        shard_layers(model, ctx.mesh)
        return Setup(model, notes=[f"fully_shard on a (replicate={replicate}, shard={shard}) mesh"])


LAYOUT = HSDP()
