"""Each decoder layer's parts run in isolation: the candidate's attention and MLP fed the reference's own inputs.

In bfloat16 a whole-model comparison cannot see a 1% systematic error: rounding noise piles up through
the layers and the backward to a few percent of a row, and the bound must cover it. Fed identical inputs,
one part of one layer (the whole layer with its residual adds, its attention block, its per-head attention
output before the output projection, its MLP or MoE block, each of its norms) differs from the reference by one part's rounding only, and a systematic error of
the same size stands out, above all in statistics rounding does not move (`numerics.isolation`).

`reference_units` runs the eager reference forward (no gradients) on the golden's batch and keeps every
part's input and output, then a float64 copy of it on the same bfloat16 inputs (the parts' exact
function: their distance from it is the reference's own rounding; forced onto the golden's experts,
whose margins are above the float64 tie check). `candidate_units` runs the candidate with a forward
pre-hook that replaces each part's input by the reference's, so no error reaches a part from upstream. Parts are found by structure and transformers' attribute names
(`self_attn`, `mlp`, ...); a layer without them is left out and said to be.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .probes import decoder_layers, find_moe_layers, replay_routes

ATTENTION = ("self_attn", "attention", "attn", "linear_attn", "mixer")
MLP = ("mlp", "block_sparse_moe", "feed_forward", "moe", "ffn")
HEADS_PROJECTION = ("o_proj", "out_proj", "dense", "c_proj", "wo")
ROTARY_LAYER = -1  # the shared rotary embedding's "layer": before the first decoder layer


@dataclass(frozen=True)
class Part:
    """One isolated part of a decoder layer: where it hooks in, and what it is."""

    layer: int
    kind: str  # "rotary" (the model's rotary table, cos and sin side by side: its positions' angles; layer -1),
    # "layer" (the decoder layer's output, residual adds included: a fused add-and-norm kernel is
    # checked there), "attention" (the block's output), "heads" (the output projection's input), "mlp", or the
    # attribute name of another part with weights of its own (a norm: "input_layernorm", ...)
    module: nn.Module = field(compare=False, repr=False)  # every part but "heads" is fed the reference's input


@dataclass
class Units:
    """What each part computed: rows [tokens, width] on the host, keyed by (layer, kind)."""

    outputs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    inputs: dict[tuple[int, str], tuple[tuple, dict]] = field(default_factory=dict)  # the forced blocks' inputs
    missing: list[str] = field(default_factory=list)  # layers or parts not found, and why
    # The golden token slots each output's rows were filled at (the candidate's passes: `Pass`); none: all.
    filled: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """One of a layout's passes as the candidate's isolated run replays it: the model's keyword arguments (the
    pass's own batch form: packed, a slice of positions, a candidate's adapted form) and the golden token slot
    of each of its token slots (-1: one the layout added)."""

    kwargs: dict
    positions: torch.Tensor


def parts(model: nn.Module) -> tuple[list[Part], list[str]]:
    """Every decoder layer's isolated parts (and the model's shared rotary embedding), and what could not be found."""
    found, missing = [], []
    rotary = [m for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] == "rotary_emb" and ".layers." not in f".{name}."]
    if len(rotary) == 1:
        found.append(Part(ROTARY_LAYER, "rotary", rotary[0]))
    for index, layer in enumerate(decoder_layers(model)):
        found.append(Part(index, "layer", layer))
        attention = _child(layer, ATTENTION)
        mlp = _child(layer, MLP)
        if attention is None:
            missing.append(f"layer {index} has no attention block ({'/'.join(ATTENTION)})")
        else:
            found.append(Part(index, "attention", attention))
            heads = _child(attention, HEADS_PROJECTION)
            if isinstance(heads, nn.Linear):
                found.append(Part(index, "heads", heads))
        if mlp is None:
            missing.append(f"layer {index} has no MLP block ({'/'.join(MLP)})")
        else:
            found.append(Part(index, "mlp", mlp))
        # The layer's other parts with weights of their own (its norms: `input_layernorm`, ...), by name.
        for name, child in layer.named_children():
            if child is not attention and child is not mlp and any(True for _ in child.parameters(recurse=False)):
                found.append(Part(index, name, child))
    return found, missing


def _child(module: nn.Module, candidates: tuple[str, ...]) -> nn.Module | None:
    for name in candidates:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return child
    return None


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1, tensor.shape[-1]).to("cpu", copy=True)


def _hidden_in(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args and isinstance(args[0], torch.Tensor):
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _Slots:
    """Where a pass's token slots sit among the golden's `total` (`at`: -1 for a slot the layout added): rows
    taken from a whole-batch tensor for the pass, and the pass's rows put back in golden order."""

    def __init__(self, at: torch.Tensor, total: int) -> None:
        self.at, self.total = at.reshape(-1).long().cpu(), total
        self.valid = self.at >= 0

    def take(self, whole: torch.Tensor, like: torch.Tensor, where: str) -> torch.Tensor:
        """`whole`'s rows (its first dimensions the golden's token slots) at this pass's slots, shaped as `like`."""
        rows = whole.reshape(self.total, -1)
        if like.numel() != self.at.numel() * rows.shape[1]:
            raise ValueError(f"{where}: the candidate's input {tuple(like.shape)} does not hold the pass's "
                             f"{self.at.numel()} token slots of {rows.shape[1]} values")
        taken = rows[self.at.clamp(min=0).to(rows.device)]
        taken[~self.valid.to(rows.device)] = 0
        return taken.reshape(like.shape)

    def put(self, units: Units, key: tuple[int, str], tensor: torch.Tensor) -> None:
        """`tensor`'s rows (one or more per token slot) into `units`' output for `key`, at their golden slots."""
        if tensor.numel() % max(self.at.numel(), 1) or not self.at.numel():
            units.outputs[key] = _rows(tensor)  # not rows per token slot: judged by its shape
            return
        width = tensor.shape[-1]
        rows = tensor.detach().reshape(self.at.numel(), -1).to("cpu", copy=True)
        have = units.outputs.get(key)
        if have is None or key not in units.filled or have.numel() != self.total * rows.shape[1]:
            have = torch.zeros(self.total * rows.shape[1] // width, width, dtype=rows.dtype)
            units.filled[key] = torch.zeros(self.total, dtype=torch.bool)
        flat = have.view(self.total, -1)
        flat[self.at[self.valid]] = rows[self.valid]
        units.filled[key][self.at[self.valid]] = True
        units.outputs[key] = have


@contextmanager
def _hooked(model: nn.Module, units: Units, feed: Units | None, dtype: torch.dtype | None,
            slots: _Slots | None = None) -> Iterator[None]:
    """Keep every part's output (and each block's input); with `feed`, each block's input is replaced by
    `feed`'s (cast to `dtype`), ahead of any hook the candidate put there. `slots`: the run is one of a layout's
    passes (`Pass`), fed and kept at its token slots; None: the golden's own batch."""
    found, missing = parts(model)
    units.missing.extend(missing)

    @torch.compiler.disable  # host bookkeeping: traced into a compiled candidate's graph, it recompiled per part
    def keep(key: tuple[int, str], tensor: torch.Tensor) -> None:
        if slots is None:
            units.outputs[key] = _rows(tensor)
        else:
            slots.put(units, key, tensor)

    with ExitStack() as stack:
        for part in found:
            key = (part.layer, part.kind)
            if part.kind == "rotary":
                # Its inputs are the positions (and the activations only for their dtype): nothing to feed.
                def keep_table(_m: nn.Module, _args: tuple, output: object, key: tuple = key) -> None:
                    if isinstance(output, (tuple, list)) and output and all(
                            isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape == output[0].shape for t in output):
                        keep(key, torch.cat(list(output), dim=-1))  # [batch, positions, cos|sin]
                stack.callback(part.module.register_forward_hook(keep_table).remove)
                continue
            if part.kind == "heads":
                def keep_in(_m: nn.Module, args: tuple, key: tuple = key) -> None:
                    if args and isinstance(args[0], torch.Tensor):
                        keep(key, args[0])
                stack.callback(part.module.register_forward_pre_hook(keep_in).remove)
                continue
            if feed is not None:
                given = feed.inputs.get(key)

                def force(_m: nn.Module, args: tuple, kwargs: dict, given: tuple | None = given,
                          where: str = f"layer {part.layer} {part.kind}") -> tuple | None:
                    hidden = _hidden_in(args, kwargs)
                    if given is None or hidden is None:
                        return None
                    fed = given if slots is None else slots.take(given, hidden, where)
                    return _with_hidden(args, kwargs, fed.to(hidden.device, dtype or hidden.dtype))
                stack.callback(part.module.register_forward_pre_hook(force, with_kwargs=True, prepend=True).remove)
            else:
                def keep_input(_m: nn.Module, args: tuple, kwargs: dict, key: tuple = key) -> None:
                    hidden = _hidden_in(args, kwargs)
                    if hidden is not None:
                        units.inputs[key] = hidden.detach().clone()
                stack.callback(part.module.register_forward_pre_hook(keep_input, with_kwargs=True).remove)

            def keep_out(_m: nn.Module, _args: tuple, output: object, key: tuple = key) -> None:
                out = _first_tensor(output)
                if out is not None:
                    keep(key, out)
            stack.callback(part.module.register_forward_hook(keep_out).remove)
        yield


def _forward(model: nn.Module, kwargs: dict, experts: dict[int, torch.Tensor] | None = None) -> None:
    device = next(model.parameters()).device
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with torch.no_grad(), replay_routes(model, experts or {}):
        model(**moved, use_cache=False)


@dataclass
class Reference:
    """The reference's parts on the golden's batch, in its own dtype and in float64 on the same inputs."""

    own: Units
    exact: Units
    heads: int  # attention heads (the "heads" part's columns are [heads x head_dim])
    experts: dict[int, int]  # experts per MoE layer


def reference_units(model: nn.Module, kwargs: dict, experts: dict[int, torch.Tensor]) -> Reference:
    """Run the (pristine) reference and its float64 copy, keeping every part's input and output."""
    was_training = model.training
    model.train()
    own = Units()
    with _hooked(model, own, None, None):
        _forward(model, kwargs)
    high = copy.deepcopy(model).to(torch.float64)
    exact = Units()
    with _hooked(high, exact, own, torch.float64):
        _forward(high, kwargs, experts)
    del high
    model.train(was_training)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return Reference(own, exact, int(getattr(config, "num_attention_heads", 0) or 0),
                     {moe.layer: moe.num_experts for moe in find_moe_layers(model)})


def leave_out_shards(reference: Reference, candidate: Units, layout: str) -> None:
    """Several ranks: a part whose output is this rank's shard (tensor parallel's heads, before the output
    projection) is left out of both, and said to be; every part a parallel plan completes is judged."""
    for key, own in list(reference.own.outputs.items()):
        given = candidate.outputs.get(key)
        if given is not None and given.shape != own.shape:
            layer, kind = key
            reference.own.missing.append(f"layer {layer} {kind}: each rank holds a shard {tuple(given.shape)} of "
                                         f"it under {layout}")
            for units in (reference.own, reference.exact, candidate):
                units.outputs.pop(key, None)


def leave_out_other_rotary(reference: Reference, candidate: Units) -> None:
    """A candidate whose rotary embedding gives its table in another form (a framework's multimodal rotary, a
    kernel that computes the angles inside attention) has no table to compare: its angles are judged through
    the attention parts they feed, and the report says the table was not isolated."""
    key = (ROTARY_LAYER, "rotary")
    own, given = reference.own.outputs.get(key), candidate.outputs.get(key)
    if own is not None and (given is None or given.shape != own.shape):
        what = "gives none" if given is None else f"gives {tuple(given.shape)} for the reference's {tuple(own.shape)}"
        reference.own.missing.append(f"rotary table: the candidate's rotary embedding {what} "
                                     "(its angles are judged through the attention parts)")
        for units in (reference.own, reference.exact, candidate):
            units.outputs.pop(key, None)


def candidate_units(model: nn.Module, passes: list[Pass], slots: int, reference: Reference) -> Units:
    """Run the candidate through a layout's passes (`slots`: the golden's token slots) with every block fed the
    reference's input at each pass's slots, keeping every part's output in golden order: the candidate runs
    in the form the layout gives it (packed, sliced, adapted), so a kernel path only that form takes is judged.
    Its routers choose for themselves: fed the reference's input, a router that flips a golden route (every
    margin is above the tie epsilon) computes something else, and a fault in the routing weights must not be
    replayed away."""
    units = Units()
    for one in passes:
        with _hooked(model, units, reference.own, None, _Slots(one.positions, slots)):
            _forward(model, one.kwargs)
    return units


def gather_column_shards(model: nn.Module, units: Units, device: torch.device) -> None:
    """Several ranks: the input of a row-parallel output projection (a tensor-parallel plan's `o_proj`, its weight
    `Shard(1)` on a one-dimensional mesh) is this rank's chunk of the per-head columns, the chunk its weight's
    columns take. The chunks gathered in the mesh's order are the whole per-head output, judged as on one rank
    (left out as a shard until 2026-12-06: a 1% error in one head then showed only through its attention block,
    at a fifth of its ratio there). Every rank of the default group must call it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    sharded = {}
    for part in parts(model)[0]:
        weight = getattr(part.module, "weight", None)
        key = (part.layer, part.kind)
        if part.kind == "heads" and key in units.outputs and isinstance(weight, DTensor) \
                and weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(1),):
            sharded[key] = weight.device_mesh
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(sharded))  # a collective per key: every rank gathers the same ones
    for key in sorted(set(everyone[0]).intersection(*map(set, everyone[1:]))):
        rows = units.outputs[key]
        whole = DTensor.from_local(rows.to(device), sharded[key], [Shard(1)], run_check=False).full_tensor()
        units.outputs[key] = whole.to("cpu", rows.dtype)


def merge_ranks(units: Units, device: torch.device) -> None:
    """Every rank's rows of each output in one (on every rank): each rank ran its own passes (its rows of the
    batch, its slice of the positions), so rank 0 alone holds only its share. Rows several ranks computed (a
    tensor-parallel layout's ranks all run the whole batch) are averaged, exactly where they agree. An output not
    every rank filled (in one shape) keeps this rank's rows and `filled`: its judgment says for how many of the
    real tokens it ran (`numerics.isolation.judge_parts`). Every rank of the default group must call it."""
    import torch.distributed as dist

    mine = sorted((key, tuple(t.shape), str(t.dtype)) for key, t in units.outputs.items() if key in units.filled)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shared = set(everyone[0]).intersection(*map(set, everyone[1:]))
    for key, _shape, _dtype in sorted(shared):
        rows, filled = units.outputs[key], units.filled[key]
        per = rows.numel() // filled.numel()
        total = (rows.reshape(filled.numel(), per).to(device, torch.float64)
                 * filled.to(device).unsqueeze(1))
        count = filled.to(device, torch.float64)
        dist.all_reduce(total)
        dist.all_reduce(count)
        merged = total / count.clamp(min=1).unsqueeze(1)
        units.outputs[key] = merged.to("cpu", rows.dtype).reshape(rows.shape)
        units.filled[key] = (count > 0).cpu()
