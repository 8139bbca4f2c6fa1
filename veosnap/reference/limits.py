"""The limits veosnap enforces on what it is given to run: stated here, once, and in docs/errors.md.

Bad test data and absurd configs are refused up front with one line naming the file, before anything is
allocated: a token id outside [0, vocab) or not an integer, an empty sequence, a sequence longer than the
config's max_position_embeddings or `MAX_SEQUENCE_TOKENS`; more than `MAX_LAYERS` decoder layers, more
than `MAX_PARAMETERS` parameters (counted on the meta device), or an estimated need of memory beyond
what this machine has.
"""

from __future__ import annotations

import os
from numbers import Integral

import torch

from ..errors import GoldenError, VeosnapError
from ..golden.codec import Golden
from . import models
from .zoo import ToyConfig

MAX_LAYERS = 1024  # real models have at most a few hundred decoder layers
MAX_PARAMETERS = 100e9  # a real-shape config keeps real widths but few layers
MAX_SEQUENCE_TOKENS = 16384  # positions "in the thousands" for real shapes; the toy batch uses 32
WHERE = "veosnap/reference/limits.py"
# Bytes per parameter while recording: the weights and gradients in the golden's dtype (4 + 4 at most),
# and their float64 twins for the noise run (8 + 8); a check needs only the first two.
RECORD_BYTES_PER_PARAMETER = 24
CHECK_BYTES_PER_PARAMETER = 8
# Activations kept for backward, per token: about 34 hidden-sized values per layer (attention and MLP
# intermediates, as in the Megatron estimate) and the logits three times over (logits, softmax, gradient).
HIDDEN_VALUES_PER_LAYER = 34
LOGIT_COPIES = 3


def check_config(toy: ToyConfig) -> int:
    """Refuse a config veosnap cannot sensibly build; the parameter count when it can."""
    text = models.hf_config(toy).get_text_config()
    layers = getattr(text, "num_hidden_layers", None)
    if layers is not None:
        if not isinstance(layers, Integral) or isinstance(layers, bool) or layers < 1:
            raise VeosnapError(f"{toy.path}: num_hidden_layers {layers!r} is not a positive integer")
        if layers > MAX_LAYERS:
            raise VeosnapError(f"{toy.path}: num_hidden_layers {layers} is over veosnap's limit of {MAX_LAYERS} "
                               f"({WHERE})")
    count = sum(p.numel() for p in models.skeleton(toy).parameters())
    if count > MAX_PARAMETERS:
        raise VeosnapError(f"{toy.path}: about {count:.3g} parameters, over veosnap's limit of {MAX_PARAMETERS:.3g} "
                           f"({WHERE})")
    return count


def check_memory(toy: ToyConfig, parameters: int, tokens: int, dtype: torch.dtype, device: torch.device,
                 recording: bool) -> None:
    """Refuse a run whose estimated memory is more than the device has (weights, gradients, activations)."""
    text = models.hf_config(toy).get_text_config()
    width = torch.finfo(dtype).bits // 8
    hidden, layers = getattr(text, "hidden_size", 0) or 0, getattr(text, "num_hidden_layers", 0) or 0
    vocab = getattr(text, "vocab_size", 0) or 0
    activations = tokens * (layers * hidden * HIDDEN_VALUES_PER_LAYER + vocab * LOGIT_COPIES)
    per_parameter = RECORD_BYTES_PER_PARAMETER if recording else CHECK_BYTES_PER_PARAMETER
    need = parameters * per_parameter + activations * (width + (8 if recording else 0))
    have, what = _memory(device)
    if have and need > have:
        parts = ("parameters, gradients, their float64 twins and activations" if recording
                 else "parameters, gradients and activations")
        raise VeosnapError(f"{toy.path}: needs about {need / 2**30:.0f} GiB to {'record' if recording else 'check'} "
                           f"({parts}), more than this machine's {have / 2**30:.0f} GiB of {what}")


def _memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "GPU memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"
    except (ValueError, OSError, AttributeError):
        return 0, "memory"


def check_sequences(source: object, ids: tuple[int, ...], sequences: list[list], toy: ToyConfig) -> None:
    """Refuse test data a model cannot run: ids outside [0, vocab) or not integers, empty or too long sequences."""
    text = models.hf_config(toy).get_text_config()
    vocab = getattr(text, "vocab_size", None)
    longest = getattr(text, "max_position_embeddings", None)
    for sid, tokens in zip(ids, sequences):
        if not tokens:
            raise VeosnapError(f"{source}: sequence {sid} is empty")
        if len(tokens) > MAX_SEQUENCE_TOKENS:
            raise VeosnapError(f"{source}: sequence {sid} has {len(tokens)} tokens, over veosnap's cap of "
                               f"{MAX_SEQUENCE_TOKENS} ({WHERE})")
        if isinstance(longest, int) and len(tokens) > longest:
            raise VeosnapError(f"{source}: sequence {sid} has {len(tokens)} tokens, over max_position_embeddings "
                               f"{longest} of {toy.path}")
        for position, token in enumerate(tokens):
            if not isinstance(token, Integral) or isinstance(token, bool):
                raise VeosnapError(f"{source}: sequence {sid} holds {token!r} at position {position}, "
                                   "not an integer token id")
            if token < 0 or (isinstance(vocab, int) and token >= vocab):
                raise VeosnapError(f"{source}: sequence {sid} holds token id {token} at position {position}, outside "
                                   f"the vocabulary [0, {vocab}) of {toy.path}")


def check_batch(golden: Golden, toy: ToyConfig) -> None:
    """Refuse a golden whose stored token ids leave the config's vocabulary (a forged or mismatched batch)."""
    vocab = getattr(models.hf_config(toy).get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for field in ("input_ids", "labels"):
        ids = golden.tensors.get(f"inputs.{field}")
        if ids is None:
            continue
        bad = (ids < 0) & (ids != -100) if field == "labels" else ids < 0
        bad = bad | (ids >= vocab)
        if bad.any():
            row, position = (int(i) for i in bad.nonzero()[0])
            raise GoldenError(golden.path, f"inputs.{field} holds token id {int(ids[row, position])} at row {row} "
                                           f"position {position}, outside the vocabulary [0, {vocab}) of its config")
