"""Every branch of each MoE family's routing code, perturbed: each a veosnap backend
(`--backend tests/router_branches.py:<name>`) that changes one branch in every router of the model.

transformers 5.24's routers (`<Family>TopKRouter.forward`) are re-stated here with the branch as a
switch; `*_as_transformers` runs the re-statement with every switch as transformers has it, and must
match the golden exactly, so each perturbation changes its one branch and nothing else. The toy
routers' weights and the inputs' token codes are drawn so that each branch changes the chosen experts
or their weights for some tokens of the golden's batch (`veosnap/reference/weights.py`); the test
`tests/test_router_branches.py` shows the golden notices each one.

BRANCHES lists them per family: (backend name, what it changes, what the golden must notice:
"routes" when the chosen experts move, "weights" when only the routing weights do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from veosnap import Unsupported
from veosnap.reference.probes import find_moe_layers


def _routers(model: nn.Module, family: str) -> list[nn.Module]:
    model_type = getattr(model.config, "model_type", "")
    if model_type != family:
        raise Unsupported(f"a {family} routing branch; this is {model_type}")
    return [moe.router for moe in find_moe_layers(model)]


def _patch(model: nn.Module, family: str, forward) -> nn.Module:  # noqa: ANN001
    for router in _routers(model, family):
        router.forward = forward.__get__(router)
    return model


# --- DeepSeek-V3: sigmoid scores, score-correction bias, group-limited top-k ---------------------------


def deepseek_v3_routing(router: nn.Module, hidden_states: torch.Tensor, *, correction_bias: bool = True,
                        group_limit: bool = True, group_score: str = "top2_sum", masked_fill: float = float("-inf"),
                        weights_from: str = "scores", normalize: bool | None = None,
                        scaling: float | None = None, scoring: str = "sigmoid") -> tuple:
    """`DeepseekV3TopkRouter.forward`, each branch a switch (the defaults are transformers')."""
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    scores = router_logits.sigmoid() if scoring == "sigmoid" else router_logits.softmax(dim=-1)
    scores_for_choice = scores + router.e_score_correction_bias if correction_bias else scores
    if group_limit:
        grouped = scores_for_choice.view(-1, router.num_group, router.num_experts // router.num_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2_sum" else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, router.num_group, router.num_experts // router.num_group)
                      .reshape(-1, router.num_experts))
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), masked_fill)
    topk_indices = torch.topk(scores_for_choice, k=router.top_k, dim=-1, sorted=False)[1]
    topk_weights = (scores if weights_from == "scores" else scores_for_choice).gather(1, topk_indices)
    if router.norm_topk_prob if normalize is None else normalize:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    topk_weights = topk_weights * (router.routed_scaling_factor if scaling is None else scaling)
    return router_logits, topk_weights, topk_indices


def _deepseek(**switch: object):  # noqa: ANN202
    def backend(model: nn.Module) -> nn.Module:
        return _patch(model, "deepseek_v3", lambda self, h: deepseek_v3_routing(self, h, **switch))

    return backend


deepseek_v3_as_transformers = _deepseek()
deepseek_v3_no_correction_bias = _deepseek(correction_bias=False)
deepseek_v3_no_group_limit = _deepseek(group_limit=False)
deepseek_v3_group_score_by_max = _deepseek(group_score="max")
deepseek_v3_masked_groups_filled_with_zero = _deepseek(masked_fill=0.0)
deepseek_v3_weights_from_biased_scores = _deepseek(weights_from="scores_for_choice")
deepseek_v3_no_topk_normalization = _deepseek(normalize=False)
deepseek_v3_no_routed_scaling = _deepseek(scaling=1.0)
deepseek_v3_softmax_scores = _deepseek(scoring="softmax")


# --- gpt-oss: biased logits, top-k, softmax over the chosen logits --------------------------------------


def gpt_oss_routing(router: nn.Module, hidden_states: torch.Tensor, *, bias_in_choice: bool = True,
                    bias: bool = True, softmax_over: str = "chosen") -> tuple:
    """`GptOssTopKRouter.forward`, each branch a switch (the defaults are transformers')."""
    router_logits = F.linear(hidden_states, router.weight, router.bias if bias else None)
    choose_by = router_logits if bias_in_choice or not bias else F.linear(hidden_states, router.weight)
    router_indices = torch.topk(choose_by, router.top_k, dim=-1)[1]
    router_top_value = router_logits.gather(1, router_indices)
    if softmax_over == "chosen":
        router_scores = F.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
    else:  # softmax over every expert, then the chosen ones' probabilities (not renormalised)
        router_scores = F.softmax(router_logits, dim=1, dtype=router_logits.dtype).gather(1, router_indices)
    return router_logits, router_scores, router_indices


def _gpt_oss(**switch: object):  # noqa: ANN202
    def backend(model: nn.Module) -> nn.Module:
        return _patch(model, "gpt_oss", lambda self, h: gpt_oss_routing(self, h, **switch))

    return backend


