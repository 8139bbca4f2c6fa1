"""VeOmni's model as a veosnap candidate: `candidate()`, the generator every backend here is written with,
and the example's backends (examples/veomni/plugin.py serves them under `plugin.py:<name>`)."""

from __future__ import annotations

from typing import Iterator

from torch import nn

import veosnap
from veosnap import Candidate, Unsupported, parallelizes

from . import kernels
from .core import (EAGER_OPS, EAGER_PATH, families, import_veomni, load_reference, ops_config, packing_collator,
                   parallel_state, parallelized, registry_key, build, runs_here, with_pipeline_masks)
from .state import restored


def candidate(reference: nn.Module, ctx: veosnap.Context, ops=None, *, collator: bool = False,  # noqa: ANN001
              own_fsdp2: bool = False, forward_only: str = "") -> Iterator[Candidate]:
    """VeOmni's model for `reference`'s config, for the layout `ctx` describes: a generator to `yield from`
    in a backend (`def mine(model, ctx): yield from candidate(model, ctx, ops_config(...))`).

    - `ops`: VeOmni's ops config (`ops_config(**overrides)`; default every op eager). Every op eager and no
      collator declares `Candidate(reference_path=EAGER_PATH)`: a bit-identical result is expected.
    - `collator=True`: the batch as VeOmni's `PackingCollator` makes it (`Candidate(adapt_batch=...)`).
    - `own_fsdp2=True`: VeOmni's own `build_parallelize_model` (meta init, its FSDP2, its weight loader),
      under the fsdp2 and hsdp layouts; mark the backend `@veosnap.parallelizes`.
    - `forward_only`: why the candidate cannot run backward here ('' when it can): gradients are not checked.

    Builds inside `restored()`: VeOmni's parallel state set for the layout, then everything VeOmni changed
    (losses, ops config, kernel registry, op slots, pointers, per-model patches) put back when the check is
    done. Where `ops` selects VeOmni kernels, each one it bound is counted while the check runs and the report
    says which ran how often (`kernels.account`); a check in which none ran fails. Raises `veosnap.Unsupported`
    (a skip with the reason) where VeOmni is missing, has no model class for the reference, has no path on
    this machine, has no kernel `ops` names for this model, or binds none of them.
    """
    import_veomni()
    ops = ops_config() if ops is None else ops
    if registry_key(reference.config) is None:
        raise Unsupported(f"VeOmni has no model class for {reference.config.model_type!r} (its registry: "
                          f"{', '.join(families())})")
    with restored() as snapshot:
        parallel_state(ctx)
        model = parallelized(reference, ops, ctx) if own_fsdp2 else load_reference(build(reference, ops), reference)
        runs_here(model)
        model = with_pipeline_masks(model)
        bound = kernels.account(model, ops, snapshot.patches)
        notes: list[str] = []
        yield Candidate(model, adapt_batch=packing_collator if collator else None, forward_only=forward_only,
                        reference_path=EAGER_PATH if ops == ops_config() and not collator else "", notes=notes)
        if bound is not None:
            bound.require_ran()
            notes.extend(bound.notes())


