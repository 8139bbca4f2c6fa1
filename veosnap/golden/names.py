"""The names of a golden's tensors, typed: parse a name once, then ask it what it is.

    inputs.<field>                     the batch the reference ran          Input
    loss                               the step's loss                      Loss
    logits                             one row per token                    Logits
    layers.N.output                    decoder layer N's output, per token  LayerOutput
    vision.N.output, audio.N.output    an encoder block's output            EncoderOutput
    vision.merger.output, vision.deepstack.N.output, audio.proj.output
                                       what an encoder writes into the LM   EncoderOutput
    grad.<param>                       a parameter's gradient               Grad
    routes.N.experts|weights|margin    MoE layer N's routes, per token      Route
    train.loss, train.grad_norm        per train step                       TrainLoss, TrainGradNorm
    update.<param>                     a parameter's update over the steps  Update

`parse(text)` gives the typed name, `str(name)` the text back exactly as goldens store it. Every name
also says where its tensor sits in the model, for reports laid out by layer: `stage` (forward,
gradient or update), `group` (output, routes, logits, loss, train for forward tensors; attention, mlp,
router, norm, embeddings, lm_head or other for a parameter's) and `layer` (the decoder layer, or None).
A new kind
(an encoder block's output, a sketched variant) is one small dataclass with a `pattern`, a `__str__`
and the properties that differ from `TensorName`'s defaults, decorated with `@kind`.

The inputs a golden may hold are the rows of `INPUT_FIELDS` (an open set: a multimodal input adds
a row); the golden file refuses any other `inputs.*` tensor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

# The first index in a path: the layer of the model's stack of layers, whatever the stack is called
# (`model.layers.3`, GPT-2's `transformer.h.3`, BERT's `bert.encoder.layer.3`); a layer's own lists (experts)
# come after it.
_IN_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_ROUTER_RE = re.compile(r"\.(gate|router)\.(weight|bias)$")  # not gate_proj: that is a dense MLP's

# The attribute names transformers gives the encoders of multimodal models (Qwen-VL's `visual`, LLaVA's
# `vision_tower`, the audio-language models' `audio_tower`), by the tower they are. A parameter or module
# path through one of them is in that encoder, never in the language model's decoder layers.
ENCODER_ATTRIBUTES = {"visual": "vision", "vision_tower": "vision", "vision_model": "vision", "audio_tower": "audio"}
ENCODERS = ("audio", "vision")  # in the order the omni models run them, before the language model


def encoder_of(path: str) -> str | None:
    """The encoder (`vision`, `audio`) a module or parameter path is inside, or None (the language model)."""
    for part in path.split("."):
        if part in ENCODER_ATTRIBUTES:
            return ENCODER_ATTRIBUTES[part]
    return None


def layer_of(path: str) -> int | None:
    """The decoder layer a module or parameter path is inside (`model.layers.3.mlp`, `transformer.h.3.mlp`
    -> 3), or None (outside the decoder layers, or inside an encoder: `model.audio_tower.layers.0` is not
    decoder layer 0)."""
    if encoder_of(path) is not None:
        return None
    match = _IN_LAYER_RE.search(path)
    return int(match.group(1)) if match else None


class TensorName:
    """What every kind of tensor name answers (defaults; kinds override what differs)."""

    pattern: ClassVar[re.Pattern[str]]
    token_rows: ClassVar[bool] = False  # one row per token of the batch: compared on real tokens only
    per_parameter: ClassVar[bool] = False  # one tensor per model parameter (gradients, updates)

    stage: ClassVar[str] = "forward"  # forward | gradient | update
    group: ClassVar[str] = "other"
    # Every kind also has `layer`: the decoder layer the tensor belongs to, or None (logits, loss, the
    # embeddings' gradient); a field of the kinds that name one, so not defined here.

    @property
    def compared(self) -> bool:
        """Compared numerically, so the golden holds a tolerance for it."""
        return True

    @classmethod
    def from_match(cls, match: re.Match[str]) -> TensorName:
        return cls(*match.groups())  # type: ignore[call-arg]


_KINDS: list[type[TensorName]] = []


def kind(cls: type[TensorName]) -> type[TensorName]:
    """Class decorator: `parse` knows this kind of name from now on."""
    _KINDS.append(cls)
    return cls


@lru_cache(maxsize=1 << 16)  # typed names are frozen: a check parses each of its names a dozen times
def parse(text: str) -> TensorName:
    """The typed name of `text`; ValueError when it is no kind of golden tensor."""
    for cls in _KINDS:
        match = cls.pattern.fullmatch(text)
        if match:
            name = cls.from_match(match)
            if str(name) != text:  # `layers.01.output`: one tensor, one spelling
                raise ValueError(f"{text!r} is not spelt as golden tensor names are ({name})")
            return name
    raise ValueError(f"{text!r} is not a golden tensor name")


def try_parse(text: str) -> TensorName | None:
    """The typed name of `text`, or None when it is no kind of golden tensor."""
    try:
        return parse(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class InputField:
    """A model input a golden may store as `inputs.<name>`.

    `token_grid`: int64 [rows, positions], the shape of `input_ids` (a token's row and position).
    `media`: one of a multimodal batch's kinds (`image`, `video`, `audio`): the kind's fields come together
    (`group`), `dtype` and `ndim` as given; `golden.codec` checks they agree with each other and the grids.
    """

    name: str
    required: bool = False
    token_grid: bool = False
    media: str | None = None
    dtype: str = "int64"
    ndim: int = 2


INPUT_FIELDS: dict[str, InputField] = {field.name: field for field in (
    InputField("input_ids", required=True, token_grid=True),
    InputField("attention_mask", required=True, token_grid=True),  # 1 on real tokens: the ones compared
    InputField("position_ids", required=True, token_grid=True),
    InputField("labels", required=True, token_grid=True),
    # 3-D (M-RoPE) positions of a vision-language model's batch: [3, rows, positions]
    InputField("mrope_position_ids", ndim=3),
    InputField("pixel_values", media="image", dtype="float32"),  # [patches, 3 * temporal * patch^2]
    InputField("image_grid_thw", media="image"),  # [images, 3]
    InputField("image_rows", media="image", ndim=1),  # [images]: each image's batch row
    InputField("pixel_values_videos", media="video", dtype="float32"),
    InputField("video_grid_thw", media="video"),
    InputField("video_rows", media="video", ndim=1),
    InputField("second_per_grid", media="video", dtype="float32", ndim=1),  # [videos]: seconds per temporal patch
    InputField("input_features", media="audio", dtype="float32", ndim=3),  # [clips, mel bins, frames]
    InputField("feature_attention_mask", media="audio"),  # [clips, frames]: 1 on real frames
    InputField("audio_rows", media="audio", ndim=1),
)}
MEDIA_KINDS = ("image", "video", "audio")


@kind
@dataclass(frozen=True)
class Input(TensorName):
    field: str

    pattern = re.compile(r"inputs\.([A-Za-z0-9_]+)")
    layer: ClassVar[None] = None

    @property
    def compared(self) -> bool:
        return False

    @property
    def known(self) -> InputField | None:
        return INPUT_FIELDS.get(self.field)

    def __str__(self) -> str:
        return f"inputs.{self.field}"


@dataclass(frozen=True)
class _Named(TensorName):
    """A tensor a golden holds once, under a name of its own."""

    text: ClassVar[str]
    layer: ClassVar[None] = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.pattern = re.compile(re.escape(cls.text))

    def __str__(self) -> str:
        return self.text


@kind
class Loss(_Named):
    text = "loss"
    group = "loss"


@kind
class Logits(_Named):
    text = "logits"
    group = "logits"
    token_rows = True


@kind
@dataclass(frozen=True)
class LayerOutput(TensorName):
    layer: int

    pattern = re.compile(r"layers\.(\d+)\.output")
    token_rows = True
    group = "output"

    @classmethod
    def from_match(cls, match: re.Match[str]) -> LayerOutput:
        return cls(int(match.group(1)))

    def __str__(self) -> str:
        return f"layers.{self.layer}.output"


ENCODER_PROJECTIONS = ("merger", "proj")  # the module that writes an encoder's features into the LM stream


@kind
@dataclass(frozen=True)
class EncoderOutput(TensorName):
    """An encoder's output at one of its hook points: block N (`vision.0.output`, one row per patch or
    audio frame), a DeepStack merger (`vision.deepstack.0.output`) or the projection into the language
    model (`vision.merger.output`, `audio.proj.output`: one row per placeholder token). Its rows are the
    encoder's own (no padding), so every row is compared."""

    encoder: str
    part: str  # "N", "deepstack.N", "merger" or "proj"

    pattern = re.compile(r"(vision|audio)\.(\d+|deepstack\.\d+|merger|proj)\.output")
    group = "output"
    layer: ClassVar[None] = None  # in no decoder layer: before them all (`forward_order`)

    @property
    def block(self) -> int | None:
        """The encoder block, or None (a merger or projection)."""
        return int(self.part) if self.part.isdigit() else None

    @property
    def forward_order(self) -> tuple[int, int, int]:
        """Where this tensor is computed in the forward: encoders in `ENCODERS` order, then within one
        its blocks, its DeepStack mergers (fed from inner blocks), its projection."""
        stage = 1 if self.block is not None else 2 if self.part.startswith("deepstack.") else 3
        index = self.block if self.block is not None else int(self.part.rsplit(".", 1)[-1]) if stage == 2 else 0
        return (ENCODERS.index(self.encoder), stage, index)

    def describe(self) -> str:
        """How a report names the place: `vision block 0`, `vision merger`, `audio deepstack merger 1`."""
        if self.block is not None:
            return f"{self.encoder} block {self.block}"
        if self.part.startswith("deepstack."):
            return f"{self.encoder} deepstack merger {self.part.rsplit('.', 1)[-1]}"
        return f"{self.encoder} {self.part}"

    def __str__(self) -> str:
        return f"{self.encoder}.{self.part}.output"


