"""`fa4`: every attention module through flash-attn 4 (`flash_attn.cute`), as a training framework calls it.

The backend registers `attention_forward` with transformers' `AttentionInterface` (and transformers'
flash-style 2D padding mask with `AttentionMaskInterface`) under `veosnap_fa4`, switches the model to
it, and undoes the registration after the check. How each call reaches the library:

- a padded batch is unpadded by its padding mask into one call of the varlen entry point
  (`flash_attn_varlen_func`, cu_seqlens from the mask), and the output padded back with zeros;
- a packed batch (one row, position ids restarting per sequence, no mask) goes to the varlen entry
  point with cu_seqlens from the position ids: how frameworks train;
- a caller's own `cu_seq_lens_q/k` (vision encoders pass them) are used as given;
- anything else calls the dense entry point (`flash_attn_func`).

Grouped-query attention runs natively; a sliding window is `window_size=(w - 1, 0)` (the key window
of transformers' eager mask); attention sinks (gpt_oss) are fa4's `learnable_sink`, with their
gradient; MLA's value heads narrower than its query heads (DeepSeek-V3) are zero-padded to the
query's head dim and the output cropped, as transformers does for every flash kernel.

Declined with the reason: float32 and float64 goldens (fa4 computes in float16/bfloat16 only), attention
dropout, masks other than a 2D padding mask, and head dims fa4 refuses on this GPU (its own message,
on the first call). fa4 runs forward on compute capability 8.x and backward from 9.0: on 8.x the
check is forward only.

Known issue: flash-attn 4.0.0b36's sm90 backward is wrong for head dims that are not a multiple of 32
(docs/findings/fa4-sm90-backward-head-dim.md). Such checks run and fail, as they should, and the
report says why in a note (`known_issue`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import Unsupported
from ..candidate import Candidate
from .support import Ran, decline, gpu_library, installed

NAME = "fa4"
IMPLEMENTATION = "veosnap_fa4"  # its key in transformers' AttentionInterface (no "flash": see below)
requires = gpu_library("flash-attn 4", "flash-attn-4", "pip install flash-attn-4; it compiles its kernels at "
                       "first use through nvidia-cutlass-dsl", capability=(8, 0))


@dataclass(frozen=True)
class Kernels:
    """The two entry points the backend calls, and what they accept (tests substitute a torch reference)."""

    dense: Callable  # (q, k, v, *, softmax_scale, causal, window_size, learnable_sink, softcap) -> (out, lse)
    varlen: Callable  # the same on [total, heads, dim] with cu_seqlens_q/k and max_seqlen_q/k
    label: str = "flash_attn.cute"
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    backward_capability: tuple[int, int] = (9, 0)
    version: str = ""  # flash-attn-4's version, for its known issues


# flash-attn 4 versions whose sm90 backward rounds the float32 dQ (and GQA dK/dV) accumulators' head dim
# to 16 in the kernel but to 32 in the postprocess: wrong gradients where the two differ
# (docs/findings/fa4-sm90-backward-head-dim.md). A version that fixes it is simply not listed.
SM90_BACKWARD_HEAD_DIM_BUG = {"4.0.0b36"}


def library() -> Kernels:
    """flash-attn 4's entry points (importing it loads the CuTe DSL; an import failure is the check's ERROR)."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    version = installed("flash-attn-4")
    return Kernels(flash_attn_func, flash_attn_varlen_func, label=f"flash_attn.cute {version}", version=version)


