"""Item 2: a router that returns its logits only (the MoE block picks the experts), as VeOmni's DeepSeek-V3.

    veosnap check --model qwen3_moe --dtype float32 --backend examples/veomni/repro/item2_one_tensor_router.py:logits_router

The model computes exactly the reference's function (same choice, same weights), yet main reads the
router's output as `(logits, weights, indices)` = rows 0, 1 and 2 of the logits, and fails.
`:hidden_router` moves `top_k` off the router (VeOmni's DeepSeek-V3 router has none): main finds no
router and reports "routing differs: layer L sends 86 of 86 tokens" for a bit-identical model.
"""

import torch
import torch.nn.functional as F


def _pick(block, logits):
    weights = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(weights, block.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def _moe_blocks(model):
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]


def logits_router(model):
    for block in _moe_blocks(model):
        block.top_k = block.gate.top_k
        gate = block.gate
        gate.forward = lambda hidden, gate=gate: F.linear(hidden.view(-1, gate.weight.shape[1]), gate.weight)

        def forward(hidden, block=block):
            flat = hidden.view(-1, hidden.shape[-1])
            weights, experts = _pick(block, block.gate(flat))
            return block.experts(flat, experts, weights).view_as(hidden)

        block.forward = forward
    return model


def hidden_router(model):
    model = logits_router(model)
    for block in _moe_blocks(model):
        del block.gate.top_k  # the block keeps it, as VeOmni's DeepseekV3MoE does
    return model
