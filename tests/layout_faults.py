"""Layout bugs planted on purpose, each a real layout with one thing wrong: `--layout tests/layout_faults.py:<name>`.

Each wraps a built-in layout and changes one step of it the way a real framework bug would, so the
tests can show a layout check catches it and names the right tensor. They double as examples of the
layout protocol: a layout is an object with `accept`, `load`, `wrap`, `shard`, `accumulate` and `clip`.
Multi-process ones are resolved again by every torchrun rank, from this file.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from veosnap.candidates.layouts import sequence
from veosnap.candidates.layouts.protocol import DataGroup, Layout, LayoutContext, Setup, Shard
from veosnap.candidates.layouts.registry import LAYOUTS
from veosnap.reference.train import clip_global


class Planted(Layout):
    """A built-in layout, step for step, except what a subclass overrides; reported under the built-in's name."""

    def __init__(self, base: str, bug: str) -> None:
        self.base = LAYOUTS[base]
        self.name, self.distributed = self.base.name, self.base.distributed
        self.description = f"{self.base.description}; {bug}"

    def accept(self, golden, nproc):  # noqa: ANN001, ANN201
        return self.base.accept(golden, nproc)

    def load(self, ctx):  # noqa: ANN001, ANN201
        return self.base.load(ctx)

    def wrap(self, model, ctx):  # noqa: ANN001, ANN201
        return self.base.wrap(model, ctx)

    def shard(self, ctx, setup):  # noqa: ANN001, ANN201
        return self.base.shard(ctx, setup)

    def accumulate(self, ctx, setup, index, count):  # noqa: ANN001, ANN201
        return self.base.accumulate(ctx, setup, index, count)

    def clip(self, params, max_norm, ctx):  # noqa: ANN001, ANN201
        return self.base.clip(params, max_norm, ctx)


class SumGrads(Planted):
    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        setup = self.base.wrap(model, ctx)
        setup.model.register_comm_hook(None, _all_reduce_sum)  # DDP's own hook averages
        return setup


def _all_reduce_sum(_state, bucket):  # noqa: ANN001, ANN202
    import torch.distributed as dist

    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


class SwapShard(Planted):
    def shard(self, ctx: LayoutContext, setup: Setup) -> list:
        own = self.base.shard(ctx, setup)
        if not ctx.last:
            return own
        first = self.base.shard(ctx, replace(setup, data=DataGroup(setup.data.size, 0)))
        # The last rank's sampler hands it the first rank's rows; the gather still puts them at its own.
        return [replace(mine, batch=theirs.batch) for mine, theirs in zip(own, first)]


class NoRestart(Planted):
    def shard(self, ctx: LayoutContext, setup: Setup) -> list:
        shards = self.base.shard(ctx, setup)
        for shard in shards:
            shard.batch.position_ids = torch.arange(shard.batch.width)[None].expand_as(shard.batch.position_ids)
        return shards


class Die(Planted):
    def load(self, ctx: LayoutContext) -> nn.Module:
        if ctx.last:
            # A crash: the process ends in C, where no Python guard sees it (os._exit would be caught as the
            # candidate's own error); torchrun reports the status.
            ctypes.CDLL(None)._exit(17)
        return self.base.load(ctx)


class Raise(Planted):
    def load(self, ctx: LayoutContext) -> nn.Module:
        if ctx.last:
            raise RuntimeError("the last rank's sampler broke")
        return self.base.load(ctx)


class Hang(Planted):
    def load(self, ctx: LayoutContext) -> nn.Module:
        if ctx.last:
            time.sleep(10**6)  # the others wait for it in their first collective
        return self.base.load(ctx)


class ClipMicro(Planted):
    @contextmanager
    def accumulate(self, ctx: LayoutContext, setup: Setup, index: int, count: int):  # noqa: ANN201
        with self.base.accumulate(ctx, setup, index, count):
            yield
        if ctx.hyper is not None:
            clip_global([p for p in setup.inner.parameters() if p.requires_grad], ctx.hyper.max_norm)


class ClipLocal(Planted):
    def clip(self, params: list[nn.Parameter], max_norm: float, ctx: LayoutContext) -> torch.Tensor:
        with torch.no_grad():
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in grads:
                grad.mul_(coef.to(grad.dtype))
        return norm


# --- sequence parallel: bugs only a layout that shards positions can have ----------------------------


def _reversed_heads(x: torch.Tensor, head_dim: int, seq_dim: int, group: object = None) -> torch.Tensor:
    """The attention output sent back with the head chunks concatenated in reverse rank order."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    pieces = sequence.gather_heads_scatter_seq(x, head_dim=head_dim, seq_dim=seq_dim, group=group)
    return torch.cat(list(reversed(pieces.chunk(world, dim=head_dim))), dim=head_dim)


class HeadsReversed(Planted):
    def wrap(self, model: nn.Module, ctx: LayoutContext) -> Setup:
        # Through the exchange hook, as a framework's plugin would hand over its own.
        sequence.use_exchange(model, sequence.Exchange(gather_heads_scatter_seq=_reversed_heads, name="reversed heads"))
        return self.base.wrap(model, ctx)


class GradsUnreduced(Planted):
    @contextmanager
    def accumulate(self, ctx: LayoutContext, setup: Setup, index: int, count: int):  # noqa: ANN201
        yield  # each rank keeps its own positions' contribution to every replicated weight


class LocalLoss(Planted):
    def shard(self, ctx: LayoutContext, setup: Setup) -> list:
        shards = self.base.shard(ctx, setup)
        for shard in shards:
            local = (shard.batch.extra["shift_labels"] != -100).sum()
            shard.batch.extra["num_items_in_batch"] = local  # this rank's count, not the whole batch's
        return shards


class BoundaryOffByOne(Planted):
    def shard(self, ctx: LayoutContext, setup: Setup) -> list:
        shards = self.base.shard(ctx, setup)
        if not ctx.last:
            return shards
        # The last rank's slice of row 0 is cut one token early; its positions, labels and mask are right.
        (shard,) = shards
        width = shard.batch.width
        start = ctx.rank * width
        row = ctx.batch.input_ids[0]
        shard.batch.input_ids[0] = row[start - 1:start - 1 + width]
        return [Shard(shard.batch, shard.positions, shard.weight)]


ddp_sum_grads = SumGrads("ddp", "gradients summed instead of averaged across data-parallel ranks")
fsdp2_swap_shard = SwapShard("fsdp2", "the last rank trains on the first rank's rows instead of its own")
packed_no_restart = NoRestart("packed", "a packed batch whose position ids run on instead of restarting per sequence")
hsdp_die = Die("hsdp", "the last rank crashes with status 17 before its step")
ddp_last_rank_raises = Raise("ddp", "the last rank raises before its step (torchrun then stops the others)")
ddp_hang = Hang("ddp", "the last rank sleeps before its step (hangs the others in their first collective)")
# train scenario only: bugs that leave every gradient right and the next parameters wrong
microbatch_clip_micro = ClipMicro("microbatch", "gradients clipped after every micro-batch, not once after accumulation")
fsdp2_clip_local = ClipLocal("fsdp2", "gradients clipped by each rank's own shard norm instead of the global norm")
sp_heads_reversed = HeadsReversed("sp", "the attention output's head chunks sent back in reverse rank order")
sp_grads_unreduced = GradsUnreduced("sp", "replicated weights' gradients not reduced across the sequence group")
sp_local_loss = LocalLoss("sp", "each rank's loss divided by its own prediction count instead of the whole batch's")
sp_boundary_off_by_one = BoundaryOffByOne("sp", "the last rank's slice of row 0 cut one token early")
