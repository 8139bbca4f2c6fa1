"""Batches built from the token tables in `testdata/`: padded (the toy golden's), packed, and rows of
packed sequences (the real-shape goldens').

A token table holds either the tokens themselves (`sequences.parquet`: id, length, tokens) or, for
sequences of thousands of tokens over vocabularies of 150k, only each sequence's length and seed
(`realshape.parquet`: id, length, seed): the ids are then derived for the model's vocabulary
(`derive_tokens`), spread over all of it. Either way the golden stores the actual ids it ran.

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


FIRST_TOKEN = 3  # ids 0 (pad), 1 (bos) and 2 (eos) never appear inside a derived sequence


def load_sequences(testdata_dir: Path, ids: tuple[int, ...] = DEFAULT_SEQUENCES, source: str = SEQUENCES_FILE,
                   vocab_size: int | None = None, distinct: int | None = None) -> list[list[int]]:
    """The token lists of the sequences `ids` from `<testdata_dir>/<source>`.

    A table of (id, length, seed) is derived for `vocab_size` (required then), from `distinct` ids
    spread over the vocabulary when given; a table of (id, tokens) is read as it is.
    """
    path = Path(testdata_dir) / source
    try:
        names = pq.read_schema(path).names
        derived = "tokens" not in names
        columns = ["id", "length", "seed"] if derived else ["id", "tokens"]
        table = pq.read_table(path, columns=columns).to_pydict()
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


def packed(sequences: list[list[int]]) -> Batch:
    """All sequences in one row, position ids restarting at each sequence."""
    ids = [t for s in sequences for t in s]
    pos = [p for s in sequences for p in range(len(s))]
    labels = [t for s in sequences for t in _labels_for(s)]
    one_row = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return Batch(one_row(ids), torch.ones(1, len(ids), dtype=torch.long), one_row(pos), one_row(labels))
