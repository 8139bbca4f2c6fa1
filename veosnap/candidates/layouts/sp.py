"""`sp`: sequence parallel (DeepSpeed-Ulysses) over every rank, and its combinations.

Every rank holds a contiguous slice of every row's positions (the golden's padded rows, or with
`sp_packed` the packed row), padded to a multiple of the world size (`sequence.slice_positions`).
Attention trades position shards for head shards with an all-to-all (`sequence.install`, the exchange
a backend may replace: `sequence.use_exchange`), runs on the whole sequence with its whole mask, and
trades back. Labels are shifted once for the whole row before slicing and the loss is divided by the
whole batch's prediction count (each rank's loss is its positions' contribution, so the engine does not
weight it again: `Shard.weight = 1.0`).

Every weight is replicated across the sequence group and each rank's backward gives only its positions'
contribution, so the gradients must be combined across the group: `sp` all-reduces them after the last
pass (averaging, with each rank's loss scaled by the world size as for any data-parallel reducer);
`sp_fsdp2` shards the weights with `fully_shard` over the same ranks, whose reduce-scatter does it; `sp_ep`
loads the model through transformers' expert parallel (`DistributedConfig(ep_size=N, fsdp_size=N)`):
experts sharded, each rank's tokens dispatched all-to-all, the rest FSDP-sharded.

On 2 ranks the sequence group is both ranks; on 4 it is all 4 (each rank a quarter of every row). Ulysses
gives each rank whole attention heads, so the world size must divide the attention heads; key/value
heads it does not divide are repeated to a multiple of it. `cp` (context parallel) has no such limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...errors import Unsupported
from ...golden.codec import Golden
from . import sequence
from .fsdp2 import shard_layers
from .hf_parallel import NO_TRAIN, load_pretrained
from .packed import pack
from .protocol import DataGroup, Layout, LayoutContext, Setup, Shard

PARAMS = ("replicated", "fsdp2", "ep")
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


class SequenceParallel(Layout):
    """Positions sharded across every rank; attention over the whole sequence through `attention`."""

    distributed = True
    attention = "ulysses"  # a `sequence.KINDS` entry

    def __init__(self, name: str, description: str, *, packed: bool = False, params: str = "replicated") -> None:
        if params not in PARAMS:
            raise ValueError(f"params must be one of {PARAMS}, not {params!r}")
        self.name, self.description, self.packed, self.params = name, description, packed, params

    def accept(self, golden: Golden, nproc: int) -> None:
        config = golden.manifest.config
        kinds = set(config.get("layer_types") or ["full_attention"])
        if kinds - set(sequence.MASK_KINDS):
            raise Unsupported(f"{', '.join(sorted(kinds - set(sequence.MASK_KINDS)))} layers: only "
                              f"{' and '.join(sequence.MASK_KINDS)} are sharded along positions")
        if self.attention == "ulysses":
            heads = int(config.get("num_attention_heads", 0))
            if heads % nproc:
                raise Unsupported(f"{nproc} ranks do not divide {golden.key.model}'s {heads} attention heads: Ulysses "
                                  "gives each rank whole heads (cp has no such limit)")
        if self.params == "ep":
            if golden.key.scenario == "train":
                raise Unsupported(NO_TRAIN)
            if not golden.is_moe:
                raise Unsupported(f"{golden.key.model} is a dense model: {self.name} shards experts, it has none")
            experts = next((config[k] for k in EXPERT_COUNTS if k in config), 0)
            if experts % nproc:
                raise Unsupported(f"{nproc} expert-parallel ranks do not divide {golden.key.model}'s {experts} experts")

    def load(self, ctx: LayoutContext) -> nn.Module:
        if self.params == "ep":
            from transformers.distributed import DistributedConfig

            return load_pretrained(ctx, DistributedConfig(ep_size=ctx.world, fsdp_size=ctx.world))
        return super().load(ctx)

    def mesh(self, ctx: LayoutContext) -> object:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("sp",))

    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        import torch.distributed as dist

        notes = []
        if self.params == "fsdp2":
            shard_layers(model, ctx.mesh)
            notes.append(f"fully_shard over the same {ctx.world} ranks")
        elif self.params == "ep":
            notes.append(f"transformers DistributedConfig(ep_size={ctx.world}, fsdp_size={ctx.world})")
        state = sequence.install(model, self.attention, dist.group.WORLD, ctx.world, ctx.rank)
        notes.insert(0, self.explain(state, model))
        # Every rank holds a distinct share of the batch's tokens: the reducer (all-reduce, FSDP) averages
        # over all of them, and the engine scales each rank's loss by the world size to make that a sum.
        return Setup(model, data=DataGroup(ctx.world, ctx.rank), notes=notes)

    def explain(self, state: sequence.SequenceAttention, model: nn.Module) -> str:
        """The report's note on how attention ran."""
        config = model.config
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        repeat = math.lcm(kv, state.world) // kv
        how = f"Ulysses all-to-all over {state.world} ranks ({state.exchange.name}), {heads // state.world} heads each"
        if repeat > 1:
            how += f", key/value heads repeated x{repeat}"
        return f"{how}; {state.wrapped} attention on the whole sequence"

    def shard(self, ctx: LayoutContext, setup: Setup) -> list[Shard]:
        whole = pack(ctx.batch) if self.packed else Shard.whole(ctx.batch)
        piece = sequence.slice_positions(whole.batch, whole.positions, ctx.world, ctx.rank)
        return [Shard(piece.batch, piece.positions, weight=1.0)]

    @contextmanager
    def accumulate(self, ctx: LayoutContext, setup: Setup, index: int, count: int) -> Iterator[None]:
        yield
        if self.params == "replicated" and index == count - 1:
            average_gradients(setup.inner, ctx)


def average_gradients(model: nn.Module, ctx: LayoutContext) -> None:
    """Average every replicated parameter's gradient over the ranks (what DDP's reducer does).

    A parameter no rank's tokens reached (an expert nobody chose) keeps no gradient; one that some
    ranks' tokens reached gets zeros on the others before the reduction, so every rank reduces alike.
    """
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    reached = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    dist.all_reduce(reached, op=dist.ReduceOp.MAX)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param, flag in zip(params, reached.tolist(), strict=True):
        if flag:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(ctx.world)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(reduced)


LAYOUT = SequenceParallel("sp", "sequence parallel (Ulysses all-to-all) over every rank, the golden's padded rows "
                                "sliced along positions, gradients all-reduced")
LAYOUTS = (
    LAYOUT,
    SequenceParallel("sp_packed", "sequence parallel (Ulysses) over every rank, the sequences packed into one row "
                                  "and sliced along positions", packed=True),
    SequenceParallel("sp_fsdp2", "sequence parallel (Ulysses) with fully_shard over the same ranks", params="fsdp2"),
    SequenceParallel("sp_ep", "sequence parallel (Ulysses) with transformers' expert parallel over the same ranks "
                              "(DistributedConfig(ep_size=N, fsdp_size=N))", params="ep"),
)
