"""`ep`: transformers' expert parallel (`DistributedConfig(ep_size=N, fsdp_size=N)`): experts sharded and
tokens dispatched all-to-all, the rest FSDP-sharded, the golden's rows split across ranks."""

from __future__ import annotations

from torch import nn

from ...errors import Unsupported
from ...golden.codec import Golden
from .hf_parallel import NO_TRAIN, accept_causal_lm, load_pretrained
from .protocol import Layout, LayoutContext, Setup


class EP(Layout):
    name = "ep"
    description = ("transformers' expert parallel (DistributedConfig(ep_size=N, fsdp_size=N)), rows split, "
                   "tokens dispatched all-to-all")
    distributed = True

    def accept(self, golden: Golden, nproc: int) -> None:
        if golden.key.scenario == "train":
            raise Unsupported(NO_TRAIN)
        if not golden.is_moe:
            raise Unsupported(f"{golden.key.model} is a dense model: {self.name} shards experts, it has none")
        accept_causal_lm(golden, self.name)
        config = golden.manifest.config
        experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config), 0)
        if experts % nproc:
            raise Unsupported(f"{nproc} expert-parallel ranks do not divide {golden.key.model}'s {experts} experts")

    def load(self, ctx: LayoutContext) -> nn.Module:
        from transformers.distributed import DistributedConfig

        return load_pretrained(ctx, DistributedConfig(ep_size=ctx.world, fsdp_size=ctx.world))

    def mesh(self, ctx: LayoutContext) -> object:
        # What a backend is told; transformers builds its own (equal) mesh inside `from_pretrained`.
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("ep",))

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        return Setup(model, notes=[f"transformers DistributedConfig(ep_size={ctx.world}, fsdp_size={ctx.world})"])


LAYOUT = EP()
