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
- MoE routers and the token codes they read: designed (below).

MoE routers are built to decide clearly, and to make every branch of their routing code matter.
A few hidden dimensions are reserved: one code dimension per expert, and one offset dimension.
Each token's embedding carries a code there (`token_codes`): a few dimensions raised to one of
three tiers, the rest left at the tail, and the offset dimension set to a constant. Each MoE
layer's router reads the code dimensions through its own permutation (so layers route
differently) and the offset dimension as a shift that puts the tail well below zero; the output
projections that write into the language model's residual stream (HF names them `o_proj`,
`down_proj`, Gated DeltaNet's `out_proj`, DeepSeek-V4's `o_b_proj`) write only faintly into the
reserved dimensions, and the language model's norms hold their constant there, so the code survives
the residual stream. In a multimodal MoE model, the projection of each encoder into the language
model (vision merger, DeepStack mergers, audio projection) writes faintly there too, and writes the
code of its placeholder token through its bias, so image, video and audio tokens route as clearly
as text. DeepSeek-V4's hash routers (`tid2eid`, a buffer transformers leaves at zeros) send each
token to `top_k` experts drawn for it (`hashed_experts`); the codes are designed for its scoring
routers only.

Codes are drawn, then each is kept only if every MoE layer's router, run on it at the smallest and
the largest scale an RMSNorm can give it, takes the same experts by a clear margin (`routes.margins`:
a group limit's margin included). Tokens whose code ties two experts of one tier have the tie broken
by the router's bias (gpt-oss) or score-correction bias (DeepSeek-V3), which therefore changes the
chosen experts for them; group limits exclude a better expert for some tokens; and a chosen expert's
biased score can fall below zero, so what the masked groups are filled with matters.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from ..golden.names import encoder_of
from ..numerics.routes import GroupLimit
from .probes import MoeLayer, find_encoders, find_moe_layers, group_limit, selection

# Scales chosen so the toy function is far from trivial (logits well away from uniform) while
# staying well conditioned in bfloat16; see docs/how-it-works.md's tolerance section.
EMBED_STD = 1.0
CODE_NOISE = 0.005  # how much of a projection's output reaches the reserved dimensions
NORM_JITTER = 0.1
BIAS_STD = 0.1
LM_HEAD_GAIN = 2.0
DECAY_RANGE = (0.1, 1.0)  # Gated DeltaNet's per-head decay rate A, drawn uniformly (A_log = log A)
# Output projections into the language model's residual stream, by module name.
OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "o_b_proj")

# Routers. Logits below are at an RMSNorm scale of 1 (a code value reaches a router as value / rms).
ROUTER_READ = 4.0  # router weight on the code dimension of its expert
TIER_LOGITS = (0.5, 2.0, 3.5)  # what a raised code dimension gives its expert's logit
# Every other expert's logit (the offset dimension's shift): far enough below the tiers that a router
# bias cannot lift a tail expert over a raised one at any norm in RMS_RANGE.
TAIL_LOGIT = -10.5
OFFSET_VALUE = 1.0  # the offset dimension's value in every token's embedding
ROUTER_NOISE = 0.02  # logit noise from the rest of the hidden state (per-element std is this / sqrt(hidden))
ROUTER_BIAS_SPREAD = 1.2  # gpt-oss's router bias, in logits: uniform in [-spread, spread]
# DeepSeek-V3's score-correction bias, in sigmoid-score units: mostly negative, so that some chosen
# experts' corrected scores fall below zero (where filling dropped groups with 0 instead of -inf differs).
SCORE_BIAS_MEAN, SCORE_BIAS_STD = -0.25, 0.1
RAISED = (0.2, 0.2, 0.35, 0.25)  # chance a code raises top_k - 1, top_k, top_k + 1, top_k + 2 dimensions
STRAY = 0.3  # under a group limit: chance a code also raises one dimension outside the groups it raises
# Codes are drawn for an RMS of the router's input between these two (the embedding's alone is about 1;
# attention and MLP outputs add to it layer by layer), and kept only with this margin across it.
RMS_RANGE = (0.9, 3.5)
RMS_POINTS = 5  # where in the range a code is tried (log-spaced): a sigmoid router's margin is not monotone in it
DESIGN_MARGIN = 0.6
DESIGN_ROUNDS = 63  # attempts per token at most (1 + 2 + 4 + ... + 32)
DESIGN_BLOCK = 4096  # codes drawn and tried together
CODEBOOK = 4096  # codes drawn at most; a larger vocabulary reuses them


def generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, name) through SHA-256, so names never collide by accident."""
    digest = hashlib.sha256(f"veosnap:{seed}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def draw(seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 values for (seed, name), on the CPU."""
    return torch.randn(shape, generator=generator(seed, name), dtype=torch.float32)


def hashed_experts(seed: int, vocab_size: int, num_experts: int, top_k: int) -> torch.Tensor:
    """[vocab, top_k]: distinct experts per token, for routers that look a token's experts up in a table
    (DeepSeek-V4's `tid2eid`) instead of scoring them."""
    keys = torch.rand((vocab_size, num_experts), generator=generator(seed, "routing.token_codes"))
    return keys.argsort(dim=1)[:, :top_k]


def router_permutation(seed: int, router_name: str, num_experts: int, limit: GroupLimit | None = None) -> torch.Tensor:
    """[num_experts]: the code dimension each expert of one router reads. Under a group limit, experts of
    one group read dimensions of one code group (groups and their members shuffled), so a code that
    raises dimensions of a few code groups raises experts of as few groups in every layer."""
    gen = generator(seed, f"routing.perm.{router_name}")
    if limit is None:
        return torch.rand(num_experts, generator=gen).argsort()
    size = num_experts // limit.groups
    groups = torch.rand(limit.groups, generator=gen).argsort()
    members = torch.rand((limit.groups, size), generator=gen).argsort(dim=1)
    return (groups[:, None] * size + members).reshape(-1)


def reserved(moe: list[MoeLayer]) -> int:
    """How many leading hidden dimensions routing reserves: one code dimension per expert, one offset."""
    return moe[0].num_experts + 1 if moe else 0


@dataclass(frozen=True)
class Plan:
    """What the rules need to know about a model besides a parameter's name and shape."""

    moe: list[MoeLayer] = field(default_factory=list)
    constants: dict[str, float] = field(default_factory=dict)  # 1-D parameter -> transformers' constant init
    projectors: dict[str, int] = field(default_factory=dict)  # encoder projection Linear -> placeholder token id
    # The input embedding's and LM head's weights by parameter name, found by structure (GPT-2's `transformer.wte`)
    embedding: str = ""
    head: str = ""
    _codes: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def codes(self, model: nn.Module, seed: int, vocab_size: int) -> torch.Tensor:
        """`token_codes` of this model, designed once (the embedding and each encoder projection read them)."""
        if (seed, vocab_size) not in self._codes:
            self._codes[seed, vocab_size] = token_codes(model, seed, vocab_size, self.moe)
        return self._codes[seed, vocab_size]


def plan_for(model: nn.Module) -> Plan:
    """The plan of `model`'s weights (see `Plan`)."""
    moe = find_moe_layers(model)
    return Plan(moe=moe, constants=constant_inits(model), projectors=encoder_projectors(model) if moe else {},
                embedding=_weight_name(model, "get_input_embeddings"), head=_weight_name(model, "get_output_embeddings"))


