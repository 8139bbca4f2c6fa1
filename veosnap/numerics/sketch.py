"""Row sketches: the row-error metric of `veosnap.tolerance` at bounded size.

A tensor is cut into rows as the metric cuts it (`row_layout`): the last dimension is a row's
columns, a 1-D tensor is one element per row, a scalar one row of one. Each row is reduced to
`width` numbers by a seeded CountSketch; consecutive rows are summed in groups of `group` rows. The
sketch is linear, so `sketch(c) - sketch(g) == sketch(c - g)`, and for any fixed difference `d`
of a group, `||sketch(d)||^2` is an unbiased estimate of `||d||^2` whose relative variance is at most
`2 / width` (exact when `d` lives in one element, or in one stripe of `width` columns of one row).

The rule (version `rowsketch-v1`; any tool can recompute a sketch from it and the `SketchSpec`):

    S        = mix32(seed ^ SEED_SALT)
    A(r)     = mix32(S ^ r)                                 r: the row's index in the whole tensor
    K(r, t)  = mix32(A(r) ^ (t * STRIPE_MULT mod 2^32))     t = c // width: the column's stripe
    rot      = K(r, t) & (width - 1)
    W_w      = mix32(K(r, t) ^ ((w + 1) * WORD_MULT mod 2^32))   w = 0 .. max(1, width / 32) - 1
    element (r, c) goes to bucket j = (c % width + rot) % width, with sign -1 when bit (j % 32) of
    W_(j // 32) is set, +1 otherwise; a row's sketch is the signed sum of its elements per bucket.

Elements of one stripe never collide (a row no wider than `width` is sketched isometrically: its
sketch is a signed permutation of it); elements of different stripes or rows collide with
probability 1/width whatever their columns, so a difference that repeats with a period of `width`
columns (one dimension of every attention head) is estimated as well as a spread-out one. The
hash is per (row, stripe), so a row's sketch is a gather within contiguous stripes: memory-bound.

Arithmetic: float32 and float64 inputs accumulate in float64, bfloat16 and float16 in float32; a
sketch is stored in float32 (float64 for a float64 tensor, the noise run). Sums run in a fixed
order, so the same tensor gives the same bytes on one machine, and a bit-identical candidate has
error exactly 0. A row's stripes are added pairwise (`pairwise_sum`): the CUDA kernel
(`sketch_triton`, imported lazily) adds them in that very order, so its values are these bits
(its sums of squares agree within float rounding); both take `mix32` and the constants from `sketch_rule`.

Comparison: a group's error is `||sketch(c_G) - sketch(g_G)|| / (sqrt(n_G) * tau)`, n_G the rows
counted in the group and tau the RMS of the golden's exact row norms, so with one row per group it
reads like the row error and with more it is the group's RMS row error. A golden whose rows are
mostly zero (an embedding gradient: only the batch's tokens) keeps only its non-zero rows'
sketches (its support); a candidate's rows outside the support are measured exactly (norm / tau).
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..errors import VeosnapError
from ..golden.limits import HARD_LIMIT, TARGET_BYTES
from ..golden.sketches import (  # the stored form lives with the golden; re-exported here for tools
    M32,
    MAX_ROWS,
    METHOD,
    MODES,
    SUFFIXES,
    WIDTHS,
    GoldenSketch,
    SketchSpec,
    row_layout,
)
from .readback import Later
from .segments import segment_ids
from .sketch_rule import (
    STRIPE_MULT,
    WORD_MULT,
    RowSketch,
    accumulation_dtype,
    mix32,
    pairwise_sum,
    seed_key,
)

__all__ = ["GoldenSketch", "SketchSpec", "row_layout", "M32", "MAX_ROWS", "METHOD", "MODES", "SUFFIXES", "WIDTHS",
           "HARD_LIMIT", "TARGET_BYTES", "mix32", "seed_key", "accumulation_dtype", "RowSketch", "pairwise_sum"]

# Rows per chunk of the torch path are chosen so its temporaries stay near this many elements.
CHUNK_ELEMENTS = 1 << 19


def seed_for(name: str, seed: int = 0) -> int:
    """A tensor's own seed from a golden's seed and the tensor's name (independent projections per
    tensor; stored in the spec, so nobody needs to derive it again)."""
    return (zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1)) & M32


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` as a (rows, columns) view (a copy only when its layout does not allow a view)."""
    rows, columns = row_layout(x.shape)
    return x.reshape(rows, columns)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """How a sketch of a `dtype` tensor is stored: float64 for the float64 noise run, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- per-row sketches (the device-side reduction) ---------------------------------------------------


def rowsketch(x2d: torch.Tensor, width: int, seed: int, *, row_offset: int = 0, col_offset: int = 0,
              impl: str = "auto") -> RowSketch:
    """Sketch every row of the 2-D `x2d` on its own device.

    `row_offset` and `col_offset` place `x2d` inside a larger tensor (a shard, a chunk): the hash
    uses global indices, so shards' sketches add up to the whole tensor's. `impl`: `triton` (CUDA),
    `torch` (any device), or `auto` (Triton on CUDA when it imports, else torch).
    """
    if x2d.ndim != 2:
        raise VeosnapError(f"rowsketch takes a 2-D (rows, columns) tensor, got {x2d.ndim}-D")
    if width not in WIDTHS:
        raise VeosnapError(f"sketch width {width} is not a power of two in 1..{WIDTHS[-1]}")
    if row_offset < 0 or col_offset < 0 or row_offset + x2d.shape[0] > MAX_ROWS + 1:
        raise VeosnapError(f"row offset {row_offset} / column offset {col_offset} out of range")
    accumulation_dtype(x2d.dtype)  # refuses non-floating tensors with one line
    if impl == "auto":
        impl = "triton" if x2d.is_cuda and triton_available() else "torch"
    if impl == "triton":
        from . import sketch_triton  # noqa: PLC0415 - CUDA only, and triton may be absent

        return sketch_triton.rowsketch(x2d, width, seed, row_offset=row_offset, col_offset=col_offset)
    if impl != "torch":
        raise VeosnapError(f"unknown sketch implementation {impl!r} (auto, torch, triton)")
    return rowsketch_torch(x2d, width, seed, row_offset=row_offset, col_offset=col_offset)


_TRITON: list[bool] = []


def triton_available() -> bool:
    """Whether the Triton kernel can be imported here (cached)."""
    if not _TRITON:
        try:
            import triton  # noqa: F401, PLC0415

            _TRITON.append(True)
        except ImportError:
            _TRITON.append(False)
    return _TRITON[0]


def rowsketch_torch(x2d: torch.Tensor, width: int, seed: int, *, row_offset: int = 0, col_offset: int = 0,
                    chunk_elements: int = CHUNK_ELEMENTS) -> RowSketch:
    """The rule in torch, on any device, a chunk of rows at a time (no full-size temporary)."""
    rows, columns = x2d.shape
    acc = accumulation_dtype(x2d.dtype)
    device = x2d.device
    k = width
    values = torch.zeros((rows, k), dtype=acc, device=device)
    sumsq = torch.zeros((rows,), dtype=acc, device=device)
    if rows == 0 or columns == 0:
        return RowSketch(values, sumsq)
    lead, first_stripe = col_offset % k, col_offset // k
    stripes = -(-(lead + columns) // k)
    bucket = torch.arange(k, device=device)
    shifts = torch.arange(min(k, 32), device=device)
    stripe_mix = (torch.arange(first_stripe, first_stripe + stripes, device=device) * STRIPE_MULT) & M32
    words = max(1, k // 32)
    key = seed_key(seed)
    # A sign flip is an XOR of the float's sign bit: cheaper than a multiply or a select.
    bits, sign_bit = (torch.int64, -(1 << 63)) if acc == torch.float64 else (torch.int32, -(1 << 31))
    aligned = lead == 0 and columns == stripes * k
    step = max(1, chunk_elements // (stripes * k))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if aligned:
            buf = x2d[r0:r1].to(acc).view(r1 - r0, stripes, k)
        else:
            buf = torch.zeros((r1 - r0, stripes * k), dtype=acc, device=device)
            buf[:, lead : lead + columns] = x2d[r0:r1]
            buf = buf.view(r1 - r0, stripes, k)
        row_keys = mix32(key ^ (torch.arange(r0, r1, device=device) + row_offset))
        keys = mix32(row_keys[:, None] ^ stripe_mix[None, :])  # (rows, stripes)
        source = (bucket - (keys & (k - 1))[:, :, None]) & (k - 1)  # the element landing in bucket j
        landed = buf.gather(2, source)
        word = torch.stack([mix32(keys ^ (((w + 1) * WORD_MULT) & M32)) for w in range(words)], dim=-1)
        negative = ((word[..., None] >> shifts) & 1).view(r1 - r0, stripes, k)  # bucket j: bit j % 32 of word j // 32
        signed = (landed.view(bits) ^ (negative.to(bits) * sign_bit)).view(acc)  # 0 or the sign bit: no overflow
        values[r0:r1] = pairwise_sum(signed, 1)
        sumsq[r0:r1] = pairwise_sum(pairwise_sum(buf * buf, 1), 1)
    return RowSketch(values, sumsq)


def _groups(rs: RowSketch, spec: SketchSpec, row_mask: torch.Tensor | None, support: torch.Tensor | None,
            out_dtype: torch.dtype, sumsq: bool = True, counts: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row sketches to per-group ones: (values (G, k) in `out_dtype`, sum of squares (G,),
    counted rows (G,)). Golden and candidate both come through here: same input, same bits. Without
    `sumsq` (a candidate, whose group sums of squares nothing reads) that part is None and not computed.
    `counts`: the counted rows per group when the caller has them (they depend on the spec, the mask and
    the support only, not on the values: a check's reducer reuses them across tensors)."""
    values, sq = rs.values, rs.sumsq if sumsq else None
    device = values.device
    if support is not None:
        values = values.index_select(0, support)
        sq = sq.index_select(0, support) if sq is not None else None
        rows = None if counts is not None else torch.ones(support.shape[0], dtype=torch.int64, device=device)
    elif row_mask is not None:
        keep = row_mask.reshape(-1)
        if keep.device != device or keep.dtype != torch.bool:
            keep = keep.to(device=device, dtype=torch.bool, non_blocking=True)
        zero = torch.zeros((), dtype=values.dtype, device=device)
        values = torch.where(keep[:, None], values, zero)
        if sq is not None:
            sq = torch.where(keep, sq, zero if sq.dtype == values.dtype else torch.zeros((), dtype=sq.dtype,
                                                                                          device=device))
        rows = None if counts is not None else keep.to(torch.int64)
    else:
        rows = None if counts is not None else torch.ones(values.shape[0], dtype=torch.int64, device=device)
    m = spec.group
    pad = spec.groups * m - values.shape[0]
    if m == 1 and not pad:  # one row a group (most tensors): the pairwise sum of one row is that row
        return values if values.dtype == out_dtype else values.to(out_dtype), sq, counts if counts is not None else rows
    if pad:
        values = F.pad(values, (0, 0, 0, pad))
        sq = F.pad(sq, (0, pad)) if sq is not None else None
        rows = F.pad(rows, (0, pad)) if rows is not None else None
    grouped = pairwise_sum(values.view(spec.groups, m, spec.width), 1).to(out_dtype)
    grouped_sq = pairwise_sum(sq.view(spec.groups, m), 1) if sq is not None else None
    return grouped, grouped_sq, counts if counts is not None else rows.view(spec.groups, m).sum(1)


