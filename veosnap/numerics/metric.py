"""The error metric, "row error": how far a candidate's tensor is from the golden's.

A tensor is cut into rows (a token's vector for activations and logits, an output row for weight
gradients, one element for 1-D tensors, the value for the loss). Each row's L2 distance from the
golden row is divided by the tensor's typical row norm (the RMS of the golden's row norms); the
tensor's error is the largest row error. A bug confined to one token, one row or one parameter
therefore shows at full size instead of being averaged away by a tensor-wide norm, while rows whose
values are small by nature don't inflate the error. Token tensors (see `golden.names`) are compared
on the batch's real tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..golden import names
from .readback import Later
from .segments import narrow_ids, segment_ids

WORST_ROWS = 5  # rows a comparison keeps for reports, besides its count of rows over the bound


def is_token_tensor(name: str) -> bool:
    """Tensors with one row per token of the batch (compared on real tokens only)."""
    parsed = names.try_parse(name)
    return parsed is not None and parsed.token_rows


def rows_of(name: str, tensor: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` as float64 rows, and the original row index of each (token tensors: real tokens only)."""
    rows, masked = _layout(name, tensor.detach().to("cpu", torch.float64), token_mask)
    index = torch.arange(rows.shape[0])
    return (rows[token_mask], index[token_mask]) if masked else (rows, index)


@dataclass(frozen=True)
class RowError:
    """The worst row of a comparison: its error, where it is, and its worst element."""

    error: float  # largest row error (row distance / typical row norm)
    row: int  # original (flattened) row index of the worst row
    column: int  # worst element within that row
    golden_value: float
    candidate_value: float
    rows_over: int  # rows whose error exceeds the bound given
    rows: int
    worst_rows: tuple[tuple[int, float], ...] = ()  # (original row index, row error): the WORST_ROWS worst first


def row_error(name: str, candidate: torch.Tensor, golden: torch.Tensor, token_mask: torch.Tensor | None,
              bound: float = float("inf")) -> RowError:
    """The row error of `candidate` against `golden` (see the module doc)."""
    c_rows, index = rows_of(name, candidate, token_mask)
    g_rows, _ = rows_of(name, golden, token_mask)
    diff = c_rows - g_rows
    per_row = diff.norm(dim=1)
    typical = g_rows.norm(dim=1).pow(2).mean().sqrt().item()
    scale = typical if typical > 0 else 1.0  # an all-zero golden: absolute error
    errors = per_row / scale
    errors = torch.where(torch.isfinite(errors), errors, torch.full_like(errors, float("inf")))
    worst = int(errors.argmax()) if errors.numel() else 0
    column = int(diff[worst].abs().nan_to_num(nan=float("inf")).argmax()) if errors.numel() else 0
    # A stable sort, so equal errors keep row order and a report is the same on every run.
    top = errors.sort(descending=True, stable=True).indices[:WORST_ROWS].tolist() if errors.numel() > 1 else []
    return RowError(
        error=float(errors[worst]) if errors.numel() else 0.0,
        row=int(index[worst]) if errors.numel() else 0,
        column=column,
        golden_value=float(g_rows[worst, column]) if errors.numel() else 0.0,
        candidate_value=float(c_rows[worst, column]) if errors.numel() else 0.0,
        rows_over=int((errors > bound).sum()),
        rows=int(errors.numel()),
        worst_rows=tuple((int(index[i]), float(errors[i])) for i in top),
    )


def row_errors(items: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, float]],
               device: torch.device | str | None = None) -> list[RowError]:
    """`row_error` of many tensors at once, (name, candidate, golden, token mask, bound) each: the same
    numbers, to the bit (the same float64 operations on the same rows), from one pass per row width and
    one read of every figure at the end, instead of some fifty small operations per tensor.

    The rows of every tensor of one width are converted to float64 once, into one buffer per side; the
    differences, row norms, errors and the count over each bound are computed for all of them at once.
    What depends on a reduction's length is still taken per tensor on a slice of its own length (the RMS of
    the golden's row norms), so its bits are `row_error`'s.

    `device`: where the arithmetic runs (None: the host, as `row_error`). Tensors elsewhere are copied there
    (a check passes its golden's tensors already there); nothing is read back before the one transfer of all
    figures, so on a GPU the host only launches kernels. On CUDA a float64 reduction may differ from the
    host's in its last bits (a norm's summation order): the figures agree to about 1e-15 relative, not to
    the bit (tests/test_sketched_goldens.py measures it on a GPU)."""
    return row_errors_later(items, device).read()


