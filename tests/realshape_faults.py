"""Bugs that only show at real shapes, each a veosnap backend: `--backend tests/realshape_faults.py:<name>`.

Each is the kind of bug a real kernel has on a shape branch the toys never reach: a key length past
one block of 128, positions past 2048, vocabulary ids past 32767, an expert that receives no token,
more than 16 sequences packed in one row. At toy shapes (32 tokens, vocabulary 256, every expert used,
4 sequences) each one is the reference itself, bit for bit, so it passes every toy golden; a
real-shape golden whose batch reaches the branch fails, naming the tensor at fault. This is why the
real-shape tier exists (tests/test_realshape.py shows both sides).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from veosnap import Unsupported
from veosnap.reference.probes import decoder_layers, find_moe_layers

KEY_BLOCK = 128  # the key block of a tiled attention kernel
ROPE_EXACT_UNTIL = 2048  # positions from here get their rotary table in bfloat16
INT16_LIMIT = 32768  # token ids from here wrap in an int16 index
VARLEN_EXACT_SEQUENCES = 16  # packed sequences after the 16th get their boundary one token late


def _eager_for(module: nn.Module):  # noqa: ANN202
    """The model family's own eager attention function (GPT-OSS adds sinks, for one)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def _tail_block_dropped(module, query, key, value, mask, **kw):  # noqa: ANN001, ANN003, ANN202
    # A tiled kernel that runs the full key blocks and skips the last, partial one: only wrong when
    # the key length is over one block and not a multiple of it.
    length = key.shape[-2]
    tail = length % KEY_BLOCK
    if length > KEY_BLOCK and tail and mask is not None:
        mask = mask.clone()
        mask[..., length - tail:] = torch.finfo(mask.dtype).min
    return _eager_for(module)(module, query, key, value, mask, **kw)


AttentionInterface.register("veosnap_fault_tail_block", _tail_block_dropped)
AttentionMaskInterface.register("veosnap_fault_tail_block", eager_mask)  # eager's additive float mask


def tail_key_block_dropped(model: nn.Module) -> nn.Module:
    """Attention ignores the last partial key block of 128 (every layer), once there is a full one."""
    model.set_attn_implementation("veosnap_fault_tail_block")
    return model


