"""Goldens that certify their sensitivity: canaries planted at record time (issue 35, item 6).

A golden is only as good as the smallest error it catches. `certify` checks, against the new golden, the
reference with one systematic error planted in one place, the same way any candidate is checked: one decoder
layer's output, one parameter's gradient, and in an MoE model one expert's share of its layer's output, each
at the scales of `LADDER` (relative, by dtype) until one fails. The scale that failed and the worst
error/bound ratio it reached are the golden's certified sensitivity (`reference.sensitivity` in its
manifest: `canary@scale: ratio`), which `record` prints and every check report carries. A canary that
passes at the ladder's top is refused in one line. `record` and `refresh` certify unless `--no-certify`; a
golden recorded without it (all goldens before this round, and those) says `not certified`.

The canaries only register hooks on the model instance they are given: they leave the process as pristine
as veosnap's own variants do (`pristine.own_variants`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..candidates import pristine
from ..candidates.backends import Backend
from ..errors import VeosnapError
from ..golden.codec import Golden
from ..numerics import fmt
from ..reference import probes
from ..reference.zoo import Project

# The errors each canary plants, relative, smallest first, by the golden's dtype; the smallest that fails is
# certified. float32 is the sharp instrument (DESIGN.md: below 0.03% is caught). In bfloat16 the forward's
# parts are checked in isolation (`numerics.isolation`): a 1% error in a layer's output is caught, one
# expert's share where its tokens' other experts do not drown it; a gradient is judged whole, where the
# backward's rounding piles up to a few percent of a row. A golden that misses the largest is refused.
LADDER = {"float32": (1e-3,), "bfloat16": (1e-2, 3e-2, 1e-1)}
Plant = Callable[[nn.Module], nn.Module]  # a backend step: registers the canary's hook on the model


def _middle(items: list) -> object:
    return items[(len(items) - 1) // 2]


def layer_output(scale: float) -> Plant:
    """The middle decoder layer's output, scaled by 1 + `scale`."""
    def plant(model: nn.Module) -> nn.Module:
        def scaled(_module: nn.Module, _args: tuple, out: object) -> object:
            if isinstance(out, (tuple, list)):  # (hidden, ...): GPT-style blocks return a list
                return type(out)([out[0] * (1 + scale), *out[1:]])
            return out * (1 + scale)

        _middle(list(probes.decoder_layers(model))).register_forward_hook(scaled)
        return model

    return plant


def gradient(scale: float) -> Plant:
    """The gradient of the middle decoder layer's first trainable weight matrix, scaled by 1 + `scale`."""
    def plant(model: nn.Module) -> nn.Module:
        layer = _middle(list(probes.decoder_layers(model)))
        weight = next(p for p in layer.parameters() if p.requires_grad and p.dim() == 2)
        weight.register_hook(lambda grad: grad * (1 + scale))
        return model

    return plant


def expert(scale: float) -> Plant:
    """In the middle MoE layer, the share of its most chosen expert scaled by 1 + `scale` (every experts module
    takes (hidden_states, top_k_index, top_k_weights): its weights where that expert was chosen)."""
    def plant(model: nn.Module) -> nn.Module:
        def scaled(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            values = [*args, *(kwargs.pop(k) for k in ("hidden_states", "top_k_index", "top_k_weights")[len(args):])]
            hidden, index, weights = values[:3]
            chosen = torch.mode(index.flatten()).values
            return (hidden, index, torch.where(index == chosen, weights * (1 + scale), weights), *values[3:]), kwargs

        _middle(probes.find_moe_layers(model)).experts.register_forward_pre_hook(scaled, with_kwargs=True)
        return model

    return plant


CANARIES: dict[str, tuple[str, Callable[[float], Plant]]] = {
    "layer_output": ("one decoder layer's output", layer_output),
    "gradient": ("one parameter's gradient", gradient),
    "expert": ("one expert's share of its layer's output", expert),
}


def certify(project: Project, golden: Golden) -> dict[str, float]:
    """Each canary that applies to `golden`'s model, checked against it: {canary: worst ratio}. Refuses, in one
    line naming the golden's key, a golden that a canary passes."""
    from .check import check

    dtype = golden.manifest.key.dtype
    ratio = 0.0
    moe = bool(golden.route_layers())
    gradients = any(name.startswith("grad.") for name in golden.manifest.tolerance)
    found: dict[str, float] = {}
    for name, (what, make) in CANARIES.items():
        if (name == "expert" and not moe) or (name == "gradient" and not gradients):
            continue
        ladder = LADDER.get(dtype, LADDER["float32"])
        for scale in ladder:
            with pristine.own_variants():
                report = check(project, golden.manifest.key, Backend(f"canary:{name}", (make(scale),)), gold=golden)
            if report.error or report.skipped:
                raise VeosnapError(f"{golden.manifest.key}: not certified: the canary {name} ({what}) could not run "
                                   f"({report.error or report.skipped})")
            ratios = [t.ratio for t in report.ranked()] + [i.ratio for i in report.isolated]  # isolated: bf16
            ratio = max((r for r in ratios if math.isfinite(r)), default=0.0)
            if report.status == "FAIL":
                found[f"{name}@{scale:g}"] = ratio if ratio > 1 else math.nextafter(1.0, 2.0)  # routes: no ratio
                break
        else:
            raise VeosnapError(f"{golden.manifest.key}: not certified: a {ladder[-1]:g} relative error in {what} "
                               f"passes this golden (worst {fmt.times(ratio)} of its bound); it cannot catch what "
                               "veosnap promises (record with --no-certify to keep it, uncertified)")
    return found


def sensitivity_note(sensitivity: dict[str, float] | None) -> str:
    """What every report says of a golden's certified sensitivity."""
    if not sensitivity:
        return "not certified: no canary was planted when this golden was recorded"
    order = list(CANARIES)  # the canaries' own order, however the manifest keeps its keys
    sensitivity = dict(sorted(sensitivity.items(), key=lambda item: (
        order.index(item[0].partition("@")[0]) if item[0].partition("@")[0] in order else len(order), item[0])))
    shown = ", ".join(f"{name.partition('@')[0]} {fmt.times(ratio)}" for name, ratio in sensitivity.items())
    scales = {name.partition("@")[2] for name in sensitivity}
    if len(scales) == 1:
        return f"certified: catches a {scales.pop()} relative error planted in each of: {shown} of its bound"
    shown = ", ".join(f"{name.partition('@')[0]} {name.partition('@')[2]} at {fmt.times(ratio)}"
                      for name, ratio in sensitivity.items())
    return f"certified: catches the relative error planted in each of: {shown} of its bound"
