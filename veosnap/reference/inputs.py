"""Batches built from the test data in `testdata/`: padded (the toy golden's), packed, and rows of packed
sequences (the real-shape goldens'), text-only or multimodal.

A token table holds either the tokens themselves (`sequences.parquet`: id, length, tokens) or, for
sequences of thousands of tokens over vocabularies of 150k, only each sequence's length and seed
(`realshape.parquet`: id, length, seed): the ids are then derived for the model's vocabulary
(`derive_tokens`), spread over all of it. Either way the golden stores the actual ids it ran.

Labels never ask a position to predict the first token of a sequence (in a padded batch the last
pad would, in a packed one the previous sequence's last token would), nor a placeholder token (an
image, video or audio position, whose embedding the model replaces), so every layout trains on exactly
the same predictions.

A multimodal batch carries, besides its token grids, the 3-D (M-RoPE) position ids the model's own
`get_rope_index` gives its rows (`rope_positions`, [3, rows, positions]; the model gets them stacked
under the text positions, the [4, rows, positions] form every Qwen-VL family takes, so no layout and no
candidate recomputes them) and its media (`Media`): pixel values and grid sizes of its images and
videos, log-mel features of its audio clips, and the batch row each item belongs to. Media tensors are
float32 in every golden dtype (the model casts them to its towers' dtype).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from ..errors import Unsupported, VeosnapError
from ..golden.codec import Golden
from ..numerics.compare import Tokens
from . import media as media_rules

IGNORE_INDEX = -100
PAD_ID = 0
DEFAULT_SEQUENCES = (0, 1, 2, 3)
SEQUENCES_FILE = "sequences.parquet"
MEDIA_FILE = "multimodal.parquet"
MEDIA_SEQUENCES_FILE = "multimodal_sequences.parquet"
ROPE_POSITIONS = "mrope_position_ids"  # the golden's name of `Batch.rope_positions`


FIRST_TOKEN = 3  # ids 0 (pad), 1 (bos) and 2 (eos) never appear inside a derived sequence


def _parquet():  # noqa: ANN202 - pyarrow.parquet
    # Imported when a table is read: a check reads its batch from the golden, and every rank and CLI start would
    # pay pyarrow's import (0.3 s on a 2-core CPU) for nothing.
    import pyarrow.parquet

    return pyarrow.parquet


def load_sequences(testdata_dir: Path, ids: tuple[int, ...] = DEFAULT_SEQUENCES, source: str = SEQUENCES_FILE,
                   vocab_size: int | None = None, distinct: int | None = None) -> list[list[int]]:
    """The token lists of the sequences `ids` from `<testdata_dir>/<source>`.

    A table of (id, length, seed) is derived for `vocab_size` (required then), from `distinct` ids
    spread over the vocabulary when given; a table of (id, tokens) is read as it is.
    """
    path = Path(testdata_dir) / source
    try:
        names = _parquet().read_schema(path).names
        derived = "tokens" not in names
        columns = ["id", "length", "seed"] if derived else ["id", "tokens"]
        table = _parquet().read_table(path, columns=columns).to_pydict()
    except (OSError, ValueError, KeyError) as exc:
        raise VeosnapError(f"{path}: cannot read the token table ({exc})") from None
    if derived:
        if not isinstance(vocab_size, int) or vocab_size <= FIRST_TOKEN:
            raise VeosnapError(f"{path}: derived sequences need the model's vocabulary size (got {vocab_size!r})")
        made = {i: (n, seed) for i, n, seed in zip(table["id"], table["length"], table["seed"])}
        missing = [i for i in ids if i not in made]
        if missing:
            raise VeosnapError(f"{path}: no sequence with id {missing[0]} (has {len(made)})")
        return [derive_tokens(made[i][0], made[i][1], vocab_size, distinct) for i in ids]
    if distinct is not None:
        raise VeosnapError(f"{path}: 'distinct' applies to derived sequences (id, length, seed), not stored tokens")
    by_id = dict(zip(table["id"], table["tokens"]))
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise VeosnapError(f"{path}: no sequence with id {missing[0]} (has {len(by_id)})")
    return [list(by_id[i]) for i in ids]


def spread_ids(distinct: int, vocab_size: int) -> torch.Tensor:
    """`distinct` token ids spread over [FIRST_TOKEN, vocab): one per equal stratum, the last always
    vocab - 1 (so a kernel indexing high vocabulary rows wrongly is seen)."""
    span = vocab_size - FIRST_TOKEN
    gen = torch.Generator().manual_seed(vocab_size * 7919 + distinct)
    offsets = torch.rand(distinct, generator=gen, dtype=torch.float64)
    ids = FIRST_TOKEN + ((torch.arange(distinct, dtype=torch.float64) + offsets) * span / distinct).long()
    ids[-1] = vocab_size - 1
    return ids.clamp(FIRST_TOKEN, vocab_size - 1)


def derive_tokens(length: int, seed: int, vocab_size: int, distinct: int | None = None) -> list[int]:
    """`length` token ids for (seed, vocabulary): uniform over [FIRST_TOKEN, vocab), or over
    `spread_ids(distinct)`; the same on every machine (a CPU generator)."""
    if type(length) is not int or length < 1:
        raise VeosnapError(f"a derived sequence needs a positive length (got {length!r})")
    gen = torch.Generator().manual_seed(int(seed))
    if distinct is None:
        return torch.randint(FIRST_TOKEN, vocab_size, (length,), generator=gen).tolist()
    pool = spread_ids(distinct, vocab_size)
    return pool[torch.randint(0, distinct, (length,), generator=gen)].tolist()


# --- media ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Media:
    """The media of a batch, in row order: each kind's tensors as the model takes them, and the batch row of
    each item (`*_rows`, non-decreasing). Absent kinds are None."""

    pixel_values: torch.Tensor | None = None  # [patches, 3 * temporal * patch * patch] float32
    image_grid_thw: torch.Tensor | None = None  # [images, 3] int64: patches along time, height, width
    image_rows: torch.Tensor | None = None  # [images] int64
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_rows: torch.Tensor | None = None
    second_per_grid: torch.Tensor | None = None  # [videos] float32: seconds per temporal patch (for
    #                                              candidates that compute their own 3-D positions)
    input_features: torch.Tensor | None = None  # [clips, mel bins, frames] float32, right-padded
    feature_attention_mask: torch.Tensor | None = None  # [clips, frames] int64: 1 on real frames
    audio_rows: torch.Tensor | None = None  # [clips] int64

    # Per kind: (the tensor whose first dimension counts the item's rows or the items, the grid, the rows).
    KINDS = {"image": ("pixel_values", "image_grid_thw", "image_rows"),
             "video": ("pixel_values_videos", "video_grid_thw", "video_rows"),
             "audio": ("input_features", None, "audio_rows")}
    ENCODER = {"image": "vision", "video": "vision", "audio": "audio"}
    NOT_MODEL_INPUTS = ("image_rows", "video_rows", "audio_rows", "second_per_grid")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present fields by name (how a golden stores them, under `inputs.`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> Media | None:
        """The media among `tensors` (by field name), or None when there are none."""
        present = {f.name: tensors[f.name] for f in fields(cls) if f.name in tensors}
        return cls(**present) if present else None

    @property
    def kinds(self) -> list[str]:
        """The media kinds present (`image`, `video`, `audio`)."""
        return [kind for kind, (values, _, _) in self.KINDS.items() if getattr(self, values) is not None]

    @property
    def encoders(self) -> set[str]:
        """The encoders a forward of this batch runs (`vision`, `audio`)."""
        return {self.ENCODER[kind] for kind in self.kinds}

    def rows_with(self) -> set[int]:
        """The batch rows that hold any medium."""
        return {int(r) for kind in self.kinds for r in getattr(self, self.KINDS[kind][2])}

    def _item_slices(self, kind: str) -> list[slice]:
        """Per item of `kind`, the slice of its values' first dimension."""
        values, grid, _ = self.KINDS[kind]
        if grid is None:  # one clip per row of input_features
            return [slice(i, i + 1) for i in range(getattr(self, values).shape[0])]
        sizes = getattr(self, grid).prod(dim=-1).tolist()
        starts = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]

    def select_rows(self, index: torch.Tensor) -> Media | None:
        """The items of batch rows `index` (in that order), renumbered to their place in `index`."""
        out: dict[str, torch.Tensor] = {}
        order = [int(i) for i in index]
        for kind in self.kinds:
            values, grid, rows = self.KINDS[kind]
            item_rows = getattr(self, rows).tolist()
            slices = self._item_slices(kind)
            picked = [(new, item) for new, row in enumerate(order) for item, r in enumerate(item_rows) if r == row]
            if not picked:
                continue
            items = [item for _, item in picked]
            out[values] = torch.cat([getattr(self, values)[slices[item]] for item in items])
            out[rows] = torch.tensor([new for new, _ in picked], dtype=torch.long)
            if grid is not None:
                out[grid] = getattr(self, grid)[items]
            if kind == "video" and self.second_per_grid is not None:
                out["second_per_grid"] = self.second_per_grid[items]
            if kind == "audio":
                out["feature_attention_mask"] = self.feature_attention_mask[items]
        return Media(**out) if out else None

    def in_one_row(self) -> Media:
        """Every item in batch row 0 (the packed layout's one row), in the same order."""
        return replace(self, **{rows: torch.zeros_like(getattr(self, rows))
                                for kind in self.kinds for rows in [self.KINDS[kind][2]]})

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """What the model's forward takes (the rows an item belongs to and the seconds per temporal patch
        are for layouts and for candidates that compute their own 3-D positions, not for the model)."""
        return {name: t for name, t in self.tensors().items() if name not in self.NOT_MODEL_INPUTS}

    def to(self, device: torch.device | str) -> Media:
        return Media(**{name: t.to(device) for name, t in self.tensors().items()})


