"""Hooks on a model: its decoder layers' outputs, its encoders' outputs, its logits, and its MoE routers'
decisions.

Uniform hook points only, no per-model code. The decoder layers are those of the language model
transformers names with `get_decoder()` (a vision-language model's `model.language_model.layers`, a
causal LM's `model.layers`). An encoder is a submodule under one of transformers' encoder attribute names
(`golden.names.ENCODER_ATTRIBUTES`: `visual`, `audio_tower`, ...) holding a list of blocks; its projection
into the language model is its `merger` (vision) or last `proj*` Linear (audio), its DeepStack mergers any
other module list named `*merger*`.

Every MoE block of transformers 5 (and of frameworks built on it, VeOmni's among them) calls an experts
module (3-D expert weights) with `(hidden_states, top_k_index, top_k_weights)`, whatever its router
returns (transformers' routers return `(logits, weights, indices)`; DeepSeek-V3's in transformers
5.9-5.12 and VeOmni's return the logits alone and leave the choice to the block). So routes are read
from the experts' inputs (a forward pre-hook) and replayed (forced onto given experts) there too; the
router's logits, read at its output where it has a `[tokens, experts]` one, give the margins and the
replayed weights (a router with a score function of its own, DeepSeek-V4's, is ranked by it; one that
picks experts from a table by token id, DeepSeek-V4's hash layers, has no margin to lose). Expert ids
are sorted per token before storing or comparing. A block whose routes cannot be read is said to be,
with the reason, never taken for one that routed every token elsewhere.

A router whose output holds no `[tokens, experts]` logits (JetMoE's returns sorted token indices, gates
and expert sizes) cannot be recorded (a golden needs margins): `unread_routers` names it and what it
returns, so the golden can say why it holds no routes for it (an `Absence` of kind `router_unread`;
`found_unread` finds the routers that are not beside an experts module without running the model).
"""

from __future__ import annotations

import re
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from ..golden import names
from ..errors import VeosnapError
from ..golden.names import ENCODER_ATTRIBUTES
from ..numerics.routes import GroupLimit, margins


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: sharded values are gathered); other tensors as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    if not callable(full_tensor):
        return tensor
    strided = _gather_strided(tensor)
    return strided if strided is not None else full_tensor()


def _gather_strided(tensor: torch.Tensor) -> torch.Tensor | None:
    """The full value of a DTensor placed `_StridedShard(d, split_factor=s)` on a 1-D mesh, gathered here.

    transformers' tensor-parallel plan places fused gate/up expert weights so (one chunk of each of the
    s halves along d per rank). torch 2.11's `full_tensor()` cannot redistribute that placement ("use_strided_
    shard_as_shard_order is True, but placements ... unable to be interpreted into a corresponding
    shard_order"; torch fell back to a greedy plan from 2.12), so every MoE model's `tp` gradient gather
    failed on torch 2.11. None when the placement is another (or uneven): then torch gathers.
    """
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return None
    placements = getattr(tensor, "placements", ())
    if len(placements) != 1 or not isinstance(placements[0], _StridedShard):
        return None
    import torch.distributed as dist

    placement, mesh = placements[0], tensor.device_mesh
    world, local = mesh.size(), tensor.to_local().contiguous()
    dim, split = placement.dim % tensor.ndim, placement.split_factor
    if tensor.shape[dim] % (split * world) or local.shape[dim] * world != tensor.shape[dim]:
        return None
    pieces = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(pieces, local, group=mesh.get_group())
    chunks = [piece.chunk(split, dim=dim) for piece in pieces]  # chunks[rank][s]: that rank's chunk of part s
    return torch.cat([chunks[rank][s] for s in range(split) for rank in range(world)], dim=dim)


# --- decoder layers and logits -----------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's stack of decoder layers (see `decoder_stack`)."""
    return decoder_stack(model)[1]


def decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The language model's stack of decoder layers, with its module path in `model`: found by structure,
    not by name. It is the module list holding most of the parameters of the decoder transformers names
    (`get_decoder()`: a vision-language model's language model, a causal LM's base model), outside any
    encoder: `model.layers` (Llama), `transformer.h` (GPT-2), `bert.encoder.layer` (BERT as a decoder),
    `backbone.layers` (Mamba), `model.decoder.layers` (BART's decoder). A layer's own lists (experts, heads)
    hold fewer parameters than the list holding the layer. A model without one is refused in one line.

    Found once per model: a check asks for it some six times (its limits, its coverage, each pass's hooks), each
    search a walk over every module and parameter (0.4 ms at 12 layers on the CPU). It is searched again if the list
    found is no longer at its path in `model`, or has changed length (a candidate that rebuilt the stack)."""
    with _STACKS_LOCK:
        known = _STACKS.get(model)
    if known is not None:
        path, held, length = known
        stack = held()
        try:
            if stack is not None and model.get_submodule(path) is stack and len(stack) == length:
                return path, stack
        except AttributeError:
            pass
    found = _decoder_stack(model)
    with _STACKS_LOCK:
        _STACKS[model] = (found[0], weakref.ref(found[1]), len(found[1]))
    return found


# decoder_stack's answers, by model (a check's prebuild thread vets the model its main thread then runs). The list
# is held weakly too: a hook on a layer that refers to the model would otherwise keep the model alive forever.
_STACKS: weakref.WeakKeyDictionary[nn.Module, tuple[str, weakref.ref, int]] = weakref.WeakKeyDictionary()
_STACKS_LOCK = threading.Lock()


def _decoder_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    root = model
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        try:
            found = get_decoder()
        except Exception:  # noqa: BLE001 - transformers' lookup raises for a few models: then the whole model
            found = None
        root = found if isinstance(found, nn.Module) else model
    # transformers' lookup goes by attribute name: ModernBERT-decoder's `decoder` is its LM head's Linear. Where it
    # found no layer list, the whole model is searched.
    best = _largest_list(model, root) or _largest_list(model, model)
    if best is None:
        raise VeosnapError(f"{type(model).__name__} has no list of decoder layers (a module list in its decoder), "
                           "so veosnap cannot hook each layer's output")
    return best


def _largest_list(model: nn.Module, root: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(path in `model`, list) of the module list under `root`, outside any encoder, holding most parameters."""
    paths = {id(module): path for path, module in model.named_modules()}
    best: tuple[int, str, nn.ModuleList] | None = None
    for module in root.modules():
        path = paths.get(id(module))
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or path is None \
                or names.encoder_of(path) is not None:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, path, module)
    return None if best is None else best[1:]


def layer_index(model: nn.Module) -> Callable[[str], int | None]:
    """The decoder layer (by index in `decoder_stack`) a module path of `model` is inside, or None."""
    stack, _ = decoder_stack(model)
    inside = re.compile(rf"{re.escape(stack)}\.(\d+)(?:\.|$)" if stack else r"(\d+)(?:\.|$)")

    def index(path: str) -> int | None:
        match = inside.match(path)
        return int(match.group(1)) if match else None

    return index


# --- encoders ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoder:
    """One encoder of a multimodal model (a vision tower, an audio tower) and its hook points."""

    kind: str  # "vision" or "audio"
    path: str  # module path (`model.visual`)
    module: nn.Module
    blocks: nn.ModuleList
    projection: nn.Module | None  # writes the encoder's features into the language model's stream
    projection_part: str  # how its output is named: "merger" (vision) or "proj" (audio)
    deepstack: nn.ModuleList | None  # mergers of intermediate blocks' features (Qwen3-VL's DeepStack)


_BLOCK_LISTS = ("blocks", "layers")


def find_encoders(model: nn.Module) -> list[Encoder]:
    """Every encoder of `model`, in `names.ENCODERS` order (none for a text model)."""
    found = {}
    for path, module in model.named_modules():
        kind = ENCODER_ATTRIBUTES.get(path.rsplit(".", 1)[-1])
        if kind is None or kind in found:
            continue
        blocks = next((b for b in (getattr(module, n, None) for n in _BLOCK_LISTS) if isinstance(b, nn.ModuleList)),
                      None)
        if blocks is None:
            continue
        if kind == "vision":
            projection, part = getattr(module, "merger", None), "merger"
        else:  # the last `proj*` Linear of the tower (`proj`, or `proj2` after `proj1`)
            linears = [child for name, child in module.named_children()
                       if name.startswith("proj") and isinstance(child, nn.Linear)]
            projection, part = (linears[-1] if linears else None), "proj"
        deepstack = next((child for name, child in module.named_children()
                          if "merger" in name and isinstance(child, nn.ModuleList)), None)
        found[kind] = Encoder(kind, path, module, blocks, projection if isinstance(projection, nn.Module) else None,
                              part, deepstack)
    return [found[kind] for kind in names.ENCODERS if kind in found]


def encoder_hook_points(model: nn.Module) -> list[tuple[names.EncoderOutput, nn.Module]]:
    """Each encoder tensor a golden holds, with the module whose output it is, in forward order."""
    points = []
    for encoder in find_encoders(model):
        points += [(names.EncoderOutput(encoder.kind, str(i)), block) for i, block in enumerate(encoder.blocks)]
        if encoder.deepstack is not None:
            points += [(names.EncoderOutput(encoder.kind, f"deepstack.{i}"), merger)
                       for i, merger in enumerate(encoder.deepstack)]
        if encoder.projection is not None:
            points.append((names.EncoderOutput(encoder.kind, encoder.projection_part), encoder.projection))
    return points


@contextmanager
def record_encoder_outputs(model: nn.Module) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Within the block, each encoder hook point's outputs are recorded by golden name, one entry per call
    (a tower runs once for a batch's images and once more for its videos)."""
    outputs: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in encoder_hook_points(model):

        def hook(_module: nn.Module, _inputs: tuple, output: object, name: str = str(name)) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            hidden = getattr(hidden, "last_hidden_state", hidden)
            outputs.setdefault(name, []).append(host_copy(full(hidden)))

        handles.append(module.register_forward_hook(hook))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy on the host, made now: a kernel may reuse the buffer in place later (on the CPU `.cpu()`
    would be no copy)."""
    return tensor.detach().to("cpu", copy=True)


def host_copy_async(tensor: torch.Tensor) -> torch.Tensor:
    """`host_copy` without waiting for it: from a GPU, a copy queued on the current stream into pinned
    memory, so the host does not stop the device mid-step. Its values are there once that stream is
    synchronized: the caller's next blocking copy from the same stream (a step's loss) or `host_sync`."""
    if not tensor.is_cuda:
        return host_copy(tensor)
    return tensor.detach().to("cpu", copy=True, non_blocking=True)


def host_sync(device: torch.device | str) -> None:
    """Wait for the copies `host_copy_async` queued on `device`'s current stream."""
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


# What a hook keeps of a tensor it sees, given the tensor's golden name: a host copy by default; capture
# passes its reducer's (a sketch made on the tensor's device for a sketched tensor).
Keep = Callable[[str, torch.Tensor], object]


def _host_copy(_name: str, tensor: torch.Tensor) -> torch.Tensor:
    return host_copy(tensor)


def layer_hidden(output: object) -> object:
    """The hidden states in what a decoder layer returned: itself, the first item of a tuple, or the first
    field of a transformers output (a layer that returns a `ModelOutput`)."""
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    to_tuple = getattr(output, "to_tuple", None)
    if callable(to_tuple) and to_tuple():
        return to_tuple()[0]
    return output


@contextmanager
def record_layer_outputs(model: nn.Module, keep: Keep = _host_copy) -> Iterator[dict[int, object]]:
    """Within the block, each decoder layer's output hidden states are recorded by index (what `keep`
    keeps of them, at once, before a later kernel can reuse the buffer)."""
    outputs: dict[int, object] = {}
    handles = []
    for index, layer in enumerate(decoder_layers(model)):

        def hook(_module: nn.Module, _inputs: tuple, output: object, index: int = index) -> None:
            outputs[index] = keep(f"layers.{index}.output", layer_hidden(output))

        handles.append(layer.register_forward_hook(hook))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def record_logits(model: nn.Module, keep: Keep = _host_copy) -> Iterator[dict[str, object]]:
    """The logits as the LM head produced them, kept (`keep`) at once.

    Fused cross-entropy kernels (liger's) write the gradient into the logits' own buffer inside the
    model's forward, so by the time the forward returns `output.logits` holds something else.
    """
    produced: dict[str, object] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield produced
        return

    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        produced["logits"] = keep("logits", full(output.detach()))

    handle = head.register_forward_hook(hook)
    try:
        yield produced
    finally:
        handle.remove()


# --- MoE blocks: routes from the experts' inputs -------------------------------------------------------


@dataclass(frozen=True)
class MoeLayer:
    """One MoE block of a model: its decoder layer index, its experts module, and its router (if found)."""

    layer: int
    router_name: str  # '' when no router was found
    router: nn.Module | None  # the child whose [experts, hidden] weight scores the experts
    num_experts: int
    top_k: int | None  # from the router or its block; None when neither says (read from the routes)
    block: nn.Module
    experts: nn.Module
    router_weight: str = "weight"  # the router's parameter (its path inside the router) that scores the experts

    def attr(self, name: str, default: object = None) -> object:
        """A routing setting (`norm_topk_prob`, `routed_scaling_factor`, ...) from the router, else its block."""
        for owner in (self.router, self.block):
            if owner is not None and hasattr(owner, name):
                return getattr(owner, name)
        return default


def _expert_counts(experts: nn.Module) -> set[int]:
    """How many experts an experts module holds: its 3-D weights' first dimension (global, under DTensor)
    and its `num_experts` (local under transformers' expert parallel); empty when it is no experts module."""
    counts = {int(p.shape[0]) for p in experts.parameters(recurse=False) if p.ndim == 3}
    if counts and isinstance(getattr(experts, "num_experts", None), int):
        counts.add(experts.num_experts)
    return counts


def scoring_weight(router: nn.Module, counts: set[int], nested: bool = False) -> tuple[str, int] | None:
    """(name in `router`, rows) of the 2-D weight that scores the experts, a row per expert: the router's own
    `weight` (a Linear router), or with `nested` that of a module inside it (AFMoE's `router.gate`); None
    when it has none."""
    for name, param in router.named_parameters(recurse=nested):
        if name.rsplit(".", 1)[-1] == "weight" and param.ndim == 2 and int(param.shape[0]) in counts \
                and (nested or name == "weight"):
            return name, int(param.shape[0])
    return None


def find_moe_layers(model: nn.Module) -> list[MoeLayer]:
    """Every MoE block in `model`, found by shape: an `experts` child with 3-D expert weights; its router
    is the other child holding a 2-D `weight` with a row per expert (`scoring_weight`)."""
    found = []
    layer_of = layer_index(model)
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module):
            continue
        counts = _expert_counts(experts)
        if not counts:
            continue
        router_name, router, rows, router_weight = "", None, 0, "weight"
        # A child's own weight first (a Linear router), then one inside a child (AFMoE's `router.gate`).
        siblings = [(n, c) for n, c in module.named_children() if c is not experts]
        for child_name, child, nested in [(n, c, False) for n, c in siblings] + [(n, c, True) for n, c in siblings]:
            weight = scoring_weight(child, counts, nested)
            if weight is not None:
                router_name, router = (f"{name}.{child_name}" if name else child_name), child
                router_weight, rows = weight
                break
        top_k = getattr(router, "top_k", None) if router is not None else None
        top_k = getattr(module, "top_k", None) if top_k is None else top_k
        layer = layer_of(name)
        found.append(MoeLayer(
            layer=len(found) if layer is None else layer,
            router_name=router_name,
            router=router,
            num_experts=rows if router is not None else max(counts),
            top_k=None if top_k is None else int(top_k),
            block=module,
            experts=experts,
            router_weight=router_weight,
        ))
    return sorted(found, key=lambda m: m.layer)


