"""Weights that do not depend on where they are made.

Every parameter's values derive from (seed, parameter name) alone: drawn on the CPU in float32
from a generator seeded by a hash of both, shaped by a rule for its kind, then cast. The same on
every device, under any sharding and in any init order.

The rules, by kind:

- matrices and convolutions: noise scaled by 1/sqrt(fan-in) (a convolution's fan-in is its input
  channels times its kernel: a Conv3d patch embedding of 3 x 2 x 16 x 16 inputs reads 1536 values);
  the LM head (and tied embeddings) at gain 2, untied embeddings at 1;
- 1-D parameters that transformers initializes to a constant c (a norm's weight 1, a bias 0, and the ones
  whose name misleads: Qwen3.5's zero-centred norms, which compute x * (1 + w), start at 0, Qwen2-VL's
  merger norm `ln_q` at 1, Gated DeltaNet's `dt_bias` and DeepSeek-V4's mHC scales at 1): c + 0.1 noise.
  The constants are asked of transformers' own `_init_weights`, module by module;
- Gated DeltaNet's decay rates `A_log`: log U(0.1, 1), so heads keep memories of different lengths;
- attention sinks and score-correction biases: rules of their own (below).

MoE routers are built to decide clearly: each token's embedding carries a code, `top_k` of a few
reserved hidden dimensions set high, and each layer's router reads those dimensions (through its
own permutation, so layers route differently). The output projections that write into the language
model's residual stream (HF names them `o_proj`, `down_proj`, Gated DeltaNet's `out_proj`, DeepSeek-V4's
`o_b_proj`) write only faintly into the reserved dimensions, so the code survives the residual stream;
in a multimodal MoE model, the projection of each encoder into the language model (vision merger,
DeepStack mergers, audio projection) does too, and writes the code of its placeholder token through its
bias, so image, video and audio tokens route as clearly as text. DeepSeek-V4's hash routers (`tid2eid`,
a buffer transformers leaves at zeros) send each token to its code's experts. Every token's chosen
experts then clear the rest by a wide margin, and every expert is used.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..golden.names import encoder_of
from .probes import MoeLayer, find_encoders, find_moe_layers

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
DECAY_RANGE = (0.1, 1.0)  # Gated DeltaNet's per-head decay rate A, drawn uniformly (A_log = log A)
# Output projections into the language model's residual stream, by module name.
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "o_b_proj")


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


@dataclass(frozen=True)
class Plan:
    """What the rules need to know about a model besides a parameter's name and shape."""

    moe: list[MoeLayer] = field(default_factory=list)
    constants: dict[str, float] = field(default_factory=dict)  # 1-D parameter -> transformers' constant init
    projectors: dict[str, int] = field(default_factory=dict)  # encoder projection Linear -> placeholder token id


def plan_for(model: nn.Module) -> Plan:
    """The plan of `model`'s weights (see `Plan`)."""
    moe = find_moe_layers(model)
    return Plan(moe=moe, constants=constant_inits(model), projectors=encoder_projectors(model) if moe else {})


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def _fan_in(model: nn.Module, name: str, shape: torch.Size) -> int:
    owner = _owner(model, name)
    if isinstance(owner, nn.modules.conv._ConvNd):
        return math.prod(shape[1:])  # [out, in / groups, *kernel]
    if len(shape) == 3 and getattr(owner, "is_transposed", False):
        return int(shape[-2])  # transposed experts store [experts, in, out]
    return int(shape[-1])


def reference_value(
    model: nn.Module, name: str, shape: torch.Size, seed: int, moe: list[MoeLayer] | None = None,
    plan: Plan | None = None,
) -> torch.Tensor:
    """The float32 value of parameter or buffer `name` for this seed (before any cast)."""
    plan = plan_for(model) if plan is None else plan
    moe = plan.moe if moe is None else moe
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # a hash router's table: each token to its code's experts
        return token_codes(seed, shape[0], moe[0].num_experts, shape[1]) if moe else torch.zeros(shape, dtype=torch.long)
    base = draw(seed, name, tuple(shape))
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
    if leaf == "A_log":
        low, high = DECAY_RANGE
        return (low + (high - low) * torch.rand(tuple(shape), generator=generator(seed, name))).log()
    owner_name = name.rsplit(".", 1)[0]
    if owner_name in plan.projectors:
        return _projector(name, leaf, shape, base, seed, plan.projectors[owner_name], moe[0], model)
    constant = plan.constants.get(name)
    if constant is not None and constant != 0.0:
        return constant + NORM_JITTER * base
    if constant is None and "norm" in name and len(shape) == 1:
        return 1.0 + NORM_JITTER * base
    if "bias" in leaf or len(shape) == 1:
        value = BIAS_STD * base
        if moe and (name.endswith("o_proj.bias") or leaf == "down_proj_bias") and encoder_of(name) is None:
            value[..., : moe[0].num_experts] *= CODE_NOISE
        return value
    gain = LM_HEAD_GAIN if name.endswith("lm_head.weight") else 1.0
    value = base * (gain / math.sqrt(_fan_in(model, name, shape)))
    if moe and encoder_of(name) is None:
        _damp_code_outputs(model, name, value, moe[0].num_experts)
    return value