def veomni(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class, every op eager (VeOmni's modeling code itself is checked)."""
    yield from candidate(model, ctx)


def veomni_sdpa(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class with transformers' SDPA attention."""
    yield from candidate(model, ctx, ops_config(attn_implementation="sdpa"))


def veomni_chunk_loss(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's chunked cross-entropy: the loss from hidden states and the LM head, no logits."""
    yield from candidate(model, ctx, ops_config(cross_entropy_loss_implementation="chunk_loss"))


def veomni_collator(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's model fed by VeOmni's packing collator (its production batch form)."""
    if model.config.model_type == "gpt_oss":  # the reason veosnap's own `packed` layout skips GPT-OSS
        raise Unsupported("eager attention cannot run GPT-OSS packed: transformers' GptOssModel builds its masks "
                          "without position_ids, so packed sequences attend to each other (VeOmni's production path "
                          "gives cu_seqlens to flash attention, a GPU kernel)")
    yield from candidate(model, ctx, collator=True)


@parallelizes
def veomni_fsdp2(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's own FSDP2 (`build_parallelize_model`) under veosnap's fsdp2 and hsdp layouts."""
    yield from candidate(model, ctx, own_fsdp2=True)


def veomni_ulysses(model: nn.Module) -> nn.Module:
    """The reference model, with VeOmni's own Ulysses all-to-all (`veomni.distributed.sequence_parallel.
    ulysses`) as the exchange of veosnap's `sp` layouts (other layouts run the reference unchanged): checks
    VeOmni's sequence-parallel communication, gradients included, against the single-process golden."""
    import_veomni()
    from veomni.distributed.sequence_parallel.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    from veosnap.candidates.layouts.sequence import Exchange, use_exchange

    return use_exchange(model, Exchange(gather_seq_scatter_heads, gather_heads_scatter_seq,
                                        name="VeOmni's ulysses all-to-all"))


# --- VeOmni's production GPU kernels (one NVIDIA GPU; each declines with the reason where it cannot run) ----


def veomni_fused_moe(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's default fused MoE, `moe_implementation="fused_triton"`: its triton group GEMM (GPU, 16-bit)."""
    _decline(model, kernels.FUSED_TRITON)
    yield from candidate(model, ctx, ops_config(moe_implementation="fused_triton"))


def veomni_quack(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's `moe_implementation="fused_quack"`: quack's CuTe DSL grouped GEMM (sm90+, 16-bit)."""
    _decline(model, kernels.FUSED_QUACK)
    yield from candidate(model, ctx, ops_config(moe_implementation="fused_quack"))


def veomni_liger(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's liger_kernel RMSNorm, SwiGLU MLP and RoPE (its GPU defaults for them; float32 too)."""
    _decline(model, kernels.LIGER)
    yield from candidate(model, ctx, ops_config(rms_norm_implementation="liger_kernel",
                                                swiglu_mlp_implementation="liger_kernel",
                                                rotary_pos_emb_implementation="liger_kernel"))


def veomni_liger_loss(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's default loss, liger_kernel's fused linear cross-entropy: from hidden states and the LM head, no
    logits (veosnap compares every other tensor, and says so)."""
    _decline(model, kernels.LIGER_LOSS)
    yield from candidate(model, ctx, ops_config(cross_entropy_loss_implementation="liger_kernel"))


def veomni_fa4(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's `attn_implementation="flash_attention_4"` (its `veomni_flash_attention_4_with_sp`, over
    `flash_attn.cute`), fed by VeOmni's PackingCollator so its `cu_seq_lens` reach the varlen kernel (16-bit,
    sm90+). flash-attn 4.0.0b36's sm90 backward is wrong for head dims not a multiple of 32
    (docs/findings/fa4-sm90-backward-head-dim.md): the report says so where the model has such heads."""
    _decline(model, kernels.FLASH_ATTENTION_4)
    yield from candidate(model, ctx, ops_config(attn_implementation="flash_attention_4"), collator=True)


def veomni_fla(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's fla ops for Qwen3.5's linear attention (gated RMSNorm, causal conv1d, chunk gated delta rule), fed
    by its PackingCollator (VeOmni's GatedDeltaNet runs varlen only); forward only where fla refuses its backward."""
    _decline(model, kernels.FLA)
    yield from candidate(model, ctx, ops_config(rms_norm_gated_implementation="fla", causal_conv1d_implementation="fla",
                                                chunk_gated_delta_rule_implementation="fla"),
                         collator=True, forward_only=kernels.fla_backward_refused())


def veomni_production(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's GPU defaults as this machine has them: every op its `OpsImplementationConfig` defaults to (fused_triton
    MoE, liger_kernel norm, SwiGLU, RoPE and fused linear cross-entropy, triton load-balancing loss, fla for Qwen3.5),
    attention `flash_attention_4` in place of its default `flash_attention_2` (no FA2 wheel here; sdpa, said in the
    report, where flash_attn.cute does not import), fed by its PackingCollator. bfloat16/float16 only."""
    ops, said, forward_only = _production(model)
    for made in candidate(model, ctx, ops, collator=True, forward_only=forward_only):
        made.notes.extend(said)
        yield made


def _decline(model: nn.Module, kernel: kernels.Kernel) -> None:
    import_veomni()
    kernel.decline(model)


def _production(model: nn.Module) -> tuple[object, list[str], str]:
    """VeOmni's production ops for `model` on this machine, what the report must say about them, and why it runs
    forward only ('' when it does not)."""
    import dataclasses

    import_veomni()
    from veomni.arguments.arguments_types import OpsImplementationConfig

    what = "VeOmni's production ops (its GPU defaults)"
    kernels.Kernel(what, (), float32="its fused MoE and flash attention are 16-bit").decline(model)
    defaults = {f.name: f.default for f in dataclasses.fields(OpsImplementationConfig) if f.name in EAGER_OPS}
    said = []
    for kernel in (kernels.LIGER, kernels.LIGER_LOSS, kernels.LOAD_BALANCING):
        kernels.Kernel(what, kernel.imports).decline(model)
    if kernels.has_experts(model.config):
        kernels.Kernel(what, kernels.FUSED_TRITON.imports).decline(model)
    try:
        kernels.FLASH_ATTENTION_4.decline(model)
        defaults["attn_implementation"] = "flash_attention_4"
        said.append("attention flash_attention_4 in place of flash_attention_2 (no flash-attn 2 wheel here)")
    except Unsupported as exc:
        defaults["attn_implementation"] = "sdpa"
        said.append("attention sdpa in place of flash_attention_2 (no flash-attn 2 wheel here) and of "
                    f"flash_attention_4 ({exc})")
    forward_only = ""
    if kernels.has_linear_attention(model.config):
        kernels.Kernel(what, kernels.FLA.imports).decline(model)
        forward_only = kernels.fla_backward_refused()
    else:  # fla's ops have no slot outside Qwen3.5: eager, so the accounting does not ask for them
        defaults.update(rms_norm_gated_implementation="eager", causal_conv1d_implementation="eager",
                        chunk_gated_delta_rule_implementation="eager")
    said.insert(0, f"VeOmni's GPU defaults (its OpsImplementationConfig's) as run here: "
                   f"{', '.join(f'{k}={v}' for k, v in defaults.items())}")
    return ops_config(**defaults), said, forward_only
