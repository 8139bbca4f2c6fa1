"""Minimal reproductions, outside veosnap, of float32 Triton kernels losing precision to TF32.

    python tools/repro_tf32.py liger     # liger-kernel's fused MoE experts (LigerExperts) in float32
    python tools/repro_tf32.py fla       # flash-linear-attention's chunk_gated_delta_rule in float32
    TRITON_F32_DEFAULT=ieee TRITON_CACHE_DIR=$(mktemp -d) python tools/repro_tf32.py liger   # the same, IEEE dots

Each compares, on random inputs of realistic width, the library's float32 result and the plain torch
float32 result with a float64 run of the same function, forward and gradients (relative L2 error), with
torch's TF32 off (what `torch.backends.cuda.matmul.allow_tf32 = False` promises) and, as the signature
of TF32 rounding, with it on. Hypothesis: Triton's `tl.dot` rounds float32 operands to TF32 unless told
otherwise (input_precision "tf32" is its default on NVIDIA GPUs, whatever torch's setting), so the
library lands near torch-with-TF32 by default and near torch-without-TF32 with TRITON_F32_DEFAULT=ieee
(a fresh TRITON_CACHE_DIR, so no kernel compiled the other way is reused). The last line printed is
the numbers as JSON. Needs a CUDA GPU, torch, transformers and the library; nothing from veosnap.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import sys

import torch
import torch.nn.functional as F

DEVICE = os.environ.get("REPRO_DEVICE", "cuda")  # cpu only to try the script's torch rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against the float64 `b`."""
    return float((a.double() - b).norm() / b.norm())


def tf32(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on


def liger() -> dict:
    """transformers' Qwen3-MoE experts, eager vs liger's fused MoE (the module liger 0.8.5 binds to them)."""
    import liger_kernel
    from liger_kernel.transformers.monkey_patch import _patch_swiglu_module
    from liger_kernel.transformers.swiglu import LigerExperts
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 1024, 2048, 768, 16, 4  # Qwen3-30B-A3B widths, fewer experts
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                            num_experts_per_tok=top_k)
    config._experts_implementation = "eager"
    eager = Qwen3MoeExperts(config)
    torch.nn.init.normal_(eager.gate_up_proj, std=hidden ** -0.5)
    torch.nn.init.normal_(eager.down_proj, std=inter ** -0.5)
    eager = eager.to(DEVICE)
    x = torch.randn(tokens, hidden, device=DEVICE)
    index = torch.rand(tokens, experts, device=DEVICE).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEVICE), dim=-1)
    grad_out = torch.randn(tokens, hidden, device=DEVICE)

    def run(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        module = copy.deepcopy(module).to(dtype)
        xi = x.to(dtype).clone().requires_grad_(True)
        out = module(xi, index, weights.to(dtype))
        out.backward(grad_out.to(dtype))
        return out.detach(), xi.grad, module.gate_up_proj.grad, module.down_proj.grad

    reference = run(eager, torch.float64)
    patched = copy.deepcopy(eager)
    _patch_swiglu_module(patched, LigerExperts)  # what liger's apply_liger_kernel_to_qwen3_moe does per layer
    results = {}
    for label, module, allow in [("torch float32, TF32 off", eager, False), ("torch float32, TF32 on", eager, True),
                                 ("liger float32 (torch TF32 off)", patched, False)]:
        tf32(allow)
        got = run(module, torch.float32)
        results[label] = dict(zip(("output", "grad_input", "grad_gate_up_proj", "grad_down_proj"),
                                  (rel(g, r) for g, r in zip(got, reference))))
    tf32(False)
    return {"library": f"liger-kernel {liger_kernel.__version__ if hasattr(liger_kernel, '__version__') else ''}",
            "shape": dict(tokens=tokens, hidden=hidden, intermediate=inter, experts=experts, top_k=top_k),
            "results": results}


def fla() -> dict:
    """fla's chunk_gated_delta_rule vs transformers' torch version (Qwen3.5), both against float64."""
    import fla as fla_package
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5

    torch_rule = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)  # unwrap: never fla itself
    torch.manual_seed(0)
    batch, length, heads, v_heads, dim = 1, 1024, 4, 8, 128  # Qwen3.5's linear-attention widths
    q, k = (torch.randn(batch, length, heads, dim, device=DEVICE) for _ in range(2))
    v = torch.randn(batch, length, v_heads, dim, device=DEVICE)
    g = F.logsigmoid(torch.randn(batch, length, v_heads, device=DEVICE))
    beta = torch.rand(batch, length, v_heads, device=DEVICE).sigmoid()
    grad_out = torch.randn(batch, length, v_heads, dim, device=DEVICE)

    def run(rule, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        inputs = [t.to(dtype).clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = rule(*inputs, g=g.to(dtype), beta=beta.to(dtype), use_qk_l2norm_in_kernel=True)
        out.backward(grad_out.to(dtype))
        return (out.detach(), *(t.grad for t in inputs))

    def torch_float64(*args, **kwargs):
        # transformers' torch rule casts to float32 inside; a float64 run keeps float64 throughout.
        return _without_float32_casts(torch_rule, *args, **kwargs)

    reference = run(torch_float64, torch.float64)
    results = {}
    for label, rule, allow in [("torch float32, TF32 off", torch_rule, False), ("torch float32, TF32 on", torch_rule, True),
                               ("fla float32 (torch TF32 off)", chunk_gated_delta_rule, False)]:
        tf32(allow)
        got = run(rule, torch.float32)
        results[label] = dict(zip(("output", "grad_q", "grad_k", "grad_v"), (rel(a, b) for a, b in zip(got, reference))))
    tf32(False)
    return {"library": f"fla {getattr(fla_package, '__version__', '')}",
            "shape": dict(batch=batch, length=length, heads=heads, v_heads=v_heads, dim=dim), "results": results}


def _without_float32_casts(fn, *args, **kwargs):
    """Run `fn` with `.to(torch.float32)` on float64 tensors left in float64."""
    from torch.overrides import TorchFunctionMode

    class Keep64(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.to and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float64:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
                if kwargs.get("dtype") is torch.float32:
                    kwargs["dtype"] = torch.float64
            return func(*args, **kwargs)

    with Keep64():
        return fn(*args, **kwargs)


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("liger", "fla"):
        sys.exit("usage: python tools/repro_tf32.py liger|fla")
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    found = {"liger": liger, "fla": fla}[which]()
    found.update(TRITON_F32_DEFAULT=os.environ.get("TRITON_F32_DEFAULT", "(unset: tf32)"), torch=torch.__version__,
                 gpu=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)
    for label, errors in found["results"].items():
        print(f"{label:32s} " + "  ".join(f"{name} {value:.2e}" for name, value in errors.items()))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
