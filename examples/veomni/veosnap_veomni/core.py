"""Building VeOmni's model for a veosnap check: its registry, ops config, weights, parallel state, collator.

Moved from examples/veomni/plugin.py (which keeps the old names for a release, warning).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch
from torch import nn

import veosnap
from veosnap import Adapted, Unsupported

from .state import MISSING

# reference parameter name -> VeOmni's, per model_type (none differ with transformers 5.9-5.22).
# Patterns (re.sub) applied to every name; found by loading each family (VeOmni's generated modeling is
# "Based on: transformers==5.9.0", the reference is the environment's transformers).
_OMNI_THINKER = [(r"^model\.audio_tower\.", "audio_tower."), (r"^model\.visual\.", "visual."),
                 (r"^model\.language_model\.", "model.")]
WEIGHT_RENAMES: dict[str, list[tuple[str, str]]] = {
    "deepseek_v4": [(r"\.compressor\.indexer\.scorer\.weights_proj\.", ".compressor.indexer.weights_proj.")],
    "qwen2_5_omni_thinker": _OMNI_THINKER,
    "qwen3_omni_moe_thinker": _OMNI_THINKER,
}

EAGER_OPS = dict(
    attn_implementation="eager",
    moe_implementation="eager",
    cross_entropy_loss_implementation="eager",
    rms_norm_implementation="eager",
    swiglu_mlp_implementation="eager",
    rotary_pos_emb_implementation="eager",
    load_balancing_loss_implementation="eager",
    # Qwen3.5's GatedDeltaNet (linear attention): VeOmni's defaults are fla kernels (GPU or MLU only).
    rms_norm_gated_implementation="eager",
    causal_conv1d_implementation="eager",
    chunk_gated_delta_rule_implementation="eager",
)
# What the all-eager backends declare (`Candidate.reference_path`): their bit-identical results are expected.
EAGER_PATH = ("VeOmni's modeling with every op eager computes transformers' eager function op for op "
              "(the eager reference's numbers are expected, to the bit)")


def families() -> list[str]:
    """The model_types VeOmni ships a model class for: its own registry (`veomni.models.loader.
    MODELING_REGISTRY`, filled by `veomni/models/transformers/<name>/`), not a list kept here."""
    if MISSING:
        return []
    from veomni.models.loader import MODELING_REGISTRY

    return sorted(MODELING_REGISTRY.valid_keys())


def import_veomni() -> None:
    """Raise `veosnap.Unsupported` (a skip with the reason) where VeOmni is not importable."""
    if MISSING:
        raise Unsupported(MISSING)


def parallel_state(ctx: veosnap.Context):  # noqa: ANN201 - veomni's ParallelState, or None in process
    """VeOmni's parallel state for the layout veosnap runs (it must agree with how veosnap splits the batch:
    `ctx.dp_world` shares of the rows, over the mesh the layout shards on)."""
    if not ctx.distributed:
        return None  # VeOmni's default single-process state
    from veomni.distributed.parallel_state import init_parallel_state

    sizes = dict(dp_size=ctx.dp_world, device_type=ctx.device.type, name=None)
    if ctx.layout == "ddp":
        return init_parallel_state(dp_mode="ddp", **sizes)
    if ctx.layout == "fsdp2":
        return init_parallel_state(dp_shard_size=ctx.dp_world, dp_mode="fsdp2", **sizes)
    if ctx.layout == "hsdp":
        mesh = ctx.mesh_shape
        return init_parallel_state(dp_replicate_size=mesh["replicate"], dp_shard_size=mesh["shard"], dp_mode="fsdp2",
                                   **sizes)
    if ctx.layout == "ep":
        raise Unsupported("VeOmni's expert parallel runs only inside its fused MoE kernels (triton group-gemm, quack, "
                          "npu: a GPU); its eager experts loop over every expert with the rank's shard of the weights")
    if ctx.layout == "tp":
        raise Unsupported("VeOmni 0.1.12 has no tensor-parallel plan for its text models "
                          "(build_parallelize_model calls parallelize_module without one)")
    if "sp" in ctx.mesh_shape:
        raise Unsupported("veosnap's sequence-parallel layouts install their own attention exchange into the model; "
                          "VeOmni's own Ulysses all-to-all is checked through that hook by `veomni_ulysses`")
    raise Unsupported(f"the VeOmni plugin does not know veosnap's layout {ctx.layout!r}")


# --- building VeOmni's model -----------------------------------------------------------------------


def ops_config(**overrides: str):  # noqa: ANN201 - veomni's OpsImplementationConfig
    """VeOmni's `OpsImplementationConfig` with every op eager (`EAGER_OPS`) except `overrides`
    (`ops_config(moe_implementation="fused_mykernel")`, `ops_config(attn_implementation="sdpa")`)."""
    import_veomni()
    from veomni.arguments.arguments_types import OpsImplementationConfig

    return OpsImplementationConfig(**{**EAGER_OPS, **overrides})


def _dtype_name(model: nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    if dtype not in names:
        raise Unsupported(f"VeOmni builds models in float32, bfloat16 or float16, not {dtype}")
    return names[dtype]


def build(reference: nn.Module, ops, init_device: str = "cpu") -> nn.Module:  # noqa: ANN001
    """VeOmni's own model class for the reference's config, built with `ops` (weights not loaded).

    `init_device="meta"` leaves the parameters unmaterialised, for VeOmni's parallelize to load.
    """
    from veomni.models import build_foundation_model

    from veomni.models.loader import MODELING_REGISTRY

    config = type(reference.config).from_dict(reference.config.to_dict())
    model_type, key = config.model_type, registry_key(config)
    if key is None:
        raise Unsupported(f"VeOmni has no model class for {model_type!r} (its registry: {', '.join(families())})")
    alias = key != model_type and model_type not in MODELING_REGISTRY._local_mapping
    if alias:  # VeOmni's registry serves the omni thinker under the omni model's name, picked by architecture
        MODELING_REGISTRY._local_mapping[model_type] = MODELING_REGISTRY[key]
    try:
        return build_foundation_model(config, torch_dtype=_dtype_name(reference), init_device=init_device,
                                      ops_implementation=ops)
    except ValueError as exc:  # transformers refuses an attention implementation (GPT-OSS: sinks)
        if "does not support an attention implementation" in str(exc):
            raise Unsupported(str(exc).split(". ")[0]) from None
        if " is not a registered backend for " in str(exc) or " is explicitly disabled for " in str(exc):
            raise Unsupported(f"VeOmni's {key} modeling: {str(exc).split('. ')[0]}") from None  # a per-model op
        raise
    except KeyError as exc:  # KERNEL_REGISTRY.resolve: no such kernel for this op slot's variant
        message = str(exc.args[0]) if exc.args else ""
        if not message.startswith("Unknown kernel"):
            raise
        raise Unsupported(f"VeOmni's {key} modeling: {message}") from None
    except RuntimeError as exc:  # KERNEL_REGISTRY.resolve: the kernel's hardware requirement is not met here
        if "but the current hardware does not satisfy this" not in str(exc):
            raise
        raise Unsupported(f"VeOmni's {key} modeling: {str(exc).splitlines()[0]}") from None
    except ModuleNotFoundError as exc:  # VeOmni's modeling needs a package this environment does not have
        where = _frame_in_veomni(exc.__traceback__)
        raise Unsupported(f"VeOmni's {key} modeling imports {exc.name} at import time ({where}); {exc.name} is not "
                          "installed here") from None
    finally:
        if alias:
            MODELING_REGISTRY._local_mapping.pop(model_type, None)


def registry_key(config) -> str | None:  # noqa: ANN001 - a transformers config
    """The key of VeOmni's modeling registry that builds `config`'s model: its model_type, or for an omni
    thinker (model_type `<omni>_thinker`, architecture `...ThinkerFor...`) the omni model's, whose entry picks
    the thinker class by architecture."""
    known = families()
    if config.model_type in known:
        return config.model_type
    base = config.model_type.removesuffix("_thinker")
    architectures = getattr(config, "architectures", None) or []
    if base in known and any("Thinker" in a for a in architectures):
        return base
    return None


def _frame_in_veomni(tb) -> str:  # noqa: ANN001 - a traceback
    """The last frame of `tb` in VeOmni's files, as `veomni/...py:line`."""
    where = ""
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if "/veomni/" in path:
            where = f"veomni/{path.rsplit('/veomni/', 1)[1]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where or "import"


