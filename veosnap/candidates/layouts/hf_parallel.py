"""Tensor and expert parallel through transformers' own `DistributedConfig` (the `tp` and `ep` layouts):
rank 0 saves the reference model, every rank loads it with `from_pretrained(distributed_config=...)`."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ...errors import Unsupported
from ...reference import models
from .protocol import LayoutContext

NO_TRAIN = ("not wired for the train scenario yet: the worker's train loop runs the data-parallel layouts "
            "(ddp, fsdp2, hsdp); transformers' tensor/expert-parallel plans are checked on step only")


def accept_causal_lm(golden: object, layout: str) -> None:
    """Decline a model `load_pretrained` cannot load: it loads through `AutoModelForCausalLM`, which knows
    no vision-language or omni config (`Unrecognized configuration class Qwen3VLConfig`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = golden.manifest.config.get("model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise Unsupported(f"{layout} loads through transformers' AutoModelForCausalLM.from_pretrained("
                          f"distributed_config=...), which has no class for {golden.key.model}'s model_type "
                          f"{model_type!r}")


def load_pretrained(ctx: LayoutContext, config: object) -> nn.Module:
    """The reference model saved by rank 0 into the shared directory, loaded by this rank with `config`."""
    import transformers

    saved = ctx.workdir / "model"
    if ctx.rank == 0 and not saved.is_dir():
        ctx.build(torch.device("cpu")).save_pretrained(saved)
    ctx.barrier()
    with warnings.catch_warnings(), models.quiet_transformers():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            saved, dtype=models.dtype_from_name(ctx.golden.key.dtype), attn_implementation=models.REFERENCE_ATTN,
            experts_implementation=models.REFERENCE_EXPERTS, distributed_config=config)
    models.pin_torch_fallbacks(model)
    return model
