"""The `train` scenario: a few AdamW steps with gradient clipping from the golden's start.

Each step is a forward and backward of the whole batch (however a layout splits it), the gradient
clipped to a total norm of `max_norm`, and one AdamW step. Captured: each step's loss
(`train.loss`) and pre-clip total gradient norm (`train.grad_norm`), each parameter's update
(`update.<param>` = final - initial, in float32: the initial values are the same everywhere and
would drown the signal of the final ones), and the first step's routes (compared first, as for
`step`). A reduction or optimizer-state bug that leaves one step's gradients right but the next
step's parameters wrong (clipping by a shard's norm, weight decay applied twice, a stale optimizer
shard) shows here and not in `step`.

The hyper-parameters live in the golden's manifest (`reference.train`, a `TrainHyper`) so a check
always replays the steps the golden recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..golden import names
from ..golden.manifest import TrainHyper
from .capture import Capture, forward_backward
from .inputs import Batch
from .probes import RouteRecord, full

SCENARIO = "train"


# The steps a train golden records. eps is largish on purpose: a parameter whose gradient is at noise
# level then moves by about gradient/eps instead of a sign-flipping +-lr, which would make legitimate
# candidates flaky. max_norm is under every zoo model's gradient norm (2.4 to 7 over the three steps),
# so clipping is active at every step. lr is small enough that the toy routers stay clear-cut through
# the steps: AdamW moves every weight by about lr a step, all in the direction the batch agrees on, and
# at 1e-3 DeepSeek-V3's smallest margin falls from 0.58 to 0.02 by step 3 (at 1e-2 it goes negative by
# step 2): its routes would then hang on near-ties a candidate would flip. At 3e-4 it stays above 0.5.
DEFAULT_HYPER = TrainHyper(steps=3, lr=3e-4, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-4, max_norm=1.0)


# One forward and backward of the whole batch (zeroing gradients first): its loss and its routes.
ForwardBackward = Callable[[], "tuple[torch.Tensor, dict[int, RouteRecord]]"]
# Clip the parameters' gradients to max_norm; returns the pre-clip total norm.
Clip = Callable[[list[nn.Parameter], float], torch.Tensor]


def clip_global(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_: one norm over all gradients (DTensor gradients reduce across their mesh)."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


@dataclass
class TrainRun:
    """What a train loop produced: the capture a golden holds, and every step's routes (for the recorder)."""

    capture: Capture
    step_routes: list[dict[int, RouteRecord]]


def train(model: nn.Module, hyper: TrainHyper, forward_backward: ForwardBackward, clip: Clip = clip_global) -> TrainRun:
    """Run `hyper.steps` steps of `forward_backward`, `clip` and AdamW on `model`'s trainable parameters.

    `model` is the module whose parameters train (under DDP, the wrapped one; under FSDP2, the sharded
    one: its DTensor parameters are gathered to full tensors for the updates, a collective).
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    initial = {name: full(p.detach()).to("cpu", torch.float32, copy=True) for name, p in named}
    optimizer = torch.optim.AdamW(params, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                  weight_decay=hyper.weight_decay)
    losses, norms, step_routes = [], [], []
    for _ in range(hyper.steps):
        loss, routes = forward_backward()
        norm = clip(params, hyper.max_norm)
        optimizer.step()
        losses.append(float(full(loss.detach()).double()))
        norms.append(float(full(norm.detach()).double()))
        step_routes.append(routes)
    tensors = {str(names.TRAIN_LOSS): torch.tensor(losses, dtype=torch.float32),
               str(names.TRAIN_GRAD_NORM): torch.tensor(norms, dtype=torch.float32)}
    for name, p in named:
        tensors[str(names.Update(name))] = full(p.detach()).to("cpu", torch.float32) - initial[name]
    optimizer.zero_grad(set_to_none=True)
    return TrainRun(Capture(tensors=tensors, routes=step_routes[0]), step_routes)


def whole_batch(model: nn.Module, batch: Batch, own_loss: bool = False) -> ForwardBackward:
    """The golden's own layout: the padded batch in one forward and backward."""

    def run() -> tuple[torch.Tensor, dict[int, RouteRecord]]:
        model.train()
        model.zero_grad(set_to_none=True)
        part = forward_backward(model, batch, own_loss=own_loss)
        return part.loss, part.routes

    return run


def run_train(model: nn.Module, batch: Batch, hyper: TrainHyper, own_loss: bool = False) -> TrainRun:
    """The train scenario in the golden's own layout (what `record` runs; a check runs it as its layout's
    passes, see `candidates.layouts.engine`)."""
    return train(model, hyper, whole_batch(model, batch, own_loss))
