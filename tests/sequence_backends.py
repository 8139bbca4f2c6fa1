"""A framework's own Ulysses exchange handed to veosnap's `sp` through the exchange hook, by a backend.

`list_exchange` has the shape of VeOmni's (`veomni.distributed.sequence_parallel.ulysses`): an autograd
function around a list all-to-all whose backward is the reverse all-to-all. Given as
`--backend tests/sequence_backends.py:list_exchange`, it replaces veosnap's own all-to-all on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from veosnap.candidates.layouts import sequence


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: object) -> torch.Tensor:
    world = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.tensor_split(world, scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(world)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim).contiguous()


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):  # noqa: ANN001, ANN205
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _seq_to_heads(x: torch.Tensor, seq_dim: int, head_dim: int, group: object = None) -> torch.Tensor:
    return _SeqAllToAll.apply(x, head_dim, seq_dim, group)


def _heads_to_seq(x: torch.Tensor, head_dim: int, seq_dim: int, group: object = None) -> torch.Tensor:
    return _SeqAllToAll.apply(x, seq_dim, head_dim, group)


LIST_EXCHANGE = sequence.Exchange(_seq_to_heads, _heads_to_seq, name="list all-to-all, VeOmni's shape")


def list_exchange(model: nn.Module) -> nn.Module:
    """The reference model, its Ulysses exchange replaced by this file's."""
    return sequence.use_exchange(model, LIST_EXCHANGE)