MEDIA_FIELDS = tuple(f.name for f in fields(Media))


# --- the batch --------------------------------------------------------------------------------------


@dataclass
class Batch:
    """Model inputs plus labels. `attention_mask` is 1 on real tokens (packed batches: all ones).

    The token grids are typed fields; a multimodal batch adds its 3-D positions and its media (see the
    module docstring); `extra` holds other model inputs a layout passes (pre-shifted labels, say),
    never stored in a golden.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    rope_positions: torch.Tensor | None = None  # [3, rows, positions] int64 (M-RoPE), or None
    media: Media | None = None

    @property
    def grids(self) -> dict[str, torch.Tensor]:
        """The token grids ([rows, positions] each) by input field."""
        return {name: getattr(self, name) for name in _GRIDS}

    @property
    def multimodal(self) -> bool:
        """Whether the batch has 3-D positions or media (what a layout that re-arranges tokens must carry)."""
        return self.rope_positions is not None or self.media is not None

    @property
    def encoders(self) -> set[str]:
        """The encoders a forward of this batch runs (`vision`, `audio`; none for text)."""
        return self.media.encoders if self.media is not None else set()

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def width(self) -> int:
        """Positions per row."""
        return self.input_ids.shape[-1]

    @property
    def token_mask(self) -> torch.Tensor:
        """[rows * positions] bool: which flattened positions hold real tokens (the ones compared)."""
        return self.attention_mask.reshape(-1).bool().cpu()

    @property
    def predictions(self) -> int:
        """How many tokens the causal-LM loss averages over (labels shifted by one, ignored ones out)."""
        return int((self.labels[..., 1:] != IGNORE_INDEX).sum())

    def tokens(self) -> Tokens:
        """The batch's positions as a comparison sees them."""
        return Tokens(mask=self.token_mask, width=self.width, ids=self.input_ids.reshape(-1).cpu())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{name: t.to(device) for name, t in self.grids.items()},
                     extra={name: t.to(device) for name, t in self.extra.items()},
                     rope_positions=None if self.rope_positions is None else self.rope_positions.to(device),
                     media=None if self.media is None else self.media.to(device))

    def select_rows(self, index: torch.Tensor) -> Batch:
        """The rows `index`, at the batch's full width (so outputs map back by position), with their media."""
        if self.extra:
            raise Unsupported(f"a batch with {', '.join(sorted(self.extra))} cannot be split by rows yet")
        index = torch.as_tensor(index, dtype=torch.long)
        return Batch(**{name: t[index] for name, t in self.grids.items()},
                     rope_positions=None if self.rope_positions is None else self.rope_positions[:, index],
                     media=None if self.media is None else self.media.select_rows(index))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch as named tensors, as a golden stores them (`inputs.<field>`)."""
        stored = dict(self.grids)
        if self.rope_positions is not None:
            stored[ROPE_POSITIONS] = self.rope_positions
        if self.media is not None:
            stored.update(self.media.tensors())
        return {f"inputs.{name}": t.cpu().contiguous() for name, t in {**stored, **self.extra}.items()}

    @classmethod
    def from_golden(cls, golden: Golden) -> Batch:
        """The batch a golden stores (its `inputs.*` tensors)."""
        stored = golden.inputs()
        grids = {name: stored.pop(name) for name in _GRIDS}
        rope = stored.pop(ROPE_POSITIONS, None)
        media = Media.from_tensors({name: stored.pop(name) for name in MEDIA_FIELDS if name in stored})
        return cls(**grids, extra=stored, rope_positions=rope, media=media)

    def model_kwargs(self, with_labels: bool = True) -> dict[str, torch.Tensor]:
        positions = self.position_ids
        if self.rope_positions is not None:
            # [4, rows, positions]: the text positions first (transformers finds packed sequences there).
            positions = torch.cat([positions.unsqueeze(0), self.rope_positions.to(positions.device)])
        kwargs = {"input_ids": self.input_ids, "position_ids": positions, **self.extra}
        if self.media is not None:
            kwargs.update(self.media.model_kwargs())
        # An all-ones mask says nothing; leaving it out lets transformers find packed sequences
        # from the restarting position ids and keep them from attending to each other.
        if not bool(self.attention_mask.all()):
            kwargs["attention_mask"] = self.attention_mask
        if with_labels:
            kwargs["labels"] = self.labels
        return kwargs


_GRIDS = ("input_ids", "attention_mask", "position_ids", "labels")


def padding_side(config: dict) -> str:
    """Where a golden's batch puts its pads for a model config: left (the zoo's rule, see `padded`), or right
    for models whose attention compresses fixed windows of positions (DeepSeek-V4's compressed layer kinds):
    left pads would enter their first windows and change a row's own output."""
    kinds = config.get("layer_types") or config.get("text_config", {}).get("layer_types") or []
    return "right" if any("compress" in str(kind) for kind in kinds) else "left"


def _labels_for(tokens: list[int], placeholders: frozenset[int] = frozenset()) -> list[int]:
    return [IGNORE_INDEX] + [IGNORE_INDEX if t in placeholders else t for t in tokens[1:]]


def padded(sequences: list[list[int]], side: str = "left", placeholders: frozenset[int] = frozenset()) -> Batch:
    """Padded rows; positions count from 0 at each sequence's first real token.

    Left padding (the default) puts pads before real tokens in causal order, so an attention mask bug
    that lets a sequence see its padding changes real outputs instead of hiding behind causality. Models
    whose output for a row depends on where its real tokens sit (DeepSeek-V4's compressors cut windows at
    fixed positions) are padded on the right. `placeholders` are token ids never predicted.
    """
    if side not in ("left", "right"):
        raise ValueError(f"padding side {side!r} (left or right)")
    width = max(len(s) for s in sequences)
    ids, mask, pos, labels = [], [], [], []
    for seq in sequences:
        pad = width - len(seq)
        parts = (([PAD_ID] * pad, seq), ([0] * pad, [1] * len(seq)), ([0] * pad, list(range(len(seq)))),
                 ([IGNORE_INDEX] * pad, _labels_for(seq, placeholders)))
        for grid, (padding, real) in zip((ids, mask, pos, labels), parts):
            grid.append(padding + real if side == "left" else real + padding)
    return Batch(*(torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos, labels)))


