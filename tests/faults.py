"""Bugs planted on purpose, each a veosnap backend: `--backend tests/faults.py:<name>`.

Each one patches the reference model the way a real kernel or framework bug would, in one layer,
one token, one row or one parameter where the bug allows, so the tests can show veosnap names the
tensor at fault. They double as examples of the backend plugin contract: a function that takes the
built model and returns the model to run.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from veosnap import Unsupported
from veosnap.reference.probes import decoder_layers, find_moe_layers

FAULT_LAYER = 1  # faults confined to one layer go in the second decoder layer
PAD_LEAK_ROW = 1  # the batch row (a 17-token sequence behind 15 pads) whose mask is broken


def _eager_for(module: nn.Module):  # noqa: ANN202
    """The model family's own eager attention function (GPT-OSS adds sinks, for one)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _attention_fault(name: str, fault, every_layer: bool = False) -> callable:  # noqa: ANN001
    """A backend that runs `fault` instead of eager attention in layer FAULT_LAYER (or every layer)."""

    def attention(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if every_layer or getattr(module, "layer_idx", None) == FAULT_LAYER:
            return fault(module, query, key, value, attention_mask, **kwargs)
        return _eager_for(module)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)  # eager's additive float mask, not sdpa's boolean one

    def backend(model: nn.Module) -> nn.Module:
        model.set_attn_implementation(name)
        return model

    return backend


def _kv_groups_swapped(module, query, key, value, mask, **kw):  # noqa: ANN001, ANN003, ANN202
    # GQA bug: key/value heads handed to the wrong group of query heads.
    return _eager_for(module)(module, query, key.flip(1), value.flip(1), mask, **kw)


def _pad_leak(module, query, key, value, mask, **kw):  # noqa: ANN001, ANN003, ANN202
    # Mask bug: one sequence's padding is not masked (causality kept), so it attends to its pads.
    if mask is not None:
        mask = mask.clone()
        seq = mask.shape[-1]
        causal = torch.triu(torch.full((seq, seq), torch.finfo(mask.dtype).min, dtype=mask.dtype), 1)
        mask[PAD_LEAK_ROW] = causal.to(mask.device)
    return _eager_for(module)(module, query, key, value, mask, **kw)


def _scale_off(module, query, key, value, mask, scaling, **kw):  # noqa: ANN001, ANN003, ANN202
    # Small bug: a softmax scale off by 0.1% (e.g. a rounded 1/sqrt(d) constant).
    return _eager_for(module)(module, query, key, value, mask, scaling=scaling * 1.001, **kw)


def _next_token_visible(module, query, key, value, mask, **kw):  # noqa: ANN001, ANN003, ANN202
    # Causal mask off by one: every token also sees the next one.
    if mask is not None:
        mask = torch.maximum(mask, torch.roll(mask, shifts=-1, dims=-1).masked_fill(
            torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device).roll(1, dims=-1), 0.0))
    return _eager_for(module)(module, query, key, value, mask, **kw)


def _low_precision_attention(module, query, key, value, mask, scaling, dropout=0.0, **kw):  # noqa: ANN001, ANN003, ANN202
    # Precision regression: QK^T and P @ V accumulated, and the softmax taken, in the input dtype, as
    # a kernel with bf16 accumulators would. In float32 this is the reference's arithmetic reordered.
    if hasattr(module, "sinks"):  # GPT-OSS: sinks need the family's own softmax
        return _eager_for(module)(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kw)
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.zeros(query.shape[:-1] + (key.shape[-2],), dtype=query.dtype, device=query.device)
    for d in range(query.shape[-1]):  # one rounding per step, like a low-precision accumulator
        scores = scores + query[..., d : d + 1] * key[..., d].unsqueeze(-2)
    scores = scores * scaling
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)  # no float32 upcast
    out = torch.zeros(probs.shape[:-1] + (value.shape[-1],), dtype=value.dtype, device=value.device)
    for j in range(value.shape[-2]):  # P @ V accumulated key by key in the input dtype too
        out = out + probs[..., j : j + 1] * value[..., j, :].unsqueeze(-2)
    return out.transpose(1, 2).contiguous(), probs