ROUTER_NAMES = ("router", "gate", "gating")
_ROUTER_CLASS_RE = re.compile(r"Router|Gating|TopKGate")
READ_FORM = "their logits over the experts (alone or first) to blocks that call their experts with " \
            "(hidden_states, top_k_index, top_k_weights)"


def looks_like_router(name: str, module: nn.Module) -> bool:
    """A module that picks `top_k` experts: named like a router, or of a router-like class."""
    return isinstance(getattr(module, "top_k", None), int) and (
        name.rsplit(".", 1)[-1] in ROUTER_NAMES or bool(_ROUTER_CLASS_RE.search(type(module).__name__)))


def describe(output: object) -> str:
    """What a module returned, for a message: `(int64 [172], float32 [86, 8], list)`."""
    if isinstance(output, torch.Tensor):
        return f"{str(output.dtype).removeprefix('torch.')} {list(output.shape)}"
    if isinstance(output, (tuple, list)):
        return "(" + ", ".join(describe(item) if isinstance(item, torch.Tensor) else type(item).__name__
                               for item in output) + ")"
    return type(output).__name__


def found_unread(model: nn.Module) -> dict[str, str]:
    """The routers veosnap will not read, found from the modules alone (the meta device will do), by
    module path: why. Modules that look like routers (`looks_like_router`) but do not sit where
    `find_moe_layers` looks, and MoE blocks (a module with `experts`) in which veosnap finds no router."""
    read = {moe.router_name for moe in find_moe_layers(model) if moe.router is not None}
    modules = dict(model.named_modules())
    unread = {name: "not beside an experts module, where veosnap reads routers" for name, module in modules.items()
              if name not in read and looks_like_router(name, module)}
    routers = (*read, *unread)
    for name, module in modules.items():
        experts = isinstance(getattr(module, "experts", None), nn.Module)
        if experts and not any(router.startswith(f"{name}.") for router in routers):
            unread[name] = "no router with top_k and weight beside its experts"
    return dict(sorted(unread.items()))


