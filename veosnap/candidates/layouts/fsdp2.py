"""`fsdp2`: FSDP2 `fully_shard` on each decoder layer and the root, the golden's rows split across ranks.
Sharded gradients and parameters are gathered to full tensors (`DTensor.full_tensor`) for comparing."""

from __future__ import annotations

from torch import nn

from ...reference.probes import decoder_layers
from .protocol import Layout, LayoutContext, Setup


def shard_layers(model: nn.Module, mesh: object) -> None:
    """`fully_shard` each decoder layer, then the root, on `mesh` (in place)."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


class FSDP2(Layout):
    name = "fsdp2"
    description = "FSDP2 fully_shard per decoder layer and root, rows split across ranks"
    distributed = True

    def mesh(self, ctx: LayoutContext) -> object:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("shard",))

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        shard_layers(model, ctx.mesh)
        return Setup(model, notes=[f"fully_shard over {ctx.world} ranks"])


LAYOUT = FSDP2()