# --- what a golden stores ----------------------------------------------------------------------------


def _check_shape(x: torch.Tensor, spec: SketchSpec, name: str) -> None:
    if tuple(x.shape) != spec.shape:
        raise VeosnapError(f"{name}: shape {list(x.shape)} but the sketch spec says {list(spec.shape)}")


def _check_mask(row_mask: torch.Tensor | None, spec: SketchSpec, name: str) -> None:
    if row_mask is not None and row_mask.numel() != spec.rows:
        raise VeosnapError(f"{name}: row mask has {row_mask.numel()} entries for {spec.rows} rows")


def record_sketch(x: torch.Tensor, spec: SketchSpec, *, row_mask: torch.Tensor | None = None,
                  support_limit: int | None = None, name: str = "tensor", impl: str = "auto") -> GoldenSketch:
    """Sketch a golden tensor on its device; returns the (small) record on the CPU.

    `row_mask` (token tensors): rows left out of the metric (padding) are left out of every group.
    `support_limit`: the planner's bound on the non-zero rows (an embedding gradient's support); if
    the golden has at most that many non-zero rows, only they are sketched (the spec records how
    many); if it has more, all rows are sketched with groups widened to fit the planned bytes.
    """
    _check_shape(x, spec, name)
    rs = rowsketch(as_rows(x.detach()), spec.width, spec.seed, impl=impl)
    return golden_from_rows(rs, spec, row_mask=row_mask, support_limit=support_limit, name=name, dtype=x.dtype)


