"""Fixed CPU threads, deterministic algorithms, TF32 off, no dropout: the same run gives the same numbers.

Recording under `deterministic()` makes a golden's bytes reproducible on one machine; checking under
it makes a report reproducible, even for kernels whose reductions otherwise vary from run to run. Every
model veosnap builds runs with its config's random settings off (`without_randomness`), and `record`
refuses a model whose training-mode forward is random all the same (`require_deterministic`).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from ..errors import VeosnapError

RECORD_THREADS = 1  # a fixed thread count keeps CPU reductions, and so the bytes, reproducible


@contextmanager
def deterministic() -> Iterator[dict]:
    """Deterministic algorithms, fixed CPU threads, TF32 off; yields the settings (for provenance),
    restores the previous ones."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads(),
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(RECORD_THREADS)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield {"deterministic_algorithms": True, "cpu_threads": RECORD_THREADS, "tf32": False}
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.set_num_threads(saved[1])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread within the block."""
    # Golden tensors are small: handing each op to a thread pool costs more than the op itself,
    # ten times more on a loaded 2-core machine (measured with tools/bench/bench_diff.py).
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# --- a deterministic reference ----------------------------------------------------------------------------
# A training-mode forward with dropout (or layer drop, stochastic depth, router jitter) is random: a golden
# recorded so would calibrate its bounds to that noise, and a 1% bug would hide in it. Veosnap runs every model
# it builds, reference and candidate alike, with these settings at 0 and says so (the golden's manifest,
# `reference.random_off`, and every report); what is random beyond them is refused at record time.
RANDOM_SETTINGS = re.compile(r"dropout|pdrop|layerdrop|layer_drop|drop_path|jitter", re.IGNORECASE)
RANDOM_TOLERANCE = 1e-3  # of the output's scale: dropout moves it by tens of percent, atomics by ~1e-7


def without_randomness(config: object, prefix: str = "") -> dict[str, float]:
    """Set `config`'s random settings (numeric fields named like dropout, pdrop, layerdrop, drop_path,
    jitter, above 0; its sub-configs' too) to 0; returns them, as `path: configured value`, sorted."""
    off: dict[str, float] = {}
    for name, value in sorted(vars(config).items()):
        if name.startswith("_"):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config (text, vision, audio)
            off.update(without_randomness(value, f"{prefix}{name}."))
        elif RANDOM_SETTINGS.search(name) and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and value > 0:
            off[f"{prefix}{name}"] = value
            setattr(config, name, type(value)(0))
    return off


def random_off_note(off: dict[str, float] | None) -> str:
    """What a record or a report says of the random settings a golden's reference ran without ('' for none)."""
    if not off:
        return ""
    shown = ", ".join(f"{name} {value:g}" for name, value in off.items())
    return f"the config's randomness is off in the reference and the candidate ({shown} set to 0): a random " \
           "forward cannot be a reference"


def require_deterministic(source: object, model: nn.Module, kwargs: dict[str, torch.Tensor]) -> None:
    """Refuse, naming `source` (the config), a model whose training-mode forward is random: a dropout module
    still set (not from a config field), or two forwards under different seeds that differ beyond
    `RANDOM_TOLERANCE` of the output's scale. The caller's random state is left as it was; the model is left in
    training mode."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            raise VeosnapError(f"{source}: {name} is {type(module).__name__}(p={module.p:g}), which no config field "
                               "sets: a random forward cannot be a reference (set it to 0)")
    device = next(model.parameters()).device
    kwargs = {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    model.train()  # as the reference runs (`capture.run_step`)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        norms = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            # Each position's logit norm: what dropout moves, at a thousandth of the logits' memory (real shapes).
            norms.append(torch.linalg.vector_norm(model(**kwargs).logits, dim=-1, dtype=torch.float32))
    first, second = norms
    scale = float(first.max())
    moved = float((first - second).abs().max())
    if moved > RANDOM_TOLERANCE * max(scale, 1e-30):
        raise VeosnapError(f"{source}: the model's training-mode forward is random (two forwards under different "
                           f"seeds differ by {moved:.3g} in a position's logit norm, {moved / scale:.1%} of the largest): a random forward "
                           "cannot be a reference; turn off what draws random numbers")
