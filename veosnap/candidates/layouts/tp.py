"""`tp`: transformers' tensor-parallel plan (`DistributedConfig(tp_size=N)`), the whole batch on every rank."""

from __future__ import annotations

from torch import nn

from ...errors import Unsupported
from ...golden.codec import Golden
from .hf_parallel import NO_TRAIN, accept_causal_lm, load_pretrained
from .protocol import DataGroup, Layout, LayoutContext, Setup


class TP(Layout):
    name = "tp"
    description = "transformers' tensor-parallel plan (DistributedConfig(tp_size=N)), full batch on every rank"
    distributed = True

    def accept(self, golden: Golden, nproc: int) -> None:
        if golden.key.scenario == "train":
            raise Unsupported(NO_TRAIN)
        accept_causal_lm(golden, self.name)
        config = golden.manifest.config  # transformers does not check this itself; it fails deep in a reshape
        heads = config.get("num_attention_heads", 0)
        for what, count in (("attention heads", heads), ("key/value heads", config.get("num_key_value_heads", heads))):
            if count % nproc:
                raise Unsupported(f"{nproc} tensor-parallel ranks do not divide {golden.key.model}'s {count} {what}")

    def load(self, ctx: LayoutContext) -> nn.Module:
        from transformers.distributed import DistributedConfig

        return load_pretrained(ctx, DistributedConfig(tp_size=ctx.world))

    def data(self, ctx: LayoutContext) -> DataGroup:
        return DataGroup()  # every rank runs the whole batch

    def mesh(self, ctx: LayoutContext) -> object:
        # What a backend is told; transformers builds its own (equal) mesh inside `from_pretrained`.
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("tp",))

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        return Setup(model, notes=[f"transformers DistributedConfig(tp_size={ctx.world})"])


LAYOUT = TP()
