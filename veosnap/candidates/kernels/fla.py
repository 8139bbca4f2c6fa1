"""`fla`: the gated DeltaNet (linear-attention) layers of Qwen3.5 and Qwen3-Next through
flash-linear-attention's Triton kernels.

transformers' gated DeltaNet layer calls two functions of its modeling module: `causal_conv1d_fn` (the
short convolution in front of q, k, v) and `torch_chunk_gated_delta_rule` (the chunked delta rule). The
reference runs their torch code (`reference.models.pin_torch_fallbacks`, which also undoes transformers'
own switch to fla when fla is installed); for the check this backend sets them to fla's
`causal_conv1d` and `chunk_gated_delta_rule`, and restores them after.

Packed batches: the layer is not given the position ids, so a forward pre-hook on each decoder layer
that holds a gated DeltaNet computes cu_seqlens from them and passes `cu_seq_lens_q` down, which the
layer hands to both functions (the keyword a framework's collator passes): both kernels then keep the
packed sequences apart, which the torch reference cannot (an eager packed run of these models fails
its golden by design; docs/models.md). Padded batches run as they are (the layer zeroes padding).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..candidate import Candidate
from .support import Ran, decline, gpu_library, installed, restoring_modules

NAME = "fla"
DELTA_RULE = "torch_chunk_gated_delta_rule"  # the modeling functions a gated DeltaNet layer calls
CONV = "causal_conv1d_fn"
requires = gpu_library("flash-linear-attention", "flash-linear-attention",
                       "pip install flash-linear-attention (Triton kernels)")


@dataclass(frozen=True)
class Kernels:
    """fla's two entry points (tests substitute a torch reference)."""

    chunk: Callable  # chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state, output_final_state, ..., cu_seqlens)
    conv: Callable  # causal_conv1d(x [B, T, D], weight [D, W], bias, *, activation, cu_seqlens) -> (y, state)
    label: str = "fla"


def library() -> Kernels:
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return Kernels(chunk_gated_delta_rule, causal_conv1d, label=f"fla {installed('flash-linear-attention')}")


def fla(model: nn.Module) -> Iterator[Candidate]:
    """The gated DeltaNet layers through fla's chunk_gated_delta_rule and causal_conv1d (GPU)."""
    decline(requires() or _without_layers(model))  # before importing fla, which takes seconds
    yield from switch(model, library())


def delta_rule_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's gated DeltaNet layers, by name: modules whose forward calls the delta-rule function."""
    return {name: module for name, module in model.named_modules() if DELTA_RULE in _called(type(module))}


def _called(cls: type) -> tuple[str, ...]:
    forward = getattr(cls, "forward", None)
    code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
    return code.co_names if code is not None else ()


def _without_layers(model: nn.Module) -> str | None:
    """Why fla changes nothing in `model` (None: it has gated DeltaNet layers)."""
    if delta_rule_layers(model):
        return None
    return (f"fla replaces gated DeltaNet (linear-attention) layers; {type(model).__name__} has none "
            f"(Qwen3.5 and Qwen3-Next have them)")


def switch(model: nn.Module, kernels: Kernels) -> Iterator[Candidate]:
    """Run `model`'s gated DeltaNet layers on `kernels` for the check; say what ran; restore the functions."""
    decline(_without_layers(model))
    layers = delta_rule_layers(model)
    ran = Ran(NAME, model, "gated DeltaNet layers")
    current: list[nn.Module | None] = [None]  # the layer whose forward is running
    hooks = []
    for layer in layers.values():
        hooks.append(layer.register_forward_pre_hook(lambda module, args: current.__setitem__(0, module)))
        hooks.append(layer.register_forward_hook(lambda module, args, out: current.__setitem__(0, None)))
    for parent in {_parent(model, name) for name in layers}:
        hooks.append(parent.register_forward_pre_hook(_pass_sequence_boundaries, with_kwargs=True))
    modules = sorted({type(layer).__module__ for layer in layers.values()})
    try:
        with restoring_modules(*modules):
            for name in modules:
                module = sys.modules[name]
                setattr(module, DELTA_RULE, _delta_rule(kernels, ran, current))
                if callable(getattr(module, CONV, None)):
                    setattr(module, CONV, _conv(kernels, ran, current))
            note = f"linear attention: {kernels.label} (chunk_gated_delta_rule, causal_conv1d)"
            yield from ran.candidate(model, note)
    finally:
        for hook in hooks:
            hook.remove()


def _parent(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0]) if "." in name else model


def _pass_sequence_boundaries(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A decoder layer's pre-hook: for a packed row, pass `cu_seq_lens_q` (from the position ids) down."""
    position_ids = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is not None or position_ids is None or position_ids.dim() != 2:
        return None
    if position_ids.shape[0] != 1:
        return None
    flat = position_ids[0]
    starts = (flat == flat.min()).nonzero().squeeze(1)
    if starts.numel() < 2:  # one sequence: nothing to keep apart
        return None
    cu = torch.cat([starts, starts.new_tensor([flat.numel()])])
    return args, {**kwargs, "cu_seq_lens_q": cu}


def _delta_rule(kernels: Kernels, ran: Ran, current: list) -> Callable:
    def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: torch.Tensor | None = None, **kwargs: object):
        ran.call(current[0], "chunk_gated_delta_rule" + (" (cu_seqlens)" if cu_seqlens is not None else ""))
        return kernels.chunk(query, key, value, g=g, beta=beta, initial_state=initial_state,
                             output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                             cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())

    return chunk_gated_delta_rule


def _conv(kernels: Kernels, ran: Ran, current: list) -> Callable:
    def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs: object) -> torch.Tensor:
        cu = kwargs.get("cu_seq_lens_q")
        ran.call(current[0], "causal_conv1d" + (" (cu_seqlens)" if cu is not None else ""))
        # transformers' layout is [batch, channels, positions]; fla's is [batch, positions, channels].
        out, _ = kernels.conv(hidden_states.transpose(1, 2), weight=weight, bias=bias, activation=activation,
                              cu_seqlens=None if cu is None else cu.long())
        return out.transpose(1, 2)

    return causal_conv1d_fn