def _fp8_probabilities(module, query, key, value, mask, scaling, dropout=0.0, **kw):  # noqa: ANN001, ANN003, ANN202
    # Precision regression: FP8 attention (probabilities in float8 e4m3 for P @ V) left enabled in a
    # 16-bit run, as FP8 attention kernels do only for 16-bit inputs. float32 runs are untouched.
    if query.dtype == torch.float32 or hasattr(module, "sinks"):
        return _eager_for(module)(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kw)
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    probs = probs.to(torch.float8_e4m3fn).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


kv_groups_swapped = _attention_fault("veosnap_fault_kv_groups", _kv_groups_swapped)
pad_leak = _attention_fault("veosnap_fault_pad_leak", _pad_leak)
softmax_scale_off = _attention_fault("veosnap_fault_scale", _scale_off)
next_token_visible = _attention_fault("veosnap_fault_next_token", _next_token_visible)
low_precision_attention = _attention_fault("veosnap_fault_low_precision", _low_precision_attention, every_layer=True)
fp8_attention_probabilities = _attention_fault("veosnap_fault_fp8_probs", _fp8_probabilities, every_layer=True)


def swapped_activation(model: nn.Module) -> nn.Module:
    """The MLP activation of one layer is GELU instead of SiLU."""
    mlp = decoder_layers(model)[FAULT_LAYER].mlp
    for module in mlp.modules():
        if hasattr(module, "act_fn"):
            module.act_fn = nn.GELU()
    if not any(hasattr(m, "act_fn") for m in mlp.modules()):  # GPT-OSS experts gate inline
        experts = mlp.experts
        experts.alpha = experts.alpha * 0.5
    return model


def _moe_layers(model: nn.Module) -> list:
    layers = find_moe_layers(model)
    if not layers:
        raise Unsupported("no MoE layer to plant this fault in")
    return layers