def golden_from_rows(rs: RowSketch, spec: SketchSpec, *, dtype: torch.dtype, row_mask: torch.Tensor | None = None,
                     support_limit: int | None = None, name: str = "tensor") -> GoldenSketch:
    """`record_sketch` from the tensor's per-row sketches (every row of `spec.shape`, in order), as
    capture hooks and sharded layouts produce them; `dtype` is the tensor's own."""
    _check_rows(rs, spec, name)
    _check_mask(row_mask, spec, name)
    if not bool(torch.isfinite(rs.sumsq).all()) or not bool(torch.isfinite(rs.values).all()):
        raise VeosnapError(f"{name}: the golden has non-finite values (NaN/Inf); a golden must be finite")
    support = None
    if spec.support is not None or support_limit is not None:
        if row_mask is not None:
            raise VeosnapError(f"{name}: a support (non-zero rows only) and a row mask cannot be combined")
        nonzero = (rs.sumsq != 0).nonzero().flatten()
        if spec.support is not None:  # recomputing a recorded sketch: the support must be the same
            if nonzero.numel() != spec.support:
                raise VeosnapError(f"{name}: {nonzero.numel()} non-zero rows but the spec's support has {spec.support}")
            support = nonzero
        elif nonzero.numel() <= support_limit and nonzero.numel() < spec.rows:
            support = nonzero
            spec = replace(spec, support=int(nonzero.numel()))
        elif spec.rows > support_limit:  # denser than planned: wider groups keep the planned bytes
            spec = replace(spec, group=spec.group * -(-spec.rows // max(1, support_limit)))
    values, sq, counts = _groups(rs, spec, row_mask, support, storage_dtype(dtype))
    counted = int(counts.sum())
    total = float(pairwise_sum(sq.double(), 0)) if sq.numel() else 0.0
    tau = math.sqrt(total / counted) if counted else 0.0
    return GoldenSketch(spec=spec, values=values.cpu(), norms=sq.sqrt().to(values.dtype).cpu(),
                        support=None if support is None else support.cpu(), tau=tau, rows_counted=counted,
                        dtype=str(dtype).removeprefix("torch."))


def _check_rows(rs: RowSketch, spec: SketchSpec, name: str) -> None:
    if tuple(rs.values.shape) != (spec.rows, spec.width):
        raise VeosnapError(f"{name}: {rs.values.shape[0]} row sketches of width {rs.values.shape[-1]} but the sketch "
                           f"spec says {spec.rows} rows of width {spec.width}")


def rowsketch_at(x2d: torch.Tensor, width: int, seed: int, positions: torch.Tensor | None = None,
                 impl: str = "auto") -> RowSketch:
    """Per-row sketches of `x2d` whose row i is row `positions[i]` of a larger tensor (a layout's shard
    of a batch: a slice of positions, rows of a micro-batch, packed sequences). The hash uses the
    global index, so these are exactly those rows' sketches in the whole tensor. `positions` (CPU
    int64) is cut into runs of consecutive indices, one kernel call each; None: rows 0, 1, ...
    """
    if positions is None:
        return rowsketch(x2d, width, seed, impl=impl)
    positions = positions.reshape(-1).cpu()
    if positions.numel() != x2d.shape[0]:
        raise VeosnapError(f"rowsketch_at: {positions.numel()} positions for {x2d.shape[0]} rows")
    if positions.numel() == 0:
        return rowsketch(x2d, width, seed, impl=impl)
    breaks = ((positions[1:] - positions[:-1]) != 1).nonzero().flatten().add(1).tolist()
    starts, stops = [0, *breaks], [*breaks, positions.numel()]
    if len(starts) == 1:
        return rowsketch(x2d, width, seed, row_offset=int(positions[0]), impl=impl)
    parts = [rowsketch(x2d[a:b], width, seed, row_offset=int(positions[a]), impl=impl) for a, b in zip(starts, stops)]
    return RowSketch(torch.cat([p.values for p in parts]), torch.cat([p.sumsq for p in parts]))


def scatter_rows(parts: Sequence[tuple[RowSketch, torch.Tensor]], rows: int) -> RowSketch:
    """Per-row sketches of a whole tensor of `rows` rows from parts that cover some of its rows (each
    with the global row index of each of its rows); rows no part covers are zero (padding)."""
    first = parts[0][0]
    if len(parts) == 1 and _in_order(parts[0][1], rows):  # one pass over the whole batch: nothing to move
        return first
    values = torch.zeros((rows, first.values.shape[1]), dtype=first.values.dtype, device=first.values.device)
    sumsq = torch.zeros((rows,), dtype=first.sumsq.dtype, device=first.sumsq.device)
    for part, positions in parts:
        index = positions.reshape(-1).to(values.device)
        values[index] = part.values.to(values.device)
        sumsq[index] = part.sumsq.to(values.device)
    return RowSketch(values, sumsq)


def _in_order(positions: torch.Tensor | None, rows: int) -> bool:
    """Whether `positions` (on the host) are 0, 1, ..., rows - 1: each row at its own place."""
    if positions is None:
        return False
    flat = positions.reshape(-1)
    return flat.device.type == "cpu" and flat.numel() == rows and bool(torch.equal(flat, torch.arange(rows)))


def zero_rows(spec: SketchSpec, dtype: torch.dtype, device: torch.device | str = "cpu") -> RowSketch:
    """The per-row sketches of an all-zero tensor of `spec.shape` (a parameter without a gradient)."""
    acc = accumulation_dtype(dtype)
    return RowSketch(torch.zeros((spec.rows, spec.width), dtype=acc, device=device),
                     torch.zeros((spec.rows,), dtype=acc, device=device))


def group_counts(spec: SketchSpec, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Rows counted per group (what `CandidateSketch.counts` holds for a candidate reduced with `spec`)."""
    if spec.support is not None or row_mask is None:
        counts = torch.ones(spec.sketched_rows, dtype=torch.int64)
    else:
        counts = row_mask.reshape(-1).to(torch.int64).cpu()
    pad = spec.groups * spec.group - counts.numel()
    return F.pad(counts, (0, pad)).view(spec.groups, spec.group).sum(1)


# --- a candidate, and the comparison -----------------------------------------------------------------


@dataclass(frozen=True)
class CandidateSketch:
    """A candidate tensor reduced on its device the way its golden was. Nothing here has been read on
    the host: `nonfinite_rows` and `first_nonfinite_row` wait for the device (`compare_sketches` reads
    them with every other figure in one transfer)."""

    values: torch.Tensor  # (groups, width)
    counts: torch.Tensor  # (groups,) rows counted per group
    off_support: torch.Tensor | None  # (rows,) exact norms of rows outside the golden's support (0 inside)
    nonfinite: torch.Tensor | None = None  # (rows,) bool: rows with a NaN/Inf (padding too); None: none
    golden: torch.Tensor | None = None  # the golden's sketch values on this device, float64, when a check put
    # them there early (the comparison then copies nothing); None: they are copied when compared
    norms: torch.Tensor | None = None  # (groups,) float64 |candidate - golden| per group, taken with `golden`
    # as soon as the sketch was made (launched while the device still runs the step), or None

    @property
    def nonfinite_rows(self) -> int:
        return 0 if self.nonfinite is None else int(self.nonfinite.sum())

    @property
    def first_nonfinite_row(self) -> int:
        return int(_first_true(self.nonfinite)) if self.nonfinite_rows else -1


def with_golden(sketch: CandidateSketch, golden: torch.Tensor) -> CandidateSketch:
    """`sketch` carrying its golden's values (float64, on its device) and its group distances from them,
    as `compare_sketch` takes them (the same operations on the same shapes: the same bits)."""
    if tuple(golden.shape) != tuple(sketch.values.shape):
        return sketch  # compared (and refused) as a shape mismatch, as before
    return replace(sketch, golden=golden, norms=(sketch.values.double() - golden).norm(dim=-1))


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """The index of the first True along the last dimension of a non-empty bool tensor (0 when none), on
    its device."""
    return mask.to(torch.int32).argmax(-1)  # argmax gives the first of equal maxima


def sketch_candidate(x: torch.Tensor, golden: GoldenSketch, *, row_mask: torch.Tensor | None = None,
                     name: str = "tensor", impl: str = "auto") -> CandidateSketch:
    """Reduce a candidate tensor (or the float64 noise run) with its golden's spec, on its device."""
    _check_shape(x, golden.spec, name)
    rs = rowsketch(as_rows(x.detach()), golden.spec.width, golden.spec.seed, impl=impl)
    return candidate_from_rows(rs, golden, row_mask=row_mask, name=name, dtype=x.dtype)


def _nonfinite_rows(rs: RowSketch) -> torch.Tensor:
    """[rows] bool: the rows with a NaN/Inf in their sketch or sum of squares. `x * 0` is 0 (or -0) for a
    finite x and NaN otherwise, and sums of zeros stay zero: the same flags as `isfinite` (a composite of
    four kernels on CUDA, ~0.15 ms of host time a call there) from three reductions' worth of launches."""
    return (rs.values * 0).sum(dim=1).add_(rs.sumsq * 0) != 0


def candidate_from_rows(rs: RowSketch, golden: GoldenSketch, *, dtype: torch.dtype,
                        row_mask: torch.Tensor | None = None, name: str = "tensor",
                        counts: torch.Tensor | None = None) -> CandidateSketch:
    """`sketch_candidate` from the tensor's per-row sketches (every row, in order); `dtype` is the
    tensor's own. Stays on the sketches' device. `counts`: the rows counted per group, when known (the
    `counts` of an earlier candidate of the same spec, mask and support: they do not depend on values)."""
    spec = golden.spec
    _check_rows(rs, spec, name)
    _check_mask(row_mask, spec, name)
    # Non-finite values anywhere fail, padding included, as they do for a whole tensor.
    # Counted on the host only when compared (one transfer for every tensor): no sync here.
    bad = _nonfinite_rows(rs)
    support = golden.support
    if support is not None and support.device != rs.values.device:
        support = support.to(rs.values.device)
    values, _, counts = _groups(rs, spec, row_mask, support, storage_dtype(dtype), sumsq=False, counts=counts)
    off = None
    if support is not None:
        off = rs.sumsq.index_fill(0, support, 0).clamp(min=0).sqrt()
    return CandidateSketch(values=values, counts=counts, off_support=off, nonfinite=bad)


@dataclass(frozen=True)
class SketchProblem:
    """Why a candidate's tensor could not be reduced with its golden's spec (another shape or dtype):
    the check reports it as the tensor's problem, as it does for a whole tensor."""

    problem: str


@dataclass(frozen=True)
class SketchError:
    """The row-error verdict from a sketch: the (estimated) largest group error and where it is."""

    error: float  # the largest group error (or off-support row error), like RowError.error
    group: int  # the worst group's index; -1 when the worst is an off-support row (exact)
    first_row: int  # original row range of the worst group (its first and last rows)
    last_row: int
    group_rows: int  # rows counted in the worst group
    rows_over: int  # groups, and off-support rows, whose error exceeds the bound
    groups: int  # groups compared (with a counted row), plus off-support rows
    rows: int  # rows compared
    estimate: bool  # True: the worst figure is an estimate from a sketch (False: exact, e.g. rows no wider than it)
    width: int
    group_size: int
    nonfinite_rows: int = 0
    first_nonfinite_row: int = -1


def compare_sketch(golden: GoldenSketch, candidate: torch.Tensor | CandidateSketch, *, bound: float = float("inf"),
                   row_mask: torch.Tensor | None = None, name: str = "tensor", impl: str = "auto") -> SketchError:
    """The estimated row error of `candidate` against `golden`, on the candidate's device.

    `candidate` is a tensor (sketched here with the golden's spec and `row_mask`) or its sketch.
    Only scalars leave the device.
    """
    if isinstance(candidate, torch.Tensor):
        candidate = sketch_candidate(candidate, golden, row_mask=row_mask, name=name, impl=impl)
    spec = golden.spec
    if tuple(candidate.values.shape) != tuple(golden.values.shape):
        raise VeosnapError(f"{name}: candidate sketch {list(candidate.values.shape)} but golden {list(golden.values.shape)}")
    common = {"width": spec.width, "group_size": spec.group}
    if candidate.nonfinite_rows:
        row = candidate.first_nonfinite_row
        return SketchError(float("inf"), -1, row, row, 1, candidate.nonfinite_rows, spec.groups, spec.rows, False,
                           nonfinite_rows=candidate.nonfinite_rows, first_nonfinite_row=row, **common)
    counted = int(candidate.counts.sum())
    if counted != golden.rows_counted:
        raise VeosnapError(f"{name}: {counted} rows counted but the golden counted {golden.rows_counted} "
                           "(another row mask than the golden's)")
    device = candidate.values.device
    scale = golden.tau if golden.tau > 0 else 1.0  # an all-zero golden: absolute error, as the exact metric
    diff = candidate.values.double() - golden.values.to(device).double()
    counts = candidate.counts
    errors = diff.norm(dim=1) / (counts.clamp(min=1).double().sqrt() * scale)
    errors = torch.where(counts > 0, errors, torch.zeros((), dtype=errors.dtype, device=device))
    compared = int((counts > 0).sum())
    worst = int(errors.argmax()) if errors.numel() else 0
    error = float(errors[worst]) if errors.numel() else 0.0
    over = int((errors > bound).sum())
    first, last = _group_rows(golden, worst)
    # One row per group no wider than the sketch: a signed permutation of the row, so the error is exact.
    estimate = not (spec.group == 1 and spec.columns <= spec.width)
    result = SketchError(error, worst, first, last, int(counts[worst]) if errors.numel() else 0, over, compared,
                         counted, estimate, **common)
    if candidate.off_support is None:
        return result
    off = candidate.off_support.double() / scale
    outside = spec.rows - spec.sketched_rows
    row = int(off.argmax())
    off_error = float(off[row])
    over += int((off > bound).sum())
    fields = {"rows_over": over, "groups": compared + outside, "rows": counted + outside}
    if off_error > error:
        return replace(result, error=off_error, group=-1, first_row=row, last_row=row, group_rows=1, estimate=False, **fields)
    return replace(result, **fields)


def compare_sketches(pairs: Sequence[tuple[GoldenSketch, CandidateSketch, float, str]]) -> list[SketchError]:
    """`compare_sketch` of many tensors at once, (golden, candidate sketch, bound, name) each: the same
    numbers (the same float64 operations, element by element), from one batched pass per sketch shape
    and ONE transfer to the host at the end, instead of several kernel launches and host syncs per
    tensor. A check compares tens of sketched tensors: on a GPU their syncs, not their arithmetic, were
    the cost."""
    return compare_sketches_later(pairs).read()


def compare_sketches_later(pairs: Sequence[tuple[GoldenSketch, CandidateSketch, float, str]]
                           ) -> Later[list[SketchError]]:
    """`compare_sketches`, its figures left on the device until read (`readback.read_together`: a check reads
    them with its whole tensors' in one transfer)."""
    for golden, candidate, _, name in pairs:
        if tuple(candidate.values.shape) != tuple(golden.values.shape):
            raise VeosnapError(f"{name}: candidate sketch {list(candidate.values.shape)} but golden "
                               f"{list(golden.values.shape)}")
    on: dict[torch.device, list[int]] = {}
    for i, (_, candidate, _, _) in enumerate(pairs):
        on.setdefault(candidate.values.device, []).append(i)
    groups, figures = list(on.values()), []
    for device, members in on.items():
        mine = [pairs[i] for i in members]
        # The golden's side goes to the device in one copy per dtype (a blocking copy waits for the device).
        early = {j: c.golden for j, (_, c, _, _) in enumerate(mine)
                 if c.golden is not None and c.golden.device == device}
        golds = {**early, **_to_device({j: golden.values for j, (golden, _, _, _) in enumerate(mine) if j not in early},
                                       device)}
        figures.append(_figures(mine, golds, device))

    def finish(read: list[list[float]]) -> list[SketchError]:
        host: list[list[float]] = [[]] * len(pairs)
        for members, flat in zip(groups, read):
            for k, i in enumerate(members):
                host[i] = flat[FIGURES * k:FIGURES * (k + 1)]
        return [_sketch_error(golden, candidate, bound, name, row)
                for (golden, candidate, bound, name), row in zip(pairs, host)]

    return Later(figures, finish)


# Per tensor, the figures the host needs, as float64 (integers below 2**53 are exact): error, worst group, groups
# over the bound, groups compared, rows in the worst group, rows counted, non-finite rows, first non-finite row,
# worst off-support error, its row, off-support rows over.
FIGURES = 11


def _to_device(tensors: dict, device: torch.device) -> dict:
    """`tensors` on `device` as float64, copied as one flat tensor per dtype (those already there stay as they
    are)."""
    out = {key: t for key, t in tensors.items() if t.device == device}
    for dtype in dict.fromkeys(t.dtype for key, t in tensors.items() if key not in out):
        keys = [key for key, t in tensors.items() if t.dtype == dtype and key not in out]
        flat = torch.cat([tensors[key].reshape(-1) for key in keys]).to(device, non_blocking=True).double()
        for key, part in zip(keys, flat.split([tensors[key].numel() for key in keys])):
            out[key] = part.view(tensors[key].shape)
    return out


def _segments(sizes: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For tensors of `sizes` elements laid end to end: each element's tensor, and each tensor's first and
    one-past-last element (on `device`, made on the host and copied in one go: no sync)."""
    n = len(sizes)
    counts = torch.tensor(sizes, dtype=torch.long)
    ends = counts.cumsum(0)
    packed = torch.cat([ends - counts, ends]).to(device, non_blocking=True)
    # Each element's tensor is made where it is used (a tensor per group: on the host it cost milliseconds
    # of fresh memory at 1B parameters), from the ends alone: no sync for its length.
    return segment_ids(packed[n:], sum(sizes)), packed[:n], packed[n:]


def _per_tensor_sum(values: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Float64 sums of 0/1 or integer `values` per tensor laid end to end: exact (integers below 2**53),
    and from a scan, not atomics (the same on every run). One dimension only: on CUDA a cumsum along the first
    of two dimensions scans each column on one thread (three columns of qwen3_moe-1b's groups: 7.6 ms on an
    H100, round 16), where a one-dimensional one takes microseconds."""
    running = torch.cat([torch.zeros(1, dtype=torch.float64, device=values.device), values.to(torch.float64).cumsum(0)])
    return running[ends] - running[starts]


def _argmax_per_tensor(key: torch.Tensor, seg: torch.Tensor, starts: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Each tensor's `argmax` of `key` (laid end to end), as an index into its own elements: `key` padded
    to one row per tensor and reduced with `argmax` itself (the largest, the first of equal ones, NaN
    first, as for each tensor alone); 0 for a tensor without elements. No atomics: allowed, and the same,
    under torch's deterministic mode."""
    n, longest = len(sizes), max(sizes, default=0)
    padded = torch.full((n, max(longest, 1)), float("-inf"), dtype=key.dtype, device=key.device)
    padded[seg, torch.arange(key.numel(), device=key.device) - starts[seg]] = key
    return padded.argmax(dim=1)


def _first_true_per_tensor(mask: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Each tensor's first True (laid end to end), as an index into its own elements; 0 for none (as
    `_first_true`): the count of its elements before its first True, from an integer scan."""
    running = torch.cat([torch.zeros(1, dtype=torch.long, device=mask.device), mask.long().cumsum(0)])
    before = running[1:] - running[starts][segment_ids(ends, mask.numel())]
    leading = _per_tensor_sum(before == 0, starts, ends)
    return torch.where(_per_tensor_sum(mask, starts, ends) > 0, leading, torch.zeros_like(leading))


def _figures(pairs: Sequence[tuple[GoldenSketch, CandidateSketch, float, str]], golds: dict[int, torch.Tensor],
             device: torch.device) -> torch.Tensor:
    """`compare_sketches`' figures (n, 11) of tensors on one device, in one pass (no sync): each tensor's
    groups laid end to end; `golds` their golden sketches on that device."""
    n = len(pairs)
    f64 = torch.float64
    sizes = [int(g.values.shape[0]) for g, _, _, _ in pairs]
    zeros = torch.zeros(n, dtype=f64, device=device)
    # Host-made tensors go over without waiting for the device (a blocking copy would sync the stream).
    params = torch.tensor([[g.tau if g.tau > 0 else 1.0, bound] for g, _, bound, _ in pairs],
                          dtype=f64).to(device, non_blocking=True)
    columns = [zeros] * 5 + [zeros]
    counts = torch.cat([c.counts.to(device, non_blocking=True) for _, c, _, _ in pairs])
    if counts.numel():
        seg, starts, ends = _segments(sizes, device)
        scale, bound = params[:, 0][seg], params[:, 1][seg]
        # As compare_sketch: the float64 difference, its row norms, over sqrt(rows) * tau. The norms are
        # taken tensor by tensor, on tensors shaped as compare_sketch's: a reduction's order depends on
        # its shape (on CUDA, on how many rows it reduces at once), and these must be its bits.
        norms = torch.cat([c.norms if c.norms is not None and c.golden is golds[j] else
                           (c.values.double() - golds[j].double()).norm(dim=-1)
                           for j, (_, c, _, _) in enumerate(pairs)])
        errors = norms / (counts.clamp(min=1).double().sqrt() * scale)
        errors = torch.where(counts > 0, errors, torch.zeros((), dtype=errors.dtype, device=device))
        worst = _argmax_per_tensor(errors, seg, starts, sizes)
        at = (starts + worst).clamp(max=counts.numel() - 1)
        empty = torch.tensor([size == 0 for size in sizes]).to(device, non_blocking=True)
        keep = lambda t: torch.where(empty, zeros, t.to(f64))  # noqa: E731 - a tensor without groups: zeros
        columns = [keep(errors[at]), keep(worst), _per_tensor_sum(errors > bound, starts, ends),
                   _per_tensor_sum(counts > 0, starts, ends), keep(counts[at]), _per_tensor_sum(counts, starts, ends)]
    masks = [c.nonfinite for _, c, _, _ in pairs]
    present = [m is not None and m.numel() > 0 for m in masks]
    if any(present):
        bad = torch.cat([m.to(device, non_blocking=True).reshape(-1) for m, p in zip(masks, present) if p])
        rows = [m.numel() if p else 0 for m, p in zip(masks, present)]
        _, starts, ends = _segments(rows, device)
        first = _first_true_per_tensor(bad, starts, ends)
        none = torch.tensor([not p for p in present]).to(device, non_blocking=True)
        columns += [_per_tensor_sum(bad, starts, ends), torch.where(none, zeros - 1, first.to(f64))]
    else:
        columns += [zeros, zeros - 1]
    off_columns = [[zeros[0]] * n for _ in range(3)]
    for j, (_, candidate, _, _) in enumerate(pairs):
        if candidate.off_support is not None and candidate.off_support.numel():
            off = candidate.off_support.double() / params[j, 0]
            row = off.argmax()
            over = (off > params[j, 1]).sum().to(f64)
            # gather, not off[row]: indexing by a 0-d device tensor reads it on the host (a sync)
            off_columns[0][j], off_columns[1][j], off_columns[2][j] = off.gather(0, row.reshape(1))[0], row.to(f64), over
    columns += [torch.stack(c) for c in off_columns]
    return torch.stack(columns, dim=1)


def _sketch_error(golden: GoldenSketch, candidate: CandidateSketch, bound: float, name: str,
                  row: list[float]) -> SketchError:
    """compare_sketch's result from `compare_sketches`' figures of one tensor."""
    error, worst, over, compared, worst_rows, counted, nonfinite, first_bad, off_error, off_row, off_over = row
    worst, over, compared, counted, nonfinite = int(worst), int(over), int(compared), int(counted), int(nonfinite)
    spec = golden.spec
    common = {"width": spec.width, "group_size": spec.group}
    if nonfinite:
        first = int(first_bad)
        return SketchError(float("inf"), -1, first, first, 1, nonfinite, spec.groups, spec.rows, False,
                           nonfinite_rows=nonfinite, first_nonfinite_row=first, **common)
    if counted != golden.rows_counted:
        raise VeosnapError(f"{name}: {counted} rows counted but the golden counted {golden.rows_counted} "
                           "(another row mask than the golden's)")
    if not spec.groups:
        worst, error, worst_rows = 0, 0.0, 0
    first, last = _group_rows(golden, worst)
    estimate = not (spec.group == 1 and spec.columns <= spec.width)
    result = SketchError(error, worst, first, last, int(worst_rows), over, compared, counted, estimate, **common)
    if candidate.off_support is None:
        return result
    outside = spec.rows - spec.sketched_rows
    over += int(off_over)
    fields = {"rows_over": over, "groups": compared + outside, "rows": counted + outside}
    if off_error > error:
        row_ = int(off_row)
        return replace(result, error=off_error, group=-1, first_row=row_, last_row=row_, group_rows=1, estimate=False,
                       **fields)
    return replace(result, **fields)


def _group_rows(golden: GoldenSketch, group: int) -> tuple[int, int]:
    """The first and last original rows of `group`."""
    spec = golden.spec
    start, stop = group * spec.group, min((group + 1) * spec.group, spec.sketched_rows)
    if stop <= start:
        return 0, 0
    if golden.support is not None:
        return int(golden.support[start]), int(golden.support[stop - 1])
    return start, stop - 1


def compare_golden_sketches(old: GoldenSketch, new: GoldenSketch, *, row_mask: torch.Tensor | None = None,
                            name: str = "tensor") -> SketchError | None:
    """How far `new` moved from `old`, both golden sketches of one tensor with the same spec and support:
    the estimated row error in `old`'s units (what a check of `new` against `old` would say). None when
    their specs or supports differ (re-sketched: not comparable)."""
    if new.spec != old.spec or (old.support is not None and not torch.equal(old.support, new.support)):
        return None
    counts = group_counts(old.spec, row_mask)
    candidate = CandidateSketch(values=new.values, counts=counts, off_support=None)
    return compare_sketch(old, candidate, name=name)


def sketch_noise(golden: GoldenSketch, high_precision: torch.Tensor, *, row_mask: torch.Tensor | None = None,
                 name: str = "tensor") -> SketchError:
    """The reference's own noise in the currency of the check: its sketch against the float64 run's,
    reduced with the same spec (the sketch is linear, so this is the sketch of their difference)."""
    return compare_sketch(golden, high_precision, row_mask=row_mask, name=name)


# --- the planner -------------------------------------------------------------------------------------

# (width, group) from the finest to the coarsest; each step about halves a tensor's bytes. Width 64
# estimates a row's error within about 9% (1/sqrt(2k)); groups grow to 64 rows at width 32 before the
# width drops to 16, and never below (docs/sketch.md has the measurements behind these).
LADDER: tuple[tuple[int, int], ...] = (
    (64, 1), (32, 1), (32, 2), (32, 4), (32, 8), (32, 16), (32, 32), (32, 64),
    (16, 64), (16, 128), (16, 256), (16, 512), (16, 1024),
)
# A tensor's bound is alpha x a maximum over its groups; over a handful of groups that maximum is a
# poor estimate of the noise (tolerance.MIN_SAMPLED_ROWS says the same of rows), so groups are
# narrowed until a tensor has at least this many (a tensor with fewer rows keeps one row per group).
MIN_GROUPS = 32
STORED_TENSOR_OVERHEAD = 160  # bytes per stored tensor: safetensors header entry and manifest JSON
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4}


@dataclass(frozen=True)
class TensorShape:
    """What the planner knows of a golden tensor before it exists."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # float32, bfloat16, ...
    support_rows: int | None = None  # a structural bound on non-zero rows (embedding gradient: tokens)
    sketchable: bool = True  # False: always whole (the loss, routes)

    @property
    def exact_bytes(self) -> int:
        if self.dtype not in _ITEMSIZE:
            raise VeosnapError(f"{self.name}: unknown dtype {self.dtype!r} for a golden tensor")
        return math.prod(self.shape) * _ITEMSIZE[self.dtype] + STORED_TENSOR_OVERHEAD

    @property
    def sketched_rows(self) -> int:
        rows, _ = row_layout(self.shape)
        return rows if self.support_rows is None else min(rows, self.support_rows)

    def sketch_bytes(self, width: int, group: int) -> int:
        sketched = self.sketched_rows
        groups = -(-sketched // clamp_group(group, sketched))
        support = 0 if self.support_rows is None else sketched * 8 + STORED_TENSOR_OVERHEAD
        return groups * (width + 1) * 4 + 2 * STORED_TENSOR_OVERHEAD + support


@dataclass(frozen=True)
class Choice:
    """One tensor's form in a golden: whole (`spec` None) or sketched with `spec`."""

    name: str
    spec: SketchSpec | None
    nbytes: int  # planned bytes (a support may make the real ones smaller, never larger)
    support_limit: int | None = None  # pass to record_sketch

    @property
    def exact(self) -> bool:
        return self.spec is None


@dataclass(frozen=True)
class Plan:
    """Every tensor's form, and the budget it was chosen for (recorded in the manifest)."""

    mode: str
    budget: int
    hard_limit: int
    fixed_bytes: int
    choices: tuple[Choice, ...]

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + sum(c.nbytes for c in self.choices)

    def choice(self, name: str) -> Choice:
        for c in self.choices:
            if c.name == name:
                return c
        raise KeyError(name)

    @property
    def sketched(self) -> dict[str, SketchSpec]:
        return {c.name: c.spec for c in self.choices if c.spec is not None}

    def to_dict(self) -> dict:
        return {"mode": self.mode, "budget": self.budget, "hard_limit": self.hard_limit,
                "planned_bytes": self.total_bytes, "sketched": sorted(self.sketched)}


def plan(tensors: Iterable[TensorShape], *, mode: str = "auto", budget: int = TARGET_BYTES,
         hard_limit: int = HARD_LIMIT, fixed_bytes: int = 0, seed: int = 0,
         ladder: Sequence[tuple[int, int]] = LADDER) -> Plan:
    """Choose each tensor's form so the golden fits `budget` bytes, localising as finely as it allows.

    `auto`: everything whole if it fits; otherwise the largest tensor (by its current bytes) is
    sketched or coarsened one ladder step at a time until the total fits, so small tensors stay whole
    and every sketched tensor ends with about the same bytes (the same number of groups).
    `always`: every sketchable tensor sketched (tests; the "no loss of power" experiment), starting
    at the ladder's first step. `never`: everything whole. The result is a function of the inputs
    only. A golden that cannot fit `hard_limit` is refused with the limit and what to do.
    """
    if mode not in MODES:
        raise VeosnapError(f"unknown sketch mode {mode!r} (auto, always, never)")
    if not ladder or any(w not in WIDTHS or g < 1 for w, g in ladder):
        raise VeosnapError(f"sketch ladder {list(ladder)} must list (power-of-two width, group >= 1) pairs")
    shapes = sorted(tensors, key=lambda t: t.name)
    if len({t.name for t in shapes}) != len(shapes):
        raise VeosnapError("sketch plan: a tensor name appears twice")
    level = {t.name: (0 if mode == "always" and _sketchable(t) else -1) for t in shapes}

    def nbytes(t: TensorShape, at: int) -> int:
        return t.exact_bytes if at < 0 else t.sketch_bytes(*ladder[at])

    def next_level(t: TensorShape) -> int | None:
        if mode == "never" or not _sketchable(t):
            return None
        current = nbytes(t, level[t.name])
        return next((at for at in range(level[t.name] + 1, len(ladder)) if nbytes(t, at) < current), None)

    total = fixed_bytes + sum(nbytes(t, level[t.name]) for t in shapes)
    largest = [(-nbytes(t, level[t.name]), t.name, t) for t in shapes if next_level(t) is not None]
    heapq.heapify(largest)  # the largest tensor first; ties by name
    while total > budget and largest:
        before, _, t = heapq.heappop(largest)
        level[t.name] = next_level(t)
        total += nbytes(t, level[t.name]) + before
        if next_level(t) is not None:
            heapq.heappush(largest, (-nbytes(t, level[t.name]), t.name, t))
    if total > hard_limit:
        coarsest = "whole" if mode == "never" else f"width {ladder[-1][0]}, groups of {ladder[-1][1]} rows"
        fix = "use --sketch auto" if mode == "never" else "record fewer tokens or layers"
        raise VeosnapError(f"golden would hold {total} bytes, over the {hard_limit} byte limit ({coarsest}); {fix}")
    choices = []
    for t in shapes:
        at = level[t.name]
        if at < 0:
            choices.append(Choice(t.name, None, t.exact_bytes))
            continue
        width, group = ladder[at]
        spec = SketchSpec(seed=seed_for(t.name, seed), width=width, group=clamp_group(group, t.sketched_rows),
                          shape=t.shape)
        choices.append(Choice(t.name, spec, nbytes(t, at), t.support_rows))
    return Plan(mode=mode, budget=budget, hard_limit=hard_limit, fixed_bytes=fixed_bytes, choices=tuple(choices))


def clamp_group(group: int, rows: int) -> int:
    """`group`, narrowed so `rows` make at least MIN_GROUPS groups (never below one row)."""
    return max(1, min(group, rows // MIN_GROUPS))


def _sketchable(t: TensorShape) -> bool:
    return t.sketchable and len(t.shape) >= 1 and math.prod(t.shape) > 0
