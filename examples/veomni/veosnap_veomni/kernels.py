"""VeOmni's production GPU kernels as candidates: whether this machine can run one (a backend's one-line
decline), and what a check bound and ran (its report's note).

VeOmni 0.1.12 binds a kernel in three ways (read from its code; each is counted here while a check runs):

- an `OpSlot` of the generated modeling module (`veomni_rms_norm = OpSlot("rms_norm", "standard")`), bound
  by `build_foundation_model` from `KERNEL_REGISTRY` for rms_norm, rotary_pos_emb, swiglu_mlp, moe_experts
  (`moe_implementation="fused_triton"` is the registry's `triton`), cross_entropy_loss, load_balancing_loss and
  Qwen3.5's rms_norm_gated, causal_conv1d, chunk_gated_delta_rule. Some models cache the bound kernel on their
  modules at init (Qwen3.5's `causal_conv1d_fn`) or build modules of the class it returns (`FusedRMSNormGated`);
- a per-model patch (`apply_per_model_patches`): DeepSeek-V3's `device_patch.py` replaces its RMSNorm class
  and `apply_rotary_pos_emb` in the generated module (it has no slot for them; `restored()` records and undoes
  these);
- pointers and registries: the attention implementation `veomni_flash_attention_4_with_sp` (VeOmni's
  sequence-parallel wrapper, then `veomni.ops.kernels.attention.flash._flash_attention_forward`, which is
  transformers' `_flash_attention_forward`, which loads `flash_attn.cute` through VeOmni's patch of the hub
  kernel loader); transformers' `LOSS_MAPPING` (models without the loss slot); the load-balancing pointer.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from veosnap import Unsupported

from .core import EAGER_OPS

FLASH = ("veomni_flash_attention_2_with_sp", "veomni_flash_attention_3_with_sp", "veomni_flash_attention_4_with_sp")
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Kernel:
    """What one of VeOmni's GPU kernels needs: a CUDA GPU of `capability`, `imports` importable (the modules
    VeOmni itself imports for it), 16-bit parameters unless it has a float32 path (`float32`: why not), and a
    model with `part` ("experts", "linear_attention"; '' for any)."""

    what: str
    imports: tuple[str, ...]
    capability: tuple[int, int] = (0, 0)
    float32: str = ""  # why float32 is declined ('' where the kernel has a float32 path)
    part: str = ""

    def decline(self, reference: nn.Module) -> None:
        """Raise `veosnap.Unsupported` (one line) where this kernel cannot run on `reference` here."""
        config = reference.config
        if self.part == "experts" and not has_experts(config):
            raise Unsupported(f"{self.what}: the model has no MoE experts (its config sets none of num_experts, "
                              "num_local_experts, n_routed_experts)")
        if self.part == "linear_attention" and not has_linear_attention(config):
            raise Unsupported(f"{self.what}: the model has no linear-attention layers (no 'linear_attention' in its "
                              "layer_types)")
        dtype = next(reference.parameters()).dtype
        if self.float32 and dtype not in SIXTEEN_BIT:
            raise Unsupported(f"{self.what} takes bfloat16/float16 only, not {str(dtype).removeprefix('torch.')}: "
                              f"{self.float32}")
        gpu(self.what, self.capability)
        for name in self.imports:
            importable(self.what, name)


def gpu(what: str, capability: tuple[int, int] = (0, 0)) -> None:
    """Raise `Unsupported` without a CUDA GPU of at least `capability`."""
    if not torch.cuda.is_available():
        raise Unsupported(f"{what} needs a CUDA GPU (torch.cuda.is_available() is False here)")
    have = torch.cuda.get_device_capability()
    if have < capability:
        raise Unsupported(f"{what} needs a GPU of compute capability {capability[0]}.{capability[1]} or newer "
                          f"(this one: {have[0]}.{have[1]})")


def importable(what: str, module: str) -> None:
    """Raise `Unsupported` naming the cause where `module` does not import here."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - an ImportError, or a library failing at import (no cutlass, no GPU)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise Unsupported(f"{what}: {module} does not import here ({type(exc).__name__}: {first})") from None


