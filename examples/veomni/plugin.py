"""VeOmni 0.1.12 as a veosnap candidate: its own model classes, ops config and parallelism.

    veosnap check --backend examples/veomni/plugin.py:veomni                  # every zoo model VeOmni implements
    veosnap check --backend examples/veomni/plugin.py:veomni --layout fsdp2   # VeOmni's parallel state, 2 ranks
    veosnap check --backend examples/veomni/plugin.py:veomni_fsdp2 --layout fsdp2  # VeOmni's own FSDP2 wrapping

Each backend here is a veosnap generator backend (see docs/backends.md): it receives the HF eager
reference veosnap built (the golden's weights, dtype and device), builds VeOmni's patched model class
for the same config through `veomni.models.build_foundation_model` with an explicit
`OpsImplementationConfig`, loads the reference's state dict into it (the parameter names of the six
families VeOmni implements match transformers 5.9-5.22; `WEIGHT_RENAMES` is where a family that
differs would map them), yields it, and restores what VeOmni changed in the process.

What VeOmni changes globally, and what this plugin does about it:

- `transformers.loss.loss_utils.LOSS_MAPPING["ForCausalLM" | "ForConditionalGeneration" |
  "ForSequenceClassification"]` (`apply_ops_config` -> `install_loss_mapping`): VeOmni's loss returns
  `(loss, logits, aux)`, so every *HF* causal LM built after it gets a tuple for a loss. The plugin pins
  VeOmni's loss onto the VeOmni instance (`model.loss_function = ...`, a transformers setter) and puts
  the three entries back as soon as the model is built: nothing at run time depends on the mapping.
- VeOmni's own singletons: the ops config (`veomni.ops.config.singleton`), the fused-MoE function
  pointer, the parallel state (`veomni.distributed.parallel_state`). The ops config is put back after
  the build; the parallel state must stay while a layout runs the model (VeOmni reads it at run time:
  the loss asks `get_parallel_state().sp_enabled`), so it is cleared in the generator's `finally`, and
  also at the next build (see CORE.md item 3: today the `finally` runs before a layout runs the model).
- At import: VeOmni registers five attention names (`veomni_*_with_sp`) in transformers'
  `ALL_ATTENTION_FUNCTIONS` and one mask builder, wraps `transformers.integrations.hub_kernels.
  load_and_register_attn_kernel` (it passes every non-VeOmni name through), and adds `info_rank0`,
  `warning_once`, ... to `logging.Logger`. These are additive (nothing an HF eager model uses changes)
  and VeOmni's already-imported modules call them at run time, so they are left in place.
- Output: VeOmni's logger writes INFO lines to **stdout** (a handler made at import), and importing its
  generated modeling files makes transformers print `[ERROR] cache_position ... not documented` lines to
  stdout. Both would corrupt `veosnap check --format json` (CORE.md item 5), so the import and the build
  run with stdout sent to stderr (the handler then holds stderr for good).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from veosnap import Unsupported

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


# --- where the plugin runs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """The layout the candidate runs under, this process's rank and the world size."""

    layout: str  # "in-process" (single, packed, microbatch: not told apart today) or a worker layout
    rank: int = 0
    world: int = 1


def where() -> Where:
    """Where this candidate runs, as far as a plugin can learn it from veosnap 0.1 (CORE.md item 4).

    Rank and world size come from torch.distributed. The layout name does not reach a backend at all:
    the one source is the worker's documented command line (`--layout a --layout b`), which names every
    layout of the torchrun, so with several in one run the plugin cannot tell which one is building it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return Where("in-process")
    rank, world = dist.get_rank(), dist.get_world_size()
    argv = sys.argv
    names = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--layout"]
    if len(names) != 1:
        raise Unsupported(f"the plugin cannot tell which of the torchrun's layouts ({', '.join(names) or '?'}) is "
                          "building it (veosnap gives a backend no layout name: issue 14 item 4); check one "
                          "layout per command")
    return Where(names[0], rank, world)


# --- global state ----------------------------------------------------------------------------------


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """VeOmni's logger and transformers' docstring checker print to stdout: keep veosnap's stdout clean."""
    sys.stdout.flush()
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _import_veomni() -> None:
    os.environ.setdefault("MODELING_BACKEND", "veomni")
    with _stdout_to_stderr():
        try:
            import veomni  # noqa: F401  (import-time patches: see the module docstring)
        except ImportError as exc:
            raise Unsupported(f"veomni is not importable here ({exc}); tools/veomni_env.sh builds an "
                              "environment with it") from None


