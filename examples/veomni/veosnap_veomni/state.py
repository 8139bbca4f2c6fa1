"""What VeOmni changes in the process, and how a check puts it back.

`import veomni` happens when this package loads (`MISSING` says why it could not), so its import-time
registrations (`IMPORT_REGISTRATIONS`) are part of the process every check starts from. Everything VeOmni
(or a kernel registered through it) changes later is snapshotted and restored by `restored()`:

- transformers' `LOSS_MAPPING` entries VeOmni's `install_loss_mapping` replaces;
- VeOmni's ops config (`veomni.ops.config.singleton`) and its parallel state (cleared on entry and exit);
- VeOmni's kernel registry, `veomni.ops.kernel_registry.KERNEL_REGISTRY` (every `(op, variant)` bucket);
- the op-slot bindings: every `OpSlot` / `OpsConfigSlot` of VeOmni's loaded modules (a generated modeling
  module's `veomni_moe_experts_forward`, ...), bound by `build_foundation_model`; slots of modules first
  imported inside the block are put back unbound;
- the fused-MoE pointers: `veomni.ops.kernels.moe._fused_moe_forward` and `apply_veomni_fused_moe_patch`,
  and the LoRA ones it binds (`veomni.lora.ops._fused_lora_moe_forward`, ...); the load-balancing loss pointer
  `apply_ops_config` binds (`veomni.ops.kernels.load_balancing_loss._load_balancing_loss`) and the attention
  pointer `veomni.ops.kernels.attention.flash._flash_attention_forward`;
- the per-model patches `apply_per_model_patches` makes in a generated modeling module (DeepSeek-V3's
  `device_patch.py` replaces its RMSNorm class and `apply_rotary_pos_emb` there, and an eager build never
  puts them back: a later all-eager DeepSeek-V3 would run liger's RMSNorm): recorded while `restored()` is
  open, undone when it closes.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator

_LOSS_KEYS = ("ForCausalLM", "ForConditionalGeneration", "ForSequenceClassification")
_REGISTRIES = (("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
               ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS"))
# (module, attribute): the fused-MoE function pointers and the dispatcher that sets them
FUSED_MOE_POINTERS = (("veomni.ops.kernels.moe", "_fused_moe_forward"),
                      ("veomni.ops.kernels.moe", "apply_veomni_fused_moe_patch"),
                      ("veomni.lora.ops", "_fused_lora_moe_forward"),
                      ("veomni.lora.ops", "_fused_independent_lora_moe_forward"),
                      ("veomni.lora.ops", "bind_lora_moe_kernels"))
# other module pointers VeOmni binds (apply_ops_config's global ops) or a backend here wraps (veosnap_veomni.kernels)
_POINTERS = FUSED_MOE_POINTERS + (("veomni.ops.kernels.load_balancing_loss", "_load_balancing_loss"),
                                  ("veomni.ops.kernels.attention.flash", "_flash_attention_forward"))
_ABSENT = object()


def _registered() -> set[str]:
    """The names in transformers' attention and mask registries (global and local), as `Registry['name']`."""
    names = set()
    for module, attr in _REGISTRIES:
        registry = getattr(importlib.import_module(module), attr)
        label = type(registry).__name__
        names |= {f"{label}[{key!r}]" for key in (*registry._global_mapping, *registry._local_mapping)}
    return names


def _import_at_load() -> tuple[str, tuple[str, ...]]:
    """`import veomni` when this package loads, before veosnap snapshots the process for a candidate: its
    import-time registrations (the `veomni_*_with_sp` attention and mask functions) are then part of the
    process every check starts from, said once, instead of being found "left behind" (and removed) by
    every check. Returns (why it is not importable, or ''; the names its import registered)."""
    os.environ.setdefault("MODELING_BACKEND", "veomni")
    before = _registered()
    try:  # what VeOmni prints at import (a banner, its INFO logger) goes to stderr: stdout may be a report
        with contextlib.redirect_stdout(sys.stderr):
            import veomni  # noqa: F401  (import-time patches: see examples/veomni/plugin.py's docstring)
            import veomni.models  # noqa: F401  (its registry of model classes)
    except ImportError as exc:
        return f"veomni is not importable here ({exc}); tools/veomni_env.sh builds an environment with it", ()
    return "", tuple(sorted(_registered() - before))


