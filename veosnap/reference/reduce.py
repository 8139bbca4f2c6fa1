"""What capture keeps of each tensor it sees: the tensor whole, or a sketch made where the tensor lives.

Capture's hooks (layer outputs, logits) and its gradient pass hand every tensor to a `Reducer`:

- `Reducer` (the base) keeps everything whole: a copy on the host, as a golden stores it.
- `RecordReducer` (record) sketches the tensors a sketch `Plan` chose, into the golden's `GoldenSketch`.
- `CandidateReducer` (check, and the record's float64 noise run) sketches the tensors its golden holds
  as sketches, with the golden's own specs, into `CandidateSketch`es.

A sketched tensor is reduced in two steps. In the hook, on the tensor's device and before any later
kernel can reuse its buffer, each row is reduced to its `width` numbers (`keep_tokens`, `keep_rows`:
a `Rows`, rows x width, small); a layout that ran the batch in pieces puts its pieces' rows back at
their positions in the golden's batch (the hash uses a row's global index, so the pieces' sketches are
the whole tensor's). Then `finish` groups the rows as the spec says and applies the row mask (real
tokens only) or the golden's support. No sketched tensor is ever copied to the host whole.

A candidate's tensor of another shape or dtype than its golden's is not an exception: it becomes a
`SketchProblem`, reported as that tensor's problem, as for a whole tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..numerics.metric import is_token_tensor
from ..numerics.sketch import (
    CandidateSketch,
    GoldenSketch,
    Plan,
    RowSketch,
    SketchProblem,
    SketchSpec,
    as_rows,
    pairwise_sum,
    candidate_from_rows,
    golden_from_rows,
    rowsketch,
    rowsketch_at,
    scatter_rows,
    storage_dtype,
    with_golden,
)
from .probes import host_copy


@dataclass(frozen=True)
class Rows:
    """Per-row sketches of a tensor, or of the rows a piece of a layout produced: their dtype, and the
    row of the whole tensor (the golden position) each stands for (None: rows 0, 1, ... in order)."""

    sketch: RowSketch
    dtype: torch.dtype
    positions: torch.Tensor | None = None

    def cpu(self) -> Rows:
        return Rows(RowSketch(self.sketch.values.cpu(), self.sketch.sumsq.cpu()), self.dtype, self.positions)


class Reducer:
    """Keeps every tensor whole (the base: no tensor is sketched)."""

    token_mask: torch.Tensor | None = None  # [rows * positions] bool of the golden's batch: real tokens

    def spec(self, name: str) -> SketchSpec | None:
        """The spec `name` is sketched with, or None: kept whole."""
        return None

    def keep_tokens(self, name: str, tensor: torch.Tensor, positions: torch.Tensor | None = None
                    ) -> torch.Tensor | Rows | SketchProblem:
        """What to keep of a token tensor ([rows, positions, ...]) a hook sees; `positions`: the flat
        position in the golden's batch of each of its token rows, -1 for a slot a layout added that
        stands for none (None: the golden's batch itself). Rows standing for none are not sketched."""
        spec = self.spec(name)
        if spec is None:
            return host_copy(tensor)
        x2d = as_rows(tensor.detach())
        if x2d.shape[-1] != spec.columns:
            return SketchProblem(f"shape {tuple(tensor.shape)} but golden {spec.shape}")
        if positions is not None:
            positions = positions.reshape(-1).cpu()
            if positions.numel() != x2d.shape[0]:
                return SketchProblem(f"{x2d.shape[0]} token rows for {positions.numel()} positions (shape "
                                     f"{tuple(tensor.shape)})")
            kept = positions >= 0
            if not bool(kept.all()):
                x2d, positions = x2d[kept.to(x2d.device)], positions[kept]
        return Rows(rowsketch_at(x2d, spec.width, spec.seed, positions), tensor.dtype, positions)

    def keep_rows(self, name: str, tensor: torch.Tensor, row_offset: int | None = None
                  ) -> torch.Tensor | Rows | SketchProblem:
        """What to keep of a per-parameter tensor (a gradient), or, with `row_offset`, of a shard of it
        along its first dimension whose first row is row `row_offset` of the whole."""
        spec = self.spec(name)
        if spec is None:
            return host_copy(tensor)
        x2d = as_rows(tensor.detach())
        shard = row_offset is not None
        fits = tuple(tensor.shape[1:]) == spec.shape[1:] if shard else tuple(tensor.shape) == spec.shape
        if not fits:
            return SketchProblem(f"shape {tuple(tensor.shape)}{' (a shard)' if shard else ''} but golden {spec.shape}")
        return Rows(rowsketch(x2d, spec.width, spec.seed, row_offset=row_offset or 0), tensor.dtype)

    def finish(self, name: str, rows: Rows | SketchProblem) -> object:
        """The kept form of a sketched tensor from all its rows (in order)."""
        raise NotImplementedError(f"{type(self).__name__} sketches nothing, so it cannot finish {name!r}")

    def finish_all(self, items: list[tuple[str, Rows | SketchProblem]]) -> dict[str, object]:
        """`finish` of many sketched tensors at once (a step's gradients), in their order: the same results
        as `finish` of each (a reducer may do the work of tensors of one kind together)."""
        return {name: self.finish(name, rows) for name, rows in items}

    def row_mask(self, name: str) -> torch.Tensor | None:
        return self.token_mask if is_token_tensor(name) else None


WHOLE = Reducer()


class RecordReducer(Reducer):
    """The recorder's: the tensors `plan` sketches become the golden's `GoldenSketch`es."""

    def __init__(self, plan: Plan, token_mask: torch.Tensor) -> None:
        self.plan = plan
        self.token_mask = token_mask.reshape(-1).cpu().bool()
        self._specs = plan.sketched

    def spec(self, name: str) -> SketchSpec | None:
        return self._specs.get(name)

    def finish(self, name: str, rows: Rows | SketchProblem) -> GoldenSketch:
        if isinstance(rows, SketchProblem):  # the reference itself does not match its plan: a veosnap bug
            raise RuntimeError(f"{name}: the reference's tensor does not match its sketch plan ({rows.problem})")
        return golden_from_rows(rows.sketch, self._specs[name], dtype=rows.dtype, row_mask=self.row_mask(name),
                                support_limit=self.plan.choice(name).support_limit, name=name)


# A float64 norm over the last dimension (`width` values) on CUDA: each output is reduced by one row of
# threads whose width is min(width, 32) lanes once 16 or more outputs share a block (512 threads), and is wider
# (up to `width`) for fewer outputs: a tensor of fewer than 16 groups, alone, would add its values in
# another order than in a stack. From 16 groups on (or at widths of 32 or less) the order is the same.
_SAME_NORM_GROUPS = 16


def _indexed(device: torch.device | str) -> torch.device:
    """`device` with its index (`cuda` is `cuda:0` when that is the current device): a tensor's own device always
    has one, and a copy made for `cuda` must be found again under it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CandidateReducer(Reducer):
    """A check's (and the float64 noise run's): the tensors its golden holds as sketches are reduced
    with the golden's specs. `check_dtype=False` for the float64 run, whose dtype differs on purpose."""

    def __init__(self, sketches: Mapping[str, GoldenSketch], token_mask: torch.Tensor,
                 check_dtype: bool = True, device: torch.device | None = None) -> None:
        self.sketches = dict(sketches)
        self.token_mask = token_mask.reshape(-1).cpu().bool()
        self.check_dtype = check_dtype
        self._masks: dict[torch.device, torch.Tensor] = {}  # the token mask on each device it was asked for
        # Rows counted per group depend on the spec's grouping, the mask and the support, not on the values:
        # made once per kind of tensor and device (a few kernel launches fewer for each tensor), read only.
        self._counts: dict[tuple, torch.Tensor] = {}
        # A check: the golden's sketches go to its device now, before the candidate runs (a GPU is idle then;
        # no sync), as the float64 the comparison reads, so the comparison copies nothing.
        self._golden_on: dict[str, torch.Tensor] = {}
        if device is not None:
            self._golden_on = {name: gold.values.to(device, non_blocking=True).double()
                               for name, gold in self.sketches.items()}
            # Likewise the token mask and each support: copied in `finish`, each was a blocking copy that
            # waited for the backward still running on the device.
            device = _indexed(device)
            self._masks[device] = self.token_mask.to(device, non_blocking=True)
            self.sketches = {name: gold if gold.support is None else
                             replace(gold, support=gold.support.to(device, non_blocking=True))
                             for name, gold in self.sketches.items()}

    def _mask_on(self, name: str, device: torch.device) -> torch.Tensor | None:
        """`row_mask(name)` on `device`, copied there once per check, without waiting for the device (a
        blocking copy waited for the backward still running there)."""
        mask = self.row_mask(name)
        if mask is None or mask.device == device:
            return mask
        device = _indexed(device)
        if device not in self._masks:
            self._masks[device] = mask.to(device, non_blocking=True)
        return self._masks[device]

    def spec(self, name: str) -> SketchSpec | None:
        gold = self.sketches.get(name)
        return None if gold is None else gold.spec

    def finish(self, name: str, rows: Rows | SketchProblem) -> CandidateSketch | SketchProblem:
        if isinstance(rows, SketchProblem):
            return rows
        gold = self.sketches[name]
        dtype = str(rows.dtype).removeprefix("torch.")
        if self.check_dtype and dtype != gold.dtype:
            return SketchProblem(f"dtype {dtype} but golden {gold.dtype}")
        if rows.sketch.values.shape[0] != gold.spec.rows:
            found = rows.sketch.values.shape[0]
            return SketchProblem(f"{found} rows but golden {gold.spec.rows} (shape {gold.spec.shape})")
        device = rows.sketch.values.device
        mask = self._mask_on(name, device)
        spec = gold.spec
        kind = (spec.rows, spec.group, spec.groups, spec.support, mask is not None, device)
        sketch = candidate_from_rows(rows.sketch, gold, dtype=rows.dtype, name=name, row_mask=mask,
                                     counts=self._counts.get(kind))
        self._counts.setdefault(kind, sketch.counts)
        golden = self._golden_on.get(name)
        if golden is not None and golden.device == sketch.values.device:
            sketch = with_golden(sketch, golden)
        return sketch

    def finish_all(self, items: list[tuple[str, Rows | SketchProblem]]) -> dict[str, object]:
        """`finish` of each, with the tensors of one kind done together: those of one spec layout (rows,
        groups of rows), mask or none, dtype and device, without a support and with their golden already on
        their device, are stacked, and their non-finite flags, grouped values and group distances are made
        in one pass each instead of ~8-12 kernel launches a tensor. The same bits as `finish` of each: the
        flags are exact by construction (sums of zeros, or NaN), the mask, the padding, the pairwise group
        sums, the conversion and the difference are elementwise in the same order, and each group's norm is
        a reduction over the same `width` values in the same order: the CPU reduces each output alone, and
        CUDA does too from 16 outputs a tensor (`_SAME_NORM_GROUPS`; fewer: those tensors' norms are taken
        one by one). The equality tests compare both paths. Anything else (a problem, a support, a kind met
        once) goes through `finish` as before."""
        kinds: dict[tuple, list[int]] = {}
        for index, (name, rows) in enumerate(items):
            kind = self._plain_kind(name, rows)
            if kind is not None:
                kinds.setdefault(kind, []).append(index)
        done: dict[int, CandidateSketch] = {}
        for members in kinds.values():
            if len(members) > 1:
                done.update(zip(members, self._finish_plain([items[i] for i in members])))
        return {name: done[index] if index in done else self.finish(name, rows)
                for index, (name, rows) in enumerate(items)}

    def _plain_kind(self, name: str, rows: Rows | SketchProblem) -> tuple | None:
        """What a sketched tensor is finished together by (see `finish_all`), or None: alone."""
        if isinstance(rows, SketchProblem) or name not in self.sketches:
            return None
        gold = self.sketches[name]
        spec, values = gold.spec, rows.sketch.values
        if (self.check_dtype and str(rows.dtype).removeprefix("torch.") != gold.dtype) or gold.support is not None \
                or tuple(values.shape) != (spec.rows, spec.width) or tuple(rows.sketch.sumsq.shape) != (spec.rows,):
            return None
        golden = self._golden_on.get(name)
        if golden is None or golden.device != values.device or tuple(golden.shape) != (spec.groups, spec.width):
            return None
        mask = self.row_mask(name)
        if mask is not None and mask.numel() != spec.rows:
            return None  # `finish` says why
        return (tuple(values.shape), spec.group, spec.groups, self.row_mask(name) is not None, values.dtype,
                rows.sketch.sumsq.dtype, rows.dtype, values.device)

    def _finish_plain(self, batch: list[tuple[str, Rows]]) -> list[CandidateSketch]:
        """`finish` of tensors of one kind (`_plain_kind`), together: `_groups` and `with_golden` on a stack."""
        first_name, first = batch[0]
        spec = self.sketches[first_name].spec
        values = torch.stack([rows.sketch.values for _, rows in batch])  # (tensors, rows, width)
        sumsq = torch.stack([rows.sketch.sumsq for _, rows in batch])
        device = values.device
        # `_nonfinite_rows` of each: x * 0 summed is 0 (or -0) unless a NaN/Inf is there, in any order.
        bad = ((values * 0).sum(dim=2).add_(sumsq * 0) != 0).unbind(0)
        mask = self._mask_on(first_name, device)
        if mask is not None:
            keep = mask.reshape(-1)
            if keep.dtype != torch.bool:
                keep = keep.to(torch.bool)
            values = torch.where(keep[None, :, None], values, torch.zeros((), dtype=values.dtype, device=device))
        out_dtype = storage_dtype(first.dtype)
        m, pad = spec.group, spec.groups * spec.group - spec.rows
        if m == 1 and not pad:
            grouped = values if values.dtype == out_dtype else values.to(out_dtype)
        else:
            if pad:
                values = F.pad(values, (0, 0, 0, pad))
            grouped = pairwise_sum(values.view(len(batch), spec.groups, m, spec.width), 2).to(out_dtype)
        if spec.groups >= _SAME_NORM_GROUPS or spec.width <= 32:
            golden = torch.stack([self._golden_on[name] for name, _ in batch])
            norms = (grouped.double() - golden).norm(dim=-1).unbind(0)  # `with_golden` of each
        else:  # few groups: CUDA would reduce each tensor's norms alone with another thread layout (see above)
            norms = [(grouped[i].double() - self._golden_on[name]).norm(dim=-1) for i, (name, _) in enumerate(batch)]
        kind = (spec.rows, spec.group, spec.groups, spec.support, mask is not None, device)
        counts = self._counts.get(kind)
        if counts is None:
            rows = mask.to(torch.int64) if mask is not None else torch.ones(spec.rows, dtype=torch.int64, device=device)
            counts = rows if m == 1 and not pad else F.pad(rows, (0, pad)).view(spec.groups, m).sum(1)
            self._counts[kind] = counts
        if grouped is values and mask is None:  # each tensor's own rows are its values, as `finish` gives them
            kept = [rows.sketch.values for _, rows in batch]
        else:
            kept = grouped.unbind(0)
        return [CandidateSketch(values=kept[i], counts=counts, off_support=None, nonfinite=bad[i],
                                golden=self._golden_on[name], norms=norms[i]) for i, (name, _) in enumerate(batch)]


def assemble_rows(pieces: list[Rows | SketchProblem], rows: int) -> Rows | SketchProblem:
    """A tensor's `rows` rows from the pieces a layout's passes produced (each knows the global row of
    each of its rows); rows no piece produced (padding) are zero. The first problem wins."""
    for piece in pieces:
        if isinstance(piece, SketchProblem):
            return piece
    scattered = scatter_rows([(piece.sketch, piece.positions) for piece in pieces], rows)
    return Rows(scattered, pieces[0].dtype)