def packed_rows(rows: list[list[list[int]]]) -> Batch:
    """Rows of packed sequences (positions restarting per sequence), left-padded to the longest row.

    One sequence per row is `padded`; one row is `packed`. The real-shape goldens mix both: a long
    sequence alone in its row (the kernels' plain causal path) beside a row of dozens of packed
    sequences (their varlen path).
    """
    width = max(sum(len(s) for s in row) for row in rows)
    ids, mask, pos, labels = [], [], [], []
    for row in rows:
        pad = width - sum(len(s) for s in row)
        ids.append([PAD_ID] * pad + [t for s in row for t in s])
        mask.append([0] * pad + [1] * (width - pad))
        pos.append([0] * pad + [p for s in row for p in range(len(s))])
        labels.append([IGNORE_INDEX] * pad + [t for s in row for t in _labels_for(s)])
    return Batch(*(torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos, labels)))


def sequences_of(batch: Batch) -> list[list[int]]:
    """The batch's sequences in order: each row's real tokens, split where the position ids restart."""
    found = []
    for ids, mask, pos in zip(batch.input_ids.cpu(), batch.attention_mask.cpu(), batch.position_ids.cpu()):
        real = mask.bool()
        tokens, positions = ids[real].tolist(), pos[real].tolist()
        for i, (token, p) in enumerate(zip(tokens, positions)):
            if i == 0 or p == 0:
                found.append([])
            found[-1].append(token)
    return found


def packed(sequences: list[list[int]], placeholders: frozenset[int] = frozenset()) -> Batch:
    """All sequences in one row, position ids restarting at each sequence."""
    ids = [t for s in sequences for t in s]
    pos = [p for s in sequences for p in range(len(s))]
    labels = [t for s in sequences for t in _labels_for(s, placeholders)]
    one_row = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return Batch(one_row(ids), torch.ones(1, len(ids), dtype=torch.long), one_row(pos), one_row(labels))


def pack(batch: Batch) -> Batch:
    """`batch`'s sequences (its rows' real tokens) packed into one row, with their 3-D positions and media.

    The labels are the padded batch's, so placeholders stay unpredicted; the 3-D positions of a row's real
    tokens do not depend on its padding (`get_rope_index` counts from each row's first real token)."""
    if batch.extra:
        raise Unsupported(f"packing a batch with {', '.join(sorted(batch.extra))} is not supported yet")
    real = batch.attention_mask.bool()
    one_row = lambda grid: grid[real].reshape(1, -1)  # noqa: E731  (row-major: sequences in row order)
    # A padded row's positions count from 0 at its first real token and its first label is ignored: the
    # real tokens' own values are already the packed row's.
    out = Batch(one_row(batch.input_ids), torch.ones(1, int(real.sum()), dtype=torch.long),
                one_row(batch.position_ids), one_row(batch.labels))
    if batch.rope_positions is not None:
        out.rope_positions = batch.rope_positions[:, real].reshape(3, 1, -1)
    if batch.media is not None:
        out.media = batch.media.in_one_row()
    return out


