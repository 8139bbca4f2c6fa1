"""The limits veosnap enforces on what it is given to run: stated here, once, and in docs/errors.md.

Bad test data and absurd or too small configs are refused up front with one line naming the file, before
anything is allocated:

- test data: a token id that is not an integer or is negative, an empty sequence, a sequence over
  `MAX_SEQUENCE_TOKENS`;
- the batch as the model sees it (`check_shape`): a row over `MAX_SEQUENCE_TOKENS` (sequences packed into
  one row count together: the row is one sequence to attention), more than `MAX_BATCH_TOKENS` positions
  in all, padding included; and the memory estimate counts eager attention's scores, which grow with the
  square of a row's width;
- test data against the config: the vocabulary must hold every token id of the golden's batch, and
  `max_position_embeddings` must reach its longest sequence. The bundled test data is known good (ids up
  to 250, sequences 0-3 of 32 tokens at most), so there the config is at fault and the message says what
  it needs; a project's own test data is named, with the sequence and position at fault;
- the config: more than `MAX_LAYERS` decoder layers, more than `MAX_PARAMETERS` parameters (counted on the
  meta device; a check's prebuild counts the model it constructed, its parameters allocated on the host
  but untouched, and stops before their values are drawn: `reference.prebuild`), an MoE `hidden_size` below the number of experts plus one (the toy weights, `weights.py`,
  give each expert of the first MoE layer one hidden dimension of every token's embedding, and one more
  dimension is the routers' offset), or an estimated need
  of memory beyond what this machine has.

What transformers itself refuses (heads that do not divide the hidden size, say) is its own one-line
error, raised where the config is built (`models.hf_config`).
"""

from __future__ import annotations

import os
from numbers import Integral
from pathlib import Path

import torch
from torch import nn

from ..errors import GoldenError, VeosnapError
from ..golden.codec import Golden
from . import models
from .inputs import SEQUENCES_FILE
from .probes import find_moe_layers
from .zoo import ToyConfig, bundled_dir, same_dir

MAX_LAYERS = 1024  # real models have at most a few hundred decoder layers
MAX_PARAMETERS = 100e9  # a real-shape config keeps real widths but few layers
MAX_SEQUENCE_TOKENS = 16384  # positions "in the thousands" for real shapes; the toy batch uses 32
MAX_BATCH_TOKENS = 65536  # a batch's positions (rows x width); the real-shape goldens hold 8192
WHERE = "veosnap/reference/limits.py"
# Bytes per parameter while recording: the weights and gradients in the golden's dtype (4 + 4 at most),
# and their float64 twins for the noise run (8 + 8); a check needs only the first two. A recording's
# activations are the larger of its two runs' (the float64 twin runs after the reference's are freed).
RECORD_BYTES_PER_PARAMETER = 24
CHECK_BYTES_PER_PARAMETER = 8
# Activations kept for backward, per token: about 17 hidden-sized values per layer (attention and MLP
# intermediates: Megatron's estimate, 34 bytes of 16-bit values, its attention scores apart as here; 34 values
# refused llama-1b-12l at 148 GiB, which the H200 recorded in its 140) and the logits three times over (logits,
# softmax, gradient).
HIDDEN_VALUES_PER_LAYER = 17
LOGIT_COPIES = 3
# Eager attention's scores ([rows, heads, width, width]): every layer keeps its softmax for backward, and one
# layer's scores are made beside them.


def check_layers(toy: ToyConfig) -> None:
    """Refuse a config whose layer count veosnap will not build (checked before any skeleton is built)."""
    text = models.text_config(toy)
    layers = getattr(text, "num_hidden_layers", None)
    if layers is not None:
        if not isinstance(layers, Integral) or isinstance(layers, bool) or layers < 1:
            raise VeosnapError(f"{toy.path}: num_hidden_layers {layers!r} is not a positive integer")
        if layers > MAX_LAYERS:
            raise VeosnapError(f"{toy.path}: num_hidden_layers {layers} is over veosnap's limit of {MAX_LAYERS} "
                               f"({WHERE})")


def prefetch_skeleton(toy: ToyConfig) -> None:
    """Start building `toy`'s skeleton on a thread when its layer count is acceptable (`models.prefetch_skeleton`);
    a config refused here is refused again, in its turn, by `check_config`."""
    try:
        check_layers(toy)
    except VeosnapError:
        return
    models.prefetch_skeleton(toy)


