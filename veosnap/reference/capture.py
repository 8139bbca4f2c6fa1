"""One forward and backward of a model on a batch, and every tensor a golden holds.

Uniform hook points only (see `probes`): the loss from the model's own forward with labels (so a
framework's fused loss is checked too), the logits, each decoder layer's output, each encoder block's
and projection's output (multimodal batches), every parameter's gradient, and each MoE router's decision. `forward_backward` runs one batch (a layout may run several,
each weighted by its share of the loss); `run_step` is the golden's own step: the whole batch, once.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..golden import names
from .inputs import IGNORE_INDEX, Batch
from .probes import (
    RouteRecord,
    full,
    record_encoder_outputs,
    record_layer_outputs,
    record_logits,
    record_routes,
    replay_routes,
)


@dataclass
class Capture:
    """Named CPU tensors of one step (`loss`, `logits`, `layers.N.output`, `grad.<param>`, or a train
    run's) and the routes by MoE layer."""

    tensors: dict[str, torch.Tensor]
    routes: dict[int, RouteRecord] = field(default_factory=dict)
    backward: bool = True  # False: a forward-only run, no `grad.*` tensors

    def route_tensors(self) -> dict[str, torch.Tensor]:
        """Routes as named tensors: `routes.N.experts`, `routes.N.weights`, `routes.N.margin`."""
        out = {}
        for layer, rec in sorted(self.routes.items()):
            out[str(names.Route(layer, "experts"))] = rec.experts.to(torch.int32)
            out[str(names.Route(layer, "weights"))] = rec.weights
            out[str(names.Route(layer, "margin"))] = rec.margin.float()
        return out

    def all_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.tensors, **self.route_tensors()}

    def experts(self) -> dict[int, torch.Tensor]:
        """The expert ids chosen per MoE layer: [tokens, k] int64."""
        return {layer: rec.experts for layer, rec in self.routes.items()}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], backward: bool = True) -> Capture:
        """What `all_tensors` gave, back as a capture."""
        routes, rest = {}, {}
        for name, t in tensors.items():
            parsed = names.try_parse(name)
            if isinstance(parsed, names.Route):
                routes.setdefault(parsed.layer, {})[parsed.part] = t
            else:
                rest[name] = t
        records = {layer: RouteRecord(layer, parts["experts"].long(), parts["weights"], parts["margin"])
                   for layer, parts in routes.items()}
        return cls(tensors=rest, routes=records, backward=backward)


@dataclass
class Part:
    """What one forward (and backward) of a batch produced, on the CPU."""

    loss: torch.Tensor  # the loss, times the batch's share of the golden's predictions
    logits: torch.Tensor  # [rows, positions, vocab]
    layers: dict[int, torch.Tensor]  # decoder layer -> [rows, positions, hidden]
    routes: dict[int, RouteRecord]  # MoE layer -> one route per token, row-major
    # golden name -> media kind -> [rows of the batch's media of that kind, ...]: encoder outputs (see
    # `by_media_kind`); a golden holds each name's kinds concatenated in `Media.KINDS` order
    encoders: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (shifted labels, mean over non-ignored) in the logits' own precision.

    HF upcasts logits to float32; the float64 noise run must not, or its loss would carry float32
    rounding into every gradient.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
    shift_labels = labels[..., 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)


@contextmanager
def cross_entropy_in_logits_precision(model: nn.Module) -> Iterator[None]:
    """Within the block, `model` computes its loss with `causal_lm_loss` as its cross-entropy.

    Everything else the model adds to that loss, it still adds itself, by its own code: an MoE
    model's load-balancing loss (`output_router_logits`) is part of the noise run's loss exactly as
    it is part of the reference's, so a bug in it is measured against float64, not counted as noise.
    """
    had_own = "_loss_function" in vars(model)
    previous = vars(model).get("_loss_function")
    model.loss_function = lambda logits, labels, vocab_size=None, **kwargs: causal_lm_loss(logits, labels)
    try:
        yield
    finally:
        if had_own:
            model.loss_function = previous
        else:
            del model._loss_function


