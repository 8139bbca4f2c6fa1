"""Batches built from the token table in `testdata/`: padded (the golden's) and packed.

Labels never ask a position to predict the first token of a sequence (in a padded batch the last
pad would, in a packed one the previous sequence's last token would), so both layouts train on
exactly the same sum(len - 1) predictions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from ..errors import Unsupported, VeosnapError
from ..golden.codec import Golden
from ..numerics.compare import Tokens

IGNORE_INDEX = -100
PAD_ID = 0
DEFAULT_SEQUENCES = (0, 1, 2, 3)
SEQUENCES_FILE = "sequences.parquet"


def load_sequences(testdata_dir: Path, ids: tuple[int, ...] = DEFAULT_SEQUENCES) -> list[list[int]]:
    """The token lists of the sequences `ids` from `<testdata_dir>/sequences.parquet`."""
    path = Path(testdata_dir) / SEQUENCES_FILE
    try:
        table = pq.read_table(path, columns=["id", "tokens"]).to_pydict()
    except (OSError, ValueError, KeyError) as exc:
        raise VeosnapError(f"{path}: cannot read the token table ({exc})") from None
    by_id = dict(zip(table["id"], table["tokens"]))
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise VeosnapError(f"{path}: no sequence with id {missing[0]} (has {len(by_id)})")
    return [list(by_id[i]) for i in ids]


@dataclass
class Batch:
    """Model inputs plus labels. `attention_mask` is 1 on real tokens (packed batches: all ones).

    The token grids are typed fields; `extra` holds any other model input a golden stores (an open
    set: pixel values, grid sizes, audio features), passed to the model as keyword arguments.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def grids(self) -> dict[str, torch.Tensor]:
        """The token grids ([rows, positions] each) by input field."""
        return {name: getattr(self, name) for name in _GRIDS}

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
                     extra={name: t.to(device) for name, t in self.extra.items()})

    def select_rows(self, index: torch.Tensor) -> Batch:
        """The rows `index`, at the batch's full width (so outputs map back by position)."""
        if self.extra:
            raise Unsupported(f"a batch with {', '.join(sorted(self.extra))} cannot be split by rows yet")
        return Batch(**{name: t[index] for name, t in self.grids.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch as named tensors, as a golden stores them (`inputs.<field>`)."""
        return {f"inputs.{name}": t.cpu().contiguous() for name, t in {**self.grids, **self.extra}.items()}

    @classmethod
    def from_golden(cls, golden: Golden) -> Batch:
        """The batch a golden stores (its `inputs.*` tensors)."""
        stored = golden.inputs()
        return cls(**{name: stored.pop(name) for name in _GRIDS}, extra=stored)

    def model_kwargs(self, with_labels: bool = True) -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, **self.extra}
        # An all-ones mask says nothing; leaving it out lets transformers find packed sequences
        # from the restarting position ids and keep them from attending to each other.
        if not bool(self.attention_mask.all()):
            kwargs["attention_mask"] = self.attention_mask
        if with_labels:
            kwargs["labels"] = self.labels
        return kwargs


_GRIDS = ("input_ids", "attention_mask", "position_ids", "labels")


def _labels_for(tokens: list[int]) -> list[int]:
    return [IGNORE_INDEX] + tokens[1:]


def padded(sequences: list[list[int]]) -> Batch:
    """Left-padded rows; positions count from 0 at each sequence's first real token.

    Left padding puts pads before real tokens in causal order, so an attention mask bug that lets a
    sequence see its padding changes real outputs instead of hiding behind causality.
    """
    width = max(len(s) for s in sequences)
    ids, mask, pos, labels = [], [], [], []
    for seq in sequences:
        pad = width - len(seq)
        ids.append([PAD_ID] * pad + seq)
        mask.append([0] * pad + [1] * len(seq))
        pos.append([0] * pad + list(range(len(seq))))
        labels.append([IGNORE_INDEX] * pad + _labels_for(seq))
    return Batch(*(torch.tensor(x, dtype=torch.long) for x in (ids, mask, pos, labels)))


def packed(sequences: list[list[int]]) -> Batch:
    """All sequences in one row, position ids restarting at each sequence."""
    ids = [t for s in sequences for t in s]
    pos = [p for s in sequences for p in range(len(s))]
    labels = [t for s in sequences for t in _labels_for(s)]
    one_row = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return Batch(one_row(ids), torch.ones(1, len(ids), dtype=torch.long), one_row(pos), one_row(labels))
