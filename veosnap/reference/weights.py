"""Weights that do not depend on where they are made.

Every parameter's values derive from (seed, parameter name) alone: drawn on the CPU in float32
from a generator seeded by a hash of both, shaped by a rule for its kind, then cast. The same on
every device, under any sharding and in any init order.

MoE routers are built to decide clearly: each token's embedding carries a code, `top_k` of a few
reserved hidden dimensions set high, and each layer's router reads those dimensions (through its
own permutation, so layers route differently). The attention and MLP output projections write
only faintly into the reserved dimensions (HF names them `o_proj` and `down_proj` in every zoo
family), so the code survives the residual stream. Every token's chosen experts then clear the rest
by a wide margin, and every expert is used.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from .probes import MoeLayer, find_moe_layers

# Scales chosen so the toy function is far from trivial (logits well away from uniform) while
# staying well conditioned in bfloat16; see the README's tolerance section.
EMBED_STD = 1.0
CODE_STRENGTH = 4.0  # a token's code dimensions in its embedding; the others there are 0
CODE_NOISE = 0.02  # how much of a projection's output reaches the code dimensions
ROUTER_READ = 1.5  # router weight on the code dimension of its expert: logit gaps of 2 or more
ROUTER_NOISE = 0.02
NORM_JITTER = 0.1
BIAS_STD = 0.1
LM_HEAD_GAIN = 2.0


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, name) through SHA-256, so names never collide by accident."""
    digest = hashlib.sha256(f"veosnap:{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def draw(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 values for (seed, name), on the CPU."""
    return torch.randn(shape, generator=generator(seed, name), dtype=torch.float32)


def token_codes(seed: int, vocab_size: int, num_codes: int, top_k: int) -> torch.Tensor:
    """[vocab, top_k]: the code dimensions (0..num_codes-1) each token's embedding sets high."""
    keys = torch.rand((vocab_size, num_codes), generator=generator(seed, "routing.token_codes"))
    return keys.argsort(dim=1)[:, :top_k]


def router_permutation(seed: int, router_name: str, num_experts: int) -> torch.Tensor:
    """[num_experts]: the code dimension each expert of one router reads."""
    return torch.rand(num_experts, generator=generator(seed, f"routing.perm.{router_name}")).argsort()


def _fan_in(model: nn.Module, name: str, shape: torch.Size) -> int:
    owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    if len(shape) == 3 and getattr(owner, "is_transposed", False):
        return int(shape[-2])  # transposed experts store [experts, in, out]
    return int(shape[-1])


def reference_value(
    model: nn.Module, name: str, shape: torch.Size, seed: int, moe: list[MoeLayer] | None = None
) -> torch.Tensor:
    """The float32 value of parameter or buffer `name` for this seed (before any cast)."""
    moe = find_moe_layers(model) if moe is None else moe
    base = draw(seed, name, tuple(shape))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        # Tied embeddings are the LM head too: give them the head's scale.
        value = base * (LM_HEAD_GAIN / math.sqrt(shape[1]) if tied else EMBED_STD)
        if moe:
            value[:, : moe[0].num_experts] = 0.0
            codes = token_codes(seed, shape[0], moe[0].num_experts, moe[0].top_k)
            value.scatter_(1, codes, CODE_STRENGTH)
        return value
    routers = {m.router_name + ".weight": m for m in moe}
    if name in routers:
        moe = routers[name]
        value = base * ROUTER_NOISE
        perm = router_permutation(seed, moe.router_name, moe.num_experts)
        value[torch.arange(moe.num_experts), perm] += ROUTER_READ
        return value
    if leaf == "e_score_correction_bias":
        return base * 0.05
    if leaf == "sinks":
        return base
    if "norm" in name and len(shape) == 1:
        return 1.0 + NORM_JITTER * base
    if "bias" in leaf or len(shape) == 1:
        value = BIAS_STD * base
        if moe and (name.endswith("o_proj.bias") or leaf == "down_proj_bias"):
            value[..., : moe[0].num_experts] *= CODE_NOISE
        return value
    gain = LM_HEAD_GAIN if name.endswith("lm_head.weight") else 1.0
    value = base * (gain / math.sqrt(_fan_in(model, name, shape)))
    if moe:
        _damp_code_outputs(model, name, value, moe[0].num_experts)
    return value


def _damp_code_outputs(model: nn.Module, name: str, value: torch.Tensor, num_codes: int) -> None:
    """Scale down what an output projection writes into the code dimensions (in place)."""
    owner_name, leaf = name.rsplit(".", 1)
    if owner_name.endswith(("o_proj", "down_proj")) and leaf == "weight":
        value[:num_codes] *= CODE_NOISE  # nn.Linear: [out=hidden, in]
    elif leaf == "down_proj" and value.ndim == 3:
        transposed = getattr(model.get_submodule(owner_name), "is_transposed", False)
        if transposed:
            value[:, :, :num_codes] *= CODE_NOISE  # [experts, in, out=hidden]
        else:
            value[:, :num_codes] *= CODE_NOISE  # [experts, out=hidden, in]


# Buffers that carry learned-like state and so get seeded values; others (rotary tables) are computed.
SEEDED_BUFFERS = ("e_score_correction_bias",)


# Parameters are drawn in parallel threads, this many at a time (each value depends on (seed, name)
# only, so neither the thread count nor the order changes a bit): a 1B-parameter model's draws take
# seconds instead of a minute. The window bounds the float32 values alive at once.
DRAW_THREADS = max(1, min(8, os.cpu_count() or 1))


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter (and seeded buffer) of `model` with its value for `seed`, cast."""
    targets = list(model.named_parameters())
    targets += [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in SEEDED_BUFFERS]
    moe = find_moe_layers(model)

    def value_of(target: tuple[str, torch.Tensor]) -> torch.Tensor:
        name, tensor = target
        return reference_value(model, name, tensor.shape, seed, moe)

    with ThreadPoolExecutor(max_workers=DRAW_THREADS) as pool:
        for start in range(0, len(targets), DRAW_THREADS):
            window = targets[start : start + DRAW_THREADS]
            for (_, tensor), value in zip(window, pool.map(value_of, window)):
                tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
