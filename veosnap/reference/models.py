"""Building a zoo model as the HF eager reference, with deterministic weights."""

from __future__ import annotations

import copy
import inspect
import logging
import math
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import VeosnapError
from . import determinism, weights
from .zoo import ToyConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}

# transformers 5 defaults to sdpa attention and grouped_mm experts: the reference asks for eager.
REFERENCE_ATTN = "eager"
REFERENCE_EXPERTS = "eager"


def dtype_from_name(name: str) -> torch.dtype:
    """`float32` / `bfloat16` / `float64` as a torch dtype, with a clear error otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise VeosnapError(f"unknown dtype {name!r} (expected one of: {', '.join(DTYPES)})") from None


# Config objects by config hash: a check asks for one about seven times (limits, coverage, the build), and
# transformers validates every field each time. Each caller gets its own deep copy (a build may change it).
_CONFIGS: dict[str, transformers.PretrainedConfig] = {}
_RANDOM_OFF: dict[str, dict[str, float]] = {}  # by config hash: what `hf_config` turned off


def hf_config(toy: ToyConfig) -> transformers.PretrainedConfig:
    """The transformers config object for a toy config (a fresh copy: the caller may change it)."""
    return copy.deepcopy(_shared_config(toy))


def text_config(toy: ToyConfig) -> transformers.PretrainedConfig:
    """The config's text part (`get_text_config()`) to read, not to change: the one cached object, not a copy (a
    copy costs 0.08 ms, and the limits read it four times on a check's path before its model is built)."""
    return _shared_config(toy).get_text_config()


def _shared_config(toy: ToyConfig) -> transformers.PretrainedConfig:
    """The cached config object of `toy` (built once per config hash): never changed; callers outside this module
    get copies (`hf_config`) or read it (`text_config`)."""
    key = toy.hash
    if key not in _CONFIGS:
        # A deep copy: transformers writes into nested sub-config dicts (a vision config's `model_type`), and
        # the toy's own dict is what a golden records and hashes.
        fields = copy.deepcopy(toy.config)
        model_type = fields.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except Exception as exc:  # noqa: BLE001 - transformers' validators raise many types; the user gets one line
            raise VeosnapError(f"{toy.path}: transformers cannot build this config ({_cause(exc)})") from None
        _RANDOM_OFF[key] = determinism.without_randomness(config)  # every model veosnap builds: docs/trust.md
        if len(_CONFIGS) >= _SKELETONS_KEPT:
            _CONFIGS.pop(next(iter(_CONFIGS)))
        _CONFIGS[key] = config
    return _CONFIGS[key]


def random_off(toy: ToyConfig) -> dict[str, float]:
    """The config's random settings (dropout and the like) that every model built from it runs without, with
    their configured values (`determinism.without_randomness`); empty for a deterministic config."""
    _shared_config(toy)
    return dict(_RANDOM_OFF[toy.hash])


def _cause(exc: BaseException, limit: int = 200) -> str:
    """The first line of the root cause (transformers wraps validation errors), at most `limit` chars."""
    root = exc.__cause__ or exc
    text = (str(root).strip().splitlines() or [type(root).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def auto_class(config: transformers.PretrainedConfig) -> type:
    """The auto class that builds a trainable model for `config`: image-text-to-text for the models that take
    images (vision-language models, Qwen3.5, the omni thinkers; they run text-only batches too), causal LM
    otherwise. One rule for every family, no model names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def build(
    toy: ToyConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    vet: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """The HF eager reference model for `toy`, weights derived from `seed`, in `dtype` on `device`.

    Parameters HF keeps in float32 (a DeepSeek-V3 router, say) stay float32, as they would when a
    user loads the model with `dtype=...`. `vet` is called with the model as constructed, its parameters
    allocated on the host but not drawn, before anything touches them or the device (a prebuild's limits:
    `reference.prebuild`); what it raises ends the build.
    """
    config = hf_config(toy)
    with warnings.catch_warnings(), quiet_transformers():
        warnings.simplefilter("ignore")
        try:
            model = _uninitialized(config, dtype)
        except Exception as exc:  # noqa: BLE001 - a config transformers accepts but cannot instantiate
            raise VeosnapError(f"{toy.path}: transformers cannot build this model ({_cause(exc)})") from None
    # Pinned before the vetting: a check that takes the vetting's facts builds no skeleton (which pins too) before it
    # snapshots the modeling module, even when this build fails after them.
    pin_torch_fallbacks(model)
    if vet is not None:
        vet(model)
    weights.initialize(model, seed)
    return model.to(device)


# transformers' `no_init_weights` patches torch's init functions and its own `init_weights` process-wide while a
# model is constructed: a construction beside it (a skeleton while a check's prebuild thread constructs its
# model) would skip its init, weight tying included, and two at once could leave the patches in place. Every
# construction holds this lock (the constructing only: not the weights' draw nor the copy to the device).
_CONSTRUCTING = threading.RLock()


def _uninitialized(config: transformers.PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The eager model for `config` with its parameters allocated but not initialized.

    Every parameter is overwritten afterwards (by `weights.initialize`, or a state dict), so HF's own
    random init would only cost time: single-threaded, it took most of a large model's build (5 s of
    7 s at 88M parameters). Buffers are computed by the modules' constructors as before, and tied
    weights are tied here, as HF's init would have: the toy models' parameters and buffers, and so
    their goldens, are bit-identical either way.
    """
    from transformers.initialization import no_init_weights

    with _CONSTRUCTING, no_init_weights():
        model = auto_class(config).from_config(
            config,
            attn_implementation=REFERENCE_ATTN,
            experts_implementation=REFERENCE_EXPERTS,
            dtype=dtype,
        )
    model.tie_weights()
    return model


# Skeletons by config hash: a check asks for one three times (limits, coverage, the modeling module), and
# building one costs time per layer. Read-only meta modules; a few configs per process at most.
_SKELETONS: dict[str, nn.Module] = {}
_SKELETONS_KEPT = 8
# Skeletons being built on a thread (`prefetch_skeleton`), by config hash.
_PENDING: dict[str, Future] = {}
# A check asks for a skeleton on two threads at once (its own limits, and the prebuild's: `reference.prebuild`):
# one builds or waits, the other finds it made.
_SKELETON_LOCK = threading.Lock()


def skeleton(toy: ToyConfig) -> nn.Module:
    """The reference model for `toy` on the meta device: its parameter names, layers and routers, no memory.
    Built once per config (the same module again after: read it, never change it); one `prefetch_skeleton`
    started is waited for (its error, if any, raised here).

    Check a config's size first (`limits.check_config`): building still costs time per layer.
    """
    key = toy.hash
    with _SKELETON_LOCK:
        model = _SKELETONS.get(key)
        if model is None:
            pending = _PENDING.pop(key, None)
            model = pending.result() if pending is not None else _build_skeleton(toy)
            if len(_SKELETONS) >= _SKELETONS_KEPT:
                _SKELETONS.pop(next(iter(_SKELETONS)))
            _SKELETONS[key] = model
    # Pinned here too (process-wide, idempotent), before any candidate runs: a check snapshots the modeling
    # module afterwards (`candidates.pristine`), and the reference's own pinning is no candidate's patch.
    pin_torch_fallbacks(model)
    return model


def _build_skeleton(toy: ToyConfig) -> nn.Module:
    config = hf_config(toy)
    with _CONSTRUCTING, warnings.catch_warnings(), quiet_transformers(), torch.device("meta"):
        warnings.simplefilter("ignore")
        try:
            return auto_class(config).from_config(
                config, attn_implementation=REFERENCE_ATTN, experts_implementation=REFERENCE_EXPERTS)
        except Exception as exc:  # noqa: BLE001 - a config transformers accepts but cannot instantiate
            raise VeosnapError(f"{toy.path}: transformers cannot build this model ({_cause(exc)})") from None


def prefetch_skeleton(toy: ToyConfig) -> None:
    """Start building `toy`'s skeleton on a thread, for a caller with other work to do first (a check reads
    its golden meanwhile: the file read, zstd and hashing release the GIL). `skeleton` waits for it. Only
    for a config whose layer count `limits.check_layers` accepted: nothing else is checked before."""
    key = toy.hash
    if key in _SKELETONS or key in _PENDING:
        return
    future: Future = Future()

    def build() -> None:
        try:
            future.set_result(_build_skeleton(toy))
        except BaseException as exc:  # noqa: BLE001 - raised where `skeleton` waits for it, never lost
            future.set_exception(exc)

    _PENDING[key] = future
    threading.Thread(target=build, name=f"veosnap-skeleton {toy.name}", daemon=True).start()


def modeling_module(toy: ToyConfig) -> str:
    """The name of the module defining the model family's classes (`transformers.models.llama.modeling_llama`)."""
    config = hf_config(toy)
    try:
        return auto_class(config)._model_mapping[type(config)].__module__
    except (KeyError, AttributeError):
        return type(skeleton(toy)).__module__


def builder(toy: ToyConfig, dtype: str, seed: int = 0) -> Callable[[torch.device], nn.Module]:
    """`build` for one config, dtype (by name) and seed, the device left open (each rank picks its own)."""
    return lambda device: build(toy, dtype_from_name(dtype), device, seed)


def upcast_copy(model: nn.Module, toy: ToyConfig, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The same function as `model` (its exact weight values) built in a higher precision."""
    config = hf_config(toy)
    with warnings.catch_warnings(), quiet_transformers():
        warnings.simplefilter("ignore")
        high = _uninitialized(config, dtype)
    state = {k: v.detach().to("cpu", dtype=dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    high.load_state_dict(state, strict=True)
    pin_torch_fallbacks(high)
    # Parameters HF creates in float32 whatever the dtype (a DeepSeek-V3 router) go up too.
    return high.to(device=next(model.parameters()).device, dtype=dtype)


def pin_torch_fallbacks(model: nn.Module) -> list[str]:
    """Make `model`'s modeling code run its own torch functions, never a kernel package it found installed.

    transformers 5 decorates some modeling functions with `use_kernel_func_from_hub_with_fallback`
    (Qwen3.5 and Qwen3-Next: `torch_chunk_gated_delta_rule` picks flash-linear-attention, `causal_conv1d_fn`
    the causal-conv1d package; the Mamba family mamba-ssm). The choice is made once, when the modeling
    module is imported, and kept in the module-level function: on a machine with `fla` installed the
    "eager reference" would silently run fla's Triton kernels. Each such function of the modules that
    define `model`'s classes is set back to the torch function it wraps (process-wide and idempotent;
    the `fla` backend swaps fla in for its check and restores this). Returns `module.function` for each
    one pinned now.
    """
    pinned = []
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        for name, value in list(vars(module).items()) if module is not None else []:
            torch_function = _kernel_choice(value)
            if torch_function is not None:
                setattr(module, name, _torch_only(torch_function, name))
                pinned.append(f"{module_name}.{name}")
    return pinned


def _kernel_choice(value: object) -> Callable | None:
    """The torch function behind a transformers fallback wrapper, else None.

    The wrapper may itself be wrapped: by a decorator that keeps `__wrapped__`, or (transformers 5.25
    with the `kernels` package, which it now installs) by a `Func` module whose forward calls the
    function. Either chain is followed to the function whose closure made the choice."""
    if not callable(value) or getattr(value, "_veosnap_torch_only", False):
        return None
    for _ in range(8):  # a decorator chain is short; a cycle must not hang the build
        wrapped = _inner(value)
        if wrapped is None:
            return None
        try:
            chosen = inspect.getclosurevars(value).nonlocals
        except (TypeError, ValueError):
            chosen = {}
        # A wrapper that chose a package, or one that found none (it then runs the torch function but warns
        # at its first call, on stderr, in the middle of a report): either way, the torch function.
        if "is_new_implementation" in chosen and chosen.get("torch_function") is wrapped:
            return wrapped
        value = wrapped
    return None


def _inner(value: object) -> Callable | None:
    """What a wrapper calls: its `__wrapped__`, or the function a kernels `Func` module's forward closes over."""
    wrapped = getattr(value, "__wrapped__", None)
    if callable(wrapped):
        return wrapped
    if isinstance(value, nn.Module):
        try:
            inner = inspect.getclosurevars(type(value).forward).nonlocals.get("func")
        except (TypeError, ValueError, AttributeError):
            return None
        return inner if callable(inner) else None
    return None


def unwrapped(value: object) -> object:
    """The innermost function behind a chain of wrappers (decorators, the kernels package's `Func` modules)."""
    for _ in range(8):
        inner = _inner(value)
        if inner is None:
            break
        value = inner
    return value


def _torch_only(torch_function: Callable, name: str) -> Callable:
    """`torch_function`, refusing what only a kernel package can do: keep packed sequences apart.

    transformers' wrapper raises the same way when the package is missing; the torch functions take
    `**kwargs` and would silently run a packed row as one sequence.
    """

    def run(*args, **kwargs):
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name}: the torch reference cannot keep packed sequences apart (cu_seqlens given)")
        return torch_function(*args, **kwargs)

    run.__wrapped__ = torch_function  # type: ignore[attr-defined]
    run._veosnap_torch_only = True  # type: ignore[attr-defined]
    run.__name__ = run.__qualname__ = getattr(torch_function, "__name__", name)
    return run


_LOWER_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CASTS = {torch.Tensor.to, torch.Tensor.type}
_SHORT_CASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
_SOFTMAXES = {F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax}
_FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.arange, torch.linspace,
              torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like}