def _weight_name(model: nn.Module, getter: str) -> str:
    """The parameter name of the weight of the module `model.<getter>()` gives ('' when none)."""
    try:
        module = getattr(model, getter, lambda: None)()
    except NotImplementedError:  # transformers' default, for a model that does not say
        return ""
    weight = getattr(module, "weight", None)
    return next((name for name, param in model.named_parameters() if param is weight), "") \
        if isinstance(weight, torch.Tensor) else ""


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def _fan_in(model: nn.Module, name: str, shape: torch.Size) -> int:
    owner = _owner(model, name)
    if isinstance(owner, nn.modules.conv._ConvNd):
        return math.prod(shape[1:])  # [out, in / groups, *kernel]
    if len(shape) == 3 and getattr(owner, "is_transposed", False):
        return int(shape[-2])  # transposed experts store [experts, in, out]
    return int(shape[-1])


def _text_config(model: nn.Module):
    """The language model's config (a multimodal model's `text_config`; a text model's own)."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _hidden_size(model: nn.Module) -> int:
    return int(getattr(_text_config(model), "hidden_size", 0) or 0)


def reference_value(
    model: nn.Module, name: str, shape: torch.Size, seed: int, moe: list[MoeLayer] | None = None,
    plan: Plan | None = None,
) -> torch.Tensor:
    """The float32 value of parameter or buffer `name` for this seed (before any cast)."""
    plan = plan_for(model) if plan is None else plan
    moe = plan.moe if moe is None else moe
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # a hash router's table: each token to experts drawn for it
        return hashed_experts(seed, shape[0], moe[0].num_experts, shape[1]) if moe else torch.zeros(shape, dtype=torch.long)
    base = draw(seed, name, tuple(shape))
    owner = name.rsplit(".", 1)[0]
    if name.endswith("embed_tokens.weight") or name == plan.embedding:
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        # Tied embeddings are the LM head too: give them the head's scale.
        value = base * (LM_HEAD_GAIN / math.sqrt(shape[1]) if tied else EMBED_STD)
        if moe:
            value[:, : reserved(moe)] = plan.codes(model, seed, int(shape[0]))
        return value
    router = next((m for m in moe if m.router is not None and name.startswith(m.router_name + ".")), None)
    if router is not None:  # the router's own parameters and seeded buffers, or those of a module inside it
        return _router_value(router, name[len(router.router_name) + 1:], base, seed)
    if leaf == "A_log":
        low, high = DECAY_RANGE
        return (low + (high - low) * torch.rand(tuple(shape), generator=generator(seed, name))).log()
    if owner in plan.projectors:
        return _projector(name, leaf, shape, base, seed, plan.projectors[owner], moe, model, plan)
    constant = plan.constants.get(name)
    if constant is None and "norm" in name and len(shape) == 1:
        constant = 1.0
    if constant is not None and (constant != 0.0 or "norm" in name):
        value = constant + NORM_JITTER * base
        if moe and "norm" in name and shape[0] == _hidden_size(model) and encoder_of(name) is None:
            # A router reads the reserved dimensions at the scale it was designed for (x * c, or x * (1 + 0)).
            value[: reserved(moe)] = constant
        return value
    if "bias" in leaf or len(shape) == 1:
        value = BIAS_STD * base
        if moe and (name.endswith("o_proj.bias") or leaf == "down_proj_bias") and encoder_of(name) is None:
            value[..., : reserved(moe)] *= CODE_NOISE
        return value
    gain = LM_HEAD_GAIN if name.endswith("lm_head.weight") or name == plan.head else 1.0
    value = base * (gain / math.sqrt(_fan_in(model, name, shape)))
    if moe and encoder_of(name) is None:
        _damp_code_outputs(model, name, value, reserved(moe))
    return value


def _router_value(moe: MoeLayer, inside: str, base: torch.Tensor, seed: int) -> torch.Tensor:
    """A router's scoring weight (reads its code dimensions through a permutation, the offset as a shift, the
    rest faintly), its bias, or its score-correction bias, by path `inside` the router."""
    leaf = inside.rsplit(".", 1)[-1]
    if inside == moe.router_weight:
        experts, hidden = base.shape
        value = base * (ROUTER_NOISE / math.sqrt(hidden))
        perm = router_permutation(seed, moe.router_name, experts, group_limit(moe.router))
        value[torch.arange(experts), perm] += ROUTER_READ
        value[:, experts] = TAIL_LOGIT / OFFSET_VALUE
        return value
    if leaf == "e_score_correction_bias":
        return SCORE_BIAS_MEAN + base * SCORE_BIAS_STD
    if leaf == "bias":  # uniform, so that no expert is shut out by an outlier
        return ROUTER_BIAS_SPREAD * (2 * torch.special.ndtr(base) - 1)
    return base * BIAS_STD


def _damp_code_outputs(model: nn.Module, name: str, value: torch.Tensor, num_codes: int) -> None:
    """Scale down what an output projection writes into the reserved dimensions (in place)."""
    owner_name, leaf = name.rsplit(".", 1)
    if owner_name.endswith(OUTPUT_PROJECTIONS) and leaf == "weight":
        value[:num_codes] *= CODE_NOISE  # nn.Linear: [out=hidden, in]
    elif leaf == "down_proj" and value.ndim == 3:
        transposed = getattr(model.get_submodule(owner_name), "is_transposed", False)
        if transposed:
            value[:, :, :num_codes] *= CODE_NOISE  # [experts, in, out=hidden]
        else:
            value[:, :num_codes] *= CODE_NOISE  # [experts, out=hidden, in]


def _projector(name: str, leaf: str, shape: torch.Size, base: torch.Tensor, seed: int, token: int,
               moe: list[MoeLayer], model: nn.Module, plan: Plan) -> torch.Tensor:
    """An encoder's last Linear into the language model: faint in the reserved dimensions, and writing
    there, through its bias, the code of its placeholder token (as that token's embedding would have)."""
    if leaf == "bias":
        value = BIAS_STD * base
        vocab = model.get_input_embeddings().weight.shape[0]
        value[: reserved(moe)] = plan.codes(model, seed, vocab)[token]
        return value
    value = base / math.sqrt(_fan_in(model, name, shape))
    value[: reserved(moe)] *= CODE_NOISE
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


# --- token codes --------------------------------------------------------------------------------------


def _code_router(model: nn.Module, moe: MoeLayer, seed: int) -> nn.Module:
    """A router of `moe.router`'s own class that reads only the reserved dimensions, holding the values
    `moe.router`'s parameters and seeded buffers have there: its decisions on a code are the real
    router's on a token whose other dimensions are silent."""
    config = copy.copy(_text_config(model))
    config.hidden_size = moe.num_experts + 1
    router = type(moe.router)(config)
    state = {}
    real = {**dict(moe.router.named_parameters()), **dict(moe.router.named_buffers())}
    for inside, tensor in [*router.named_parameters(), *router.named_buffers()]:
        full = _router_value(moe, inside, draw(seed, f"{moe.router_name}.{inside}", tuple(real[inside].shape)), seed)
        state[inside] = full[:, : tensor.shape[1]] if inside == moe.router_weight else full
    router.load_state_dict(state, strict=False)
    return router.float().eval()


def _proposals(seed: int, attempt: int, block: int, tokens: int, experts: int, top_k: int,
               limit: GroupLimit | None) -> torch.Tensor:
    """[tokens, experts] candidate codes for the open tokens of one block: top_k (-1, +0, +1 or +2)
    dimensions raised to a tier, the rest 0. Under a group limit the raised dimensions lie in as many
    code groups as the router keeps, but for one in another group now and then (which that group's
    weaker sum should shut out)."""
    gen = generator(seed, f"routing.codes.{attempt}.{block}")
    count = top_k - 1 + torch.multinomial(torch.tensor(RAISED), tokens, replacement=True, generator=gen)
    keys = torch.rand((tokens, experts), generator=gen)
    if limit is not None:
        # Raise dimensions of `keep` code groups; a stray code raises top_k + 2 there (so the kept groups'
        # sums clearly beat a group with one raised expert) and one more dimension in another group.
        home_groups = torch.rand((tokens, limit.groups), generator=gen).argsort(dim=1)[:, : limit.keep]
        home = torch.zeros(tokens, limit.groups, dtype=torch.bool).scatter_(1, home_groups, True)
        home = home.repeat_interleave(experts // limit.groups, dim=1)
        stray = torch.rand(tokens, generator=gen) < STRAY
        away = (torch.rand((tokens, experts), generator=gen) * ~home).argmax(dim=1, keepdim=True)
        count = torch.where(stray, (top_k + 2) + 1, count)
        keys = keys + home + stray[:, None] * torch.zeros_like(keys).scatter_(1, away, 3.0)
    raised = torch.zeros_like(keys, dtype=torch.bool).scatter_(
        1, keys.argsort(dim=1, descending=True), torch.arange(experts)[None, :] < count[:, None])
    tiers = torch.randint(len(TIER_LOGITS), (tokens, experts), generator=gen)
    levels = (torch.tensor(TIER_LOGITS)[tiers] - TAIL_LOGIT) / ROUTER_READ
    return torch.where(raised, levels, torch.zeros_like(levels))


@torch.no_grad()
def _decides_clearly(routers: list[nn.Module], codes: torch.Tensor) -> torch.Tensor:
    """[codes] the smallest margin over every router and `RMS_RANGE`; -inf where some router's choice
    depends on where in that range the token's norm falls.

    A router that ranks experts by their logits (plus a bias) has margins linear in the scale, so the
    range's two ends bound them; a sigmoid router's are tried at `RMS_POINTS` points across it.
    """
    offset = torch.full((codes.shape[0], 1), OFFSET_VALUE)
    inputs = torch.cat([codes, offset], dim=1)
    low, high = RMS_RANGE
    worst = torch.full((codes.shape[0],), float("inf"))
    for router in routers:
        scales = torch.tensor([low, high])
        while True:
            logits, _, indices = router((inputs[None] / scales[:, None, None]).reshape(-1, inputs.shape[1]))[:3]
            chosen = selection(router, logits)
            if len(scales) == RMS_POINTS or bool((chosen.slope == 1).all()):
                break
            scales = torch.logspace(math.log10(low), math.log10(high), RMS_POINTS)
        margin = chosen.margins(indices).view(len(scales), -1)
        picked = indices.long().sort(dim=1).values.view(len(scales), codes.shape[0], -1)
        steady = (picked == picked[:1]).all(dim=2).all(dim=0)
        worst = torch.minimum(worst, margin.min(dim=0).values.masked_fill(~steady, float("-inf")))
    return worst


def _scores_hidden_states(router: nn.Module) -> bool:
    """Whether `router` decides from the hidden states alone: not from the token ids (as a hash router does),
    nor from anything else its block hands it (AFMoE's expert bias), so a code can be tried on it alone."""
    params = list(inspect.signature(type(router).forward).parameters.values())[2:]  # after self, hidden_states
    return "input_ids" not in inspect.signature(type(router).forward).parameters and all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


@torch.no_grad()
def _returns_choice(router: nn.Module, experts: int) -> bool:
    """Whether `router` returns transformers' `(logits, weights, expert ids)` (Llama 4's returns two tensors)."""
    try:
        output = router(torch.zeros(1, experts + 1))
    except Exception:  # noqa: BLE001 - a router that cannot run on a code alone is not tried on codes
        return False
    return isinstance(output, (tuple, list)) and len(output) >= 3 and isinstance(output[2], torch.Tensor) \
        and not output[2].is_floating_point()


def token_codes(model: nn.Module, seed: int, vocab_size: int, moe: list[MoeLayer]) -> torch.Tensor:
    """[vocab, experts + 1]: each token's values in the reserved dimensions (its code, then the offset).

    A codebook of up to `CODEBOOK` codes is drawn, token t taking code t mod `CODEBOOK` (tokens that
    share a code differ in every other dimension). Per block of the codebook, a code is the first
    drawn that every router decides clearly (see the module docstring), or after `DESIGN_ROUNDS`
    attempts the clearest one drawn; attempts are tried 1, 2, 4, ... at a time for the codes still open.
    """
    # A block that says neither its top-k nor its router's: codes raise about two dimensions, tried on no router.
    experts, top_k = moe[0].num_experts, moe[0].top_k or 2
    limit = group_limit(moe[0].router)
    # Routers that look a token's experts up by its id (DeepSeek-V4's hash layers) have no decision to design for;
    # nor can one that needs more than hidden states, or that returns no (logits, weights, experts), be tried on
    # codes alone (its codes are drawn, not designed).
    routers = [_code_router(model, m, seed) for m in moe if m.router is not None and m.top_k is not None
               and _scores_hidden_states(m.router)]
    routers = [router for router in routers if _returns_choice(router, experts)]
    book = min(vocab_size, CODEBOOK)
    blocks = []
    for block, first in enumerate(range(0, book, DESIGN_BLOCK)):
        tokens = min(DESIGN_BLOCK, book - first)
        best = torch.zeros(tokens, experts)
        best_margin = torch.full((tokens,), float("-inf"))
        start, batch = 0, 1
        while start < DESIGN_ROUNDS:
            open_ = (best_margin < DESIGN_MARGIN).nonzero().flatten()
            if open_.numel() == 0:
                break
            attempts = range(start, min(start + batch, DESIGN_ROUNDS))
            # Drawn for the tokens still open only (which ones are is as deterministic as the draws).
            codes = torch.stack([_proposals(seed, a, block, open_.numel(), experts, top_k, limit) for a in attempts])
            margin = _decides_clearly(routers, codes.reshape(-1, experts)).view(len(attempts), -1)
            # The first attempt that decides clearly, else the clearest (ties to the first).
            score = torch.where(margin >= DESIGN_MARGIN, torch.full_like(margin, float("inf")), margin)
            pick = score.argmax(dim=0)
            picked = margin.gather(0, pick[None]).squeeze(0)
            better = picked > best_margin[open_]
            best[open_[better]] = codes[pick, torch.arange(open_.numel())][better]
            best_margin[open_[better]] = picked[better]
            start, batch = start + len(attempts), batch * 2
        blocks.append(best)
    codes = torch.cat(blocks)[torch.arange(vocab_size) % book]
    return torch.cat([codes, torch.full((vocab_size, 1), OFFSET_VALUE)], dim=1)


# Buffers that carry learned-like state and so get seeded values; others (rotary tables) are computed.
SEEDED_BUFFERS = ("e_score_correction_bias", "tid2eid")


# Parameters are drawn in parallel threads, this many at a time (each value depends on (seed, name)
# only, so neither the thread count nor the order changes a bit): a 1B-parameter model's draws take
# seconds instead of a minute. The window bounds the float32 values alive at once.
DRAW_THREADS = max(1, min(8, os.cpu_count() or 1))


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Overwrite every parameter (and seeded buffer) of `model` with its value for `seed`, cast."""
    targets = list(model.named_parameters())
    targets += [(n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in SEEDED_BUFFERS]
    plan = plan_for(model)

    def value_of(target: tuple[str, torch.Tensor]) -> torch.Tensor:
        name, tensor = target
        return reference_value(model, name, tensor.shape, seed, plan=plan)

    with ThreadPoolExecutor(max_workers=DRAW_THREADS) as pool:
        for start in range(0, len(targets), DRAW_THREADS):
            window = targets[start : start + DRAW_THREADS]
            for (_, tensor), value in zip(window, pool.map(value_of, window)):
                tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