def unweighted_experts(model: nn.Module) -> nn.Module:
    """One MoE layer sums its experts' outputs without their routing weights."""
    moe = _moe_layers(model)[-1]
    experts = decoder_layers(model)[moe.layer].mlp.experts
    forward = experts.forward

    def summed(hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
        return forward(hidden_states, top_k_index, torch.ones_like(top_k_weights))

    experts.forward = summed
    return model


def one_token_rerouted(model: nn.Module) -> nn.Module:
    """One MoE layer sends one token to an expert it did not choose (a clear routing flip)."""
    moe = _moe_layers(model)[0]

    def hook(_module, _inputs, output):  # noqa: ANN001, ANN202
        logits, weights, indices = output[0], output[1], output[2].clone()
        token = indices.shape[0] - 1  # the last token of the batch: a real token (left padding)
        chosen = set(indices[token].tolist())
        indices[token, 0] = next(e for e in range(moe.num_experts) if e not in chosen)
        return (logits, weights, indices)

    moe.router.register_forward_hook(hook)
    return model


def norm_eps_wrong(model: nn.Module) -> nn.Module:
    """One layer's input RMSNorm uses eps 1e-3 instead of the config's (a small bug)."""
    norm = decoder_layers(model)[FAULT_LAYER].input_layernorm
    norm.variance_epsilon = 1e-3
    return model


def dropped_norm_gradient(model: nn.Module) -> nn.Module:
    """One parameter's gradient is lost (as if it were detached): layer 1's input norm weight."""
    weight = decoder_layers(model)[FAULT_LAYER].input_layernorm.weight
    weight.register_hook(torch.zeros_like)
    return model


def loss_counts_padding(model: nn.Module) -> nn.Module:
    """The fused loss forgets ignore_index: padded positions are trained to predict token 0."""
    loss_function = model.loss_function

    def loss(logits, labels, vocab_size, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return loss_function(logits, labels.clamp(min=0), vocab_size, **kwargs)

    model.loss_function = loss
    return model


def _load_balancing(model: nn.Module):  # noqa: ANN202
    """The transformers module whose `load_balancing_loss_func` this model's loss calls."""
    if not getattr(model.config, "output_router_logits", False):
        raise Unsupported("no load-balancing loss in this model's loss (output_router_logits is off)")
    module = sys.modules[type(model).__module__]
    if not hasattr(module, "load_balancing_loss_func"):
        raise Unsupported(f"{module.__name__} has no load_balancing_loss_func")
    return module


def aux_loss_counts_padding(model: nn.Module):  # noqa: ANN201
    """The MoE load-balancing loss counts the padding tokens (the attention mask is not passed to it)."""
    module = _load_balancing(model)
    original = module.load_balancing_loss_func

    def unmasked(gate_logits, num_experts=None, top_k=2, attention_mask=None):  # noqa: ANN001, ANN202
        return original(gate_logits, num_experts, top_k, None)

    module.load_balancing_loss_func = unmasked
    try:
        yield model
    finally:  # a process-wide patch: undone when the check is done
        module.load_balancing_loss_func = original


def aux_loss_coefficient_dropped(model: nn.Module) -> nn.Module:
    """The load-balancing loss is added without its coefficient (router_aux_loss_coef taken as 1)."""
    _load_balancing(model)
    model.router_aux_loss_coef = 1.0
    return model


def aux_loss_left_out(model: nn.Module) -> nn.Module:
    """The load-balancing loss is left out of the loss (a framework that computes only cross-entropy)."""
    _load_balancing(model)
    model.router_aux_loss_coef = 0.0
    return model


# Bugs in the MoE load-balancing (auxiliary) loss: checked against the `*_aux` goldens, whose loss holds it.
AUX_LOSS_FAULTS = ["aux_loss_counts_padding", "aux_loss_coefficient_dropped", "aux_loss_left_out"]

# Name -> (bug size, what the check must name). "large": fails in float32 and bfloat16;
# "small": fails in float32, may hide under bfloat16 noise.
FAULTS = {
    "swapped_activation": ("large", "layers.1.output"),
    "kv_groups_swapped": ("large", "layers.1.output"),
    "pad_leak": ("large", "layers.1.output"),
    "next_token_visible": ("large", "layers.1.output"),
    "unweighted_experts": ("large", "moe"),
    "one_token_rerouted": ("large", "routes"),
    "loss_counts_padding": ("large", "loss"),
    "dropped_norm_gradient": ("large", "grad.model.layers.1.input_layernorm.weight"),
    "softmax_scale_off": ("small", "layers.1.output"),
    "norm_eps_wrong": ("small", "layers.1.output"),
}
# Precision regressions: exact in float32, judged by the bfloat16 goldens. FP8 probabilities are far
# outside bf16 noise and fail; bf16 accumulators in attention add about 1.5x the reference's own
# bf16 noise and stay inside the bound (tools/measure/calibrate_tolerance.py prints both).
PRECISION_FAULTS = {"fp8_attention_probabilities": "fails", "low_precision_attention": "within bound"}


def expert_bias_grad_in_bfloat16(model: nn.Module) -> nn.Module:
    """The MoE experts' bias gradients rounded to bfloat16, as a grouped GEMM that accumulates them in low
    precision does (transformers' grouped_mm on GPT-OSS: docs/findings/transformers-grouped-mm-bias-grad-bf16.md).
    Every other tensor is untouched; a float32 golden's bounds catch it."""
    biases = [p for name, p in model.named_parameters() if ".experts." in name and name.endswith("_bias")]
    if not biases:
        raise Unsupported("no expert biases to plant this fault in")
    for parameter in biases:
        parameter.register_hook(lambda grad: grad.to(torch.bfloat16).to(grad.dtype))
    return model


def first_layer_scaled(model: nn.Module) -> nn.Module:
    """A bug any architecture can have: decoder layer 0's output 1% too large (a residual scale off, say)."""

    def scale(_module: nn.Module, _inputs: tuple, output: object) -> object:
        if isinstance(output, (tuple, list)):  # GPT's blocks return a list
            return type(output)([output[0] * 1.01, *output[1:]])
        return output * 1.01

    decoder_layers(model)[0].register_forward_hook(scale)
    return model