def known_issue(version: str, capability: tuple[int, int] | None, head_dims: set[int]) -> str | None:
    """The report's note when this check runs into a known flash-attn 4 bug (None: it does not)."""
    if capability is None or capability[0] != 9 or version not in SM90_BACKWARD_HEAD_DIM_BUG:
        return None
    bad = sorted(d for d in head_dims if d <= 128 and -(-d // 16) % 2)  # rounded to 16, not a multiple of 32
    if not bad:
        return None
    return (f"known flash-attn {version} bug on sm90: wrong backward (dq; dk/dv with GQA) for head dim "
            f"{', '.join(map(str, bad))}, not a multiple of 32; expect failing gradients "
            f"(docs/findings/fa4-sm90-backward-head-dim.md, and its repro_fa4.py)")


def fa4(model: nn.Module) -> Iterator[Candidate]:
    """Every attention module through flash-attn 4's dense and varlen kernels (GPU, float16/bfloat16)."""
    decline(requires())
    yield from switch(model, library())


def switch(model: nn.Module, kernels: Kernels) -> Iterator[Candidate]:
    """Switch `model`'s attention to `kernels` for the check, say what ran, and undo the registration."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    param = next(model.parameters())
    if param.dtype not in kernels.dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in kernels.dtypes)
        raise Unsupported(f"{kernels.label} computes attention in {names} only, not {str(param.dtype)[6:]}")
    ran = Ran(NAME, model, "attention modules")
    head_dims: set[int] = set()  # what the kernels were called with, for `known_issue`
    attentions, masks = AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping
    saved = [(table, table.get(IMPLEMENTATION)) for table in (attentions, masks)]
    # Named without "flash": transformers treats any "flash..." implementation as one of its own flash
    # kernels and tries to load it. Models then call it as they call sdpa or eager (vision encoders
    # chunk by image), with the flash-style 2D padding mask registered for it below.
    AttentionInterface.register(IMPLEMENTATION, attention_forward(kernels, ran, head_dims))
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)
    try:
        try:
            model.set_attn_implementation(IMPLEMENTATION)
        except (ValueError, ImportError) as exc:  # transformers refuses models without the attention interface
            raise Unsupported(f"{type(model).__name__} cannot switch attention: {str(exc).split('. ')[0]}") from None
        if model.config._attn_implementation != IMPLEMENTATION:
            raise Unsupported(f"{type(model).__name__} does not use transformers' attention interface")
        forward_only = ""
        if param.device.type == "cuda" and torch.cuda.get_device_capability(param.device) < kernels.backward_capability:
            forward_only = f"{kernels.label} has no backward before sm{'.'.join(map(str, kernels.backward_capability))}"
        notes = yield from ran.candidate(model, f"attention: {kernels.label}", forward_only)
        capability = torch.cuda.get_device_capability(param.device) if param.device.type == "cuda" else None
        issue = known_issue(kernels.version, capability, head_dims)
        if issue:
            notes.append(issue)
    finally:
        for table, value in saved:
            if value is None:
                table.pop(IMPLEMENTATION, None)
            else:
                table[IMPLEMENTATION] = value


def attention_forward(kernels: Kernels, ran: Ran, head_dims: set[int] | None = None) -> Callable:
    """transformers' attention-interface function for `kernels`: HF layout in, HF layout out (the head
    dims it calls the kernels with are added to `head_dims`)."""

    def forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                sliding_window: int | None = None, softcap: float | None = None, s_aux: torch.Tensor | None = None,
                is_causal: bool | None = None, position_ids: torch.Tensor | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                max_length_q: int | None = None, max_length_k: int | None = None,
                **kwargs: object) -> tuple[torch.Tensor, None]:
        if dropout:
            raise Unsupported(f"{kernels.label} has no attention dropout (the model trains with {dropout})")
        batch, length = query.shape[0], query.shape[2]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [batch, positions, heads, dim]
        v_dim = v.shape[-1]
        if v_dim != q.shape[-1]:  # MLA: flash kernels want one head dim
            if v_dim > q.shape[-1]:
                raise Unsupported(f"value head dim {v_dim} is wider than the query's {q.shape[-1]}")
            v = F.pad(v, (0, q.shape[-1] - v_dim))
        if head_dims is not None:
            head_dims.add(q.shape[-1])
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        options = {"softmax_scale": scaling, "causal": causal, "softcap": softcap or 0.0}
        if sliding_window is not None:
            options["window_size"] = (sliding_window - 1, 0 if causal else sliding_window - 1)
        if s_aux is not None:
            options["learnable_sink"] = s_aux

        if cu_seq_lens_q is not None:  # the caller's own sequence boundaries
            out = _varlen(kernels, ran, module, q, k, v, cu_seq_lens_q, cu_seq_lens_k, options, "given cu_seqlens")
        elif attention_mask is not None:
            out = _unpadded(kernels, ran, module, q, k, v, attention_mask, options)
        elif position_ids is not None and (cu := _packed_boundaries(position_ids, batch, length)) is not None:
            out = _varlen(kernels, ran, module, q, k, v, cu, None, options, "packed")
        else:
            ran.call(module, "dense")
            out = _call(kernels, kernels.dense, q, k, v, **options)
        out = out.reshape(batch, length, *out.shape[-2:])
        return out[..., :v_dim].contiguous(), None

    return forward


def _packed_boundaries(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens of the sequences packed in the batch's rows, or None when every row is one sequence.

    A sequence starts at each row's start and wherever a row's position ids do not count up by one, as the
    reference's mask finds them (transformers' `find_packed_sequence_indices`), in every row: transformers'
    own flash paths look for packing only at batch size 1, and a packed row beside an ordinary one then
    attends across its sequences (real-shape goldens, 2026-12-02: 22-47x from layer 0).
    """
    pos = position_ids.reshape(-1, length).expand(batch, length)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if not bool(starts[:, 1:].any()):
        return None
    flat = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([flat, flat.new_tensor([batch * length])]).to(torch.int32)


def _varlen(kernels: Kernels, ran: Ran, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cu_q: torch.Tensor, cu_k: torch.Tensor | None, options: dict, how: str) -> torch.Tensor:
    cu_q = cu_q.to(device=q.device, dtype=torch.int32).contiguous()
    cu_k = cu_q if cu_k is None else cu_k.to(device=q.device, dtype=torch.int32).contiguous()
    ran.call(module, f"varlen ({how})")
    return _call(kernels, kernels.varlen, *(t.reshape(-1, *t.shape[-2:]) for t in (q, k, v)),
                 cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_longest(cu_q), max_seqlen_k=_longest(cu_k),
                 **options)


def _unpadded(kernels: Kernels, ran: Ran, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention over the real tokens of a padded batch, in one varlen call; padding rows get zeros."""
    batch, length = q.shape[:2]
    if mask.dim() != 2 or tuple(mask.shape) != (batch, length):
        raise Unsupported(f"{kernels.label} takes a 2D padding mask; this model passed a mask of shape "
                          f"{tuple(mask.shape)} (a custom attention pattern)")
    keep = mask.bool()
    index = keep.reshape(-1).nonzero().squeeze(1)
    cu = F.pad(keep.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    picked = [t.reshape(batch * length, *t.shape[-2:])[index] for t in (q, k, v)]
    ran.call(module, "varlen (unpadded)")
    out = _call(kernels, kernels.varlen, *picked, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=_longest(cu),
                max_seqlen_k=_longest(cu), **options)
    full = out.new_zeros(batch * length, *out.shape[-2:])
    return full.index_copy(0, index, out)


def _longest(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _call(kernels: Kernels, entry: Callable, *args: torch.Tensor, **options: object) -> torch.Tensor:
    """One kernel call; what the library refuses to run (a head dim on this GPU) declines the check."""
    try:
        out = entry(*args, **options)
    except (AssertionError, NotImplementedError) as exc:
        message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, NotImplementedError) or "not supported" in message or "Unsupported" in message:
            raise Unsupported(f"{kernels.label} refuses this attention: {message}") from None
        raise
    return out[0] if isinstance(out, tuple) else out