@contextmanager
def unread_routers(model: nn.Module) -> Iterator[dict[str, str]]:
    """Within the block, the routers whose routes are not read, by module path: what each returns.

    Those are the ones `found_unread` finds (one that does not run keeps its reason from there), and
    routers found by shape whose output holds no `[tokens, experts]` logits (no margins to record).
    """
    read = {moe.router_name: moe for moe in find_moe_layers(model) if moe.router is not None}
    unread = found_unread(model)
    said: set[str] = set()
    handles = []
    for name, module in model.named_modules():
        if name not in read and name not in unread:
            continue

        def hook(module: nn.Module, _inputs: tuple, output: object, name: str = name) -> None:
            if name not in said and (name not in read or router_logits(output, read[name].num_experts) is None):
                said.add(name)
                unread[name] = f"{type(module).__name__} returns {describe(output)}"

        handles.append(module.register_forward_hook(hook))
    try:
        yield unread
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class Selection:
    """What a router ranks experts by: scores (float32), their slope against the logits, and its group
    limit (None when every expert competes)."""

    scores: torch.Tensor
    slope: torch.Tensor
    group_limit: GroupLimit | None = None

    def margins(self, chosen: torch.Tensor) -> torch.Tensor:
        """Per token, in logit units: how far the choice `chosen` is from changing (see `routes.margins`)."""
        return margins(self.scores, chosen, self.slope, self.group_limit)