@contextlib.contextmanager
def _loss_mapping_restored() -> Iterator[None]:
    """Within the block VeOmni may install its loss wrappers into transformers' LOSS_MAPPING; then restored."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    saved = {key: LOSS_MAPPING.get(key) for key in _LOSS_KEYS}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                LOSS_MAPPING.pop(key, None)
            else:
                LOSS_MAPPING[key] = value


def _clear_veomni_state() -> None:
    from veomni.distributed.parallel_state import clear_parallel_state
    from veomni.ops.config.singleton import set_ops_config

    clear_parallel_state()
    set_ops_config(None)


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
    model_type = reference.config.model_type
    if model_type not in VEOMNI_FAMILIES:
        raise Unsupported(f"VeOmni 0.1.12 has no model class for {model_type!r}")
    from veomni.models import build_foundation_model
    from veomni.ops.config.singleton import get_ops_config, set_ops_config

    config = type(reference.config).from_dict(reference.config.to_dict())
    previous_ops = get_ops_config()
    with _stdout_to_stderr(), _loss_mapping_restored():
        try:
            model = build_foundation_model(config, torch_dtype=_dtype_name(reference), init_device=init_device,
                                           ops_implementation=ops)
        except ValueError as exc:  # transformers refuses an attention implementation (GPT-OSS: sinks)
            if "does not support an attention implementation" not in str(exc):
                raise
            raise Unsupported(str(exc).split(". ")[0]) from None
        # Pinned on the instance: the global mapping is restored when this block ends.
        model.loss_function = model.loss_function
    set_ops_config(previous_ops)
    return model


def reference_state(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's weights under VeOmni's parameter names (each tensor its own, for safetensors)."""
    renames = WEIGHT_RENAMES.get(reference.config.model_type, {})
    return {renames.get(name, name): tensor.detach().clone().contiguous()
            for name, tensor in reference.state_dict().items()}


def load_reference(model: nn.Module, reference: nn.Module) -> nn.Module:
    """Load the reference's weights into VeOmni's model; every parameter must be covered, in its dtype."""
    state = reference_state(reference)
    result = model.load_state_dict(state, strict=False)
    missing = [n for n in result.missing_keys if n in dict(model.named_parameters())]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"VeOmni's {type(model).__name__} and the reference disagree on parameters: "
                           f"missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}")
    for name, param in model.named_parameters():
        if param.dtype != state[name].dtype:
            raise RuntimeError(f"VeOmni keeps {name} in {param.dtype}, the reference in {state[name].dtype}")
    return model.to(next(reference.parameters()).device)


# --- workarounds for what veosnap 0.1 cannot read (CORE.md items 1 and 2) -------------------------


class _LogitsProbe:
    """Item 1: a VeOmni model whose loss comes from hidden states returns `logits=None` and never calls its
    LM head (GPT-OSS always; every family under `chunk_loss`), and veosnap's capture then fails on
    `output.logits.detach()`. The probe computes the LM head on the final hidden states *after* the loss,
    under no_grad, only when the model returned no logits: the loss and every gradient stay the
    candidate's own, and veosnap's LM-head hook sees logits to compare."""

    def __init__(self, model: nn.Module) -> None:
        self.hidden: torch.Tensor | None = None
        inner = getattr(model, "model", None)
        head = model.get_output_embeddings()
        if not isinstance(inner, nn.Module) or head is None:
            return
        inner.register_forward_hook(self._keep_hidden)
        model.register_forward_hook(self._fill_logits)
        self.head = head

    def _keep_hidden(self, _module: nn.Module, _args: tuple, output: object) -> None:
        self.hidden = getattr(output, "last_hidden_state", None)

    def _fill_logits(self, _module: nn.Module, _args: tuple, output: object) -> None:
        if getattr(output, "logits", 0) is None and self.hidden is not None:
            with torch.no_grad():
                output.logits = self.head(self.hidden)
        self.hidden = None