def reference_state(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's weights under VeOmni's parameter names (each tensor its own, for safetensors)."""
    renames = WEIGHT_RENAMES.get(reference.config.model_type, [])

    def renamed(name: str) -> str:
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        return name

    return {renamed(name): tensor.detach().clone().contiguous()
            for name, tensor in reference.state_dict().items()}


def load_reference(model: nn.Module, reference: nn.Module) -> nn.Module:
    """Load the reference's weights into VeOmni's model; every parameter must be covered."""
    state = reference_state(reference)
    result = model.load_state_dict(state, strict=False)
    missing = [n for n in result.missing_keys if n in dict(model.named_parameters())]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"VeOmni's {type(model).__name__} and the reference disagree on parameters: "
                           f"missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}")
    # A parameter VeOmni keeps in another dtype than the reference is not refused here: veosnap reports it
    # as a structure difference, naming the transformers versions when they differ from the golden's.
    return model.to(next(reference.parameters()).device)


_PLACEHOLDERS = {"image_mask": ("image_token_id", "image_token_index"),
                 "video_mask": ("video_token_id", "video_token_index"),
                 "audio_mask": ("audio_token_id", "audio_token_index")}


def runs_here(model: nn.Module) -> None:
    """Decline a VeOmni model whose modeling has no path on this machine (found by building it, not by name)."""
    linear = [m for m in model.modules() if hasattr(m, "causal_conv1d_fn")]
    if linear and any(m.causal_conv1d_fn is None for m in linear):
        raise Unsupported(
            f"VeOmni's {type(model).__name__} runs its linear attention (GatedDeltaNet) only varlen: its decoder "
            "layers assert cu_seq_lens_q, and with causal_conv1d_implementation='eager' (its kernels are fla: GPU "
            "or MLU, npu) causal_conv1d_fn is unset and the varlen path raises NotImplementedError ('can't process "
            "varlen now'); no CPU path")


def with_pipeline_masks(model: nn.Module) -> nn.Module:
    """VeOmni's multimodal models take `image_mask`/`video_mask`/`audio_mask` from its data pipeline
    (`process_sample`: `input_ids == <placeholder id>`); without them Qwen2.5-VL all-gathers the ids over its
    sequence-parallel group (no process group in a single process) and the omni thinkers assert. A forward
    pre-hook adds them as the pipeline makes them, from the ids each call gets (a rank's rows, a packed row)."""
    config = model.config
    ids = {mask: next((getattr(config, a) for a in attrs if isinstance(getattr(config, a, None), int)), None)
           for mask, attrs in _PLACEHOLDERS.items()}
    ids = {mask: token for mask, token in ids.items() if token is not None}
    if "image_mask" not in ids:
        return model  # a text model

    def add_masks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        input_ids = kwargs.get("input_ids")
        if input_ids is not None:
            for mask, token in ids.items():
                kwargs.setdefault(mask, input_ids == token)
        return args, kwargs

    model.register_forward_pre_hook(add_masks, with_kwargs=True)
    return model


def parallelized(reference: nn.Module, ops, ctx: veosnap.Context) -> nn.Module:  # noqa: ANN001
    """VeOmni's own `build_parallelize_model`: meta init, its FSDP2 wrapping, its weights loader."""
    if ctx.layout not in ("fsdp2", "hsdp"):
        raise Unsupported(f"VeOmni's own FSDP2 is checked under the fsdp2 and hsdp layouts, not {ctx.layout}")
    from safetensors.torch import save_file
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed.torch_parallelize import build_parallelize_model

    model = build(reference, ops, init_device="meta")
    with tempfile.TemporaryDirectory(prefix="veomni-weights-") as tmp:
        save_file(reference_state(reference), str(Path(tmp) / "model.safetensors"))
        return build_parallelize_model(model, weights_path=tmp, init_device="meta",
                                       mixed_precision=MixedPrecisionConfig(enable=False),
                                       enable_gradient_checkpointing=False)


# --- VeOmni's collator: the batch in its production form ------------------------------------------


def packing_collator(batch, ctx: veosnap.Context) -> Adapted:  # noqa: ANN001 - a veosnap Batch
    """The batch as VeOmni's `PackingCollator` makes it: each row's real tokens, all in one row, position ids
    restarting per sequence, `cu_seq_lens_q/k` and `max_length_q/k` for its varlen attention."""
    features, positions = [], []
    for row in range(batch.rows):
        real = batch.attention_mask[row].bool()
        features.append({"input_ids": batch.input_ids[row][real], "labels": batch.labels[row][real],
                         "position_ids": batch.position_ids[row][real]})
        positions.append(row * batch.width + real.nonzero().flatten())
    return Adapted(dict(_data_collator().PackingCollator()(features)), torch.cat(positions))


def _data_collator():  # noqa: ANN202 - the module veomni.data.data_collator
    """VeOmni's collator module. `veomni.data` also imports its data loaders and datasets, which need the
    trainer's dependencies (torchdata, datasets) that `--no-deps` leaves out; the collator itself needs
    none of them, so without them its file is loaded alone, under its own name."""
    import importlib
    import importlib.util
    import sys

    name = "veomni.data.data_collator"
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.modules.pop(name, None)
    import veomni

    spec = importlib.util.spec_from_file_location(name, Path(veomni.__file__).parent / "data" / "data_collator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


