"""MoE routes: where routers are, what they chose, how clearly, and how two route sets compare.

Transformers 5 gives every MoE block a router returning `(logits, weights, indices)` and an experts
module taking `(hidden_states, top_k_index, top_k_weights)`, so routes are captured at the router's
output without per-model code. Expert ids are sorted per token before storing or comparing (some
routers, DeepSeek-V3's among them, pick with `topk(sorted=False)`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class MoeLayer:
    """One MoE block of a model: its decoder layer index and its router."""

    layer: int
    router_name: str
    router: nn.Module
    num_experts: int
    top_k: int


def find_moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every MoE block in `model`, found by shape (a router with `top_k` beside an `experts` module)."""
    found = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        for child_name, child in module.named_children():
            if child is experts or not hasattr(child, "top_k") or not hasattr(child, "weight"):
                continue
            match = _LAYER_RE.search(name)
            layer = int(match.group(1)) if match else len(found)
            found.append(
                MoeLayer(
                    layer=layer,
                    router_name=f"{name}.{child_name}" if name else child_name,
                    router=child,
                    num_experts=int(child.weight.shape[0]),
                    top_k=int(child.top_k),
                )
            )
    return sorted(found, key=lambda m: m.layer)


def selection_scores(router: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores a router ranks experts by (float32), and their slope against the logits.

    Softmax and plain top-k routers rank by logits (softmax is monotone; slope 1); sigmoid routers
    with a score-correction bias (DeepSeek-V3) rank by sigmoid(logits) + bias.
    """
    logits = logits.detach().float()
    bias = getattr(router, "e_score_correction_bias", None)
    if isinstance(bias, torch.Tensor):
        sig = logits.sigmoid()
        return sig + bias.detach().float().to(logits.device), sig * (1 - sig)
    return logits, torch.ones_like(logits)


def margins(scores: torch.Tensor, chosen: torch.Tensor, slope: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, in logit units: how far the lowest chosen expert is from the best one not chosen.

    The score gap is divided by the mean slope of the two scores against their logits, so a
    sigmoid router's margin reads on the same scale as a softmax router's logit gap, and one tie
    epsilon serves both. For group-limited routers the group mask is ignored, which can only
    understate a margin.
    """
    slope = torch.ones_like(scores) if slope is None else slope
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen.long(), True)
    low_score, low_at = scores.masked_fill(~picked, float("inf")).min(dim=1)
    high_score, high_at = scores.masked_fill(picked, float("-inf")).max(dim=1)
    mean_slope = (slope.gather(1, low_at[:, None]) + slope.gather(1, high_at[:, None])).squeeze(1) / 2
    return (low_score - high_score) / mean_slope.clamp_min(1e-12)


@dataclass
class RouteRecord:
    """What one MoE layer's router decided for every token of the batch (flattened batch x seq)."""

    layer: int
    experts: torch.Tensor  # [tokens, k] int64, sorted ascending per token
    weights: torch.Tensor  # [tokens, k] routing weights in the order of `experts`
    margin: torch.Tensor  # [tokens] float32, logit units: lowest chosen vs best unchosen expert (see `margins`)