class _RouteProbe(nn.Module):
    """Item 2: VeOmni's DeepSeek-V3 router returns only its logits (top-k happens in the MoE block) and has
    no `top_k`, so veosnap finds no router and reports every token as rerouted. This probe sits beside the
    experts, is called with the experts' own inputs `(hidden, top_k_index, top_k_weights)` plus the
    router's logits, returns `(logits, weights, indices)` as veosnap's router hook expects, and hands the
    experts whatever that hook returns (so veosnap's route replay reaches the experts too). It holds
    the router's weight and bias as plain attributes: no parameter is added, no gradient renamed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        gate = block.gate
        self.top_k = int(block.top_k)
        for name in ("norm_topk_prob", "routed_scaling_factor"):
            setattr(self, name, getattr(block, name))
        self.__dict__["weight"] = gate.weight  # not registered: veosnap reads num_experts from its shape
        self.__dict__["e_score_correction_bias"] = gate.e_score_correction_bias
        self._logits: torch.Tensor | None = None
        gate.register_forward_hook(self._keep_logits)
        block.experts.register_forward_pre_hook(self._route)

    def _keep_logits(self, _module: nn.Module, _args: tuple, logits: torch.Tensor) -> None:
        self._logits = logits

    def _route(self, _experts: nn.Module, args: tuple) -> tuple:
        hidden, indices, weights = args[:3]
        _logits, weights, indices = self(self._logits, weights, indices)
        return (hidden, indices, weights, *args[3:])

    def forward(self, logits: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> tuple:
        return logits, weights, indices


def readable(model: nn.Module) -> nn.Module:
    """Attach the probes veosnap 0.1 needs to read this VeOmni model (no-ops where nothing is missing)."""
    _LogitsProbe(model)
    for module in list(model.modules()):
        gate = getattr(module, "gate", None)
        if isinstance(getattr(module, "experts", None), nn.Module) and isinstance(gate, nn.Module) \
                and not hasattr(gate, "top_k") and hasattr(module, "top_k"):
            module.route_probe = _RouteProbe(module)
    return model


# --- parallel state ----------------------------------------------------------------------------------


def init_parallel_state(here: Where):  # noqa: ANN201 - veomni's ParallelState
    """VeOmni's parallel state for a veosnap layout (it must agree with how veosnap splits the batch)."""
    from veomni.distributed.parallel_state import init_parallel_state as veomni_init

    world = here.world
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if here.layout == "ddp":
        return veomni_init(dp_size=world, dp_mode="ddp", device_type=device_type, name=None)
    if here.layout == "fsdp2":
        return veomni_init(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type=device_type, name=None)
    if here.layout == "hsdp":
        from veosnap.candidates.layouts.hsdp import hsdp_mesh

        replicate, shard = hsdp_mesh(world)
        return veomni_init(dp_size=world, dp_replicate_size=replicate, dp_shard_size=shard, dp_mode="fsdp2",
                           device_type=device_type, name=None)
    if here.layout == "ep":
        raise Unsupported(_EP_REASON if not torch.cuda.is_available() else _EP_GPU_REASON)
    if here.layout == "tp":
        raise Unsupported("VeOmni 0.1.12 has no tensor-parallel plan for its text models "
                          "(build_parallelize_model calls parallelize_module without one)")
    raise Unsupported(f"the VeOmni plugin does not know veosnap's layout {here.layout!r}")


def scoped_to_forward(model: nn.Module, state) -> nn.Module:  # noqa: ANN001
    """Item 3 workaround: VeOmni reads its parallel state at run time (the loss asks `sp_enabled`), but a
    generator backend's `finally` runs before a layout runs the model. So the state is made current
    only around the model's own forward (VeOmni's `set_parallel_state`, as its `use_parallel_state` does
    for one module), and the process-wide global stays clear between calls."""
    from veomni.distributed.parallel_state import set_parallel_state

    previous: list = []

    def enter(*_: object) -> None:
        previous.append(set_parallel_state(state))

    def leave(*_: object) -> None:  # returns None: a forward hook's value would replace the output
        set_parallel_state(previous.pop())

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)
    return model