def selection(router: nn.Module | MoeLayer, logits: torch.Tensor) -> Selection:
    """How `router` ranks experts, read from its attributes (the logits it returned, flattened).

    Softmax and plain top-k routers rank by logits (softmax is monotone; slope 1; a router bias is
    already in its logits); a router with its own score function (DeepSeek-V4's `score_fn`,
    sqrt-softplus) ranks by it, plus its score-correction bias (slope by autograd); sigmoid routers
    with a score-correction bias (DeepSeek-V3) rank by sigmoid(logits) + bias, within their kept
    groups when `n_group`/`topk_group` limit them.
    """
    logits = logits.detach().float()
    get = router.attr if isinstance(router, MoeLayer) else lambda name, default=None: getattr(router, name, default)
    bias = get("e_score_correction_bias")
    offset = bias.detach().float().to(logits.device) if isinstance(bias, torch.Tensor) else 0.0
    score_fn = get("score_fn")
    if callable(score_fn):
        with torch.enable_grad():
            x = logits.clone().requires_grad_(True)
            scores = score_fn(x)
            (slope,) = torch.autograd.grad(scores.sum(), x)
        return Selection(scores.detach() + offset, slope, group_limit(router))
    if not isinstance(bias, torch.Tensor):
        return Selection(logits, torch.ones_like(logits))
    sig = logits.sigmoid()
    return Selection(sig + offset, sig * (1 - sig), group_limit(router))


