"""Bugs planted in the multimodal and hybrid models' new parts, each a veosnap backend
(`--backend tests/mm_faults.py:<name>`), and two candidates a framework would write: one that keeps
every rank's encoders in step (`dummy_encoders`) and one that forgets a frozen tower (`unfrozen_vision`).

Each bug patches the reference model the way a framework or kernel bug would, and undoes itself after the
check (generator backends), so the report names the tensor where the bug first shows.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import torch
from torch import nn

from veosnap import Unsupported
from veosnap.candidates.kernels.fla import DELTA_RULE, delta_rule_layers
from veosnap.reference.probes import find_encoders


def _encoder(model: nn.Module, kind: str):  # noqa: ANN202
    found = [e for e in find_encoders(model) if e.kind == kind]
    if not found:
        raise Unsupported(f"{type(model).__name__} has no {kind} encoder")
    return found[0]


def patch_off_by_one(model: nn.Module) -> Iterator[nn.Module]:
    """The vision patch embedding reads its patches shifted by one (a framework that drops the first patch
    row of its pixel buffer and wraps the last one around)."""
    embed = _encoder(model, "vision").module.patch_embed
    handle = embed.register_forward_pre_hook(lambda _m, args: (args[0].roll(1, dims=0), *args[1:]))
    try:
        yield model
    finally:
        handle.remove()


def video_rope_section_wrong(model: nn.Module) -> Iterator[nn.Module]:
    """The language model's M-RoPE splits its frequencies into (t, h, w) sections in the wrong order: the
    last section moved first (Qwen2-VL's [2, 3, 3] becomes [3, 2, 3]). Text positions are equal on t, h and
    w, so only multimodal batches see it."""
    rotary = [m for m in model.get_decoder().modules() if isinstance(getattr(m, "mrope_section", None), list)]
    if not rotary:
        raise Unsupported(f"{type(model).__name__} has no M-RoPE")
    saved = [list(m.mrope_section) for m in rotary]
    for module, section in zip(rotary, saved):
        wrong = [section[-1], *section[:-1]]
        if wrong == section:
            raise Unsupported(f"mrope_section {section} reads the same rotated")
        module.mrope_section = wrong
    try:
        yield model
    finally:
        for module, section in zip(rotary, saved):
            module.mrope_section = section


def decay_applied_twice(model: nn.Module) -> Iterator[nn.Module]:
    """Gated DeltaNet's per-token decay applied twice (log-decay g doubled: a kernel that multiplies the
    state by exp(g) both before and after its update)."""
    modules = {type(layer).__module__ for layer in delta_rule_layers(model).values()}
    if not modules:
        raise Unsupported(f"{type(model).__name__} has no gated DeltaNet layer")
    saved = {name: getattr(sys.modules[name], DELTA_RULE) for name in modules}
    for name, rule in saved.items():
        def twice(*args, rule=rule, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if "g" in kwargs:
                kwargs["g"] = kwargs["g"] * 2
            else:
                args = (*args[:3], args[3] * 2, *args[4:])
            return rule(*args, **kwargs)

        setattr(sys.modules[name], DELTA_RULE, twice)
    try:
        yield model
    finally:
        for name, rule in saved.items():
            setattr(sys.modules[name], DELTA_RULE, rule)


def audio_shifted_one_placeholder(model: nn.Module) -> Iterator[nn.Module]:
    """The audio features land one placeholder late (a framework that scatters them after an off-by-one
    placeholder count): the audio encoder's own outputs are right, the language model's inputs are not."""
    tower = _encoder(model, "audio").module

    def shift(_module: nn.Module, _args: tuple, output: object) -> object:
        output.last_hidden_state = output.last_hidden_state.roll(1, dims=0)
        return output

    handle = tower.register_forward_hook(shift)
    try:
        yield model
    finally:
        handle.remove()


def unfrozen_vision(model: nn.Module) -> nn.Module:
    """A framework that ignores the frozen vision tower: its parameters train anyway."""
    for param in _encoder(model, "vision").module.parameters():
        param.requires_grad_(True)
    return model


def dummy_encoders(model: nn.Module) -> Iterator[nn.Module]:
    """What a framework does so that every rank takes part in its encoders' collectives: on a batch without
    images or videos, the vision encoder runs on a dummy image (one merged token) once for images and once
    for videos, as a rank with both runs it, before the language model; its outputs, times zero, are added
    to the loss (so their backward runs too, after the language model's, as on a rank with media). A rank
    with images only would still differ from one with videos: a framework that mixes them runs its encoder
    once per batch."""
    vision = _encoder(model, "vision").module
    config = model.config.vision_config
    grid = torch.tensor([[1, 2, 2]])
    width = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    original = model.forward

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        dummy = None
        if kwargs.get("pixel_values") is None and kwargs.get("pixel_values_videos") is None:
            device = next(vision.parameters()).device
            pixels = torch.zeros(int(grid.prod()), width, device=device, dtype=next(vision.parameters()).dtype)
            dummy = 0.0
            for _kind in ("image", "video"):
                out = vision(pixels, grid_thw=grid.to(device))
                values = out if isinstance(out, (tuple, list)) else out.values() if hasattr(out, "values") else [out]
                dummy = dummy + sum(t.float().sum() for t in values if isinstance(t, torch.Tensor) and t.requires_grad)
        output = original(*args, **kwargs)
        if dummy is not None and output.loss is not None:
            output.loss = output.loss + 0.0 * dummy
        return output

    model.forward = forward
    try:
        yield model
    finally:
        del model.forward


FAULTS = {
    "patch_off_by_one": ("vision.0.output", "a vision patch embedding reading patches shifted by one"),
    "video_rope_section_wrong": ("layers.0.output", "M-RoPE sections in the wrong order"),
    "decay_applied_twice": ("layers.0.output", "Gated DeltaNet's decay applied twice"),
    "audio_shifted_one_placeholder": ("layers.0.output", "audio features one placeholder late"),
}