def rope_low_precision_far(model: nn.Module) -> nn.Module:
    """The rotary table is computed in bfloat16 for positions from 2048 on (exact below)."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None:
        raise Unsupported("no shared rotary embedding (model.model.rotary_emb) to plant this fault in")

    def hook(_module, args, kwargs, output):  # noqa: ANN001, ANN202
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is None or int(positions.max()) < ROPE_EXACT_UNTIL:
            return output
        far = (positions >= ROPE_EXACT_UNTIL).unsqueeze(-1)
        return tuple(torch.where(far, t.to(torch.bfloat16).to(t.dtype), t) for t in output)

    rotary.register_forward_hook(hook, with_kwargs=True)
    return model


def rope_angle_low_precision_far(model: nn.Module) -> nn.Module:
    """The rotary angles (position x inverse frequency) are computed in bfloat16 for positions from 2048 on, as a
    kernel running under autocast without transformers' guard would (exact below). Unlike a table rounded to
    bfloat16 (`rope_low_precision_far`, which a bfloat16 model's table already is), this is wrong in every dtype:
    bfloat16 holds positions past 2048 only to a multiple of 16."""
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)
    if rotary is None or not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise Unsupported("no shared rotary embedding with inv_freq (model.model.rotary_emb) to plant this fault in")

    def hook(module, args, kwargs, output):  # noqa: ANN001, ANN202
        positions = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        if positions is None or positions.dim() != 2 or int(positions.max()) < ROPE_EXACT_UNTIL:
            return output
        cos, sin = output
        angles = (positions[..., None].to(torch.bfloat16) * module.inv_freq.to(positions.device, torch.bfloat16))
        table = torch.cat((angles, angles), dim=-1).float()
        if table.shape != cos.shape:
            raise RuntimeError(f"rotary table {tuple(cos.shape)} is not [batch, positions, 2 x inv_freq]")
        scale = getattr(module, "attention_scaling", 1.0)
        far = (positions >= ROPE_EXACT_UNTIL).unsqueeze(-1)
        return (torch.where(far, (table.cos() * scale).to(cos.dtype), cos),
                torch.where(far, (table.sin() * scale).to(sin.dtype), sin))

    rotary.register_forward_hook(hook, with_kwargs=True)
    return model


def loss_int16_vocab(model: nn.Module) -> nn.Module:
    """The loss kernel indexes the vocabulary with an int16: a label id of 32768 or more reads the
    row of (id mod 32768) (the sign bit masked off), so it trains the wrong logit."""
    loss_function = model.loss_function

    def loss(logits, labels, vocab_size, **kwargs):  # noqa: ANN001, ANN003, ANN202
        wrapped = torch.where(labels >= INT16_LIMIT, labels % INT16_LIMIT, labels)
        return loss_function(logits, wrapped, vocab_size, **kwargs)

    model.loss_function = loss
    return model


def empty_expert_shifts_groups(model: nn.Module) -> nn.Module:
    """A grouped GEMM whose group offsets skip an expert with no tokens: the next expert's tokens are
    multiplied by the empty expert's weights (every MoE layer). Exact when every expert has a token."""
    layers = find_moe_layers(model)
    if not layers:
        raise Unsupported("no MoE layer to plant this fault in")
    for moe in layers:
        experts = decoder_layers(model)[moe.layer].mlp.experts
        forward = experts.forward

        def shifted(hidden_states, top_k_index, top_k_weights, _forward=forward, _experts=moe.num_experts):  # noqa: ANN001, ANN202
            counts = torch.bincount(top_k_index.flatten(), minlength=_experts)
            index = top_k_index.clone()
            for empty in (counts[:-1] == 0).nonzero().flatten().tolist():
                index[top_k_index == empty + 1] = empty
            return _forward(hidden_states, index, top_k_weights)

        experts.forward = shifted
    return model


def varlen_boundary_late(model: nn.Module) -> nn.Module:
    """Packed sequences after the 16th in a row start one token late (cu_seqlens off by one from
    there on): their first token is taken for the previous sequence's last one."""
    inner = getattr(model, "model", None)
    if inner is None:
        raise Unsupported("no base model (model.model) to plant this fault in")

    def hook(_module, args, kwargs):  # noqa: ANN001, ANN202
        positions, mask = kwargs.get("position_ids"), kwargs.get("attention_mask")
        if positions is None:
            return None
        real = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else torch.ones_like(positions, dtype=torch.bool)
        late = positions.clone()
        for row in range(positions.shape[0]):
            starts = ((positions[row] == 0) & real[row]).nonzero().flatten().tolist()
            for number, start in enumerate(starts[VARLEN_EXACT_SEQUENCES:], VARLEN_EXACT_SEQUENCES):
                end = starts[number + 1] if number + 1 < len(starts) else positions.shape[1]
                late[row, start] = late[row, start - 1] + 1
                late[row, start + 1:end] = torch.arange(end - start - 1, device=positions.device)
        return args, {**kwargs, "position_ids": late}

    inner.register_forward_pre_hook(hook, with_kwargs=True)
    return model


# Name -> (the tensor the check must name among its failures, what the golden's batch must reach).
FAULTS = {
    "tail_key_block_dropped": ("layers.0.output", "a key length over 128 and not a multiple of it"),
    "rope_low_precision_far": ("layers.0.output", "positions of 2048 or more"),
    "rope_angle_low_precision_far": ("layers.0.output", "positions of 2048 or more"),
    "loss_int16_vocab": ("loss", "label ids of 32768 or more"),
    "empty_expert_shifts_groups": ("moe", "an expert without tokens, before one with tokens"),
    "varlen_boundary_late": ("layers.0.output", "more than 16 sequences packed in one row"),
}