def group_limit(router: nn.Module | MoeLayer) -> GroupLimit | None:
    """The router's group limit (`num_group` or `n_group` groups, `topk_group` kept), None without one."""
    get = router.attr if isinstance(router, MoeLayer) else lambda name, default=None: getattr(router, name, default)
    groups = int(get("num_group", get("n_group", 1)) or 1)
    keep = int(get("topk_group", groups) or groups)
    return GroupLimit(groups, keep) if 1 < groups and keep < groups else None


# A router that picks its experts from a table by token id (DeepSeek-V4's hash layers, `tid2eid`) makes no
# decision that a small numerical difference could flip: its margin is the largest float32.
NO_TIE_MARGIN = float(torch.finfo(torch.float32).max)


def is_table_router(router: nn.Module) -> bool:
    """Whether `router` picks experts by token id from a table (`tid2eid`) rather than by score."""
    return isinstance(getattr(router, "tid2eid", None), torch.Tensor)


@dataclass
class RouteRecord:
    """What one MoE layer's router decided for every token it saw (flattened batch x seq)."""

    layer: int
    experts: torch.Tensor  # [tokens, k] int64, sorted ascending per token
    weights: torch.Tensor  # [tokens, k] routing weights in the order of `experts`
    margin: torch.Tensor  # [tokens] float32, logit units: lowest chosen vs best unchosen expert (see `margins`);
    # NaN where the router's logits could not be read


class Routes(dict):
    """The routes recorded by layer (`RouteRecord`s), and the MoE layers that could not be read, with why."""

    def __init__(self) -> None:
        super().__init__()
        self.unreadable: dict[int, str] = {}  # layer -> why its routes could not be read
        self.no_margin: dict[int, str] = {}  # layer -> why its margins are unknown (routes read)


def sort_route(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort expert ids ascending per token and carry the weights along."""
    experts, order = indices.long().sort(dim=-1)
    return experts, weights.gather(-1, order)


def router_logits(output: object, num_experts: int) -> torch.Tensor | None:
    """The `[tokens, experts]` logits in a router's output (a tensor, or a tuple's first item), else None."""
    first = output[0] if isinstance(output, (tuple, list)) and output else output
    if isinstance(first, torch.Tensor) and first.ndim >= 2 and first.shape[-1] == num_experts:
        return first
    return None


_INDEX_NAMES = ("top_k_index", "router_indices", "selected_experts", "topk_indices")
_WEIGHT_NAMES = ("top_k_weights", "routing_weights", "router_scores", "topk_weights")


def experts_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(top_k_index, top_k_weights) from an experts call `(hidden_states, top_k_index, top_k_weights)`,
    positional or by name; else why they cannot be read."""
    index = args[1] if len(args) > 1 else next((kwargs[n] for n in _INDEX_NAMES if n in kwargs), None)
    weights = args[2] if len(args) > 2 else next((kwargs[n] for n in _WEIGHT_NAMES if n in kwargs), None)
    if not isinstance(index, torch.Tensor) or not isinstance(weights, torch.Tensor):
        return "its experts were not called with (hidden_states, top_k_index, top_k_weights)"
    if index.is_floating_point() or index.shape != weights.shape or index.ndim != 2:
        return (f"its experts were called with expert ids {tuple(index.shape)} {index.dtype} and weights "
                f"{tuple(weights.shape)}, not [tokens, k] ids and weights")
    return index, weights