@dataclass(frozen=True)
class _Parameter(TensorName):
    """A tensor per model parameter, named by the parameter's path (`model.layers.1.mlp.up_proj.weight`)."""

    param: str

    prefix: ClassVar[str]
    per_parameter = True

    @property
    def module(self) -> str:
        """The path of the module holding the parameter."""
        return self.param.rsplit(".", 1)[0]

    @property
    def layer(self) -> int | None:
        """The decoder layer the parameter is in, or None (embeddings, final norm, LM head, encoders)."""
        return layer_of(self.param)

    @property
    def encoder(self) -> str | None:
        """The encoder (`vision`, `audio`) the parameter is in, or None (the language model)."""
        return encoder_of(self.param)

    @property
    def group(self) -> str:  # type: ignore[override]
        """What the parameter belongs to: norm, embeddings, lm_head, router, attention, mlp or other."""
        module = self.module
        if "norm" in module.rsplit(".", 1)[-1]:
            return "norm"
        if "embed" in module:
            return "embeddings"
        if "lm_head" in module:
            return "lm_head"
        if _ROUTER_RE.search(self.param):
            return "router"
        if ".self_attn." in f".{module}." or ".attn." in f".{module}.":
            return "attention"
        if ".mlp." in f".{module}." or "block_sparse_moe" in module:
            return "mlp"
        return "other"

    @property
    def within_layer(self) -> str:
        """The module's path inside its decoder layer (`self_attn.o_proj`); the whole path outside one."""
        match = _IN_LAYER_RE.search(self.module) if self.layer is not None else None
        return self.module if match is None else self.module[match.end():]

    def __str__(self) -> str:
        return f"{self.prefix}{self.param}"