# --- multimodal batches from the test data ----------------------------------------------------------


@dataclass(frozen=True)
class Medium:
    """One raw medium of `multimodal.parquet` (uint8 pixels [H, W, 3] or [F, H, W, 3]; int16 PCM)."""

    id: str
    kind: str  # image, video, audio
    tensor: torch.Tensor
    fps: float


def load_media(testdata_dir: Path) -> dict[str, Medium]:
    """Every medium of `<testdata_dir>/multimodal.parquet`, by id."""
    path = Path(testdata_dir) / MEDIA_FILE
    try:
        rows = _parquet().read_table(path).to_pylist()
        out = {}
        for row in rows:
            dtype = {"uint8": torch.uint8, "int16": torch.int16}[row["dtype"]]
            tensor = torch.frombuffer(bytearray(row["data"]), dtype=dtype).reshape(row["shape"]).clone()
            out[row["id"]] = Medium(row["id"], row["kind"], tensor, float(row["fps"]))
        return out
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        raise VeosnapError(f"{path}: cannot read the media table ({type(exc).__name__}: {exc})") from None


def load_media_sequences(testdata_dir: Path, family: str) -> dict[str, tuple[list[int], list[str]]]:
    """The token sequences of `multimodal_sequences.parquet` for one media family: sample -> (tokens, media)."""
    path = Path(testdata_dir) / MEDIA_SEQUENCES_FILE
    try:
        rows = _parquet().read_table(path).to_pylist()
    except (OSError, ValueError) as exc:
        raise VeosnapError(f"{path}: cannot read the multimodal token table ({exc})") from None
    found = {r["sample"]: (list(r["tokens"]), list(r["media"])) for r in rows if r.get("family") == family}
    if not found:
        raise VeosnapError(f"{path}: no sequences for the media family {family!r}")
    return found