MISSING, IMPORT_REGISTRATIONS = _import_at_load()


def _slots() -> dict[int, tuple[object, dict]]:
    """Every OpSlot / OpsConfigSlot in VeOmni's loaded modules: id -> (slot, its binding)."""
    from veomni.ops.dispatch import OpsConfigSlot, OpSlot

    found = {}
    for name, module in list(sys.modules.items()):
        if not (name == "veomni" or name.startswith("veomni.")) or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, (OpSlot, OpsConfigSlot)) and id(value) not in found:
                found[id(value)] = (value, dict(vars(value)))
    return found


def _unbound(slot: object) -> dict:
    from veomni.ops.dispatch import OpSlot

    return {"_kernel": None, "_impl_name": None} if isinstance(slot, OpSlot) else {"_value": "eager"}


@dataclass(frozen=True)
class Patch:
    """One per-model patch VeOmni made (`apply_per_model_patches`): `owner.attr` (a generated modeling module's
    class or function, or a class's `forward`) and what it was before (`_ABSENT`: nothing)."""

    owner: object
    attr: str
    before: object

    def undo(self) -> None:
        if self.before is _ABSENT:
            with contextlib.suppress(AttributeError):
                delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.before)


@dataclass
class Snapshot:
    """VeOmni's process-wide state at one moment (`take()`), put back by `restore()`.

    Covers the kernel registry (`KERNEL_REGISTRY`), every op-slot binding, the fused-MoE, load-balancing and
    attention pointers, the ops config and transformers' `LOSS_MAPPING` entries VeOmni replaces; `restore()`
    also clears VeOmni's parallel state and undoes `patches`, the per-model patches `restored()` recorded while
    it was open. See the module docstring for the exact list.
    """

    registry: dict = field(default_factory=dict)
    slots: dict = field(default_factory=dict)
    pointers: dict = field(default_factory=dict)
    ops: object = None
    losses: dict = field(default_factory=dict)
    patches: list = field(default_factory=list)

    @classmethod
    def take(cls) -> "Snapshot":
        from transformers.loss.loss_utils import LOSS_MAPPING
        from veomni.ops.config.singleton import get_ops_config
        from veomni.ops.kernel_registry import KERNEL_REGISTRY

        pointers = {}
        for module, attr in _POINTERS:
            with contextlib.suppress(ImportError):
                pointers[(module, attr)] = getattr(importlib.import_module(module), attr, _ABSENT)
        return cls(registry={key: dict(bucket) for key, bucket in KERNEL_REGISTRY._specs.items()},
                   slots=_slots(), pointers=pointers, ops=get_ops_config(),
                   losses={key: LOSS_MAPPING.get(key) for key in _LOSS_KEYS})

    def restore(self) -> None:
        from transformers.loss.loss_utils import LOSS_MAPPING
        from veomni.distributed.parallel_state import clear_parallel_state
        from veomni.ops.config.singleton import set_ops_config
        from veomni.ops.kernel_registry import KERNEL_REGISTRY

        clear_parallel_state()
        for patch in reversed(self.patches):
            patch.undo()
        self.patches.clear()
        set_ops_config(self.ops)
        for key, value in self.losses.items():
            if value is None:
                LOSS_MAPPING.pop(key, None)
            else:
                LOSS_MAPPING[key] = value
        KERNEL_REGISTRY._specs.clear()  # in place: the registry object is what VeOmni's modules hold
        KERNEL_REGISTRY._specs.update({key: dict(bucket) for key, bucket in self.registry.items()})
        for key, (slot, binding) in _slots().items():
            vars(slot).update(self.slots[key][1] if key in self.slots else _unbound(slot))
        for (module, attr), value in self.pointers.items():
            target = importlib.import_module(module)
            if value is _ABSENT:
                vars(target).pop(attr, None)
            else:
                setattr(target, attr, value)