def _text(config):  # noqa: ANN001, ANN202 - a transformers config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def has_experts(config) -> bool:  # noqa: ANN001
    text = _text(config)
    return any(int(getattr(text, k, 0) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def has_linear_attention(config) -> bool:  # noqa: ANN001
    return "linear_attention" in (getattr(_text(config), "layer_types", None) or [])


SIXTEEN = "VeOmni's fused MoE kernels are 16-bit (its group GEMM and fused_moe_forward assert bfloat16/float16)"
FUSED_TRITON = Kernel("VeOmni's fused_triton MoE (its triton group GEMM)", ("veomni.ops.kernels.moe.group_gemm",),
                      (7, 0), SIXTEEN, "experts")
FUSED_QUACK = Kernel("VeOmni's fused_quack MoE (quack's CuTe DSL grouped GEMM)",
                     ("veomni.ops.kernels.moe.quack_gemm",), (9, 0), SIXTEEN, "experts")
LIGER = Kernel("VeOmni's liger_kernel RMSNorm, SwiGLU and RoPE",
               ("liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu", "liger_kernel.transformers.rope"))
LIGER_LOSS = Kernel("VeOmni's liger_kernel fused linear cross-entropy", ("veomni.ops.kernels.cross_entropy.liger",))
FLASH_ATTENTION_4 = Kernel("VeOmni's flash_attention_4 (veomni_flash_attention_4_with_sp over flash_attn.cute)",
                           ("flash_attn.cute",), (9, 0), "flash-attn 4 computes attention in 16 bits")
FLA = Kernel("VeOmni's fla linear-attention ops (Qwen3.5's GatedDeltaNet)",
             ("fla.modules", "fla.modules.convolution", "fla.ops.gated_delta_rule"), (0, 0), "", "linear_attention")
LOAD_BALANCING = Kernel("VeOmni's triton load-balancing loss", ("veomni.ops.kernels.load_balancing_loss.triton",))


def fla_backward_refused() -> str:
    """Why fla refuses its gated backward here ('' where it runs it): fla 0.6.0 raises in `chunk_bwd_dqkwg` on
    Hopper with Triton >= 3.4, < 3.7.1 (wrong gated gradients, fla issue #640) unless tilelang is installed."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return ""
    if importlib.util.find_spec("tilelang") is not None:
        return ""
    import triton

    return (f"fla refuses its gated chunk backward on Hopper with Triton {triton.__version__} (>= 3.4, < 3.7.1 gives "
            "wrong gradients, fla issue #640) and tilelang is not installed")


def kernel_ops(ops) -> dict[str, str]:  # noqa: ANN001 - VeOmni's OpsImplementationConfig
    """The ops config's fields that select a VeOmni kernel (not eager; attention only VeOmni's flash ones)."""
    chosen = {f: getattr(ops, f) for f in EAGER_OPS if f != "attn_implementation" and getattr(ops, f) != "eager"}
    if ops.attn_implementation in FLASH:
        chosen["attn_implementation"] = ops.attn_implementation
    return chosen


# --- what a check bound and ran ----------------------------------------------------------------------


class Bound:
    """VeOmni's kernels bound in one candidate, each wrapped to count its calls while the check runs."""

    def __init__(self, asked: dict[str, str]) -> None:
        self.asked = asked  # the ops config's kernel fields
        self.kernels: dict[str, str] = {}  # label -> what it is (primary: said when not called)
        self.fallbacks: dict[str, str] = {}  # label -> what it is (paths a model may not take: LOSS_MAPPING, ...)
        self.calls: Counter[str] = Counter()
        self.paths: dict[str, Counter[str]] = {}  # label -> how it ran (attention: varlen, its kernel)
        self.head_dims: set[int] = set()

    def counted(self, label: str, fn: Callable, what: str = "", fallback: bool = False) -> Callable:
        (self.fallbacks if fallback else self.kernels)[label] = what

        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            self.calls[label] += 1
            return fn(*args, **kwargs)

        return wrapper

    def require_ran(self) -> None:
        """Fail the check where none of the kernels VeOmni bound ran: it would have checked VeOmni's eager path."""
        if not self.calls:
            raise RuntimeError(f"VeOmni bound {', '.join(self.kernels) or 'nothing'} for "
                               f"{', '.join(f'{k}={v}' for k, v in self.asked.items())} but none of it ran")

    def notes(self) -> list[str]:
        """The report's notes: what ran (`line`), and veosnap's note on a known flash-attn 4 bug the head dims
        VeOmni's flash attention ran with meet (docs/findings/fa4-sm90-backward-head-dim.md)."""
        said = [self.line()]
        if self.asked.get("attn_implementation") == "veomni_flash_attention_4_with_sp" and self.head_dims \
                and torch.cuda.is_available():
            from veosnap.candidates.kernels.fa4 import known_issue
            from veosnap.candidates.kernels.support import installed

            issue = known_issue(installed("flash-attn-4"), torch.cuda.get_device_capability(), self.head_dims)
            said += [issue] if issue else []
        return said

    def line(self) -> str:
        """The report's note: each kernel and how often it ran (over every pass of the check)."""
        ran = []
        for label in [*self.kernels, *self.fallbacks]:
            if not self.calls[label]:
                continue
            what = self.kernels.get(label) or self.fallbacks.get(label)
            how = ", ".join(f"{path} {n}x" for path, n in self.paths.get(label, {}).items())
            ran.append(f"{label}{f' ({what})' if what else ''}: {self.calls[label]}x{f' [{how}]' if how else ''}")
        idle = [label for label in self.kernels if not self.calls[label]]
        return ("VeOmni ran " + "; ".join(ran) + (f"; bound, not called: {', '.join(idle)}" if idle else "")
                + (f"; attention head dims {sorted(self.head_dims)}" if self.head_dims else ""))


def account(model: nn.Module, ops, patches: list) -> Bound | None:  # noqa: ANN001
    """Wrap every kernel VeOmni bound in `model` (its modeling modules' op slots and the modules that cached
    their kernels, the per-model `patches` of its build, its flash attention, the loss mapping and the
    load-balancing pointer) to count its calls; None where `ops` asks for no VeOmni kernel (eager, sdpa).
    Raises `Unsupported` where it asks for some and the model binds none of them (nothing would run)."""
    asked = kernel_ops(ops)
    if not asked:
        return None
    from veomni.ops.dispatch import OpSlot
    from veomni.ops.kernel_registry import KERNEL_REGISTRY

    bound = Bound(asked)
    names = {type(m).__module__ for m in model.modules()}
    slots = {id(v): v for name in names if name.startswith("veomni.") and name in sys.modules
             for v in vars(sys.modules[name]).values() if isinstance(v, OpSlot) and v._kernel is not None}
    for slot in slots.values():
        spec = KERNEL_REGISTRY._specs.get((slot.op_name, slot.variant), {}).get(slot._impl_name)
        label = f"{slot.op_name}/{slot.variant}={slot._impl_name}"
        # a causal LM never calls its sequence-classification loss: not said as "bound, not called"
        fallback = (slot.op_name, slot.variant) == ("cross_entropy_loss", "seq_cls")
        _count(bound, model, label, slot, "_kernel", spec.description if spec else "", fallback)
    for patch in patches:
        owner = getattr(patch.owner, "__name__", type(patch.owner).__name__).rsplit(".", 1)[-1]
        new = vars(patch.owner).get(patch.attr)
        label = f"{owner}.{patch.attr} -> {getattr(new, '__qualname__', repr(new))} (per-model patch)"
        _count(bound, model, label, patch.owner, patch.attr, getattr(new, "__module__", ""))
    if ops.attn_implementation in FLASH and getattr(model.config, "_attn_implementation", "") in FLASH:
        _count_attention(bound, model.config._attn_implementation)
    if ops.cross_entropy_loss_implementation != "eager":
        from transformers.loss.loss_utils import LOSS_MAPPING

        for key in ("ForCausalLM", "ForConditionalGeneration"):
            if LOSS_MAPPING.get(key) is not None:
                LOSS_MAPPING[key] = bound.counted(f"LOSS_MAPPING[{key!r}]={ops.cross_entropy_loss_implementation}",
                                                  LOSS_MAPPING[key], fallback=True)
    if ops.load_balancing_loss_implementation != "eager":
        lb = importlib.import_module("veomni.ops.kernels.load_balancing_loss")
        lb._load_balancing_loss = bound.counted(
            f"load_balancing_loss pointer={ops.load_balancing_loss_implementation}", lb._load_balancing_loss,
            fallback=True)
    if not bound.kernels and not bound.fallbacks:
        raise Unsupported(f"VeOmni's {type(model).__name__} binds none of "
                          f"{', '.join(f'{k}={v}' for k, v in asked.items())}: no slot, patch or pointer of its "
                          "modeling takes them, so the check would run VeOmni's eager path")
    return bound


def _count(bound: Bound, model: nn.Module, label: str, owner: object, attr: str, what: str,
           fallback: bool = False) -> None:
    """Count calls of `owner.attr` (a kernel function, or a class whose modules the model was built with), also
    where the model's modules hold the same kernel (cached at init) or are instances of it."""
    kernel = getattr(owner, attr)
    if isinstance(kernel, type):  # a module class (liger's RMSNorm, fla's FusedRMSNormGated): its modules
        modules = [m for m in model.modules() if isinstance(m, kernel)]
        what = f"{what + ', ' if what else ''}{len(modules)} modules"
        (bound.fallbacks if fallback else bound.kernels)[label] = what
        for module in modules:
            module.forward = bound.counted(label, module.forward, what, fallback)
        return
    wrapped = bound.counted(label, kernel, what, fallback)
    setattr(owner, attr, wrapped)
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if value is kernel:
                setattr(module, name, wrapped)


def _count_attention(bound: Bound, implementation: str) -> None:
    """Count VeOmni's flash attention calls by the path transformers takes and the kernel it loaded."""
    flash = importlib.import_module("veomni.ops.kernels.attention.flash")
    hf = importlib.import_module("transformers.modeling_flash_attention_utils")
    label = f"attention={implementation}"
    bound.kernels[label] = "VeOmni's flash wrapper -> transformers' _flash_attention_forward"
    inner = flash._flash_attention_forward
    paths = bound.paths.setdefault(label, Counter())

    def counted(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: object,
                *args: object, **kwargs: object) -> object:
        out = inner(query, key, value, attention_mask, *args, **kwargs)
        varlen = kwargs.get("cu_seq_lens_q") is not None or attention_mask is not None
        fn = hf._flash_varlen_fn if varlen else hf._flash_fn
        how = ("varlen, cu_seq_lens given" if kwargs.get("cu_seq_lens_q") is not None
               else "varlen, unpadded by the mask" if attention_mask is not None else "dense or packed by position ids")
        paths[f"{how}: {getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', fn)}"] += 1
        bound.calls[label] += 1
        bound.head_dims.add(int(query.shape[-1]))
        return out

    flash._flash_attention_forward = counted
