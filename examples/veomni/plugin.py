"""VeOmni 0.1.12 as a veosnap candidate: its own model classes, ops config, collator and parallelism.

    veosnap check --backend examples/veomni/plugin.py:veomni                          # every zoo model it implements
    veosnap check --backend examples/veomni/plugin.py:veomni --layout ddp --layout fsdp2 --layout hsdp
    veosnap check --backend examples/veomni/plugin.py:veomni_fsdp2 --layout fsdp2     # VeOmni's own FSDP2 wrapping
    veosnap check --backend examples/veomni/plugin.py:veomni_collator --layout fsdp2  # VeOmni's packing collator

The worked case of docs/backends.md. Each backend is a generator backend that takes where it runs
(`ctx`, a `veosnap.Context`): it receives the HF eager reference veosnap built (the golden's weights,
dtype and device), builds VeOmni's patched model class for the same config through
`veomni.models.build_foundation_model` with an explicit `OpsImplementationConfig`, loads the
reference's state dict into it (the parameter names of the six families VeOmni implements match
transformers 5.9-5.22; `WEIGHT_RENAMES` is where a family that differs would map them), sets up
VeOmni's parallel state for the layout it is told, yields the model, and in its `finally` restores
what VeOmni changed in the process. Everything else is veosnap's: a loss without logits (GPT-OSS, the
chunked loss) is compared on every other tensor, DeepSeek-V3's one-tensor router is read at its
experts' inputs, what VeOmni prints goes to stderr, and the patches stay applied while a layout runs.

- `veomni_collator` hands VeOmni the batch in its production form: `Candidate(adapt_batch=...)` runs
  VeOmni's own `PackingCollator` (padding removed, sequences in one row, position ids restarting,
  `cu_seq_lens_*` and `max_length_*` for varlen kernels) and says where each packed token stands in
  the golden's batch, so the comparison stays on the golden's tokens.
- `veomni_fsdp2` is VeOmni's production path, `build_parallelize_model` (meta init, its own FSDP2
  wrapping, its weight loader), declared `@parallelizes`: the layout hands it the plain reference and
  does not shard it a second time.

What VeOmni changes in the process (found by running every path), and what this plugin does about it,
the "must restore" list of a real framework:

- `transformers.loss.loss_utils.LOSS_MAPPING["ForCausalLM" | "ForConditionalGeneration" |
  "ForSequenceClassification"]` (`build_foundation_model` -> `install_loss_mapping`): VeOmni's losses
  return `(loss, logits, aux)`, so every HF model built later would get a tuple for a loss. Restored
  when the check is done (a test fails without it).
- VeOmni's ops config (`veomni.ops.config.singleton`) and the OpSlots of its modeling modules
  (`build_foundation_model`): the ops config is restored when the check is done; OpSlots are rebound
  at every build.
- VeOmni's parallel state (`veomni.distributed.parallel_state`: the global state, its topology cache,
  a registry of meshes and groups; `init_parallel_state`): set for the layout, cleared when the check
  is done (and before it, so nothing earlier is taken for this check's).
- At `import veomni`: five `veomni_*_with_sp` names in transformers' `ALL_ATTENTION_FUNCTIONS`, a mask
  function, a wrapped `load_and_register_attn_kernel`, `logging.Logger.info_rank0` and friends. Left:
  additive (nothing an HF eager model uses changes), and VeOmni's imported modules call them.
- A `veomni` logger writing INFO lines to stdout, and transformers' docstring checks printing to stdout
  when VeOmni's modeling files import: nothing to do, veosnap points stdout at stderr while candidates run.
- `torch.utils.checkpoint.CheckpointFunction` (`build_parallelize_model(enable_reentrant=True)`): not
  used (gradient checkpointing is off).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

import veosnap
from veosnap import Adapted, Candidate, Unsupported, parallelizes

# model_type -> VeOmni's registry has a patched class for it (0.1.12: `veomni/models/transformers/*`).
# Mixtral is the one zoo family VeOmni does not implement.
VEOMNI_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss")
# reference parameter name -> VeOmni's, per model_type (none differ with transformers 5.9-5.22).
WEIGHT_RENAMES: dict[str, dict[str, str]] = {}

EAGER_OPS = dict(
    attn_implementation="eager",
    moe_implementation="eager",
    cross_entropy_loss_implementation="eager",
    rms_norm_implementation="eager",
    swiglu_mlp_implementation="eager",
    rotary_pos_emb_implementation="eager",
    load_balancing_loss_implementation="eager",
)
_LOSS_KEYS = ("ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification")


# --- VeOmni's process-wide state ---------------------------------------------------------------------


def _import_veomni() -> None:
    os.environ.setdefault("MODELING_BACKEND", "veomni")
    try:
        import veomni  # noqa: F401  (import-time patches: see the module docstring)
    except ImportError as exc:
        raise Unsupported(f"veomni is not importable here ({exc}); tools/veomni_env.sh builds an "
                          "environment with it") from None


@contextlib.contextmanager
def _restored() -> Iterator[None]:
    """Within the block VeOmni may install its losses into transformers' LOSS_MAPPING, set its ops config
    and its parallel state; after it (the check done, failed or not) all three are as they were."""
    from transformers.loss.loss_utils import LOSS_MAPPING
    from veomni.distributed.parallel_state import clear_parallel_state
    from veomni.ops.config.singleton import get_ops_config, set_ops_config

    saved = {key: LOSS_MAPPING.get(key) for key in _LOSS_KEYS}
    ops = get_ops_config()
    clear_parallel_state()  # a state left by anything before this check would be taken as this one's
    try:
        yield
    finally:
        clear_parallel_state()
        set_ops_config(ops)
        for key, value in saved.items():
            if value is None:
                LOSS_MAPPING.pop(key, None)
            else:
                LOSS_MAPPING[key] = value


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


def _ops(**overrides: str):  # noqa: ANN202 - veomni's OpsImplementationConfig
    _import_veomni()
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

    config = type(reference.config).from_dict(reference.config.to_dict())
    try:
        return build_foundation_model(config, torch_dtype=_dtype_name(reference), init_device=init_device,
                                      ops_implementation=ops)
    except ValueError as exc:  # transformers refuses an attention implementation (GPT-OSS: sinks)
        if "does not support an attention implementation" not in str(exc):
            raise
        raise Unsupported(str(exc).split(". ")[0]) from None


def reference_state(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's weights under VeOmni's parameter names (each tensor its own, for safetensors)."""
    renames = WEIGHT_RENAMES.get(reference.config.model_type, {})
    return {renames.get(name, name): tensor.detach().clone().contiguous()
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


# --- the backends ----------------------------------------------------------------------------------


def _candidate(reference: nn.Module, ctx: veosnap.Context, ops, *, own: bool = False,  # noqa: ANN001
               collate: bool = False) -> Iterator[nn.Module | Candidate]:
    if reference.config.model_type not in VEOMNI_FAMILIES:
        raise Unsupported(f"VeOmni 0.1.12 has no model class for {reference.config.model_type!r}")
    with _restored():
        parallel_state(ctx)
        model = parallelized(reference, ops, ctx) if own else load_reference(build(reference, ops), reference)
        yield Candidate(model, adapt_batch=packing_collator) if collate else model


def veomni(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class, every op eager (VeOmni's modeling code itself is checked)."""
    yield from _candidate(model, ctx, _ops())


def veomni_sdpa(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's model class with transformers' SDPA attention."""
    yield from _candidate(model, ctx, _ops(attn_implementation="sdpa"))


def veomni_chunk_loss(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's chunked cross-entropy: the loss from hidden states and the LM head, no logits."""
    yield from _candidate(model, ctx, _ops(cross_entropy_loss_implementation="chunk_loss"))


def veomni_collator(model: nn.Module, ctx: veosnap.Context) -> Iterator[Candidate]:
    """VeOmni's model fed by VeOmni's packing collator (its production batch form)."""
    if model.config.model_type == "gpt_oss":  # the reason veosnap's own `packed` layout skips GPT-OSS
        raise Unsupported("eager attention cannot run GPT-OSS packed: transformers' GptOssModel builds its masks "
                          "without position_ids, so packed sequences attend to each other (VeOmni's production path "
                          "gives cu_seqlens to flash attention, a GPU kernel)")
    yield from _candidate(model, ctx, _ops(), collate=True)


@parallelizes
def veomni_fsdp2(model: nn.Module, ctx: veosnap.Context) -> Iterator[nn.Module]:
    """VeOmni's own FSDP2 (`build_parallelize_model`) under veosnap's fsdp2 and hsdp layouts."""
    yield from _candidate(model, ctx, _ops(), own=True)


def veomni_ulysses(model: nn.Module) -> nn.Module:
    """The reference model, with VeOmni's own Ulysses all-to-all (`veomni.distributed.sequence_parallel.
    ulysses`) as the exchange of veosnap's `sp` layouts (other layouts run the reference unchanged): checks
    VeOmni's sequence-parallel communication, gradients included, against the single-process golden."""
    _import_veomni()
    from veomni.distributed.sequence_parallel.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    from veosnap.candidates.layouts.sequence import Exchange, use_exchange

    return use_exchange(model, Exchange(gather_seq_scatter_heads, gather_heads_scatter_seq,
                                        name="VeOmni's ulysses all-to-all"))
