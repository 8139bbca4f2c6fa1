"""The row-sketch kernel for CUDA, in Triton (imported lazily by `sketch.rowsketch`; CUDA only).

It computes `sketch.rowsketch_torch`'s numbers (within float rounding) from the same rule: `mix32`
is the very function of `sketch` compiled by Triton, and the constants come from there too.

One program owns BLOCK_R rows and a run of stripes; per stripe it loads each row's `width`
contiguous elements in rotated order (a gather inside one stripe: the same cache lines as a plain
load), applies the signs and adds them into its (BLOCK_R, width) accumulator. Long rows are split
over several programs whose partial sketches are added afterwards in a fixed pairwise order. No
atomics, and the launch configuration is a function of (columns, width) only, never of the rows or
the device, so a sketch is reproducible bit for bit on one machine (and across GPUs of one class),
and a row shard's sketch equals the same rows' sketch in the whole tensor.
"""

from __future__ import annotations

import types

import torch
import triton
import triton.language as tl

from . import sketch as rule

# The rule's own function, compiled with globals that hold only `tl` (which Triton's interpreter,
# TRITON_INTERPRET=1, looks for; it lets the CPU test this kernel without a GPU).
mix32 = triton.jit(types.FunctionType(rule.mix32.__code__, {"tl": tl, "__name__": __name__}, "mix32"))
STRIPE_MULT = tl.constexpr(rule.STRIPE_MULT)
WORD_MULT = tl.constexpr(rule.WORD_MULT)

TILE = 2048  # elements per program per stripe step: BLOCK_R = TILE // width rows
# Long rows are split over programs of this many stripes, their partial sketches added afterwards.
# The split depends on the columns only, so a row's sums run in one order however many rows there
# are: a row shard, a chunk or the whole tensor give the same bits (and so do TILE and NUM_WARPS).
STRIPES_PER_PROGRAM = 256
NUM_WARPS = 4


@triton.jit(do_not_specialize=["key", "row_offset", "lead", "first_stripe"])
def _rowsketch_kernel(x_ptr, out_ptr, sumsq_ptr, rows, columns, row_stride, key, row_offset, lead, first_stripe,
                      stripes_per_program,
                      WIDTH: tl.constexpr, WORDS: tl.constexpr, BLOCK_R: tl.constexpr, ACC: tl.constexpr):
    block = tl.program_id(0)
    part = tl.program_id(1)
    r = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < rows
    j = tl.arange(0, WIDTH)  # bucket
    row_key = mix32(key.to(tl.uint32) ^ (r + row_offset).to(tl.uint32))
    base = x_ptr + r.to(tl.int64)[:, None] * row_stride
    acc = tl.zeros((BLOCK_R, WIDTH), dtype=ACC)
    sq = tl.zeros((BLOCK_R, WIDTH), dtype=ACC)
    for i in range(stripes_per_program):
        t = part * stripes_per_program + i  # stripes past the row's end load nothing (col >= columns)
        stripe_key = mix32(row_key ^ ((t + first_stripe).to(tl.uint32) * STRIPE_MULT))
        rot = (stripe_key & (WIDTH - 1)).to(tl.int32)
        col = t * WIDTH + ((j[None, :] - rot[:, None]) & (WIDTH - 1)) - lead  # the element landing in bucket j
        ok = row_ok[:, None] & (col >= 0) & (col < columns)
        v = tl.load(base + col, mask=ok, other=0.0).to(ACC)
        word = tl.broadcast_to(mix32(stripe_key ^ WORD_MULT)[:, None], (BLOCK_R, WIDTH))
        for w in tl.static_range(1, WORDS):
            word_w = mix32(stripe_key ^ (((w + 1) * WORD_MULT) & 0xFFFFFFFF))
            word = tl.where((j >> 5)[None, :] == w, word_w[:, None], word)
        negative = ((word >> (j & 31).to(tl.uint32)[None, :]) & 1) != 0
        acc += tl.where(negative, -v, v)
        sq += v * v
    out = out_ptr + part.to(tl.int64) * rows * WIDTH + r.to(tl.int64)[:, None] * WIDTH + j[None, :]
    tl.store(out, acc, mask=row_ok[:, None])
    tl.store(sumsq_ptr + part.to(tl.int64) * rows + r, tl.sum(sq, axis=1), mask=row_ok)


def launch_config(stripes: int, width: int, tile: int = TILE) -> tuple[int, int, int]:
    """(BLOCK_R, programs per row block, stripes per program): the rows never enter."""
    parts = -(-stripes // STRIPES_PER_PROGRAM)
    return max(1, tile // width), parts, -(-stripes // parts)


def rowsketch(x2d: torch.Tensor, width: int, seed: int, *, row_offset: int = 0, col_offset: int = 0,
              tile: int = TILE, num_warps: int = NUM_WARPS) -> rule.RowSketch:
    """`sketch.rowsketch` on CUDA. `tile` and `num_warps` exist for tools/bench_sketch.py's sweep:
    they change the speed, not a row's sketch (a row's sum of squares may differ in its last bit)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()  # the kernel reads rows of unit stride; goldens' tensors already are
    rows, columns = x2d.shape
    acc = rule.accumulation_dtype(x2d.dtype)
    if rows == 0 or columns == 0:
        zeros = torch.zeros((rows, width), dtype=acc, device=x2d.device)
        return rule.RowSketch(zeros, torch.zeros((rows,), dtype=acc, device=x2d.device))
    lead, first_stripe = col_offset % width, col_offset // width
    stripes = -(-(lead + columns) // width)
    block_r, parts, per_program = launch_config(stripes, width, tile)
    out = torch.empty((parts, rows, width), dtype=acc, device=x2d.device)
    sumsq = torch.empty((parts, rows), dtype=acc, device=x2d.device)
    grid = (-(-rows // block_r), parts)
    _rowsketch_kernel[grid](
        x2d, out, sumsq, rows, columns, x2d.stride(0), rule.seed_key(seed), row_offset, lead, first_stripe, per_program,
        WIDTH=width, WORDS=max(1, width // 32), BLOCK_R=block_r,
        ACC=tl.float64 if acc == torch.float64 else tl.float32, num_warps=num_warps,
    )
    return rule.RowSketch(rule.pairwise_sum(out, 0), rule.pairwise_sum(sumsq, 0))
