"""Run one training step of a model on a batch and capture every tensor a golden holds.

Uniform hook points only: the loss from the model's own forward with labels (so a framework's fused
loss is checked too), the logits, each decoder layer's output, every parameter's gradient, and each
MoE router's decision (see `routing`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .inputs import IGNORE_INDEX, Batch
from .routing import RouteRecord, record_routes


@dataclass
class Capture:
    """Named CPU tensors of one step (`loss`, `logits`, `layers.N.output`, `grad.<param>`) and routes."""

    tensors: dict[str, torch.Tensor]
    routes: dict[int, RouteRecord] = field(default_factory=dict)
    backward: bool = True  # False: a forward-only run, no `grad.*` tensors

    def route_tensors(self) -> dict[str, torch.Tensor]:
        """Routes as named tensors: `routes.N.experts`, `routes.N.weights`, `routes.N.margin`."""
        out = {}
        for layer, rec in sorted(self.routes.items()):
            out[f"routes.{layer}.experts"] = rec.experts.to(torch.int32)
            out[f"routes.{layer}.weights"] = rec.weights
            out[f"routes.{layer}.margin"] = rec.margin.float()
        return out

    def all_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.tensors, **self.route_tensors()}


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (`model.model.layers` in every zoo family)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList):
            return module
    raise TypeError(f"{type(model).__name__}: no decoder layer list found")


@contextmanager
def record_layer_outputs(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, each decoder layer's output hidden states are recorded by index."""
    outputs: dict[int, torch.Tensor] = {}
    handles = []
    for index, layer in enumerate(decoder_layers(model)):

        def hook(_module: nn.Module, _inputs: tuple, output: object, index: int = index) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            # A copy now: a kernel may reuse this buffer in place later (on the CPU .cpu() is no copy).
            outputs[index] = hidden.detach().to("cpu", copy=True)

        handles.append(layer.register_forward_hook(hook))
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def record_logits(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The logits as the LM head produced them, copied at once.

    Fused cross-entropy kernels (liger's) write the gradient into the logits' own buffer inside the
    model's forward, so by the time the forward returns `output.logits` holds something else.
    """
    produced: dict[str, torch.Tensor] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        yield produced
        return

    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        produced["logits"] = output.detach().to("cpu", copy=True)

    handle = head.register_forward_hook(hook)
    try:
        yield produced
    finally:
        handle.remove()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (shifted labels, mean over non-ignored) in the logits' own precision.

    HF upcasts logits to float32; the float64 noise run must not, or its loss would carry float32
    rounding into every gradient.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    shift_labels = labels[..., 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)


def run_step(model: nn.Module, batch: Batch, *, own_loss: bool = False, backward: bool = True) -> Capture:
    """One forward and backward of `model` on `batch`; returns everything captured, on the CPU.

    With `own_loss`, the loss is computed here in the logits' precision instead of by the model
    (used for the float64 noise run). Without `backward`, only the forward runs (under no_grad, for
    kernels that have no backward here) and no gradients are captured.
    """
    device = next(model.parameters()).device
    batch = batch.to(device)
    model.train()
    model.zero_grad(set_to_none=True)
    with record_layer_outputs(model) as layer_outputs, record_routes(model) as routes, \
            record_logits(model) as produced, torch.set_grad_enabled(backward):
        output = model(**batch.model_kwargs(with_labels=not own_loss), use_cache=False)
        logits = produced.get("logits", output.logits.detach().to("cpu", copy=True))
        loss = causal_lm_loss(output.logits, batch.labels) if own_loss else output.loss
    if backward:
        loss.backward()
    tensors = {"loss": loss.detach().cpu(), "logits": logits}
    for index, hidden in sorted(layer_outputs.items()):
        tensors[f"layers.{index}.output"] = hidden
    if not backward:
        return Capture(tensors=tensors, routes=dict(routes), backward=False)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        tensors[f"grad.{name}"] = _full(grad).detach().cpu()
    return Capture(tensors=tensors, routes=dict(routes))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (sharded gradients are gathered before comparing); others as they are."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor
