"""Backends: how a candidate model is made from the reference one.

A backend is a callable that receives the built reference model (in the golden's dtype, on the
device) and returns the model to run; it may patch the model in place and return it (or None).
It may also:

- take a second parameter, `ctx`: where it runs (`context.Context`: layout, rank, world, data-parallel
  share, device mesh, device); `veosnap.context()` gives the same from anywhere while it runs;
- return `Candidate(model, ...)` to say more about the candidate: `forward_only=reason` when it cannot
  run a backward pass here (the check then compares the forward tensors and says why gradients were
  not checked; `forward_only(model, reason)` is the short form), `adapt_batch=fn` when it takes the
  golden's batch in a form of its own (the comparison stays on the golden's tokens),
  `full_gradients=fn` when it shards parameters outside DTensor, `notes=[...]` to say in the report
  what it replaced (a generator may append to that list after its `yield`: what its kernels actually
  ran, counted during the check);
- be marked `@parallelizes` when it builds its own parallel model (its own FSDP2, EP, ...): every
  layout then hands it the plain reference and does not wrap what it returns;
- raise `Unsupported(reason)` when it does not apply to this model or machine: the check is skipped;
- be a generator function that yields the model once: code after the `yield` (put it in a
  `finally`) runs when the check is done, to undo process-wide patches (as in a pytest fixture).
  Whatever it patched stays applied while any layout runs the model (every pass, route replay).

SPEC is:

- a registered name: `eager`, `sdpa`, `sdpa_<kernel>`, `flex_attention`, `flash_attention_<2|3|4>`,
  `grouped_mm`, `batched_mm`, `compile`, the kernel libraries `fa4`, `fla`, `quack`, `liger` (`kernels/`),
  or one added with `register` (`veosnap.register_backend`);
- `path/to/file.py:function` or `package.module:function`;
- the name of a `veosnap.backends` entry point;
- several of these joined by `+` (`sdpa+grouped_mm`), applied left to right.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import warnings
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from ..errors import NothingToChange, Unsupported, VeosnapError
from ..reference.zoo import shown
from . import context, specs
from .candidate import REFERENCE_PATH, Adapted, Candidate, forward_only  # noqa: F401 - Adapted: the backend API, importable here too
from .kernels import fa4, fla, liger, quack
from .kernels.support import gpu_library

BackendFn = Callable[..., object]
ENTRY_POINT_GROUP = "veosnap.backends"


def parallelizes(fn: BackendFn) -> BackendFn:
    """Mark `fn` as a backend that builds its own parallel model (a framework's FSDP2, EP, ...).

    Every layout then hands it the plain reference (never a model transformers already sharded, as the
    tp and ep layouts otherwise load) with the context saying how the golden's rows are split, and
    runs what it returns as it is: no DDP wrapper, no second `fully_shard`. The backend wraps, shards
    and reduces as its framework does (reducers average over `ctx.dp_world` ranks, as DDP and FSDP2 do).
    """
    fn.veosnap_parallelizes = True  # type: ignore[attr-defined]
    return fn


def _wants_context(fn: Callable) -> bool:
    """Whether `fn` takes the context as a second positional parameter (`def backend(model, ctx)`)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    if len(params) < 2:
        return False
    second = params[1]
    return second.kind == second.VAR_POSITIONAL or second.name == "ctx" or second.default is second.empty


@dataclass(frozen=True)
class Registered:
    """A built-in backend: its function, and a test of whether this machine can run it at all."""

    fn: BackendFn
    requires: Callable[[], str | None] = lambda: None  # the reason it cannot run here, or None


_REGISTRY: dict[str, Registered] = {}


def register(name: str, fn: BackendFn | None = None, *,
             requires: Callable[[], str | None] | None = None) -> Callable[[BackendFn], BackendFn] | BackendFn:
    """Register a backend under `name`: `register(name, fn)`, or `@register(name)` as a decorator.

    `requires` returns why this machine cannot run it (None when it can); `veosnap check --matrix`
    leaves such backends out of its default columns. A backend registered at run time is known to
    this process only: torchrun ranks resolve SPECs again (give them a file, module or entry point).
    """

    def wrap(fn: BackendFn) -> BackendFn:
        _REGISTRY[name] = Registered(fn, requires or (lambda: None))
        return fn

    return wrap if fn is None else wrap(fn)


def builtin_names() -> list[str]:
    return sorted(_REGISTRY)


def unavailable_here(name: str) -> str | None:
    """Why the registered backend `name` cannot run on this machine, or None when it can."""
    return _REGISTRY[name].requires()


def runnable_builtins() -> list[str]:
    """Registered backends this machine can run, `eager` first (the matrix's default columns)."""
    names = [n for n in builtin_names() if unavailable_here(n) is None]
    return sorted(names, key=lambda n: (n != "eager", n))


# --- built-ins -------------------------------------------------------------------------------------


@register("eager")
def eager(model: nn.Module) -> nn.Module:
    """The reference itself (eager attention, eager experts)."""
    return model


def attention(implementation: str) -> BackendFn:
    """A backend that switches the model to transformers' attention `implementation`."""

    def apply(model: nn.Module) -> nn.Module:
        try:
            model.set_attn_implementation(implementation)
        except (ValueError, ImportError) as exc:  # transformers refuses models it has no support for
            raise Unsupported(str(exc).split(". ")[0].strip()) from None
        return model

    apply.__doc__ = f"transformers' `{implementation}` attention."
    return apply


register("sdpa")(attention("sdpa"))


def _gpu_with(module: str | None, what: str, missing: str = "") -> Callable[[], str | None]:
    """A `requires` test: a CUDA GPU and, if named, an importable `module`."""

    def requires() -> str | None:
        if not torch.cuda.is_available():
            return f"{what} needs a CUDA GPU"
        if module and importlib.util.find_spec(module) is None:
            return f"{what} is not installed ({missing})"
        return None

    return requires


def _flash_attention(version: int, requires: Callable[[], str | None]) -> BackendFn:
    """transformers' own `flash_attention_<version>` integration (16-bit only, as the kernels are)."""
    switch = attention(f"flash_attention_{version}")

    def apply(model: nn.Module) -> nn.Module:
        reason = requires()
        if reason:
            raise Unsupported(reason)
        dtype = next(model.parameters()).dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise Unsupported(f"flash-attn {version} computes in float16/bfloat16 only, not {str(dtype)[6:]}")
        return switch(model)

    apply.__doc__ = f"transformers' `flash_attention_{version}` (flash-attn {version}'s own integration)."
    return apply


# flash-attn 2 and 3 publish no binary wheel: 2.8.3 is a source distribution whose sm90 build takes
# longer than a lent GPU's 10-minute command, 3 is built from the repository's hopper/ directory.
# A distribution is checked, not a module: flash-attn-4 also installs the `flash_attn` package.
_FLASH_ATTENTION = {
    2: gpu_library("flash-attn 2", "flash-attn", "no binary wheel on PyPI: 2.8.3 is a source distribution, "
                   "built for the GPU at install (tens of minutes of nvcc for sm90)", capability=(8, 0)),
    3: gpu_library("flash-attn 3", "flash-attn-3", "no wheel on PyPI: build hopper/ of Dao-AILab/flash-attention "
                   "(tens of minutes of nvcc)", capability=(9, 0)),
    4: gpu_library("flash-attn 4", "flash-attn-4", "pip install flash-attn-4", capability=(9, 0)),
}
for _version, _requires in _FLASH_ATTENTION.items():
    register(f"flash_attention_{_version}", requires=_requires)(_flash_attention(_version, _requires))


@contextmanager
def wrapped_attention(name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, transformers' attention function `name` is `wrap(the function)`; then as it was."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    had = name in ALL_ATTENTION_FUNCTIONS._local_mapping
    before = ALL_ATTENTION_FUNCTIONS[name]
    ALL_ATTENTION_FUNCTIONS[name] = wrap(before)
    try:
        yield
    finally:
        if had:
            ALL_ATTENTION_FUNCTIONS[name] = before
        else:
            del ALL_ATTENTION_FUNCTIONS[name]


# torch's errors when no enabled SDPA kernel accepts a call (CUDA; CPU)
NO_KERNEL = ("No available kernel", "No viable backend for scaled_dot_product_attention")


def declining_sdpa(kernel: str, sdpa: Callable) -> Callable:
    """HF's SDPA attention function `sdpa`, run under one of torch's kernels: where that kernel cannot run
    the model's attention call as HF makes it, `Unsupported` with torch's reasons (a skip, not an error).

    Which call HF makes depends on the model and on the batch, so only the real call can tell: with grouped
    key/value heads and no mask (an unpadded batch) HF passes `enable_gqa=True`, which torch's efficient
    kernel refuses; with a mask (a padded batch) it repeats the key/value heads, which it runs; flash runs
    the unmasked call and refuses the masked one."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: object, **kwargs: object) -> object:
        try:
            return sdpa(module, query, key, value, *args, **kwargs)
        except RuntimeError as exc:
            if not any(said in str(exc) for said in NO_KERNEL):
                raise
            # Torch says why each kernel declined in warnings; the second call fails the same way, at once.
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    sdpa(module, query, key, value, *args, **kwargs)
                except RuntimeError:
                    pass
            why = "; ".join(dict.fromkeys(" ".join(str(w.message).split())[:200] for w in said)) or str(exc)
            grouped = ", grouped" if query.shape[1] != key.shape[1] else ""
            masked = kwargs.get("attention_mask", args[0] if args else None) is not None
            raise Unsupported(f"SDPA's {kernel} kernel cannot run this model's attention call ({query.dtype}, "
                              f"{query.shape[1]} query and {key.shape[1]} key/value heads{grouped}, head_dim "
                              f"{query.shape[-1]}, {'with' if masked else 'no'} mask): {why}") from None

    return attention


def _sdpa_kernel(kernel: str) -> BackendFn:
    """SDPA pinned to one of torch's kernels (flash, efficient, cudnn, math), where it applies."""

    def apply(model: nn.Module) -> Iterator[nn.Module]:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                                        "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[kernel])
        attention("sdpa")(model)
        # Declined at the model's own attention call (its shapes, its mask), not on a stand-in probe: a
        # probe cannot know whether HF will pass a mask or enable_gqa for this batch.
        with wrapped_attention("sdpa", lambda sdpa: declining_sdpa(kernel, sdpa)), sdpa_kernel(backend):
            yield model

    apply.__doc__ = f"SDPA restricted to torch's `{kernel}` kernel."
    return apply


for _kernel in ("flash", "efficient", "cudnn"):
    register(f"sdpa_{_kernel}", requires=_gpu_with(None, f"SDPA's {_kernel} kernel"))(_sdpa_kernel(_kernel))
register("sdpa_math")(_sdpa_kernel("math"))


# Inductor's words when no configuration of a Triton template fits the GPU (shared memory, registers).
OUT_OF_RESOURCE = ("out of resource", "No valid triton configs")


def declining_flex(flex: Callable) -> Callable:
    """HF's flex attention function `flex`: where torch's flex kernel cannot be built for the model's call on
    this GPU (no Triton configuration fits its shared memory), `Unsupported` with torch's figures.

    Inductor compiles the kernel at the first call, for that call's dtype and head dims: DeepSeek-V3's float32
    attention (head_dim 192 for queries and keys, 128 for values) needs 278,784 bytes of shared memory a block,
    an H200 has 232,448 (2026-12-02). That is torch's limit on this machine, not a wrong kernel: a skip."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  *args: object, **kwargs: object) -> object:
        try:
            return flex(module, query, key, value, *args, **kwargs)
        except Exception as exc:  # InductorError wraps triton's OutOfResources; neither is public API
            said = " ".join(str(exc).split())
            if not all(words in said for words in OUT_OF_RESOURCE):
                raise
            figures = re.search(r"Required: (\d+) Hardware limit: ?(\d+)", said)
            need = (f"it needs {figures[1]} bytes of shared memory a block, the GPU has {figures[2]}" if figures
                    else said[said.index("out of resource"):][:120])
            raise Unsupported(f"torch's flex_attention kernel cannot be built for this model's attention call on "
                              f"this GPU ({query.dtype}, head_dim {query.shape[-1]} for queries and keys, "
                              f"{value.shape[-1]} for values): {need}") from None

    return attention


@register("flex_attention")
def flex_attention(model: nn.Module) -> Iterator[nn.Module | Candidate]:
    """transformers' `flex_attention`; forward only where torch has no flex backward (CPU)."""
    attention("flex_attention")(model)
    if next(model.parameters()).device.type != "cpu":
        # Inductor's flex kernel refuses head dims below 16 ("NYI: embedding dimension ... at least 16"), which
        # toy vision towers have (qwen3_vl_moe's: 8): a decline, not an error of the check.
        small = sorted({m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)
                        and m.head_dim < 16})
        if small:
            raise Unsupported(f"flex_attention on CUDA needs attention head dims of at least 16 (torch inductor's "
                              f"flex kernel); this model has head dim {', '.join(map(str, small))}")
        with wrapped_attention("flex_attention", declining_flex):
            yield model
        return
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise Unsupported("flex_attention cannot run attention sinks on CPU")
    # FlexAttention refuses inputs that require grad on CPU, so only the forward can be checked.
    yield forward_only(model, "flex_attention has no backward on CPU")


def _experts(implementation: str) -> BackendFn:
    def apply(model: nn.Module) -> nn.Module:
        if not type(model)._can_set_experts_implementation():
            raise NothingToChange(f"{implementation} swaps the MoE experts' kernel; {type(model).__name__} has no "
                                  "experts (a dense model)")
        model.set_experts_implementation(implementation)
        return model

    apply.__doc__ = f"transformers' `{implementation}` experts kernel (dense models: nothing to change, n/a)."
    return apply


register("grouped_mm")(_experts("grouped_mm"))
register("batched_mm")(_experts("batched_mm"))


@register("compile")
def compile_(model: nn.Module) -> Iterator[nn.Module]:
    """`torch.compile` (inductor) on the model's forward, in place so parameter names are unchanged."""
    # Dynamo's caches are per code object, shared by every model of a family: after its recompile
    # limit (8) it silently runs eager, and a matrix's later `compile` cells would check nothing.
    # Each check starts from a reset (inductor's on-disk cache still spares repeated compiles).
    torch._dynamo.reset()
    # nn.Module.compile keeps the module (and its parameter names, which name the gradients);
    # torch.compile(model) would wrap it and prefix every name with `_orig_mod.`.
    model.compile(backend="inductor")
    try:
        yield model
    finally:
        torch._dynamo.reset()


# Kernel libraries, one module each in kernels/, registered here where the registry is.
register(fa4.NAME, fa4.fa4, requires=fa4.requires)
register(fla.NAME, fla.fla, requires=fla.requires)
register(liger.NAME, liger.liger, requires=liger.requires)
register(quack.NAME, quack.quack, requires=quack.requires)

# --- resolving specs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """A resolved backend spec: its display name and the functions applied in order."""

    spec: str
    steps: tuple[BackendFn, ...]

    @property
    def parallelizes(self) -> bool:
        """Whether a step builds its own parallel model (`@parallelizes`): layouts then do not wrap it."""
        return any(getattr(step, "veosnap_parallelizes", False) for step in self.steps)

    @contextmanager
    def prepare(self, model: nn.Module, ctx: context.Context | None = None) -> Iterator[Candidate]:
        """Apply every step to `model`; within the block the candidate runs, after it patches are undone.

        `ctx` is where it runs (default: in process, on the model's device); it is `veosnap.context()`
        within the block. Forward-only is sticky: if any step declares it, the combination is forward
        only. At most one step may adapt the batch, and one read full gradients.
        """
        ctx = ctx or context.in_process(model)
        reasons: list[str] = []
        chosen: dict[str, tuple[str, object]] = {}  # what a step set -> (which step, the value)
        said: list[list[str]] = []  # each step's notes, read when every step has finished
        unchanged: list[str] = []  # steps that had nothing to change on this model (NothingToChange), why
        with context.told(ctx), ExitStack() as stack:
            for step in self.steps:
                args = (model, ctx) if _wants_context(step) else (model,)
                try:
                    if inspect.isgeneratorfunction(step):
                        result = stack.enter_context(contextmanager(step)(*args))
                    else:
                        result = step(*args)
                except NothingToChange as exc:
                    unchanged.append(str(exc))
                    continue
                if isinstance(result, Candidate):
                    model = result.model
                    said.append(result.notes)
                    if result.reference_path:
                        said.append([REFERENCE_PATH + result.reference_path])
                    if result.forward_only:
                        reasons.append(result.forward_only)
                    for what in ("adapt_batch", "full_gradients"):
                        value, name = getattr(result, what), getattr(step, "__name__", repr(step))
                        if value is not None and what in chosen:
                            raise VeosnapError(f"backend {self.spec!r}: both {chosen[what][0]!r} and {name!r} set "
                                               f"{what}; one step may")
                        if value is not None:
                            chosen[what] = (name, value)
                elif result is not None:
                    model = result
            if len(unchanged) == len(self.steps):  # the candidate would be the reference itself: not a pass
                raise NothingToChange("; ".join(unchanged))
            value = {what: chosen[what][1] if what in chosen else None for what in ("adapt_batch", "full_gradients")}
            combined = Candidate(model, forward_only="; ".join(reasons), **value)  # type: ignore[arg-type]
            combined.notes.extend(f"changed nothing: {why}" for why in unchanged)
            yield combined
        for notes in said:  # the generators have finished: their counts are final
            combined.notes.extend(notes)


def resolve(spec: str) -> Backend:
    """Turn a SPEC into a Backend, with a one-line error naming what could not be found."""
    if not spec or not spec.strip():
        raise VeosnapError("empty backend spec")
    return Backend(spec=spec, steps=tuple(_resolve_one(part.strip()) for part in spec.split("+")))


def _resolve_one(spec: str) -> BackendFn:
    registry = {name: registered.fn for name, registered in _REGISTRY.items()}
    try:
        return specs.load(spec, "backend", registry, ENTRY_POINT_GROUP, callable, "callable")  # type: ignore[return-value]
    except KeyError:
        known = ", ".join(builtin_names())
        raise VeosnapError(f"unknown backend {spec!r} (built in: {known}; or path/to/file.py:function, module:function)") from None


# What the package itself registers; a name registered later (or registered again) exists in one process only.
_SHIPPED = dict(_REGISTRY)


def shipped(name: str) -> Backend:
    """The built-in backend `name` as veosnap ships it, even where a conftest registered another under
    that name (the recorder's fragility check runs veosnap's own variants only)."""
    return Backend(spec=name, steps=(_SHIPPED[name].fn,))


def portable(spec: str) -> str | None:
    """`spec` as any process can resolve it: a backend registered at run time (a conftest's
    `register_backend("mine", fn)`) becomes `path/to/file.py:fn`; None when there is no such path (a
    lambda, a local function). Built-ins, files, modules and entry points are already portable."""
    parts = []
    for part in (p.strip() for p in spec.split("+")):
        if part in _REGISTRY and _REGISTRY[part] is not _SHIPPED.get(part):
            fn = _REGISTRY[part].fn
            try:
                source = inspect.getsourcefile(fn)
            except TypeError:
                source = None
            if source is None or "<" in fn.__qualname__:
                return None
            part = f"{shown(Path(source))}:{fn.__qualname__}"
        parts.append(part)
    return "+".join(parts)