def keep_route(records: Routes, moe: MoeLayer, args: tuple, kwargs: dict, logits: list) -> None:
    """What `record_routes` keeps when an MoE block's experts are called: the routes (experts, weights, the
    router's margins from `logits[0]`, its output this step) into `records`, or why they cannot be read."""
    found = experts_inputs(args, kwargs)
    if isinstance(found, str):
        records.unreadable[moe.layer] = found
        return
    indices, weights = found
    experts, sorted_weights = sort_route(indices.detach(), weights.detach())
    chosen = indices.reshape(-1, indices.shape[-1])
    scored, logits[0] = logits[0], None
    if (moe.router is not None and is_table_router(moe.router)) or chosen.shape[-1] >= moe.num_experts:
        # A table router, or one that takes every expert (top-k = experts): no choice a difference could flip.
        margin = torch.full((chosen.shape[0],), NO_TIE_MARGIN)
    elif scored is not None and scored.reshape(-1, scored.shape[-1]).shape[0] == chosen.shape[0]:
        margin = host_copy_async(selection(moe, scored.reshape(-1, scored.shape[-1])).margins(chosen))
    else:
        why = "no router found" if moe.router is None else \
            f"{moe.router_name} returned no [tokens, {moe.num_experts}] logits"
        records.no_margin[moe.layer] = f"margins unknown: {why}"
        margin = torch.full((chosen.shape[0],), float("nan"))
    # Queued copies, no sync in the middle of the step: the step's loss (`capture.forward_backward`
    # copies it to the host, blocking, on the same stream) is read after them.
    records[moe.layer] = RouteRecord(
        layer=moe.layer,
        experts=host_copy_async(experts.reshape(-1, experts.shape[-1])),
        weights=host_copy_async(sorted_weights.reshape(-1, experts.shape[-1])),
        margin=margin,
    )


@contextmanager
def record_routes(model: nn.Module) -> Iterator[Routes]:
    """Within the block, every MoE block's routes (the experts' inputs) are recorded by layer index;
    after it, `unreadable` says which blocks' routes could not be read and why. On a GPU the host copies
    are queued (`host_copy_async`): read them after a blocking copy from the device, or `host_sync`."""
    records = Routes()
    handles = []
    seen: set[int] = set()
    layers = find_moe_layers(model)
    for moe in layers:
        logits: list[torch.Tensor | None] = [None]

        def keep_logits(_module: nn.Module, _inputs: tuple, output: object, moe: MoeLayer = moe,
                        logits: list = logits) -> None:
            logits[0] = router_logits(output, moe.num_experts)

        def read(_module: nn.Module, args: tuple, kwargs: dict, moe: MoeLayer = moe, logits: list = logits) -> None:
            seen.add(moe.layer)
            keep_route(records, moe, args, kwargs, logits)

        if moe.router is not None:
            handles.append(moe.router.register_forward_hook(keep_logits))
        handles.append(moe.experts.register_forward_pre_hook(read, with_kwargs=True))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()
        for moe in layers:
            if moe.layer not in seen:
                records.unreadable[moe.layer] = ("its experts module was not called with the routes (a fused MoE "
                                                 "path that bypasses it?)")