def _up(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` with every lower float dtype among them replaced by float64."""
    if kwargs.get("dtype") in _LOWER_FLOATS:
        kwargs["dtype"] = torch.float64
    return tuple(torch.float64 if a in _LOWER_FLOATS else a for a in args), kwargs


def _beyond_float32(value: object) -> bool:
    """A Python float that float32, the default dtype, cannot hold."""
    return isinstance(value, float) and math.isfinite(value) and abs(value) > torch.finfo(torch.float32).max


class KeepFloat64(TorchFunctionMode):
    """Within this mode nothing is computed below float64: a float64 tensor is never cast down nor
    soft-maxed in a lower precision, and a float tensor made from scratch or from integers (a count,
    a mask) is float64.

    HF modeling code upcasts to float32 for stability (RMSNorm, eager softmax, routers, rotary) and
    builds some float32 tensors of its own (an MoE load-balancing loss's token counts); in a float64
    run those would round to float32 and both cap the run's precision near the float32 reference's
    own and turn a padding row's float64 mask minimum into -inf. The noise run computes the same
    function, just more precisely, under this mode.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        first = args[0] if args else None
        if func in _FACTORIES:
            args, kwargs = _up(args, kwargs)
            if func is torch.full and "dtype" not in kwargs and _beyond_float32(args[1] if len(args) > 1 else
                                                                              kwargs.get("fill_value")):
                # `torch.full((), torch.finfo(scores.dtype).min)` (XGLM's mask floor): float64's minimum, no dtype
                kwargs["dtype"] = torch.float64
        elif isinstance(first, torch.Tensor) and first.dtype == torch.float64:
            if func in _SHORT_CASTS:
                return first
            if func in _CASTS or func in _SOFTMAXES:
                args, kwargs = _up(args, kwargs)
        elif isinstance(first, torch.Tensor) and not first.is_floating_point():
            if func in _SHORT_CASTS:
                return first.to(torch.float64)
            if func in _CASTS:
                args, kwargs = _up(args, kwargs)
        return func(*args, **kwargs)


class quiet_transformers:
    """Silence transformers' logger while building toy models (warnings about toy sizes)."""

    def __enter__(self) -> None:
        self._logger = logging.getLogger("transformers")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