@dataclass(frozen=True)
class Row:
    """One row of a scenario's batch: a text sequence (`("text", id)`) or a multimodal sample (its name)."""

    text: int | None = None
    sample: str | None = None

    def __str__(self) -> str:
        return f"text {self.text}" if self.sample is None else self.sample


def media_family(config: object) -> media_rules.Family:
    """The test data's media family whose placeholder counts fit a model config (patch size, and whether it
    has an audio tower). A config that fits none is refused with the reason."""
    vision = getattr(config, "vision_config", None)
    patch = getattr(vision, "patch_size", None)
    audio = getattr(config, "audio_config", None) is not None
    for family in media_rules.FAMILIES.values():
        if family.vision.patch_size == patch and (family.audio_rule is not None) == audio:
            return family
    raise VeosnapError(f"{getattr(config, 'model_type', config)}: no media family of the test data fits a vision "
                       f"patch size of {patch}{' with an audio tower' if audio else ''}")


def placeholder_ids(config: object) -> dict[str, int]:
    """The model's image, video and audio placeholder token ids (transformers spells them two ways)."""
    found = {}
    for kind in ("image", "video", "audio"):
        for attr in (f"{kind}_token_id", f"{kind}_token_index"):
            value = getattr(config, attr, None)
            if isinstance(value, int):
                found[kind] = value
                break
    return found


def multimodal_batch(testdata_dir: Path, rows: list[Row], config: object, side: str = "left") -> tuple[Batch, str]:
    """The padded batch of `rows` for a model config, with its media (3-D positions not yet: see
    `with_rope_positions`), and the media family it was made for."""
    family = media_family(config)
    texts = {r.text for r in rows if r.sample is None}
    text_of = dict(zip(sorted(texts), load_sequences(testdata_dir, tuple(sorted(texts))))) if texts else {}
    samples = load_media_sequences(testdata_dir, family.name) if any(r.sample for r in rows) else {}
    raw = load_media(testdata_dir) if samples else {}
    sequences, items = [], []
    for index, row in enumerate(rows):
        if row.sample is None:
            sequences.append(text_of[row.text])
            continue
        if row.sample not in samples:
            raise VeosnapError(f"{Path(testdata_dir) / MEDIA_SEQUENCES_FILE}: no sample {row.sample!r} for family "
                               f"{family.name}")
        tokens, ids = samples[row.sample]
        sequences.append(tokens)
        for medium_id in ids:
            if medium_id not in raw:
                raise VeosnapError(f"{Path(testdata_dir) / MEDIA_FILE}: no medium {medium_id!r} (sample {row.sample})")
            items.append((index, raw[medium_id]))
    placeholders = placeholder_ids(config)
    batch = padded(sequences, side, frozenset(placeholders.values()))
    batch.media = _media(items, family)
    _check_placeholders(batch, placeholders, family, config)
    return batch, family.name