def _damp_code_outputs(model: nn.Module, name: str, value: torch.Tensor, num_codes: int) -> None:
    """Scale down what an output projection writes into the code dimensions (in place)."""
    owner_name, leaf = name.rsplit(".", 1)
    if owner_name.endswith(OUTPUT_PROJECTIONS) and leaf == "weight":
        value[:num_codes] *= CODE_NOISE  # nn.Linear: [out=hidden, in]
    elif leaf == "down_proj" and value.ndim == 3:
        transposed = getattr(model.get_submodule(owner_name), "is_transposed", False)
        if transposed:
            value[:, :, :num_codes] *= CODE_NOISE  # [experts, in, out=hidden]
        else:
            value[:, :num_codes] *= CODE_NOISE  # [experts, out=hidden, in]


def _projector(name: str, leaf: str, shape: torch.Size, base: torch.Tensor, seed: int, token: int, moe: MoeLayer,
               model: nn.Module) -> torch.Tensor:
    """An encoder's last Linear into the language model: damped in the code dimensions, and writing the code
    of its placeholder token through its bias (as that token's embedding would have carried it)."""
    num_codes = moe.num_experts
    if leaf == "bias":
        value = BIAS_STD * base
        value[:num_codes] = 0.0
        vocab = model.get_input_embeddings().weight.shape[0]
        code = token_codes(seed, vocab, num_codes, moe.top_k)[token]
        value[code] = CODE_STRENGTH
        return value
    value = base / math.sqrt(_fan_in(model, name, shape))
    value[:num_codes] *= CODE_NOISE
    return value


def encoder_projections(model: nn.Module) -> list[tuple[str, str]]:
    """(module path, encoder kind) of the last Linear of each module that writes an encoder's features into
    the language model: the projection (vision merger, audio projection) and each DeepStack merger."""
    paths = {id(m): n for n, m in model.named_modules()}
    found = []
    for encoder in find_encoders(model):
        writers = [encoder.projection] if encoder.projection is not None else []
        writers += list(encoder.deepstack) if encoder.deepstack is not None else []
        for writer in writers:
            linears = [m for m in writer.modules() if isinstance(m, nn.Linear)]
            if linears:
                found.append((paths[id(linears[-1])], encoder.kind))
    return found


def encoder_projectors(model: nn.Module) -> dict[str, int]:
    """Each encoder projection's last Linear, with the placeholder token whose code it writes (image tokens
    for vision, audio tokens for audio); none when the model has no such token id."""
    config = getattr(model, "config", None)
    tokens = {}
    for kind, names in (("vision", ("image_token_id", "image_token_index")),
                        ("audio", ("audio_token_id", "audio_token_index"))):
        token = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if token is not None:
            tokens[kind] = token
    return {path: tokens[kind] for path, kind in encoder_projections(model) if kind in tokens}


_PLAIN = (nn.Linear, nn.Embedding, nn.modules.conv._ConvNd)  # transformers initializes their biases to 0


@torch.no_grad()
def constant_inits(model: nn.Module) -> dict[str, float]:
    """Each 1-D parameter transformers initializes to a constant, and that constant, by parameter name.

    Asked of transformers itself: each module holding 1-D parameters is initialized by the `_init_weights`
    of the pretrained model it belongs to (its nearest `PreTrainedModel` ancestor), its values read, and
    restored. Linear, embedding and convolution biases are left out (always 0, the default rule)."""
    from transformers import PreTrainedModel

    owners = {path: module for path, module in model.named_modules() if isinstance(module, PreTrainedModel)}
    found: dict[str, float] = {}
    with torch.random.fork_rng(devices=[]):  # some inits draw random values: leave the global RNG as it was
        for path, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.ndim == 1]
            if not own or isinstance(module, _PLAIN):
                continue
            owner_path = max((o for o in owners if o == "" or path == o or path.startswith(o + ".")), key=len)
            direct = list(module.named_parameters(recurse=False))
            saved = [(p, p.detach().clone(), getattr(p, "_is_hf_initialized", None)) for _, p in direct]
            for _, p in direct:
                if hasattr(p, "_is_hf_initialized"):
                    del p._is_hf_initialized
            try:
                owners[owner_path]._init_weights(module)
                for name, p in own:
                    values = p.detach().float()
                    if values.numel() and bool((values == values.flatten()[0]).all()):
                        found[f"{path}.{name}" if path else name] = float(values.flatten()[0])
            finally:
                for p, value, flag in saved:
                    p.copy_(value)
                    if flag is not None:
                        p._is_hf_initialized = flag
    return found


# Buffers that carry learned-like state and so get seeded values; others (rotary tables) are computed.
SEEDED_BUFFERS = ("e_score_correction_bias", "tid2eid")


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter (and seeded buffer) of `model` with its value for `seed`, cast."""
    targets = list(model.named_parameters())
    targets += [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in SEEDED_BUFFERS]
    plan = plan_for(model)
    for name, tensor in targets:
        value = reference_value(model, name, tensor.shape, seed, plan=plan)
        tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