def row_errors_later(items: Sequence[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, float]],
                     device: torch.device | str | None = None) -> Later[list[RowError]]:
    """`row_errors`, its figures left on the device until read (`readback.read_together`: a check reads them
    with its sketches' in one transfer)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    out: list[RowError | None] = [None] * len(items)
    widths: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, list[int] | None]]] = {}
    picked: dict[int, tuple[torch.Tensor, list[int]]] = {}  # a token mask's rows, on `device` and the host, once
    for i, (name, candidate, golden, token_mask, _) in enumerate(items):
        c_rows, index = _native_rows(name, candidate, token_mask, device, picked)
        g_rows, _ = _native_rows(name, golden, token_mask, device, picked)
        if c_rows.shape[0] == 0:
            out[i] = RowError(0.0, 0, 0, 0.0, 0.0, 0, 0)
            continue
        widths.setdefault(int(c_rows.shape[1]), []).append((i, c_rows, g_rows, index))
    groups = list(widths.values())

    def placed(per_width: list[list[RowError]]) -> list[RowError]:
        for members, errors in zip(groups, per_width):
            for (i, *_), err in zip(members, errors):
                out[i] = err
        return out  # type: ignore[return-value]

    return Later.all([_same_width([(m[1], m[2], m[3], items[m[0]][4]) for m in members]) for members in groups],
                     placed)


def uncompared_rows(name: str, tensor: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """The rows of `tensor` its row error leaves out (a token tensor's padding), in its own dtype."""
    rows, masked = _layout(name, tensor.detach().cpu(), token_mask)
    return rows[~token_mask] if masked else rows[:0]


def _layout(name: str, t: torch.Tensor, token_mask: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """`t` as rows (see `rows_of`), and whether `token_mask` picks its rows (one entry per row)."""
    token = token_mask is not None and is_token_tensor(name)
    if t.ndim == 0:
        rows = t.reshape(1, 1)
    elif t.ndim == 1:
        rows = t.reshape(-1, 1)
    elif token and t.ndim > 2 and t.numel() % token_mask.numel() == 0 and t.shape[0] * t.shape[1] == token_mask.numel():
        rows = t.reshape(token_mask.numel(), -1)
    else:
        rows = t.reshape(-1, t.shape[-1])
    return rows, token and token_mask.numel() == rows.shape[0]


def _native_rows(name: str, tensor: torch.Tensor, token_mask: torch.Tensor | None, device: torch.device,
                 picked: dict[int, tuple[torch.Tensor, list[int]]]) -> tuple[torch.Tensor, list[int] | None]:
    """`rows_of` on `device` without the float64 copy (converting after the rows are chosen gives the same
    values); the original index of each row (on the host) only when they are not 0, 1, ... (None). The
    token mask is read on the host (it is the golden batch's), so choosing rows never waits for a device."""
    t = tensor.detach()
    if t.device != device:
        t = t.to(device, non_blocking=True)
    rows, masked = _layout(name, t, token_mask)
    if not masked:
        return rows, None
    if id(token_mask) not in picked:
        index = token_mask.nonzero()[:, 0]
        # The host's as a list: a report names a few rows of each tensor, and a list is read without a torch
        # call (139 tensor reads were 0.6 ms of the host's work after the read at qwen3_moe-60m).
        picked[id(token_mask)] = (index.to(device, non_blocking=True), index.tolist())
    on_device, index = picked[id(token_mask)]
    return rows.index_select(0, on_device), index


CHUNK = 1 << 18  # float64 values per side converted at a time: 2 MiB, reused (fewer fresh pages than whole copies)
# On a GPU a chunk costs five kernel launches, and the caching allocator hands the buffers back without fresh
# pages: 32 MiB a side there (qwen3_moe-1b's whole tensors of width 2048 took 9 chunks, 63 kernels, at 2 MiB).
CHUNK_CUDA = 1 << 22


def _same_width(members: list[tuple[torch.Tensor, torch.Tensor, list[int] | None, float]]
                ) -> Later[list[RowError]]:
    """`row_errors` of tensors whose rows have one width (none without rows), on their rows' device.

    The rows are streamed through two small reused float64 buffers, a chunk of rows at a time (a chunk
    may hold rows of several tensors): a large tensor's float64 copies would cost more in fresh memory
    than in arithmetic. A row's norm is the same whichever rows are reduced with it. Every offset is known
    on the host, so nothing is read back until the figures, in one transfer."""
    f64 = torch.float64
    device = members[0][0].device
    sizes = [int(c.shape[0]) for c, _, _, _ in members]
    total, width = sum(sizes), int(members[0][0].shape[1])
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    chunk = max(1, (CHUNK_CUDA if device.type == "cuda" else CHUNK) // max(width, 1))
    c_buf = torch.empty(min(chunk, total), width, dtype=f64, device=device)
    g_buf = torch.empty_like(c_buf)
    per_row = torch.empty(total, dtype=f64, device=device)  # |candidate row - golden row|
    golden_norms = torch.empty(total, dtype=f64, device=device)
    first = 0  # the first tensor with rows in this chunk
    one_chunk = total <= chunk
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        for k in range(first, len(members)):  # the pieces of this chunk's rows, tensor by tensor
            a, b = max(lo, starts[k]), min(hi, starts[k + 1])
            if a >= hi:
                break
            c, g, _, _ = members[k]
            if (a, b) == (starts[k], starts[k + 1]):  # the whole tensor
                c_buf[a - lo:b - lo].copy_(c)
                g_buf[a - lo:b - lo].copy_(g)
            else:
                c_buf[a - lo:b - lo].copy_(c[a - starts[k]:b - starts[k]])
                g_buf[a - lo:b - lo].copy_(g[a - starts[k]:b - starts[k]])
            if b == starts[k + 1]:
                first = k + 1
        cv, gv = c_buf[:hi - lo], g_buf[:hi - lo]
        torch.linalg.vector_norm(gv, dim=1, out=golden_norms[lo:hi])  # into place: no copy kernel after each
        # All rows in one chunk (a GPU's usual case): both buffers are kept, and the worst rows read from them.
        torch.linalg.vector_norm(cv - gv if one_chunk else cv.sub_(gv), dim=1, out=per_row[lo:hi])
    squares = golden_norms.pow(2)
    # The golden's typical row norm, as row_error takes it: the mean over the tensor's own rows alone
    # (torch's sqrt, on a 0-d tensor, as there: it is not always the correctly rounded one).
    typical = torch.stack([squares[a:b].mean().sqrt() for a, b in zip(starts, starts[1:])])
    scales = torch.where(typical > 0, typical, torch.ones_like(typical))  # an all-zero golden: absolute error
    on = {"device": device, "non_blocking": True}
    bounds = torch.tensor(starts).to(**on)  # every tensor's first row, then the total
    segment = segment_ids(bounds[1:], total)  # made on the device: no host tensor per row
    first_rows = bounds[:-1]
    # A NaN row error is infinite, as row_error's `where(isfinite)`: errors are never negative, so one kernel
    # (nan_to_num's) does what isfinite's four and where's did.
    errors = (per_row / scales[segment]).nan_to_num_(nan=float("inf"), posinf=float("inf"))
    # Rows over each tensor's bound: a running count read at the tensors' ends (integers: exact, and no
    # atomics, which torch's deterministic mode refuses on CUDA).
    over = (errors > torch.tensor([b for _, _, _, b in members], dtype=f64).to(**on)[segment]).long().cumsum(0)
    over = torch.cat([over.new_zeros(1), over])
    over = over[bounds[1:]] - over[first_rows]
    # Within each tensor, its rows worst first, ties in row order (row_error's stable sort): a stable sort by
    # error, then a stable sort by tensor, keeps that order within each tensor's stretch.
    by_error = errors.sort(descending=True, stable=True).indices
    order = by_error[narrow_ids(segment[by_error], len(members)).sort(stable=True).indices]
    worst = order[first_rows]
    top = [starts[k] + j for k, n in enumerate(sizes) if n > 1 for j in range(min(WORST_ROWS, n))]
    top_rows = order[torch.tensor(top, dtype=torch.long).to(**on)]
    local = worst - first_rows  # each worst row's place in its own tensor's rows
    # The worst rows' largest differences, from the rows as converted (the same float64 values): two reads of
    # the kept buffers, else four kernels a tensor from its own rows.
    if one_chunk:
        c_rows, g_rows = c_buf.index_select(0, worst), g_buf.index_select(0, worst)
    else:
        c_rows = torch.cat([c.index_select(0, local[k:k + 1]).to(f64) for k, (c, _, _, _) in enumerate(members)])
        g_rows = torch.cat([g.index_select(0, local[k:k + 1]).to(f64) for k, (_, g, _, _) in enumerate(members)])
    column = (c_rows - g_rows).abs().nan_to_num(nan=float("inf")).argmax(dim=1, keepdim=True)
    figures = torch.stack([errors[worst], local.to(f64), column[:, 0].to(f64), g_rows.gather(1, column)[:, 0],
                           c_rows.gather(1, column)[:, 0], over.to(f64)], dim=1)
    ranked_at = (top_rows - first_rows[segment[top_rows]]).to(f64)
    n_members = len(members)
    indices = [ix for _, _, ix, _ in members]

    def finish(read: list[list[float]]) -> list[RowError]:
        flat, ranked_local, ranked_errors = read
        rows6 = [flat[6 * k:6 * k + 6] for k in range(n_members)]
        results, at = [], 0
        for (error, row, col, g, c, n_over), n, ix in zip(rows6, sizes, indices):
            shown = min(WORST_ROWS, n) if n > 1 else 0
            place = (lambda r, ix=ix: ix[int(r)]) if ix is not None else (lambda r: int(r))  # noqa: E731
            ranked = tuple((place(r), e) for r, e in zip(ranked_local[at:at + shown], ranked_errors[at:at + shown]))
            results.append(RowError(error=error, row=place(row), column=int(col), golden_value=g, candidate_value=c,
                                    rows_over=int(n_over), rows=n, worst_rows=ranked))
            at += shown
        return results

    # Every figure of every tensor, read with the check's others (row places are below 2**53: exact in float64).
    return Later([figures.reshape(-1), ranked_at, errors[top_rows]], finish)
