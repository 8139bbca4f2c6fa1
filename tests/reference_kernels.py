"""Plain-torch stand-ins for the kernel libraries' entry points, with the libraries' calling conventions.

The `fa4`, `fla` and `quack` backends call their library through a small `Kernels` record; these
stand-ins let the CPU suite run each backend's own plumbing (unpadding, cu_seqlens from position ids,
sinks and windows, expert sorting and the grouped GEMM's autograd) against the cpu goldens. They
compute in the inputs' dtype, as the eager reference does, so a correct backend passes and a wrong
boundary, offset or transpose fails.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5

from veosnap.candidates.kernels import fa4, fla, quack

# --- flash-attn 4: flash_attn_func / flash_attn_varlen_func -------------------------------------------


def flash_dense(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                softcap=0.0, **unused):
    """[batch, positions, heads, dim] attention as fa4 defines it: causal aligned bottom-right,
    window (left, right) in keys, a learnable sink an extra logit per query head."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    lq, lk = q.shape[1], k.shape[1]
    qi = torch.arange(lq, device=q.device).unsqueeze(1) + (lk - lq)
    kj = torch.arange(lk, device=q.device).unsqueeze(0)
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    left, right = window_size
    if causal:
        right = 0
    if left is not None:
        allowed &= kj >= qi - left
    if right is not None:
        allowed &= kj <= qi + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    if learnable_sink is not None:
        sink = learnable_sink.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if learnable_sink is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), None


def flash_varlen(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **options):
    """[total, heads, dim]: each sequence of cu_seqlens on its own."""
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        sq = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        sk = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
        out, _ = flash_dense(q[sq][None], k[sk][None], v[sk][None], **options)
        outs.append(out[0])
    return torch.cat(outs), None


FA4 = fa4.Kernels(flash_dense, flash_varlen, label="torch stand-in for flash_attn.cute",
                  dtypes=(torch.float32, torch.bfloat16))


# --- quack: gemm(A, B, cu_seqlens_m=...) / gemm(A, B, cu_seqlens_k=...) -----------------------------


def grouped_gemm(a, b, cu_seqlens_m=None, cu_seqlens_k=None, **unused):
    """quack's varlen GEMM: per group g, A[rows of g] @ B[g] (varlen M) or A[:, cols of g] @ B[rows of g] (varlen K)."""
    if cu_seqlens_m is not None:
        out = a.new_empty(a.shape[0], b.shape[-1])
        for g in range(cu_seqlens_m.numel() - 1):
            rows = slice(int(cu_seqlens_m[g]), int(cu_seqlens_m[g + 1]))
            out[rows] = a[rows] @ b[g]
        return out
    groups = cu_seqlens_k.numel() - 1
    out = a.new_zeros(groups, a.shape[0], b.shape[-1])
    for g in range(groups):
        cols = slice(int(cu_seqlens_k[g]), int(cu_seqlens_k[g + 1]))
        out[g] = a[:, cols] @ b[cols]
    return out


QUACK = quack.Kernels(grouped_gemm, label="torch stand-in for quack's grouped GEMM",
                      dtypes=(torch.float32, torch.bfloat16))


# --- fla: chunk_gated_delta_rule / causal_conv1d -------------------------------------------------------


def _segments(length, cu_seqlens):
    if cu_seqlens is None:
        return [slice(0, length)]
    return [slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1])) for i in range(cu_seqlens.numel() - 1)]


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """transformers' torch delta rule, run on each sequence of cu_seqlens on its own (fla's varlen contract)."""
    outs = [_TORCH_RULE(q[:, s], k[:, s], v[:, s], g=g[:, s], beta=beta[:, s],
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s in _segments(q.shape[1], cu_seqlens)]
    return torch.cat(outs, dim=1), None


# Read before any backend swaps the module's function (transformers may have wrapped it around fla's).
_TORCH_RULE = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def causal_conv1d(x, weight=None, bias=None, activation=None, cu_seqlens=None, **unused):
    """fla's causal conv on [batch, positions, channels], each sequence of cu_seqlens on its own."""
    outs = []
    for s in _segments(x.shape[1], cu_seqlens):
        seg = x[:, s].transpose(1, 2)
        out = F.conv1d(F.pad(seg, (weight.shape[-1] - 1, 0)), weight.unsqueeze(1), bias, groups=seg.shape[1])
        outs.append(out.transpose(1, 2))
    out = torch.cat(outs, dim=1)
    return (F.silu(out) if activation in ("silu", "swish") else out), None


FLA = fla.Kernels(chunk_gated_delta_rule, causal_conv1d, label="torch stand-in for fla")


# --- backends on the stand-ins, as a test registers them ----------------------------------------------


def fa4_on_torch(model):
    yield from fa4.switch(model, FA4)


def quack_on_torch(model):
    yield from quack.switch(model, QUACK)


def fla_on_torch(model):
    yield from fla.switch(model, FLA)
