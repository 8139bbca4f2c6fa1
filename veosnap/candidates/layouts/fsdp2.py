"""`fsdp2`: FSDP2 `fully_shard` on each decoder layer and the root, the golden's rows split across ranks.
Sharded gradients and parameters are gathered to full tensors (`DTensor.full_tensor`) for comparing.

`fully_shard` wants one parameter dtype per group, and transformers keeps some parameters in float32 in a
bfloat16 model (DeepSeek-V3's router): those go into a group of their own first, as frameworks shard them.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

import torch

from ...errors import Unsupported
from ...golden.codec import Golden
from ...reference.inputs import Batch
from ...reference.probes import decoder_layers
from .protocol import Layout, LayoutContext, Setup, Shard, shard_rows


def shard_layers(model: nn.Module, mesh: object) -> None:
    """`fully_shard` each block the model names as unsplittable (its `_no_split_modules`: the decoder layers,
    and a multimodal model's encoder blocks and encoders), innermost first, then the root, on `mesh` (in
    place). Frameworks wrap by the same list; a model without one has its decoder layers sharded."""
    for block in shard_units(model):
        shard_uniform(block, mesh)
    shard_uniform(model, mesh)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules `shard_layers` shards before the root, innermost first (a block before the encoder that
    holds it)."""
    unsplit = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if m is not model and type(m).__name__ in unsplit]
    if not units:
        return list(decoder_layers(model))
    depth = {id(m): 0 for m in units}
    for module in units:  # how many other units a unit holds: 0 for a block, more for an encoder
        depth[id(module)] = sum(1 for inner in module.modules() if inner is not module and id(inner) in depth)
    return sorted(units, key=lambda m: depth[id(m)])


def shard_uniform(module: nn.Module, mesh: object) -> None:
    """`fully_shard(module)`, after giving each submodule whose parameters have another dtype than most
    of `module`'s (by size) a group of its own."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    owners: dict[nn.Module, list[nn.Parameter]] = {}
    stack = [module]
    while stack:
        current = stack.pop()
        own = list(current.parameters(recurse=False))
        if own:
            owners[current] = own
        stack.extend(c for c in current.children() if not isinstance(c, FSDPModule))  # sharded already
    sizes = Counter()
    for params in owners.values():
        for param in params:
            sizes[param.dtype] += param.numel()
    if len(sizes) > 1:
        main = sizes.most_common(1)[0][0]
        for owner, params in owners.items():
            dtypes = {p.dtype for p in params}
            if dtypes == {main}:
                continue
            if owner is module or len(dtypes) > 1:
                names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise Unsupported(f"{type(owner).__name__} holds parameters of several dtypes ({names}) itself; "
                                  "fully_shard needs one dtype per group")
            fully_shard(owner, mesh=mesh)
    fully_shard(module, mesh=mesh)


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


class AsymmetricFSDP2(FSDP2):
    """FSDP2 with the rows split by what they hold: rank 0 the text-only rows, the other ranks the rows with
    media. A rank whose batch has no media does not run the encoders, so their FSDP units' collectives wait
    for it: a framework must run its encoders on every rank (a dummy input on a text-only batch, scaled to
    zero in the loss). The eager reference does not: its check fails, within the time limit, naming the
    ranks and where each one was."""

    name = "fsdp2_asym"
    description = "FSDP2, rank 0 holding the text-only rows, the others the rows with media"

    def accept(self, golden: Golden, nproc: int) -> None:
        batch = Batch.from_golden(golden)
        with_media = batch.media.rows_with() if batch.media is not None else set()
        if not with_media or len(with_media) == batch.rows:
            raise Unsupported("needs a batch with rows with and without media (scenarios vision and audio)")
        if nproc - 1 > len(with_media):
            raise Unsupported(f"{nproc - 1} ranks for {len(with_media)} rows with media: one at least each")

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        with_media = sorted(ctx.batch.media.rows_with())
        if ctx.rank == 0:
            rows = torch.tensor([r for r in range(ctx.batch.rows) if r not in with_media])
        else:
            rows = torch.tensor(with_media)[shard_rows(len(with_media), ctx.world - 1, ctx.rank - 1)]
        return [Shard.rows(ctx.batch, rows)]


LAYOUT = FSDP2()
LAYOUTS = (LAYOUT, AsymmetricFSDP2())