@contextlib.contextmanager
def restored() -> Iterator[Snapshot]:
    """Within the block VeOmni (or a kernel registered through it) may change its kernel registry, op-slot
    bindings, fused-MoE pointers, ops config, parallel state and transformers' `LOSS_MAPPING`; after it
    (done, failed or not) all are as they were on entry and the parallel state is cleared. The parallel
    state is also cleared on entry: one left by anything earlier would be taken for this block's. The per-model
    patches VeOmni makes within the block are recorded (`Snapshot.patches`) and undone too. Nests."""
    from veomni.distributed.parallel_state import clear_parallel_state
    from veomni.ops.config import registry

    snapshot = Snapshot.take()
    clear_parallel_state()
    patch_target = registry._patch_target
    registry._patch_target = _recording(patch_target, snapshot.patches)
    try:
        yield snapshot
    finally:
        registry._patch_target = patch_target
        snapshot.restore()


def _recording(patch_target: Callable, into: list) -> Callable:
    """VeOmni's `_patch_target` (what `apply_per_model_patches` calls for each op it binds in a modeling
    module), recording what it replaces into `into`."""

    def recorded(hf_module: object, target_attr: str, backend: object) -> None:
        target = backend.target_override or target_attr
        owner, attr = (getattr(hf_module, target), "forward") if backend.replace_forward else (hf_module, target)
        before = vars(owner).get(attr, _ABSENT)
        patch_target(hf_module, target_attr, backend)
        into.append(Patch(owner, attr, before))

    return recorded


def register_fused_moe(name: str, forward: Callable, *, description: str = "") -> None:
    """Register `forward` as VeOmni's fused MoE kernel `name`, selected by `moe_implementation="fused_<name>"`.

    `forward` has the signature of VeOmni's raw fused-MoE kernels (`group_gemm_fused_moe_forward`):
    `(num_experts, routing_weights, selected_experts, hidden_states, fc1_1_weight, fc1_2_weight, fc2_weight,
    fc1_1_2_weight=None, swiglu_limit=None) -> [tokens, hidden]`, with the transformers v5 expert layout
    (`fc1_1_2_weight` is `gate_up_proj`, `[experts, 2 * intermediate, hidden]`; `fc2_weight` is `down_proj`,
    `[experts, hidden, intermediate]`). It goes where VeOmni's own triton and quack kernels go: a
    `KernelSpec(op_name="moe_experts", variant="standard", hardware "any")` in `KERNEL_REGISTRY`, wrapped by
    VeOmni's own experts adapter, and `apply_veomni_fused_moe_patch` (which `build_foundation_model` calls to
    set the `_fused_moe_forward` pointer, and which refuses names it does not know) is wrapped to accept
    `name`, as VeOmni's docstring tells third-party backends to do. Call it inside `restored()`: both changes
    are undone there. A `name` already in the registry is refused (VeOmni's `ValueError`).
    """
    from veomni.ops.kernel_registry import KERNEL_REGISTRY, HardwareRequirement, KernelSpec
    from veomni.ops.kernels import moe
    from veomni.ops.kernels.moe import _make_moe_experts_adapter

    KERNEL_REGISTRY.register(KernelSpec(name=name, op_name="moe_experts", variant="standard",
                                        factory=lambda: _make_moe_experts_adapter(forward),
                                        hardware=HardwareRequirement(device_type="any"),
                                        description=description or f"{name}: a fused MoE kernel registered by a test"))
    dispatch = moe.apply_veomni_fused_moe_patch

    def apply_veomni_fused_moe_patch(fused_moe_kernel: str = "triton") -> None:
        if fused_moe_kernel != name:
            return dispatch(fused_moe_kernel)
        moe._fused_moe_forward = forward
        from veomni.lora.ops import bind_lora_moe_kernels

        bind_lora_moe_kernels(name)  # no LoRA kernel for it: VeOmni clears its LoRA pointers
        return None

    moe.apply_veomni_fused_moe_patch = apply_veomni_fused_moe_patch
