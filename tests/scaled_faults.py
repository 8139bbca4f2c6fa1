"""Small systematic bugs, each a veosnap backend: `--backend tests/scaled_faults.py:<name>`.

Each scales one share of the model's computation by `1 + s` (`s` from `VEOSNAP_FAULT_SCALE`, default 0.01):
a kernel that mis-normalizes, drops a residual share or mis-weights an expert looks like this. In bfloat16
the whole-model comparison cannot see 1%: the isolated parts (`veosnap.numerics.isolation`) must, and must
say where. The scale is applied in float32, so 1% is 1% (bfloat16's own 1.01 is 1.0078).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from veosnap import Unsupported
from veosnap.reference.isolation import ATTENTION, HEADS_PROJECTION, _child
from veosnap.reference.probes import decoder_layers, find_moe_layers

FAULT_EXPERT = 3  # the expert `one_expert_scaled` mis-weights
FAULT_HEAD = 0  # the head `one_head_scaled` scales
LAST_QUARTER = 24  # `last_quarter_scaled` scales positions from here on (the toy batch is 32 wide)


def _scale() -> float:
    return float(os.environ.get("VEOSNAP_FAULT_SCALE", "0.01"))


def _scaled(tensor: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    return (tensor.float() * factor).to(tensor.dtype)


def _on_output(module: nn.Module, change) -> None:  # noqa: ANN001
    def hook(_m: nn.Module, _args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            return (change(output[0]), *output[1:])
        return change(output)

    module.register_forward_hook(hook)


def _attention_blocks(model: nn.Module) -> list[nn.Module]:
    return [a for layer in decoder_layers(model) if (a := _child(layer, ATTENTION)) is not None]


def attention_scaled(model: nn.Module) -> nn.Module:
    """Every attention block's output scaled by 1 + s."""
    s = _scale()
    for block in _attention_blocks(model):
        _on_output(block, lambda t: _scaled(t, 1 + s))
    return model


def packed_attention_scaled(model: nn.Module) -> nn.Module:
    """Every attention block's output scaled by 1 + s when it runs one packed row (a varlen-only kernel path): the
    golden's padded rows never take it."""
    s = _scale()
    for block in _attention_blocks(model):
        _on_output(block, lambda t: _scaled(t, 1 + s) if t.shape[0] == 1 else t)
    return model


def last_quarter_scaled(model: nn.Module) -> nn.Module:
    """Attention output scaled by 1 + s at positions LAST_QUARTER and later (a long-context kernel path)."""
    s = _scale()
    positions: list[torch.Tensor] = []

    def keep(_m: nn.Module, _args: tuple, kwargs: dict) -> None:
        positions[:] = [kwargs["position_ids"]]

    model.register_forward_pre_hook(keep, with_kwargs=True)

    def change(t: torch.Tensor) -> torch.Tensor:
        late = (positions[0].reshape(t.shape[:-1]) >= LAST_QUARTER).float().unsqueeze(-1)
        return _scaled(t, 1 + s * late)

    for block in _attention_blocks(model):
        _on_output(block, change)
    return model


def one_head_scaled(model: nn.Module) -> nn.Module:
    """Head FAULT_HEAD's attention output scaled by 1 + s before the output projection."""
    s = _scale()
    heads = model.config.get_text_config().num_attention_heads

    def pre(_m: nn.Module, args: tuple) -> tuple:
        x = args[0].float().clone()
        width = x.shape[-1] // heads
        x[..., FAULT_HEAD * width:(FAULT_HEAD + 1) * width] *= 1 + s
        return (x.to(args[0].dtype), *args[1:])

    for block in _attention_blocks(model):
        projection = _child(block, HEADS_PROJECTION)
        projection.register_forward_pre_hook(pre)
    return model


def _moe_layers(model: nn.Module) -> list:
    moes = find_moe_layers(model)
    if not moes:
        raise Unsupported("no routed experts")
    return moes


def experts_scaled(model: nn.Module) -> nn.Module:
    """Every routed expert's output scaled by 1 + s."""
    s = _scale()
    for moe in _moe_layers(model):
        _on_output(moe.experts, lambda t: _scaled(t, 1 + s))
    return model


def one_expert_scaled(model: nn.Module) -> nn.Module:
    """Expert FAULT_EXPERT's contribution scaled by 1 + s (its routing weight, as the experts receive it)."""
    s = _scale()

    def pre(_m: nn.Module, args: tuple, kwargs: dict) -> tuple:
        hidden, index, weights = args[:3]
        weights = torch.where(index == FAULT_EXPERT, _scaled(weights, 1 + s), weights)
        return (hidden, index, weights, *args[3:]), kwargs

    for moe in _moe_layers(model):
        moe.experts.register_forward_pre_hook(pre, with_kwargs=True)
    return model


def norm_scaled(model: nn.Module) -> nn.Module:
    """Every decoder layer's input norm's output scaled by 1 + s (a norm weight offset off, say)."""
    s = _scale()
    for layer in decoder_layers(model):
        _on_output(layer.input_layernorm, lambda t: _scaled(t, 1 + s))
    return model


def residual_scaled(model: nn.Module) -> nn.Module:
    """The first decoder layer's output, residual stream included, scaled by 1 + s (a fused add-and-norm kernel
    that mis-adds the residual, say): no block's own output changes, only the layer's. (Not the last layer's:
    the final RMSNorm would undo a scale there, and the model would compute the same function.)"""
    s = _scale()
    _on_output(list(decoder_layers(model))[0], lambda t: _scaled(t, 1 + s))
    return model


def one_gradient_scaled(model: nn.Module) -> nn.Module:
    """The first decoder layer's attention query projection's weight gradient scaled by 1 + s (a fused
    backward that mis-scales one weight's gradient, say): the forward is untouched."""
    s = _scale()
    layer = list(decoder_layers(model))[0]
    weight = next(p for name, p in layer.named_parameters() if p.requires_grad and p.dim() == 2)
    weight.register_hook(lambda grad: _scaled(grad, 1 + s))
    return model


def miscompiled(model: nn.Module) -> nn.Module:
    """`torch.compile` whose graph scales every SiLU's output by 1 + s before inductor compiles it: a fault only the
    compiled code has (a miscompiled fusion, say); the model's own eager forward is right."""
    s = _scale()

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._inductor.compile_fx import compile_fx

        scaled = 0
        for node in list(graph.graph.nodes):
            if node.op == "call_function" and "silu" in getattr(node.target, "__name__", ""):
                with graph.graph.inserting_after(node):
                    wrong = graph.graph.call_function(_scaled, (node, 1 + s))
                node.replace_all_uses_with(wrong, delete_user_cb=lambda user: user is not wrong)
                scaled += 1
        if scaled:
            graph.recompile()
        return compile_fx(graph, example_inputs)

    torch._dynamo.reset()
    model.compile(backend=backend)
    return model