# The parameter count of each config `check_config` passed, by config hash. A pytest session constructs one
# config's model once per backend and layout, and its prebuild vets each on the build's path, before the weights
# are drawn: the walks over every module and parameter (1.9 ms at 12 layers on the CPU, llama-12l-narrow, the
# collector paused) give the same answer each time, for the same config and transformers. A refusal is not kept.
_PASSED: dict[str, int] = {}


def check_config(toy: ToyConfig, model: nn.Module | None = None) -> int:
    """Refuse a config veosnap cannot sensibly build; the parameter count when it can. `model`: the config's
    model as constructed, its parameters not yet drawn (a prebuild vets its own: `reference.prebuild`);
    else the meta-device skeleton. A config passed once in this process is passed again without a look."""
    check_layers(toy)
    key = toy.hash
    if key in _PASSED:
        return _PASSED[key]
    _PASSED[key] = count = check_model(toy, models.skeleton(toy) if model is None else model)
    return count


def check_model(toy: ToyConfig, model: nn.Module) -> int:
    """`check_config`'s look at `model` itself (its parameters, its decoder stack, its routers), every time."""
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMETERS:
        raise VeosnapError(f"{toy.path}: about {count:.3g} parameters, over veosnap's limit of {MAX_PARAMETERS:.3g} "
                           f"({WHERE})")
    try:  # a model without a stack of decoder layers is refused here, before anything is drawn or run
        moe = find_moe_layers(model)
    except VeosnapError as exc:
        raise VeosnapError(f"{toy.path}: {exc}") from None
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.get_input_embeddings(), "embedding_dim", 0)
    if moe and moe[0].num_experts + 1 > hidden:
        raise VeosnapError(
            f"{toy.path}: hidden_size {hidden} is below the number of experts plus one ({moe[0].num_experts}, top-"
            f"{moe[0].top_k}): veosnap's toy routers give each expert one hidden dimension of the token code and "
            f"read one more as an offset, so hidden_size must be at least {moe[0].num_experts + 1}")
    return count

# transformers' `batched_mm` experts (made for a few tokens) copy each chosen expert's weights once per
# (token, choice) and keep the copies for backward, where their gradient is as large again.
BATCHED_MM_COPIES = 2
_EXPERT_WEIGHTS = ("gate_up_proj", "up_proj", "gate_proj", "down_proj")


