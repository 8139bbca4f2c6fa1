"""`quack`: every MoE experts module through quack's grouped GEMM (CuTe DSL; Hopper and newer).

Registered as the experts implementation `quack` in transformers' `ExpertsInterface` (beside `eager`,
`grouped_mm`, `batched_mm`), and the model switched to it for the check. The forward is transformers'
`grouped_mm` experts forward with its two grouped matrix products done by quack instead of
`torch._grouped_mm`: the (token, expert) pairs sorted by expert, each expert's rows multiplied by its
own weight matrix in one varlen-M GEMM (`cu_seqlens_m`: the experts' row offsets), biases, the gate
and the routing weights applied in torch. The backward is quack's too (`GroupedMM`): the input
gradient is a varlen-M GEMM with the transposed weights, each expert's weight gradient a varlen-K GEMM
over its own rows (`cu_seqlens_k`), an expert with no rows giving a zero gradient.

Declined with the reason: dense models (no experts module), and float32/float64 goldens (quack's
Hopper GEMM takes float16, bfloat16 and fp8 operands).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import Unsupported
from ..candidate import Candidate
from .support import Ran, decline, gpu_library, installed

NAME = "quack"
IMPLEMENTATION = "quack"  # its key in transformers' ExpertsInterface
requires = gpu_library("quack", "quack-kernels", "pip install quack-kernels; it compiles its kernels at first "
                       "use through nvidia-cutlass-dsl", capability=(9, 0))


@dataclass(frozen=True)
class Kernels:
    """quack's GEMM, called as `gemm(A, B, cu_seqlens_m=...)` or `gemm(A, B, cu_seqlens_k=...)`."""

    gemm: Callable
    label: str = "quack"
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


def library() -> Kernels:
    from quack.gemm_interface import gemm

    # tuned=False: quack's default tile configuration, no autotuning sweep (minutes of JIT per shape).
    return Kernels(functools.partial(gemm, tuned=False), label=f"quack {installed('quack-kernels')} grouped GEMM")


def quack(model: nn.Module) -> Iterator[Candidate]:
    """Every MoE experts module through quack's grouped GEMM, forward and backward (GPU, 16-bit)."""
    decline(requires() or _dense(model))  # before importing quack, which compiles through the CuTe DSL
    yield from switch(model, library())


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that dispatch through transformers' experts interface (`@use_experts_implementation`)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate")]


def _dense(model: nn.Module) -> str | None:
    """Why quack changes nothing in `model` (None: it has MoE experts modules)."""
    if experts_modules(model):
        return None
    return f"{type(model).__name__} has no MoE experts module (quack replaces the experts' GEMMs)"


def switch(model: nn.Module, kernels: Kernels) -> Iterator[Candidate]:
    """Switch `model`'s experts to `kernels` for the check, say what ran, and unregister after."""
    from transformers.integrations.moe import ExpertsInterface

    decline(_dense(model))
    dtype = next(model.parameters()).dtype
    if dtype not in kernels.dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in kernels.dtypes)
        raise Unsupported(f"{kernels.label} multiplies {names} operands, not {str(dtype).removeprefix('torch.')}")
    ran = Ran(NAME, model, "experts modules")
    table = ExpertsInterface._global_mapping
    saved = table.get(IMPLEMENTATION)
    ExpertsInterface.register(IMPLEMENTATION, experts_forward(kernels, ran))
    try:
        model.set_experts_implementation(IMPLEMENTATION)
        yield from ran.candidate(model, f"experts: {kernels.label}, forward and backward")
    finally:
        if saved is None:
            table.pop(IMPLEMENTATION, None)
        else:
            table[IMPLEMENTATION] = saved


class GroupedMM(torch.autograd.Function):
    """`out[r] = x[r] @ w[e]` for the rows r of each group e (`cu`: the groups' row offsets), on quack."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, cu: torch.Tensor, gemm: Callable) -> torch.Tensor:
        ctx.save_for_backward(x, w, cu)
        ctx.gemm = gemm
        return gemm(x, w, cu_seqlens_m=cu)  # x [rows, k] (k-major), w [groups, k, n] -> [rows, n]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w, cu = ctx.saved_tensors
        grad = grad.contiguous()
        dx = ctx.gemm(grad, w.mT, cu_seqlens_m=cu) if ctx.needs_input_grad[0] else None
        # Per group, x[rows].T @ grad[rows]: the contraction runs over the group's own rows (varlen K),
        # x.T is m-major as quack wants it; a group without rows gets a zero gradient.
        dw = ctx.gemm(x.T, grad, cu_seqlens_k=cu) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def experts_forward(kernels: Kernels, ran: Ran) -> Callable:
    """An `ExpertsInterface` function: transformers' grouped_mm experts forward, its GEMMs on quack."""

    def forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        ran.call(self, "experts forward on grouped GEMMs")
        top_k = top_k_index.size(-1)
        tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]
        expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)
        # Expert parallel marks pairs routed to other ranks with ids >= num_experts: they sort last,
        # and only the pairs before them are multiplied (the rest contribute zero).
        valid = int((expert_ids < self.num_experts).sum())
        ids = expert_ids[:valid]
        counts = torch.bincount(ids, minlength=self.num_experts)
        cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        rows = hidden_states[order[:valid] // top_k].contiguous()

        up = self.gate_up_proj if self.has_gate else self.up_proj
        up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
        out = _linear(rows, up, up_bias, ids, cu, self.is_transposed, kernels.gemm)
        out = self._apply_gate(out) if self.has_gate else self.act_fn(out)
        out = _linear(out.contiguous(), self.down_proj, self.down_proj_bias if self.has_bias else None, ids, cu,
                      self.is_transposed, kernels.gemm)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1)[order[:valid]].unsqueeze(-1)
        if valid < order.numel():
            out = torch.cat([out, out.new_zeros(order.numel() - valid, hidden)])
        pairs = torch.empty_like(out).index_copy(0, order, out)  # back to (token, k) order
        return pairs.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

    return forward


def _linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor,
            cu: torch.Tensor, transposed: bool, gemm: Callable) -> torch.Tensor:
    """Each expert's rows times its weight (stored [experts, out, in], or [experts, in, out] if transposed)."""
    out = GroupedMM.apply(rows, weight if transposed else weight.transpose(-2, -1), cu, gemm)
    if bias is None:
        return out
    if bias.dtype in (torch.float16, torch.bfloat16):
        # The gather's backward adds each row's gradient into its expert's bias one row at a time, in the
        # bias's dtype: in bfloat16 that is 3-6x eager's error at ~256 rows an expert (gpt_oss-real on the
        # H200: 3.5x; eager sums an expert's rows in one float32-accumulated reduction). A float32 gather
        # accumulates in float32 and rounds once; the forward rounds the same sum once, as before.
        return (out.float() + bias.float()[ids]).to(out.dtype)
    return out + bias[ids]
