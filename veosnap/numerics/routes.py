"""How clearly a router decided (margins), and how two sets of MoE routes compare.

Routes are expert ids per token, sorted ascending per token (some routers, DeepSeek-V3's among them,
pick with `topk(sorted=False)`). A token whose golden margin is under the tie epsilon is a near-tie:
its flip is counted apart and does not fail a check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupLimit:
    """Group-limited routing (DeepSeek-V3's `n_group`, `topk_group`): the experts form `groups` equal
    groups in index order, each scored by the sum of its two best scores, and only the `keep` best
    groups' experts compete for the top-k."""

    groups: int
    keep: int


def margins(scores: torch.Tensor, chosen: torch.Tensor, slope: torch.Tensor | None = None,
            group_limit: GroupLimit | None = None) -> torch.Tensor:
    """Per token, in logit units: how far the router's decision is from changing.

    The lowest chosen expert against the best competing one not chosen. The score gap is divided by
    the mean slope of the two scores against their logits, so a sigmoid router's margin reads on the
    same scale as a softmax router's logit gap, and one tie epsilon serves both. Under a group limit
    only experts of the kept groups compete, and the gap between the last kept group and the best
    dropped one counts too when swapping the two would change the chosen experts; a group's score is
    the sum of its two best experts', so that gap is divided by the mean slope of each pair's sum
    (twice the mean of the four).
    """
    slope = torch.ones_like(scores) if slope is None else slope
    picked = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, chosen.long(), True)
    competing = torch.ones_like(picked)
    if group_limit is not None and group_limit.keep < group_limit.groups:
        competing, group_margin = _group_decision(scores, picked, slope, group_limit, chosen.shape[-1])
    low_score, low_at = scores.masked_fill(~picked, float("inf")).min(dim=1)
    high_score, high_at = scores.masked_fill(picked | ~competing, float("-inf")).max(dim=1)
    mean_slope = (slope.gather(1, low_at[:, None]) + slope.gather(1, high_at[:, None])).squeeze(1) / 2
    margin = (low_score - high_score) / mean_slope.clamp_min(1e-12)
    if group_limit is not None and group_limit.keep < group_limit.groups:
        margin = torch.minimum(margin, group_margin)
    return margin


def _group_decision(scores: torch.Tensor, picked: torch.Tensor, slope: torch.Tensor, limit: GroupLimit,
                    top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[tokens, experts] which experts compete (their group is kept, or they were chosen), and per token
    the group margin in logit units (inf where swapping the last kept and best dropped group would
    leave the chosen experts as they are)."""
    tokens, experts = scores.shape
    per_group = experts // limit.groups
    best, best_at = scores.view(tokens, limit.groups, per_group).topk(min(2, per_group), dim=-1)
    group_scores = best.sum(dim=-1)
    order = group_scores.argsort(dim=1, descending=True, stable=True)
    last_kept, first_dropped = order[:, limit.keep - 1], order[:, limit.keep]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, order[:, : limit.keep], True)

    def experts_of(groups: torch.Tensor) -> torch.Tensor:
        return groups.repeat_interleave(per_group, dim=1)

    competing = experts_of(kept) | picked
    swapped = kept.clone()
    swapped.scatter_(1, last_kept[:, None], False).scatter_(1, first_dropped[:, None], True)
    alternative = scores.masked_fill(~experts_of(swapped), float("-inf")).topk(top_k, dim=1).indices
    moved = torch.zeros_like(picked).scatter_(1, alternative, True) != picked
    gap = group_scores.gather(1, last_kept[:, None]) - group_scores.gather(1, first_dropped[:, None])
    group_slope = slope.view(tokens, limit.groups, per_group).gather(2, best_at).sum(dim=-1)
    boundary_slope = (group_slope.gather(1, last_kept[:, None]) + group_slope.gather(1, first_dropped[:, None])) / 2
    group_margin = (gap / boundary_slope.clamp_min(1e-12)).squeeze(1)
    return competing, torch.where(moved.any(dim=1), group_margin, torch.full_like(group_margin, float("inf")))


def flips(golden_experts: torch.Tensor, candidate_experts: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: the tokens of `token_mask` sent to another set of experts than the golden's."""
    return (golden_experts != candidate_experts).any(dim=-1) & token_mask


@dataclass(frozen=True)
class RouteDiff:
    """How a candidate's routes in one layer differ from the golden's, over the compared tokens."""

    layer: int
    tokens: int
    clear_flips: int
    near_tie_flips: int
    first_flipped_token: int | None
    # Per expert id, over the clearly flipped tokens: how many the candidate sends to the expert that
    # the golden does not (gained) and the other way round (lost). Indexed 0..highest id either chose.
    gained: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    unreadable: str = ""  # why the candidate's routes in this layer could not be read ('' when they were)

    @property
    def passed(self) -> bool:
        return self.clear_flips == 0

    def message(self) -> str:
        if self.unreadable:
            return (f"routes not readable in layer {self.layer}: {self.unreadable}; expert ids and weights not "
                    "compared, the tensors downstream are")
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
    differs = flips(golden_experts, candidate_experts, token_mask)
    near_tie = golden_margin < tie_epsilon
    clear = differs & ~near_tie
    flipped = clear.nonzero().flatten()
    experts = max(int(golden_experts.max()), int(candidate_experts.max()), -1) + 1 if golden_experts.numel() else 0
    golden_hot = _one_hot(golden_experts[clear], experts)
    candidate_hot = _one_hot(candidate_experts[clear], experts)
    return RouteDiff(
        layer=layer,
        tokens=int(token_mask.sum()),
        clear_flips=int(clear.sum()),
        near_tie_flips=int((differs & near_tie).sum()),
        first_flipped_token=int(flipped[0]) if flipped.numel() else None,
        gained=tuple((candidate_hot & ~golden_hot).sum(dim=0).tolist()),  # one read, not one per expert
        lost=tuple((golden_hot & ~candidate_hot).sum(dim=0).tolist()),
    )


def _one_hot(experts: torch.Tensor, count: int) -> torch.Tensor:
    """[tokens, k] expert ids as a [tokens, count] bool mask of the experts each token went to.

    A negative id (a token dropped by a capacity-limited router) goes to no expert."""
    slots = experts.long().clamp_min(-1) + 1  # column 0 collects the dropped, then goes
    return torch.zeros(experts.shape[0], count + 1, dtype=torch.bool).scatter_(1, slots, True)[:, 1:]