_EP_REASON = ("VeOmni's expert parallel runs only inside its fused MoE kernels (triton group-gemm, quack, npu: "
              "GPU); its eager experts loop over all experts with the rank's shard of the weights")
_EP_GPU_REASON = ("veosnap's ep layout hands the backend a model transformers has already expert-sharded "
                  "(DistributedConfig(ep_size=N)); VeOmni must shard the full model itself (issue 14 item 4)")


# --- the backends ----------------------------------------------------------------------------------


def _candidate(reference: nn.Module, ops, own_parallelize: bool = False) -> Iterator[nn.Module]:  # noqa: ANN001
    if reference.config.model_type not in VEOMNI_FAMILIES:
        raise Unsupported(f"VeOmni 0.1.12 has no model class for {reference.config.model_type!r}")
    _clear_veomni_state()  # a previous check's state (see the module docstring: CORE.md item 3)
    try:
        here = where()
        state = init_parallel_state(here) if here.layout != "in-process" else None
        if own_parallelize:
            model = _parallelized(reference, ops, here)
        else:
            model = load_reference(build(reference, ops), reference)
        if state is not None:
            _clear_veomni_state()  # from here on the state is current only inside the model's forward
            scoped_to_forward(model, state)
        yield readable(model)
    finally:
        _clear_veomni_state()


def _parallelized(reference: nn.Module, ops, here: Where) -> nn.Module:  # noqa: ANN001
    """VeOmni's own `build_parallelize_model`: meta init, FSDP2 wrapping, weights loaded from a file."""
    if here.layout not in ("fsdp2", "hsdp"):
        raise Unsupported(f"VeOmni's own parallelize is checked under fsdp2 and hsdp, not {here.layout}")
    from safetensors.torch import save_file
    from veomni.arguments import MixedPrecisionConfig
    from veomni.distributed.torch_parallelize import build_parallelize_model

    model = build(reference, ops, init_device="meta")
    with tempfile.TemporaryDirectory(prefix="veomni-weights-") as tmp:
        save_file(reference_state(reference), str(Path(tmp) / "model.safetensors"))
        with _stdout_to_stderr():
            model = build_parallelize_model(model, weights_path=tmp, init_device="meta",
                                            mixed_precision=MixedPrecisionConfig(enable=False),
                                            enable_gradient_checkpointing=False)
    return model


def veomni(model: nn.Module) -> Iterator[nn.Module]:
    """VeOmni's model class, every op eager (VeOmni's modeling code itself is checked)."""
    yield from _candidate(model, _ops())


def veomni_sdpa(model: nn.Module) -> Iterator[nn.Module]:
    """VeOmni's model class with transformers' SDPA attention."""
    yield from _candidate(model, _ops(attn_implementation="sdpa"))


def veomni_chunk_loss(model: nn.Module) -> Iterator[nn.Module]:
    """VeOmni's chunked cross-entropy: the loss from hidden states and the LM head, no logits (CORE.md item 1)."""
    yield from _candidate(model, _ops(cross_entropy_loss_implementation="chunk_loss"))


def veomni_fsdp2(model: nn.Module) -> Iterator[nn.Module]:
    """VeOmni's own FSDP2 (`build_parallelize_model`) under veosnap's fsdp2/hsdp layouts."""
    yield from _candidate(model, _ops(), own_parallelize=True)


def veomni_ulysses(model: nn.Module) -> nn.Module:
    """The reference model, with VeOmni's own Ulysses all-to-all (`veomni.distributed.sequence_parallel.
    ulysses`) as the exchange of veosnap's `sp` layouts (other layouts run the reference unchanged): checks
    VeOmni's sequence-parallel communication, gradients included, against the single-process golden."""
    _import_veomni()
    from veomni.distributed.sequence_parallel.ulysses import gather_heads_scatter_seq, gather_seq_scatter_heads

    from veosnap.candidates.layouts.sequence import Exchange, use_exchange

    return use_exchange(model, Exchange(gather_seq_scatter_heads, gather_heads_scatter_seq,
                                        name="VeOmni's ulysses all-to-all"))