gpt_oss_as_transformers = _gpt_oss()
gpt_oss_bias_only_in_weights = _gpt_oss(bias_in_choice=False)
gpt_oss_no_router_bias = _gpt_oss(bias=False)
gpt_oss_softmax_over_all_experts = _gpt_oss(softmax_over="all")


# --- Qwen3-MoE and Mixtral: softmax over every expert, top-k, renormalised -----------------------------


def softmax_topk_routing(router: nn.Module, hidden_states: torch.Tensor, *, renormalize: bool | None = None,
                         order: str = "softmax_then_topk", softmax_dtype: torch.dtype | None = torch.float32,
                         cast_back: bool = True) -> tuple:
    """`Qwen3MoeTopKRouter.forward` and `MixtralTopKRouter.forward` (Mixtral: always renormalised, weights
    left in float32), each branch a switch (the defaults are transformers')."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    router_logits = F.linear(hidden_states, router.weight)
    if order == "softmax_then_topk":
        probs = F.softmax(router_logits, dim=-1, dtype=softmax_dtype)
        top_value, router_indices = torch.topk(probs, router.top_k, dim=-1)
    else:  # top-k of the logits, softmax over the chosen ones
        top_logits, router_indices = torch.topk(router_logits, router.top_k, dim=-1)
        top_value = F.softmax(top_logits, dim=-1, dtype=softmax_dtype)
    if getattr(router, "norm_topk_prob", True) if renormalize is None else renormalize:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    if cast_back:
        top_value = top_value.to(router_logits.dtype)
    return router_logits, top_value, router_indices


def _softmax_family(family: str, **switch: object):  # noqa: ANN202
    if family == "mixtral":
        switch.setdefault("cast_back", False)

    def backend(model: nn.Module) -> nn.Module:
        return _patch(model, family, lambda self, h: softmax_topk_routing(self, h, **switch))

    return backend


qwen3_moe_as_transformers = _softmax_family("qwen3_moe")
qwen3_moe_norm_topk_prob_flipped = _softmax_family("qwen3_moe", renormalize=False)
qwen3_moe_topk_before_softmax = _softmax_family("qwen3_moe", order="topk_then_softmax")
mixtral_as_transformers = _softmax_family("mixtral")
mixtral_no_renormalization = _softmax_family("mixtral", renormalize=False)
mixtral_topk_before_softmax = _softmax_family("mixtral", order="topk_then_softmax")


def mixtral_jitter_left_on(model: nn.Module) -> nn.Module:
    """Mixtral's router jitter (multiplicative noise on the router's input in training) left on at 0.01."""
    _routers(model, "mixtral")
    for module in model.modules():
        if hasattr(module, "jitter_noise") and hasattr(module, "gate"):
            module.jitter_noise = 0.01
    return model


# Per family: (backend, the branch it changes, what the golden notices). "same" marks a re-statement of a
# branch that is the same function as transformers' (so no golden can tell them apart, and none must).
BRANCHES = {
    "deepseek_v3": [
        ("deepseek_v3_no_correction_bias", "choose without e_score_correction_bias", "routes"),
        ("deepseek_v3_no_group_limit", "every group competes (n_group/topk_group ignored)", "routes"),
        ("deepseek_v3_group_score_by_max", "groups ranked by their best expert, not their best two", "routes"),
        ("deepseek_v3_masked_groups_filled_with_zero", "dropped groups' experts filled with 0.0, not -inf", "routes"),
        ("deepseek_v3_weights_from_biased_scores", "weights from the bias-corrected scores", "weights"),
        ("deepseek_v3_no_topk_normalization", "top-k weights not normalised (norm_topk_prob)", "weights"),
        ("deepseek_v3_no_routed_scaling", "routed_scaling_factor dropped", "weights"),
        ("deepseek_v3_softmax_scores", "softmax scores instead of sigmoid", "routes"),
    ],
    "gpt_oss": [
        ("gpt_oss_bias_only_in_weights", "router bias left out of the choice (kept in the weights)", "routes"),
        ("gpt_oss_no_router_bias", "router bias dropped", "routes"),
        ("gpt_oss_softmax_over_all_experts", "softmax over every expert, not over the chosen logits", "weights"),
    ],
    "qwen3_moe": [
        ("qwen3_moe_norm_topk_prob_flipped", "top-k probabilities not renormalised (norm_topk_prob)", "weights"),
        ("qwen3_moe_topk_before_softmax", "top-k of the logits, softmax over the chosen: with norm_topk_prob "
                                          "the same function", "same"),
    ],
    "mixtral": [
        ("mixtral_no_renormalization", "top-k probabilities not renormalised", "weights"),
        ("mixtral_jitter_left_on", "router jitter (router_jitter_noise) left on in training", "weights"),
        ("mixtral_topk_before_softmax", "top-k of the logits, softmax over the chosen: renormalised, the same "
                                        "function", "same"),
    ],
}
AS_TRANSFORMERS = {family: f"{family}_as_transformers" for family in BRANCHES}
