"""A user's attention kernel as a veosnap backend: register it with transformers, switch the model to it.

Check it against every golden with one command:

    veosnap check --backend examples/my_attention_backend.py:my_attention

`my_attention_buggy` is the same kernel with a classic bug (it ignores the padding mask), to show
what a failure looks like:

    veosnap check --model llama --dtype float32 --backend examples/my_attention_backend.py:my_attention_buggy
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from veosnap import Unsupported


def attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      *, ignore_padding: bool = False, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch attention. query: (batch, heads, q, dim); key, value: (batch, kv_heads, k, dim).

    `attention_mask` is additive (0 where a query may attend, a large negative number elsewhere),
    because the mask function registered below is transformers' eager one.
    """
    groups = query.shape[1] // key.shape[1]  # grouped-query attention: share each kv head
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[-2]]
        if ignore_padding:  # the bug: keep only the causal part, so real tokens attend to padding
            mask = torch.full_like(mask, torch.finfo(mask.dtype).min).triu(1)
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def buggy_attention_forward(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_forward(*args, ignore_padding=True, **kwargs)


AttentionInterface.register("my_attention", attention_forward)
AttentionInterface.register("my_attention_buggy", buggy_attention_forward)
AttentionMaskInterface.register("my_attention", eager_mask)
AttentionMaskInterface.register("my_attention_buggy", eager_mask)


def _switch(model: nn.Module, implementation: str) -> nn.Module:
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise Unsupported(f"{implementation} has no attention sinks")  # reported as a skipped check
    model.set_attn_implementation(implementation)
    return model


def my_attention(model: nn.Module) -> nn.Module:
    """The veosnap backend: veosnap passes the reference model, this returns the candidate."""
    return _switch(model, "my_attention")


def my_attention_buggy(model: nn.Module) -> nn.Module:
    return _switch(model, "my_attention_buggy")
