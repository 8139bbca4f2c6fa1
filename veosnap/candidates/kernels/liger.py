"""`liger`: liger-kernel's patches for the model type (RMSNorm, RoPE, SwiGLU and the MoE experts,
cross-entropy), as `liger_kernel.transformers` applies them to a model instance.

Liger's fused *linear* cross-entropy never materializes the logits the golden compares, so its plain
fused cross-entropy stands in for it; every other patch is liger's default for the model type. Liger
patches transformers' modeling modules (and `torch.nn.functional.cross_entropy`) process-wide, not just
the instance: they are restored when the check is done. The report lists what liger replaced: each
module's new forward (`LigerRMSNorm.forward` on 9 modules, `LigerExperts.forward` on the experts, ...)
and each module-level function.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Iterator

from torch import nn

from ...errors import Unsupported
from ..candidate import Candidate
from .support import compact, decline, gpu_library, installed, restoring_modules

NAME = "liger"
OPTIONS = {"fused_linear_cross_entropy": False, "cross_entropy": True}
PATCHED = ("transformers.loss.loss_utils", "torch.nn.functional")  # beside the model's modeling module
requires = gpu_library("liger-kernel", "liger-kernel", "pip install liger-kernel")


def liger(model: nn.Module) -> Iterator[Candidate]:
    """liger-kernel's patches for this model type; GPU only; what it replaced is in the report."""
    decline(requires())
    with restoring_modules(*PATCHED, type(model).__module__):
        replaced = apply(model)
        yield Candidate(model, notes=[f"liger {installed('liger-kernel')} replaced: {'; '.join(replaced)}"])


def apply(model: nn.Module) -> list[str]:
    """Apply liger's patches for the model type to `model` (and its modeling module); what was replaced."""
    from liger_kernel.transformers import monkey_patch

    model_type = model.config.model_type
    if model_type not in monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise Unsupported(f"liger-kernel has no patches for model type {model_type!r}")
    watched = (type(model).__module__, *PATCHED)
    before = _snapshot(model, watched)
    monkey_patch._apply_liger_kernel_to_instance(model=model, **OPTIONS)
    replaced = _replaced(model, before, watched)
    if not replaced:
        raise RuntimeError(f"liger-kernel {installed('liger-kernel')} changed nothing in {type(model).__name__}")
    return replaced


def _snapshot(model: nn.Module, module_names: tuple[str, ...]) -> dict:
    return {"forwards": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
            "globals": {name: dict(vars(sys.modules[name])) for name in module_names if name in sys.modules}}


def _replaced(model: nn.Module, before: dict, module_names: tuple[str, ...]) -> list[str]:
    """What the patch changed: instance forwards (grouped by the new function) and module-level names."""
    by_function: dict[str, list[str]] = defaultdict(list)
    for name, module in model.named_modules():
        forward = module.__dict__.get("forward")
        if forward is not None and forward is not before["forwards"].get(name):
            function = getattr(forward, "__func__", forward)
            by_function[getattr(function, "__qualname__", repr(function))].append(name or type(module).__name__)
    lines = [f"{function} on {len(names)} modules ({compact(names)})" for function, names in sorted(by_function.items())]
    for module_name in module_names:
        old = before["globals"].get(module_name, {})
        for attr, value in vars(sys.modules[module_name]).items():
            if attr in old and old[attr] is not value and callable(value) and not isinstance(value, type):
                lines.append(f"{module_name.rpartition('.')[2]}.{attr} -> {getattr(value, '__name__', repr(value))}")
    return lines