def auxiliary_loss(model: nn.Module) -> str:
    """What `model` adds to its cross-entropy, in words ('' for nothing).

    transformers' MoE models add a load-balancing loss over all the batch's real tokens when their
    config sets `output_router_logits` (times `router_aux_loss_coef`). It is not a sum over tokens:
    the loss of a batch split into parts is not the sum of the parts' losses.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return ""
    coef = getattr(config, "router_aux_loss_coef", None)
    return "a load-balancing loss" + (f" (router_aux_loss_coef {coef:g})" if coef is not None else "")


def forward_backward(model: nn.Module, batch: Batch, *, inner: nn.Module | None = None, share: float = 1.0,
                     grad_scale: float = 1.0, own_loss: bool = False, backward: bool = True,
                     forced: dict[int, torch.Tensor] | None = None) -> Part:
    """Forward `batch` through `model` and backward its loss weighted by `share * grad_scale`.

    `inner` is the HF model inside `model` (a DDP wrapper, say), where the hooks go; `share` is the
    batch's share of the golden's predictions (the returned loss is weighted by it); `grad_scale`
    undoes a reducer's averaging over ranks. With `own_loss`, the model's cross-entropy is taken in the
    logits' precision (the float64 noise run; its other loss terms are its own); without `backward`, only the forward runs, under no_grad; with
    `forced`, the routers are forced onto those experts (route replay).
    """
    inner = model if inner is None else inner
    batch = batch.to(next(inner.parameters()).device)
    replay = replay_routes(inner, forced) if forced else nullcontext()
    precise = cross_entropy_in_logits_precision(inner) if own_loss else nullcontext()
    with record_layer_outputs(inner) as layers, record_routes(inner) as routes, record_logits(inner) as produced, \
            record_encoder_outputs(inner) as encoded, replay, precise, torch.set_grad_enabled(backward):
        output = model(**batch.model_kwargs(), use_cache=False)
        logits = produced["logits"] if "logits" in produced else full(output.logits.detach()).to("cpu", copy=True)
        loss = output.loss
    weight = share * grad_scale
    if backward:
        (loss if weight == 1.0 else loss * weight).backward()
    reported = loss.detach().cpu() if share == 1.0 else (loss.detach().float() * share).cpu()
    return Part(loss=reported, logits=logits, layers=dict(layers), routes=dict(routes),
                encoders=by_media_kind(encoded, batch))


def by_media_kind(encoded: dict[str, list[torch.Tensor]], batch: Batch) -> dict[str, dict[str, torch.Tensor]]:
    """Each encoder hook point's calls, by the media kind each call ran: a tower runs once per kind its batch
    holds, in `Media.KINDS` order (a vision tower: the images, then the videos). Calls of an encoder the
    batch has no media for (a dummy forward that keeps ranks in step) are dropped."""
    kinds = batch.media.kinds if batch.media is not None else []
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, calls in encoded.items():
        encoder = names.parse(name).encoder  # type: ignore[attr-defined]
        mine = [kind for kind in kinds if batch.media.ENCODER[kind] == encoder]
        if not mine:
            continue
        if len(calls) != len(mine):  # not one call per kind: kept whole, under the first
            out[name] = {mine[0]: torch.cat(calls)}
            continue
        out[name] = dict(zip(mine, calls))
    return out


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """`grad.<name>` of every trainable parameter, on the CPU, gathered to full tensors (a collective
    under DTensor); a parameter without a gradient has a zero one."""
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            out[str(names.Grad(name))] = full(grad).detach().cpu()
    return out


def run_step(model: nn.Module, batch: Batch, *, own_loss: bool = False, backward: bool = True) -> Capture:
    """The golden's step: one forward and backward of `model` on the whole `batch`; everything captured.

    With `own_loss`, the model's cross-entropy is taken in the logits' precision (the float64 noise
    run); whatever else its loss holds (an MoE load-balancing loss), the model computes as always. Without `backward`, only the forward runs (under no_grad, for
    kernels that have no backward here) and no gradients are captured.
    """
    model.train()
    model.zero_grad(set_to_none=True)
    part = forward_backward(model, batch, own_loss=own_loss, backward=backward)
    tensors = {str(names.LOSS): part.loss, str(names.LOGITS): part.logits}
    tensors.update({str(names.LayerOutput(index)): hidden for index, hidden in sorted(part.layers.items())})
    tensors.update({name: torch.cat(list(calls.values())) for name, calls in part.encoders.items()})
    if backward:
        tensors.update(gradients(model))
    return Capture(tensors=tensors, routes=part.routes, backward=backward)
