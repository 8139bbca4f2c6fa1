"""A third-party fused MoE kernel for VeOmni, registered through VeOmni's own `KERNEL_REGISTRY`
(`moe_implementation="fused_toy"`), and the veosnap backends that check it (tests/test_veomni_adapter.py).

`grouped_gemm_moe` is a pure-torch grouped GEMM (tokens sorted by expert, one matmul per expert group) with a
hand-written autograd backward, in the signature of VeOmni's raw fused-MoE kernels. `BUG` plants a 1% bug in
expert `BUG_EXPERT`: `"forward"` scales that expert's output in the forward (the backward stays right for the
forward it should have been), `"down_grad"` scales only that expert's `down_proj` weight gradient. Backends:
`--backend tests/veomni_fused_moe.py:fused_toy` (clean), `:fused_toy_forward_bug`, `:fused_toy_down_grad_bug`;
torchrun's ranks resolve them by this path, so the file finds the adapter package itself.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "veomni"))
import veosnap_veomni as vv  # noqa: E402

BUG_EXPERT = 3
BUG = 1.01


class GroupedGemmMoe(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = experts[t, k]."""

    @staticmethod
    def forward(ctx, hidden, weights, experts, gate_up, down, bug):  # noqa: ANN001, ANN205
        _, slots = experts.flatten().sort(stable=True)  # the (token, k) slots grouped by expert
        counts = torch.bincount(experts.flatten(), minlength=gate_up.shape[0]).tolist()
        token = slots // experts.shape[1]
        x = hidden[token]
        out = torch.zeros_like(hidden)
        saved, start = [], 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            start += n
            if n == 0:
                continue
            gate, up = (x[rows] @ gate_up[e].T).chunk(2, dim=-1)
            act = F.silu(gate) * up
            y = act @ down[e].T
            if bug == "forward" and e == BUG_EXPERT:
                y = y * BUG
            w = weights.flatten()[slots[rows]]
            out.index_add_(0, token[rows], y * w[:, None])
            saved.append((e, rows, gate, up, act, y))
        ctx.save_for_backward(hidden, weights, gate_up, down, slots, token)
        ctx.groups, ctx.bug, ctx.k = saved, bug, experts.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, weights, gate_up, down, slots, token = ctx.saved_tensors
        x = hidden[token]
        grad_hidden = torch.zeros_like(hidden)
        grad_weights = torch.zeros_like(weights).flatten()
        grad_gate_up, grad_down = torch.zeros_like(gate_up), torch.zeros_like(down)
        for e, rows, gate, up, act, y in ctx.groups:
            g = grad_out[token[rows]]
            grad_weights[slots[rows]] = (g * y).sum(-1)
            gy = g * weights.flatten()[slots[rows]][:, None]
            if ctx.bug == "forward" and e == BUG_EXPERT:
                gy = gy * BUG  # the chain rule through the scaled output: the bug is the forward's alone
            grad_down[e] = gy.T @ act
            if ctx.bug == "down_grad" and e == BUG_EXPERT:
                grad_down[e] *= BUG
            g_act = gy @ down[e]
            sig = torch.sigmoid(gate)
            g_gate = g_act * up * sig * (1 + gate * (1 - sig))
            g_up = g_act * F.silu(gate)
            g_gu = torch.cat([g_gate, g_up], dim=-1)
            grad_gate_up[e] = g_gu.T @ x[rows]
            grad_hidden.index_add_(0, token[rows], g_gu @ gate_up[e])
        return grad_hidden, grad_weights.view_as(weights), None, grad_gate_up, grad_down, None


def grouped_gemm_moe(num_experts, routing_weights, selected_experts, hidden_states,  # noqa: ANN001, ANN201
                     fc1_1_weight, fc1_2_weight, fc2_weight, fc1_1_2_weight=None, swiglu_limit=None, *, bug: str = ""):
    """VeOmni's raw fused-MoE signature (`group_gemm_fused_moe_forward`), merged gate/up weights only."""
    if fc1_1_2_weight is None or swiglu_limit is not None:
        raise NotImplementedError("grouped_gemm_moe takes merged gate_up weights and no SwiGLU clamp")
    assert fc1_1_2_weight.shape[0] == num_experts
    return GroupedGemmMoe.apply(hidden_states, routing_weights, selected_experts, fc1_1_2_weight, fc2_weight, bug)


def _check(model: nn.Module, ctx, bug: str) -> Iterator:  # noqa: ANN001
    calls = []

    def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return grouped_gemm_moe(*args, **kwargs, bug=bug)

    with vv.restored():
        vv.register_fused_moe("toy", kernel, description="pure-torch grouped GEMM (tests/veomni_fused_moe.py)")
        for candidate in vv.candidate(model, ctx, vv.ops_config(moe_implementation="fused_toy")):
            yield candidate
            if not calls:  # a kernel that never ran would pass as the eager experts: refuse it
                raise RuntimeError("the fused_toy MoE kernel was never called")
            candidate.notes.append(f"fused_toy MoE kernel called {len(calls)} times")


def fused_toy(model: nn.Module, ctx) -> Iterator:  # noqa: ANN001
    """VeOmni's qwen3_moe with the toy grouped-GEMM kernel as its fused MoE."""
    yield from _check(model, ctx, "")


def fused_toy_forward_bug(model: nn.Module, ctx) -> Iterator:  # noqa: ANN001
    """The same with expert 3's forward output 1% too large."""
    yield from _check(model, ctx, "forward")


def fused_toy_down_grad_bug(model: nn.Module, ctx) -> Iterator:  # noqa: ANN001
    """The same with expert 3's down_proj weight gradient 1% too large (the forward is right)."""
    yield from _check(model, ctx, "down_grad")