def reweigh(router: nn.Module | MoeLayer, logits: torch.Tensor, indices: torch.Tensor,
            like: torch.Tensor) -> torch.Tensor:
    """The routing weights a router would give experts `indices`, from its own logits.

    Four router families cover the zoo: a score function of its own (DeepSeek-V4's sqrt-softplus, hash
    routers included: gather, normalize, scale), sigmoid with score-correction bias (DeepSeek-V3: the
    same with sigmoid), softmax over the chosen logits (GPT-OSS, whose router has a bias), and softmax
    over all experts then gather (Qwen-MoE, Mixtral; renormalized when `norm_topk_prob`). Settings are
    read from the router, else its block (VeOmni keeps `norm_topk_prob` and the scaling on the block).
    """
    attr = router.attr if isinstance(router, MoeLayer) else (lambda name, default=None: getattr(router, name, default))
    router_module = router.router if isinstance(router, MoeLayer) else router
    logits = logits.reshape(-1, logits.shape[-1])
    idx = indices.long()
    score_fn = attr("score_fn")
    if callable(score_fn):
        w = score_fn(logits).gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * attr("routed_scaling_factor", 1.0)
    elif isinstance(attr("e_score_correction_bias"), torch.Tensor):
        w = logits.float().sigmoid().gather(1, idx)
        if attr("norm_topk_prob", True):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * attr("routed_scaling_factor", 1.0)
    elif isinstance(getattr(router_module, "bias", None), torch.Tensor):
        w = torch.softmax(logits.gather(1, idx), dim=1, dtype=logits.dtype)
    else:
        w = torch.softmax(logits.float(), dim=-1).gather(1, idx)
        if attr("norm_topk_prob", True):
            w = w / w.sum(dim=-1, keepdim=True)
    return w.to(like.dtype)


@contextmanager
def replay_routes(model: nn.Module, experts_by_layer: dict[int, torch.Tensor]) -> Iterator[dict[int, str]]:
    """Within the block, each MoE block's experts get the given expert ids (route replay); the block
    yields the layers that could not be replayed, and why (no router logits to weigh the forced experts).

    The weights are still the candidate's own, recomputed for the forced experts from its router's
    logits, so gradients flow through the candidate's router as they would had it chosen the same experts.
    """
    handles = []
    skipped: dict[int, str] = {}
    for moe in find_moe_layers(model):
        forced = experts_by_layer.get(moe.layer)
        if forced is None:
            continue
        if moe.router is None:
            skipped[moe.layer] = "no router found to weigh the golden's experts"
            continue
        logits: list[torch.Tensor | None] = [None]

        def keep_logits(_module: nn.Module, _inputs: tuple, output: object, moe: MoeLayer = moe,
                        logits: list = logits) -> None:
            logits[0] = router_logits(output, moe.num_experts)

        def force(_module: nn.Module, args: tuple, kwargs: dict, moe: MoeLayer = moe, logits: list = logits,
                  forced: torch.Tensor = forced) -> tuple | None:
            found = experts_inputs(args, kwargs)
            scored, logits[0] = logits[0], None
            if isinstance(found, str) or scored is None:
                skipped[moe.layer] = found if isinstance(found, str) else \
                    f"{moe.router_name} returned no [tokens, {moe.num_experts}] logits to weigh the golden's experts"
                return None
            indices, weights = found
            new_indices = forced.to(indices.device, indices.dtype).reshape(indices.shape)
            new_weights = reweigh(moe, scored, new_indices, weights).reshape(weights.shape)
            if len(args) > 2:
                return (args[0], new_indices, new_weights, *args[3:]), kwargs
            index_name = next(n for n in _INDEX_NAMES if n in kwargs) if len(args) < 2 else None
            weight_name = next(n for n in _WEIGHT_NAMES if n in kwargs)
            kwargs = {**kwargs, weight_name: new_weights}
            if index_name is None:
                return (args[0], new_indices, *args[2:]), kwargs
            return args, {**kwargs, index_name: new_indices}

        handles.append(moe.router.register_forward_hook(keep_logits))
        handles.append(moe.experts.register_forward_pre_hook(force, with_kwargs=True))
    try:
        yield skipped
    finally:
        for handle in handles:
            handle.remove()
