"""Backends that use the plugin contract as a training framework would (docs/backends.md), each with a planted
bug beside it. Given by file SPEC (`tests/plugin_backends.py:name`) so torchrun ranks resolve them too.

Events a test wants to see from the ranks go to the file `$VEOSNAP_TEST_EVENTS` (one line each, with the rank).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

import veosnap
from veosnap import Adapted, Candidate, Unsupported, parallelizes


def _event(text: str) -> None:
    path = os.environ.get("VEOSNAP_TEST_EVENTS")
    if path:
        rank = os.environ.get("RANK", "-")
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{rank} {text}\n")


# --- item 1: a loss computed without logits ----------------------------------------------------------


def _fused_loss(model: nn.Module, ignore_padding: bool) -> nn.Module:
    """The model's loss from its hidden states and the LM head weight, as chunked / fused linear
    cross-entropy computes it: the LM head module is never called and no logits are returned."""

    def forward(input_ids=None, labels=None, use_cache=None, **kwargs):  # noqa: ANN001, ANN202
        hidden = model.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = F.linear(hidden[:, :-1], model.lm_head.weight).float()
        targets = labels[:, 1:]
        if not ignore_padding:  # the bug: the pads' ignore_index becomes a real class
            targets = targets.clamp(min=0)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=None)

    model.forward = forward
    return model


def fused_loss(model: nn.Module) -> nn.Module:
    return _fused_loss(model, ignore_padding=True)


def fused_loss_counts_padding(model: nn.Module) -> nn.Module:
    return _fused_loss(model, ignore_padding=False)


# --- item 2: routers that return one tensor, and a MoE that bypasses its experts module ----------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def _one_tensor_router(model: nn.Module, flip_token: int | None = None, top_k_on_block: bool = False,
                       hide_logits: bool = False) -> nn.Module:
    """Qwen3-MoE routed as VeOmni's DeepSeek-V3 (and HF's in transformers 5.9-5.12) route: the router returns
    its logits, the block picks the experts and calls `experts(hidden, top_k_index, top_k_weights)`.
    `hide_logits`: the router returns its softmax scores in another layout ([experts, tokens]), so no
    `[tokens, experts]` logits can be read at its output."""
    for block in _blocks(model):
        gate = block.gate
        block.top_k = gate.top_k
        if top_k_on_block:
            del gate.top_k  # nothing on the router says how many experts a token takes
        gate.forward = lambda hidden, gate=gate: F.linear(hidden.reshape(-1, gate.weight.shape[1]), gate.weight)
        if hide_logits:
            gate.forward = lambda hidden, gate=gate: F.linear(hidden.reshape(-1, gate.weight.shape[1]), gate.weight).T

        def forward(hidden: torch.Tensor, block: nn.Module = block) -> torch.Tensor:
            flat = hidden.reshape(-1, hidden.shape[-1])
            logits = block.gate(flat)
            logits = logits.T if hide_logits else logits
            weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), block.top_k, dim=-1)
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)
            if flip_token is not None:  # the bug: one token's second expert is another one
                experts = experts.clone()
                taken = set(experts[flip_token].tolist())
                experts[flip_token, 1] = next(e for e in range(logits.shape[-1]) if e not in taken)
            return block.experts(flat, experts, weights).view_as(hidden)

        block.forward = forward
    return model


def one_tensor_router(model: nn.Module) -> nn.Module:
    return _one_tensor_router(model)


def one_tensor_router_top_k_on_block(model: nn.Module) -> nn.Module:
    return _one_tensor_router(model, top_k_on_block=True)


def one_tensor_router_flips_a_token(model: nn.Module) -> nn.Module:
    return _one_tensor_router(model, flip_token=5)


def hidden_logits_router_flips_a_token(model: nn.Module) -> nn.Module:
    return _one_tensor_router(model, flip_token=5, hide_logits=True)


def experts_bypassed(model: nn.Module) -> nn.Module:
    """A fused MoE that reads the experts' weights itself and never calls the experts module: the same
    function (the experts' own forward, called as a plain function), but no hook point to read routes at."""
    for block in _blocks(model):
        forward = type(block.experts).forward

        def fused(hidden: torch.Tensor, block: nn.Module = block, forward=forward) -> torch.Tensor:  # noqa: ANN001
            flat = hidden.reshape(-1, hidden.shape[-1])
            _, weights, experts = block.gate(flat)
            return forward(block.experts, flat, experts, weights).view_as(hidden)

        block.forward = fused
    return model


# --- item 3: a generator backend whose patch must stay applied while any layout runs -----------------

PATCHED: list[bool] = []


def patched_while_running(model: nn.Module):  # noqa: ANN201 - a generator backend
    PATCHED.append(True)
    _event("patched")

    def check(*_: object) -> None:
        _event(f"forward patched={bool(PATCHED)}")
        if not PATCHED:
            raise RuntimeError("the backend's patch was undone before the model ran")

    handle = model.register_forward_pre_hook(check)
    try:
        yield model
    finally:
        PATCHED.clear()
        handle.remove()
        _event("restored")


# --- item 4: where it runs, and a framework that parallelizes the model itself ------------------------


def _told(model: nn.Module, ctx: veosnap.Context) -> str:
    sharded = any(type(p).__name__ == "DTensor" for p in model.parameters())
    mesh = ",".join(f"{name}:{size}" for name, size in ctx.mesh_shape.items()) or "none"
    return (f"layout={ctx.layout} rank={ctx.rank}/{ctx.world} dp={ctx.dp_rank}/{ctx.dp_world} mesh={mesh} "
            f"device={ctx.device.type} distributed={ctx.distributed} accessor={veosnap.context() is ctx} "
            f"golden={ctx.golden} sharded_before={sharded}")


def where(model: nn.Module, ctx: veosnap.Context) -> nn.Module:
    """Skips, saying what it was told (the skip reason is the test's window into every rank's context)."""
    raise Unsupported(_told(model, ctx))


@parallelizes
def where_parallelizing(model: nn.Module, ctx: veosnap.Context) -> nn.Module:
    raise Unsupported(_told(model, ctx))


@parallelizes
def own_fsdp2(model: nn.Module, ctx: veosnap.Context) -> nn.Module:
    """Shards the model the way a framework's parallelize function does (VeOmni's parallelize_model_fsdp2),
    on a mesh of its own built from the sizes it was told."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if ctx.distributed:
        mesh = init_device_mesh(ctx.device.type, (ctx.dp_world,), mesh_dim_names=("dp_shard",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _own_reduction(model: nn.Module, ctx: veosnap.Context, reduce: bool) -> Candidate:
    """A framework that reduces gradients its own way (no DDP, no DTensor): each rank keeps its local
    gradient, and `full_gradients` says how to read the full one (an all-reduce averaging over the
    data-parallel ranks, as DDP's would)."""
    import torch.distributed as dist

    def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in model.named_parameters():
            grad = param.grad.detach().clone()
            if reduce and ctx.distributed:
                dist.all_reduce(grad, group=ctx.group)
                grad /= ctx.dp_world
            out[name] = grad
        return out

    return Candidate(model, full_gradients=full_gradients)


@parallelizes
def own_reduction(model: nn.Module, ctx: veosnap.Context) -> Candidate:
    return _own_reduction(model, ctx, reduce=True)


@parallelizes
def own_reduction_forgotten(model: nn.Module, ctx: veosnap.Context) -> Candidate:
    return _own_reduction(model, ctx, reduce=False)


# --- item 5: a candidate that prints ----------------------------------------------------------------

print("[chatty] imported")  # at import, as VeOmni's logger and transformers' docstring checks do


def chatty(model: nn.Module) -> nn.Module:
    print("[chatty] building my model")
    os.write(1, b"[chatty] a C extension writes to fd 1\n")
    model.register_forward_pre_hook(lambda *_: print("[chatty] forward"))
    return model


# --- item 6: a framework that takes the batch in its own form ----------------------------------------


def _packing(swapped: bool = False):  # noqa: ANN202
    """Its collator's form: padding removed, the sequences of the batch in one row, position ids restarting
    per sequence (from which a varlen kernel takes cu_seqlens), two pad slots of its own at the end."""

    def adapt(batch, ctx: veosnap.Context) -> Adapted:  # noqa: ANN001
        keep = batch.attention_mask.reshape(-1).bool()
        flat = torch.arange(keep.numel(), device=keep.device)[keep]
        if swapped:  # the bug: the first two tokens' outputs put back at each other's place
            flat[[0, 1]] = flat[[1, 0]]
        pad = torch.zeros(2, dtype=torch.long, device=keep.device)
        kwargs = {"input_ids": torch.cat([batch.input_ids.reshape(-1)[keep], pad])[None],
                  "position_ids": torch.cat([batch.position_ids.reshape(-1)[keep], torch.arange(2).to(pad)])[None],
                  "labels": torch.cat([batch.labels.reshape(-1)[keep], pad - 100])[None]}
        positions = torch.cat([flat, torch.full((2,), -1, device=keep.device)])
        return Adapted(kwargs, positions)

    return adapt


def collator_form(model: nn.Module, ctx: veosnap.Context) -> Candidate:
    return Candidate(model, adapt_batch=_packing())


def collator_form_positions_swapped(model: nn.Module, ctx: veosnap.Context) -> Candidate:
    return Candidate(model, adapt_batch=_packing(swapped=True))


# --- item 7: a model whose structure changed -------------------------------------------------------


def norm_in_bfloat16(model: nn.Module) -> nn.Module:
    """As transformers 5.22 keeps DeepSeek-V3's router weight in the model dtype: one parameter in another dtype."""
    model.model.norm.to(torch.bfloat16)
    return model


def extra_parameter(model: nn.Module) -> nn.Module:
    model.model.norm.register_parameter("offset", nn.Parameter(torch.zeros_like(model.model.norm.weight)))
    return model


# --- item 8: a rank that fails first ---------------------------------------------------------------


def rank0_fails_first(model: nn.Module, ctx: veosnap.Context) -> nn.Module:
    """Rank 0 fails at once (as `from_pretrained(distributed_config=...)` does without accelerate); rank 1 goes
    on into a collective and waits there until torchrun stops it."""
    if ctx.distributed:
        if ctx.rank == 0:
            raise ImportError("Using a `distributed_config` requires `accelerate`: `pip install accelerate`")
        time.sleep(1)
        import torch.distributed as dist

        dist.barrier()
    print("never reached on rank 0", file=sys.stderr)
    return model