@kind
@dataclass(frozen=True)
class Grad(_Parameter):
    prefix = "grad."
    stage = "gradient"
    pattern = re.compile(r"grad\.(.+)")


@kind
@dataclass(frozen=True)
class Update(_Parameter):
    prefix = "update."
    stage = "update"
    pattern = re.compile(r"update\.(.+)")


ROUTE_PARTS = ("experts", "weights", "margin")


@kind
@dataclass(frozen=True)
class Route(TensorName):
    """MoE layer `layer`'s routes: expert ids (sorted per token), their weights, the router's margin."""

    layer: int
    part: str

    pattern = re.compile(r"routes\.(\d+)\.(experts|weights|margin)")
    token_rows = True
    group = "routes"

    @classmethod
    def from_match(cls, match: re.Match[str]) -> Route:
        return cls(int(match.group(1)), match.group(2))

    @property
    def compared(self) -> bool:
        return self.part == "weights"  # expert ids are compared as routes, margins are the golden's own

    def __str__(self) -> str:
        return f"routes.{self.layer}.{self.part}"


@kind
class TrainLoss(_Named):
    text = "train.loss"  # one element per train step
    group = "train"


@kind
class TrainGradNorm(_Named):
    text = "train.grad_norm"  # the pre-clip total gradient norm, one element per train step
    group = "train"


LOSS, LOGITS, TRAIN_LOSS, TRAIN_GRAD_NORM = Loss(), Logits(), TrainLoss(), TrainGradNorm()
PER_STEP = (TRAIN_LOSS, TRAIN_GRAD_NORM)  # one element per train step