def sort_route(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort expert ids ascending per token and carry the weights along."""
    experts, order = indices.long().sort(dim=-1)
    return experts, weights.gather(-1, order)


@contextmanager
def record_routes(model: nn.Module) -> Iterator[dict[int, RouteRecord]]:
    """Within the block, every router call of `model` is recorded by layer index."""
    records: dict[int, RouteRecord] = {}
    handles = []
    for moe in find_moe_layers(model):

        def hook(module: nn.Module, _inputs: tuple, output: tuple, layer: int = moe.layer) -> None:
            logits, weights, indices = output[0], output[1], output[2]
            experts, sorted_weights = sort_route(indices.detach(), weights.detach())
            scores, slope = selection_scores(module, logits.reshape(-1, logits.shape[-1]))
            records[layer] = RouteRecord(
                layer=layer,
                experts=experts.reshape(-1, experts.shape[-1]).cpu(),
                weights=sorted_weights.reshape(-1, experts.shape[-1]).cpu(),
                margin=margins(scores, indices.reshape(-1, indices.shape[-1]), slope).cpu(),
            )

        handles.append(moe.router.register_forward_hook(hook))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class RouteDiff:
    """How a candidate's routes in one layer differ from the golden's, over the compared tokens."""

    layer: int
    tokens: int
    clear_flips: int
    near_tie_flips: int
    first_flipped_token: int | None

    @property
    def passed(self) -> bool:
        return self.clear_flips == 0

    def message(self) -> str:
        if self.clear_flips:
            return (
                f"routing differs: layer {self.layer} sends {self.clear_flips} of {self.tokens} tokens "
                f"to other experts than the golden"
            )
        if self.near_tie_flips:
            return f"layer {self.layer}: {self.near_tie_flips} near-tie token(s) flipped (reported, not failed)"
        return f"layer {self.layer}: all {self.tokens} tokens routed as the golden"


def compare_routes(
    layer: int,
    golden_experts: torch.Tensor,
    golden_margin: torch.Tensor,
    candidate_experts: torch.Tensor,
    token_mask: torch.Tensor,
    tie_epsilon: float,
) -> RouteDiff:
    """Count tokens (among `token_mask`) sent to other experts; near-ties are counted apart."""
    differs = (golden_experts != candidate_experts).any(dim=-1) & token_mask
    near_tie = golden_margin < tie_epsilon
    clear = differs & ~near_tie
    flipped = clear.nonzero().flatten()
    return RouteDiff(
        layer=layer,
        tokens=int(token_mask.sum()),
        clear_flips=int(clear.sum()),
        near_tie_flips=int((differs & near_tie).sum()),
        first_flipped_token=int(flipped[0]) if flipped.numel() else None,
    )


def reweigh(router: nn.Module, logits: torch.Tensor, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The routing weights `router` would give experts `indices`, from its own logits.

    Three router families cover the zoo: sigmoid with score-correction bias (DeepSeek-V3: gather,
    normalize, scale), softmax over the chosen logits (GPT-OSS, whose router has a bias), and softmax
    over all experts then gather (Qwen-MoE, Mixtral; renormalized when `norm_topk_prob`).
    """
    logits = logits.reshape(-1, logits.shape[-1])
    idx = indices.long()
    if isinstance(getattr(router, "e_score_correction_bias", None), torch.Tensor):
        w = logits.float().sigmoid().gather(1, idx)
        if getattr(router, "norm_topk_prob", True):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * getattr(router, "routed_scaling_factor", 1.0)
    elif isinstance(getattr(router, "bias", None), torch.Tensor):
        w = torch.softmax(logits.gather(1, idx), dim=1, dtype=logits.dtype)
    else:
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        if getattr(router, "norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
    return w.to(like.dtype)


@contextmanager
def replay_routes(model: nn.Module, experts_by_layer: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the block, each router's choice is replaced by the given expert ids (route replay).

    The weights are still the candidate's own, recomputed for the forced experts, so gradients flow
    through the candidate's router as they would had it chosen the same experts.
    """
    handles = []
    for moe in find_moe_layers(model):
        forced = experts_by_layer.get(moe.layer)
        if forced is None:
            continue

        def hook(module: nn.Module, _inputs: tuple, output: tuple, forced: torch.Tensor = forced) -> tuple:
            logits, weights, indices = output[0], output[1], output[2]
            new_indices = forced.to(indices.device, indices.dtype).reshape(indices.shape)
            new_weights = reweigh(module, logits, new_indices.reshape(-1, new_indices.shape[-1]), weights)
            return (logits, new_weights.reshape(weights.shape), new_indices, *output[3:])

        handles.append(moe.router.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
