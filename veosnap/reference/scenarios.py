"""Scenarios: what a golden's step runs (the key's `scenario` part: one golden file each, but one).

A scenario is a batch (rows of the test data) and a kind of step. `step` and `train` run the text batch
(sequences 0-3) on every model, a vision-language model included (its towers then idle: no media, no
gradient for them); `vision` and `audio` are one forward and backward of a multimodal batch, on the models
with the encoders they need:

    step           text rows 0-3                                        every model
    train          text rows 0-3, 3 AdamW steps with clipping           every model
    vision         image+text, text-only and video+text rows: the        a vision encoder
                   encoder runs twice (images, then videos), and two
                   rows carry no medium (a mixed batch)
    audio          audio clips of three lengths, one row with an image   an audio encoder
                   and a clip, one with an image only
    frozen_vision  `vision` with the vision encoder frozen               a vision encoder

`frozen_vision` has no golden of its own: freezing an encoder changes no forward value and no other
gradient (bit for bit, in the reference), so it is checked against the `vision` golden, without the
frozen encoder's gradients, and a candidate that produces one fails. One golden fewer per model keeps the
zoo small.

The rows are ordered so that the default data-parallel split over 2 ranks (contiguous halves) gives each
rank the same encoder calls (FSDP2 shards every encoder block, so a rank that skipped an encoder call
would leave its peers waiting in a collective); `fsdp2_asym` splits the rows with and without media on
purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import Unsupported, VeosnapError
from ..golden.key import CHECKED_AGAINST
from .inputs import Row
from .probes import find_encoders

TEXT = tuple(Row(text=i) for i in (0, 1, 2, 3))


@dataclass(frozen=True)
class Scenario:
    """One scenario: its rows, the encoders a model needs for it, the encoders it freezes, and whether it
    trains (`train`: the optimizer steps of `reference.train`)."""

    name: str
    description: str
    rows: tuple[Row, ...] = TEXT
    needs: frozenset[str] = frozenset()  # encoders the model must have (`vision`, `audio`)
    frozen: tuple[str, ...] = ()  # encoders whose parameters do not train
    train: bool = False

    @property
    def recorded(self) -> str:
        """The scenario whose golden file holds this scenario's reference (`golden.key.CHECKED_AGAINST`)."""
        return CHECKED_AGAINST.get(self.name, self.name)

    @property
    def multimodal(self) -> bool:
        return any(row.sample for row in self.rows)

    def accept(self, config: dict) -> None:
        """Raise `Unsupported` when a model config (a dict) lacks an encoder this scenario needs (transformers
        names an encoder's sub-config `vision_config` or `audio_config`)."""
        have = encoders_of(config)
        missing = sorted(self.needs - have)
        if missing:
            article = "an" if missing[0][0] in "aeiou" else "a"
            raise Unsupported(f"scenario {self.name} needs {article} {' and '.join(missing)} encoder, which "
                              f"{config.get('model_type', 'the model')} has not")

    def applies(self, config: dict) -> bool:
        try:
            self.accept(config)
        except Unsupported:
            return False
        return True

    def freeze(self, model: nn.Module) -> nn.Module:
        """Set `requires_grad=False` on the encoders this scenario freezes (in place)."""
        for encoder in find_encoders(model):
            if encoder.kind in self.frozen:
                for param in encoder.module.parameters():
                    param.requires_grad_(False)
        return model


def encoders_of(config: dict) -> set[str]:
    """The encoders a model config describes (`vision`, `audio`)."""
    return {kind for kind in ("vision", "audio") if isinstance(config.get(f"{kind}_config"), dict)}


def _rows(*items: int | str) -> tuple[Row, ...]:
    return tuple(Row(text=i) if isinstance(i, int) else Row(sample=i) for i in items)


_VISION = _rows("image_tiny", 0, "video_square", "image_two", 1, "video_odd")
_ALL = (
    Scenario("step", "one forward and backward of the text batch"),
    Scenario("train", "3 AdamW steps with gradient clipping on the text batch", train=True),
    Scenario("vision", "images of four sizes (some resized), two videos (4 frames; 3, the last repeated) and "
             "two text-only rows", _VISION, needs=frozenset({"vision"})),
    Scenario("audio", "audio clips of three lengths (the longest spans two chunks and two windows), one row "
             "with an image and a clip, one with an image only",
             _rows("audio_chirp", "image_audio", "audio_long", "image_tiny"), needs=frozenset({"audio"})),
    Scenario("frozen_vision", "the vision batch with the vision encoder frozen (no gradient for it), checked "
             "against the vision golden", _VISION, needs=frozenset({"vision"}), frozen=("vision",)),
)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in _ALL}  # golden.key.SCENARIOS names them, in this order


def applicable(config: dict) -> list[Scenario]:
    """The scenarios a model config can run, in order."""
    return [s for s in SCENARIOS.values() if s.applies(config)]


def get(name: str) -> Scenario:
    """The scenario `name`, with a one-line error naming the known ones otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise VeosnapError(f"unknown scenario {name!r} (known: {', '.join(SCENARIOS)})") from None