def _media(items: list[tuple[int, Medium]], family: media_rules.Family) -> Media | None:
    out: dict[str, torch.Tensor] = {}
    images = [(row, m) for row, m in items if m.kind == "image"]
    videos = [(row, m) for row, m in items if m.kind == "video"]
    clips = [(row, m) for row, m in items if m.kind == "audio"]
    if images:
        out["pixel_values"], out["image_grid_thw"] = media_rules.image_inputs([m.tensor for _, m in images],
                                                                             family.vision)
        out["image_rows"] = torch.tensor([row for row, _ in images], dtype=torch.long)
    if videos:
        out["pixel_values_videos"], out["video_grid_thw"] = media_rules.video_inputs([m.tensor for _, m in videos],
                                                                                    family.vision)
        out["video_rows"] = torch.tensor([row for row, _ in videos], dtype=torch.long)
        out["second_per_grid"] = torch.tensor([family.vision.temporal_patch_size / m.fps for _, m in videos],
                                              dtype=torch.float32)
    if clips:
        waves = [m.tensor.to(torch.float32) / 32768.0 for _, m in clips]
        out["input_features"], out["feature_attention_mask"] = media_rules.audio_inputs(waves)
        out["audio_rows"] = torch.tensor([row for row, _ in clips], dtype=torch.long)
    return Media(**out) if out else None


def _check_placeholders(batch: Batch, placeholders: dict[str, int], family: media_rules.Family,
                        config: object) -> None:
    """Each row holds exactly as many placeholder tokens as its media give (or the model would refuse them)."""
    media = batch.media
    for kind, token in placeholders.items():
        counts = (batch.input_ids == token).sum(dim=1)
        expected = torch.zeros_like(counts)
        if media is not None and kind in media.kinds:
            values, grid, rows = Media.KINDS[kind]
            if grid is not None:
                per_item = getattr(media, grid).prod(dim=-1) // family.vision.merge_size ** 2
            else:
                frames = media.feature_attention_mask.sum(dim=-1)
                per_item = torch.tensor([media_rules.audio_tokens(int(f), family) for f in frames])
            expected.index_add_(0, getattr(media, rows), per_item.to(expected.dtype))
        if not torch.equal(counts, expected):
            raise VeosnapError(f"{getattr(config, 'model_type', '?')}: the test data's {kind} placeholders "
                               f"({counts.tolist()} per row) do not match its media ({expected.tolist()}); "
                               f"regenerate testdata/ with tools/data/make_multimodal_testdata.py")


def with_rope_positions(batch: Batch, model: torch.nn.Module) -> Batch:
    """`batch` with the 3-D positions the model's own `get_rope_index` gives its rows (models without one:
    unchanged). Its arguments are matched by name, so every Qwen-VL family and the omni thinkers are asked
    alike; the result is stored as int64 (some releases return float positions of integral value)."""
    owner = next((m for m in (getattr(model, "model", None), model) if hasattr(m, "get_rope_index")), None)
    if owner is None:
        return batch
    config = model.config
    placeholders = placeholder_ids(config)
    ids, mask = batch.input_ids, batch.attention_mask
    media = batch.media or Media()
    token_types = torch.zeros_like(ids)
    for value, kind in ((1, "image"), (2, "video"), (3, "audio")):
        if kind in placeholders:
            token_types[ids == placeholders[kind]] = value
    seconds = media.second_per_grid
    offered = {
        "input_ids": ids, "attention_mask": mask, "mm_token_type_ids": token_types,
        "image_grid_thw": media.image_grid_thw, "video_grid_thw": media.video_grid_thw,
        "second_per_grid_ts": seconds, "second_per_grids": seconds, "video_second_per_grid": seconds,
        "use_audio_in_video": False,
        "audio_seqlens": None if media.feature_attention_mask is None else media.feature_attention_mask.sum(-1),
    }
    params = inspect.signature(owner.get_rope_index).parameters
    positions, _ = owner.get_rope_index(**{name: value for name, value in offered.items() if name in params})
    return replace(batch, rope_positions=positions.to(torch.long).cpu().contiguous())