def batched_mm_bytes(toy: ToyConfig, tokens: int, dtype: torch.dtype) -> int:
    """The memory `batched_mm` gathers for `tokens` positions, over every MoE layer (0 for a dense model):
    tokens x top_k copies of one expert's weights, `BATCHED_MM_COPIES` times."""
    text = models.text_config(toy)
    top_k = getattr(text, "num_experts_per_tok", None) or getattr(text, "experts_per_token", None) or 0
    per_expert = sum(p.numel() // p.shape[0] for name, p in models.skeleton(toy).named_parameters()
                     if p.dim() == 3 and name.rsplit(".", 1)[-1] in _EXPERT_WEIGHTS)
    return tokens * top_k * per_expert * (torch.finfo(dtype).bits // 8) * BATCHED_MM_COPIES


def check_shape(source: object, rows: int, width: int) -> None:
    """Refuse a batch of `rows` rows of `width` positions (padding included; packed sequences count together)
    wider or larger than veosnap's caps, naming `source` (the file that made it)."""
    if width > MAX_SEQUENCE_TOKENS:
        raise VeosnapError(f"{source}: a row of {width} tokens (sequences packed into a row count together), over "
                           f"veosnap's cap of {MAX_SEQUENCE_TOKENS} per row ({WHERE})")
    if rows * width > MAX_BATCH_TOKENS:
        raise VeosnapError(f"{source}: {rows} rows of {width} positions, {rows * width} in all, over veosnap's cap of "
                           f"{MAX_BATCH_TOKENS} ({WHERE})")


def check_memory(toy: ToyConfig, parameters: int, tokens: int, dtype: torch.dtype, device: torch.device,
                 recording: bool, width: int = 0) -> None:
    """Refuse a run whose estimated memory is more than the device has (weights, gradients, activations).
    `tokens`: the batch's positions, rows x `width` (its rows' width, when known: eager attention's scores)."""
    need = memory_needed(toy, parameters, tokens, dtype, recording, width)
    have, what = _memory(device)
    if have and need > have:
        parts = ("parameters, gradients, their float64 twins and activations" if recording
                 else "parameters, gradients and activations")
        raise VeosnapError(f"{toy.path}: needs about {need / 2**30:.0f} GiB to {'record' if recording else 'check'} "
                           f"({parts}), more than this machine's {have / 2**30:.0f} GiB of {what}")


def memory_needed(toy: ToyConfig, parameters: int, tokens: int, dtype: torch.dtype, recording: bool,
                  width: int = 0) -> int:
    """Estimated peak bytes of a check (weights, gradients, activations) or a recording, whose float64 twin
    runs after the reference's own run has freed its activations: the larger of the two runs' activations."""
    text = models.text_config(toy)
    nbytes = torch.finfo(dtype).bits // 8
    hidden, layers = getattr(text, "hidden_size", 0) or 0, getattr(text, "num_hidden_layers", 0) or 0
    vocab = getattr(text, "vocab_size", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 0
    activations = tokens * (layers * hidden * HIDDEN_VALUES_PER_LAYER + vocab * LOGIT_COPIES
                            + width * heads * (layers + 1))
    per_parameter = RECORD_BYTES_PER_PARAMETER if recording else CHECK_BYTES_PER_PARAMETER
    return parameters * per_parameter + activations * (max(nbytes, 8) if recording else nbytes)


def _memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "GPU memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory"
    except (ValueError, OSError, AttributeError):
        return 0, "memory"


def check_sequences(testdata: Path, ids: tuple[int, ...], sequences: list[list], toy: ToyConfig,
                    table: str = SEQUENCES_FILE) -> None:
    """Refuse test data a model cannot run (see the module docstring): ids outside [0, vocab) or not
    integers, empty sequences, sequences beyond the config's positions or veosnap's cap. `table`: the
    token table under `testdata` they came from (a config's `veosnap.json` may name another)."""
    source = Path(testdata) / table
    text = models.text_config(toy)
    vocab = getattr(text, "vocab_size", None)
    longest = getattr(text, "max_position_embeddings", None)
    if isinstance(longest, int) and longest < 0:  # XLNet's -1: relative positions, no limit
        longest = None
    if same_dir(testdata, bundled_dir("testdata")):  # known good: a misfit is the config's
        _check_config_fits(toy, vocab, longest, f"{source}, sequences {', '.join(map(str, ids))}", sequences)
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


def _check_config_fits(toy: ToyConfig, vocab: object, positions: object, batch: str, sequences: list[list]) -> None:
    """Refuse a config too small for the bundled test data, saying what it needs."""
    largest = max((max(tokens) for tokens in sequences if tokens), default=-1)
    if isinstance(vocab, int) and largest >= vocab:
        raise VeosnapError(f"{toy.path}: vocab_size {vocab} is too small for the test data: the golden's batch "
                           f"({batch}) holds token ids up to {largest}, so vocab_size must be at least {largest + 1}")
    longest = max(map(len, sequences), default=0)
    if isinstance(positions, int) and longest > positions:
        raise VeosnapError(f"{toy.path}: max_position_embeddings {positions} is below the longest sequence of the "
                           f"golden's batch ({longest} tokens, {batch}); it must be at least {longest}")


def check_batch(golden: Golden, toy: ToyConfig) -> None:
    """Refuse a golden whose stored token ids leave the config's vocabulary (a forged or mismatched batch)."""
    vocab = getattr(models.text_config(toy), "vocab_size", None)
    if not isinstance(vocab, int):
        return
    inputs = golden.inputs()
    ids = inputs.get("input_ids")
    if ids is not None and ids.dim() == 2:
        check_shape(golden.path, *ids.shape)
    for field in ("input_ids", "labels"):
        ids = inputs.get(field)
        if ids is None:
            continue
        bad = (ids < 0) & (ids != -100) if field == "labels" else ids < 0
        bad = bad | (ids >= vocab)
        if bad.any():
            row, position = (int(i) for i in bad.nonzero()[0])
            raise GoldenError(golden.path, f"inputs.{field} holds token id {int(ids[row, position])} at row {row} "
                                           f"position {position}, outside the vocabulary [0, {vocab}) of its config")
