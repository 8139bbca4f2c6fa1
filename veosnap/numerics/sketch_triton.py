"""The row-sketch kernel for CUDA, in Triton (imported lazily by `sketch.rowsketch`; CUDA only).

It computes `sketch.rowsketch_torch`'s values bit for bit (up to the sign of an exact zero) and its
sums of squares within float rounding, from the same rule: `mix32` is the very function of `sketch_rule`
compiled by Triton, and the constants come from there too.

The tile. A program owns BLOCK_R rows and a run of a row's stripes, which it walks S stripes (a
step) at a time. A stripe of the program's rows is a (Q, BLOCK_R, E) tensor: Q = width / E lanes
share one (row, stripe) and each holds E of its buckets, j = e * Q + q, in registers; the other
lanes and the warps take further rows. So one warp-wide load touches 32 / Q rows (a few cache lines;
with lanes along the rows it touched 32), and a (row, stripe)'s hashes (its rotation and sign words,
2-3 `mix32`) are computed by Q lanes and serve E elements each instead of one or two. A lane loads
its buckets' elements in rotated order (a gather inside one stripe: the cache lines of a plain
load) and flips their signs by an XOR of the sign bit; the S stripes of a step are independent
loads, so S * E of them are in flight per lane and row.

The order of the sums. The torch path adds a row's stripes pairwise (`sketch_rule.pairwise_sum`), and so
does this kernel: a step's S stripes as a binary tree, the steps of a program as a binary tree (a
loop of two rounds per level, adding into zeros), and a row's programs (aligned runs of a power of
two of steps) pairwise on the host. The pairwise sum of aligned power-of-two chunks is the pairwise
sum of the whole, and zeros past a row's end change nothing, so a row's values are the torch path's
bits whatever the launch parameters, the column split, or the rows sketched with it (a shard, a
chunk). Sums of squares are added per lane, then across the tile: the same bits for every row of
one launch configuration (so shards of one configuration agree), within rounding of the torch path.
No atomics: a sketch is reproducible bit for bit on one machine.

The launch parameters live in one table, `CONFIGS`, keyed by (dtype, width); `tools/bench/bench_sketch.py`
checks the kernel against the torch path on the GPU and sweeps them.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import sketch_rule as rule

if os.environ.get("TRITON_INTERPRET") == "1":  # the CPU runs the kernel in Triton's interpreter (tests)
    import triton.runtime.interpreter as _interpreter

    _patch = _interpreter._patch_lang_tensor

    def _patched(tensor, scope) -> None:  # noqa: ANN001 - numpy >= 2.3 refuses int() of a 1-element array
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    if getattr(_patch, "__name__", "") != "_patched":
        _interpreter._patch_lang_tensor = _patched

# The rule's own function, compiled with globals that hold only `tl` (which Triton's interpreter,
# TRITON_INTERPRET=1, looks for; it lets the CPU test this kernel without a GPU).
mix32 = triton.jit(types.FunctionType(rule.mix32.__code__, {"tl": tl, "__name__": __name__}, "mix32"))
STRIPE_MULT = tl.constexpr(rule.STRIPE_MULT)
WORD_MULT = tl.constexpr(rule.WORD_MULT)
MAX_LEVELS = 16  # the grid's second dimension holds at most 65535 programs per row block
# Squares are added across the tile once per chunk of this many stripes, and chunks pairwise; a
# program's run of stripes is a whole number of chunks (the column split's granularity).
CHUNK_STRIPES = 32


@dataclass(frozen=True)
class Config:
    """How the kernel is launched. None of it changes a row's values (module docstring).

    vec_bytes: bytes of a stripe that one lane holds: E = vec_bytes / element size buckets (at most
    the width, at least width / 32 so that a stripe fits in a warp), Q = width / E lanes per stripe.
    s: stripes per step, loaded at once (s * E loads in flight per lane and row).
    block_r: rows per program, a power of two; 0 gives one row per Q lanes of each warp (32 * warps / Q).
    warps, stages, maxnreg: Triton's num_warps, num_stages and maxnreg (0: ptxas chooses).
    levels: a program adds at most 2**levels steps, at least a chunk of CHUNK_STRIPES stripes (fewer
    than 2**levels when that leaves too few programs to fill the device); the rest of a row goes to
    further programs, added on the host.
    """

    vec_bytes: int = 16
    s: int = 4
    block_r: int = 0
    warps: int = 4
    stages: int = 1
    maxnreg: int = 0
    levels: int = 5

    def tile(self, width: int, element_size: int) -> tuple[int, int, int]:
        """(Q, E, BLOCK_R) for a `width`-wide sketch of elements of `element_size` bytes."""
        e = max(min(width, max(1, self.vec_bytes // element_size)), width // 32)
        q = width // e
        return q, e, self.block_r or max(1, 32 * self.warps // q)

    def label(self) -> str:
        extra = (f" st{self.stages}" if self.stages != 1 else "") + (f" reg{self.maxnreg}" if self.maxnreg else "")
        return f"v{self.vec_bytes} s{self.s} r{self.block_r or 'auto'} w{self.warps} l{self.levels}{extra}"


# Launch parameters by (input dtype, width); a width not listed uses the dtype's (dtype, None) entry.
# Chosen by reasoning (docs/sketch.md, "The kernel") before any GPU sweep: 16 bytes per lane and
# stripe (8 bfloat16 buckets: each (row, stripe) hash serves 8 elements, and a warp's load touches
# 32 / Q rows), 4 stripes in flight per step (about 96 registers: 5 programs of 4 warps per SM).
# tools/bench/bench_sketch.py sweeps them on the GPU and prints the best per (dtype, width) as such an
# entry: adopting it is a one-line change here, and the values a sketch computes do not change.
CONFIGS: dict[tuple[torch.dtype, int | None], Config] = {
    (torch.bfloat16, None): Config(vec_bytes=16, s=4),
    (torch.float16, None): Config(vec_bytes=16, s=4),
    (torch.float32, None): Config(vec_bytes=16, s=4),
    (torch.float64, None): Config(vec_bytes=32, s=2),
    # From tools/bench/bench_sketch.py's sweep on an H200 (torch 2.11, triton 3.6, 2026-11-30): the best total
    # time per (dtype, width) over the benchmark's shapes (docs/sketch.md has the table).
    (torch.bfloat16, 32): Config(vec_bytes=8, s=8, block_r=32, warps=4, stages=1, maxnreg=0, levels=5),
    (torch.bfloat16, 64): Config(vec_bytes=8, s=8, block_r=16, warps=4, stages=1, maxnreg=0, levels=5),
    (torch.float32, 32): Config(vec_bytes=16, s=4, block_r=0, warps=4, stages=1, maxnreg=0, levels=6),
    (torch.float32, 64): Config(vec_bytes=8, s=4, block_r=8, warps=4, stages=1, maxnreg=0, levels=5),
    (torch.float64, 64): Config(vec_bytes=16, s=4, block_r=8, warps=4, stages=1, maxnreg=0, levels=5),
}


def config_for(dtype: torch.dtype, width: int) -> Config:
    """The table's launch parameters for sketching a `dtype` tensor at `width`."""
    return CONFIGS.get((dtype, width)) or CONFIGS.get((dtype, None)) or Config()


@triton.jit
def _stripe(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
            WIDTH: tl.constexpr, WORDS: tl.constexpr, MASKED: tl.constexpr, ACC: tl.constexpr):
    """Stripe t of each row, signed and in its buckets ((Q, R, E)); `sq` plus the squares."""
    k = mix32(row_key ^ ((t + first_stripe).to(tl.uint32) * STRIPE_MULT))  # (1, R, 1)
    rot = (k & (WIDTH - 1)).to(tl.int32)
    u = (jj - rot) & (WIDTH - 1)  # the element of the stripe landing in bucket j
    base = x_ptr + (row_off + t * WIDTH)  # one 64-bit address per (row, stripe); row_off holds -lead
    if MASKED:
        col = t * WIDTH + u
        v = tl.load(base + u, mask=(col >= lead) & (col < columns + lead), other=0.0)
    else:
        v = tl.load(base + u)
    word = mix32(k ^ WORD_MULT)
    for w in tl.static_range(1, WORDS):
        word = tl.where(wsel == w, mix32(k ^ (((w + 1) * WORD_MULT) & 0xFFFFFFFF)), word)
    # A sign flip is an XOR of the sign bit: bit j % 32 of the bucket's word, shifted there.
    negative = (word << sh) & 0x80000000
    if v.dtype == tl.float64:
        v = v.to(ACC)
        signed = (v.to(tl.uint64, bitcast=True) ^ (negative.to(tl.uint64) << 32)).to(tl.float64, bitcast=True)
    elif ACC == tl.float64:  # a float32 input: the sign in float32, then widen (the same number)
        signed = (v.to(tl.uint32, bitcast=True) ^ negative).to(tl.float32, bitcast=True).to(ACC)
        v = v.to(ACC)
    else:
        v = v.to(ACC)
        signed = (v.to(tl.uint32, bitcast=True) ^ negative).to(tl.float32, bitcast=True)
    return signed, sq + v * v


@triton.jit
def _step(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
          N: tl.constexpr, WIDTH: tl.constexpr, WORDS: tl.constexpr, MASKED: tl.constexpr, ACC: tl.constexpr):
    """Stripes t .. t + N - 1 added as a binary tree: the first levels of the pairwise order. Their
    loads are independent, so all N are in flight at once."""
    if N == 1:
        return _stripe(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
                       WIDTH, WORDS, MASKED, ACC)
    else:
        a, sq = _step(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
                      N // 2, WIDTH, WORDS, MASKED, ACC)
        b, sq = _step(x_ptr, row_off, row_key, t + N // 2, first_stripe, lead, columns, jj, sh, wsel, sq,
                      N // 2, WIDTH, WORDS, MASKED, ACC)
        return a + b, sq


@triton.jit
def _steps(x_ptr, row_off, row_key, step, end, first_stripe, lead, columns, jj, sh, wsel, sq, zero,
           LEVEL: tl.constexpr, S: tl.constexpr, WIDTH: tl.constexpr, WORDS: tl.constexpr, ACC: tl.constexpr):
    """Steps step .. step + 2**LEVEL - 1 (those before `end`) of S stripes, as a binary tree: the
    next levels of the pairwise order. A level is a loop of two rounds adding into zeros, and
    0 + a + b is a + b exactly, so no round needs a branch (an absent step is simply not run).
    Squares are added into `sq` per lane, in order."""
    if LEVEL == 0:
        t = step * S
        if (t * WIDTH >= lead) & ((t + S) * WIDTH <= columns + lead):
            v, sq = _step(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
                          S, WIDTH, WORDS, False, ACC)
        else:  # a row's first stripe (a column offset) or its last ones
            v, sq = _step(x_ptr, row_off, row_key, t, first_stripe, lead, columns, jj, sh, wsel, sq,
                          S, WIDTH, WORDS, True, ACC)
        return v, sq
    else:
        half: tl.constexpr = 1 << (LEVEL - 1)
        total = zero
        for h in range(tl.minimum(2, tl.cdiv(end - step, half))):
            v, sq = _steps(x_ptr, row_off, row_key, step + h * half, end, first_stripe, lead, columns, jj, sh,
                           wsel, sq, zero, LEVEL - 1, S, WIDTH, WORDS, ACC)
            total += v
        return total, sq


@triton.jit
def _chunks(x_ptr, row_off, row_key, step, end, first_stripe, lead, columns, jj, sh, wsel, zero, zero_rows,
            LEVEL: tl.constexpr, CHUNK: tl.constexpr, S: tl.constexpr, WIDTH: tl.constexpr, WORDS: tl.constexpr,
            ACC: tl.constexpr):
    """As `_steps`, with the squares of each chunk of 2**CHUNK steps added across the tile into one
    number per row, and the chunks' numbers added pairwise: so a row's sum of squares does not
    depend on how its chunks are split over programs."""
    if LEVEL == CHUNK:
        v, sq = _steps(x_ptr, row_off, row_key, step, end, first_stripe, lead, columns, jj, sh, wsel, zero, zero,
                       CHUNK, S, WIDTH, WORDS, ACC)
        return v, tl.sum(tl.sum(sq, axis=2, keep_dims=True), axis=0, keep_dims=True)  # (1, R, 1)
    else:
        half: tl.constexpr = 1 << (LEVEL - 1)
        total = zero
        total_sq = zero_rows
        for h in range(tl.minimum(2, tl.cdiv(end - step, half))):
            v, sq = _chunks(x_ptr, row_off, row_key, step + h * half, end, first_stripe, lead, columns, jj, sh,
                            wsel, zero, zero_rows, LEVEL - 1, CHUNK, S, WIDTH, WORDS, ACC)
            total += v
            total_sq += sq
        return total, total_sq


@triton.jit(do_not_specialize=["rows", "columns", "row_stride", "key", "row_offset", "lead", "first_stripe",
                               "stripes", "steps_per_program"])
def _rowsketch_kernel(x_ptr, out_ptr, sumsq_ptr, rows, columns, row_stride, key, row_offset, lead, first_stripe,
                      stripes, steps_per_program,
                      WIDTH: tl.constexpr, WORDS: tl.constexpr, E: tl.constexpr, BLOCK_R: tl.constexpr,
                      S: tl.constexpr, LEVELS: tl.constexpr, CHUNK: tl.constexpr, WIDE: tl.constexpr,
                      ACC: tl.constexpr):
    Q: tl.constexpr = WIDTH // E
    block = tl.program_id(0)
    part = tl.program_id(1)
    r = (block * BLOCK_R + tl.arange(0, BLOCK_R))[None, :, None]  # (1, R, 1)
    r_in = tl.minimum(r, rows - 1)  # rows past the end load the last row; their results are not stored
    row_key = mix32(key.to(tl.uint32) ^ (r_in + row_offset).to(tl.uint32))
    if WIDE:  # 2**31 elements or more: 64-bit offsets
        row_off = r_in.to(tl.int64) * row_stride - lead
    else:
        row_off = r_in * row_stride - lead
    # Dimension 0 is the one Triton spreads lanes over first for a gather (no contiguous axis):
    # Q lanes per stripe, then rows over the remaining lanes and the warps, then E in registers.
    q = tl.arange(0, Q)[:, None, None]  # (Q, 1, 1)
    e = tl.arange(0, E)[None, None, :]  # (1, 1, E)
    jj = e * Q + q  # (Q, 1, E): the buckets a lane holds
    sh = (31 - (jj & 31)).to(tl.uint32)
    wsel = (e * Q) >> 5  # bucket j's sign word (q < Q <= 32 divides 32): known per register

    step = part * steps_per_program
    end = tl.minimum(step + steps_per_program, tl.cdiv(stripes, S))
    zero = tl.zeros((Q, BLOCK_R, E), dtype=ACC)
    total, sq = _chunks(x_ptr, row_off, row_key, step, end, first_stripe, lead, columns, jj, sh, wsel, zero,
                        tl.zeros((1, BLOCK_R, 1), dtype=ACC), LEVELS, CHUNK, S, WIDTH, WORDS, ACC)
    tl.store(out_ptr + part.to(tl.int64) * rows * WIDTH + r.to(tl.int64) * WIDTH + jj, total, mask=r < rows)
    tl.store(sumsq_ptr + part.to(tl.int64) * rows + r, sq, mask=r < rows)


_SMS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


@dataclass(frozen=True)
class Plan:
    """A launch: the tile, and how a row's steps are split over programs."""

    q: int
    e: int
    block_r: int
    chunk: int  # log2 of the steps in a chunk (CHUNK_STRIPES stripes)
    steps_per_program: int  # a power of two, a multiple of a chunk: a subtree of the row's pairwise sums
    parts: int  # programs per row block
    levels: int  # log2 of the most steps a program adds


def launch_plan(rows: int, stripes: int, width: int, element_size: int, config: Config,
                programs_wanted: int = 1) -> Plan:
    """The steps per program start at 2**levels and halve, down to a chunk, while the launch has
    fewer than `programs_wanted` programs (a tensor of few rows: split its columns more). None of it
    changes a bit of the result, so it may depend on the rows and on the device."""
    q, e, block_r = config.tile(width, element_size)
    if config.s not in (1, 2, 4, 8, 16, 32) or block_r & (block_r - 1):
        raise ValueError(f"s {config.s} and block_r {block_r} must be powers of two (s at most {CHUNK_STRIPES})")
    chunk = (CHUNK_STRIPES // config.s).bit_length() - 1
    levels = max(config.levels, chunk)
    steps = -(-stripes // config.s)
    row_blocks = -(-rows // block_r)
    per_program = 1 << levels
    while per_program > 1 << chunk and row_blocks * -(-steps // per_program) < programs_wanted:
        per_program //= 2
    while -(-steps // per_program) > 65535:  # the grid's limit: more steps per program
        per_program, levels = per_program * 2, max(levels, per_program.bit_length())
    return Plan(q, e, block_r, chunk, per_program, -(-steps // per_program), levels)


def launch(x2d: torch.Tensor, width: int, seed: int, *, row_offset: int = 0, col_offset: int = 0,
           config: Config | None = None) -> tuple[rule.RowSketch, object]:
    """`rowsketch`, also returning the compiled kernel (registers, spills: tools/bench/bench_sketch.py)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()  # the kernel reads rows of unit stride; goldens' tensors already are
    rows, columns = x2d.shape
    acc = rule.accumulation_dtype(x2d.dtype)
    if rows == 0 or columns == 0:
        zeros = torch.zeros((rows, width), dtype=acc, device=x2d.device)
        return rule.RowSketch(zeros, torch.zeros((rows,), dtype=acc, device=x2d.device)), None
    config = config or config_for(x2d.dtype, width)
    if not 0 <= config.levels <= MAX_LEVELS:
        raise ValueError(f"levels {config.levels} is not in 0..{MAX_LEVELS}")
    lead, first_stripe = col_offset % width, col_offset // width
    stripes = -(-(lead + columns) // width)
    wanted = 2 * _multiprocessors(x2d.device) if x2d.is_cuda else 1
    plan = launch_plan(rows, stripes, width, x2d.element_size(), config, wanted)
    out = torch.empty((plan.parts, rows, width), dtype=acc, device=x2d.device)
    sumsq = torch.empty((plan.parts, rows), dtype=acc, device=x2d.device)
    key = rule.seed_key(seed)
    key -= (key >> 31) << 32  # as a signed 32-bit argument: one compiled kernel for every seed
    options = {"num_warps": config.warps, "num_stages": config.stages}
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    kernel = _rowsketch_kernel[(-(-rows // plan.block_r), plan.parts)](
        x2d, out, sumsq, rows, columns, x2d.stride(0), key, row_offset, lead, first_stripe,
        stripes, plan.steps_per_program,
        WIDTH=width, WORDS=max(1, width // 32), E=plan.e, BLOCK_R=plan.block_r, S=config.s, LEVELS=plan.levels,
        CHUNK=plan.chunk, WIDE=x2d.stride(0) * rows + width >= 1 << 31,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        **options,
    )
    if plan.parts == 1:
        return rule.RowSketch(out[0], sumsq[0]), kernel
    return rule.RowSketch(rule.pairwise_sum(out, 0), rule.pairwise_sum(sumsq, 0)), kernel


def rowsketch(x2d: torch.Tensor, width: int, seed: int, *, row_offset: int = 0, col_offset: int = 0,
              config: Config | None = None, **overrides: int) -> rule.RowSketch:
    """`sketch.rowsketch` on CUDA. `config` (default: `config_for(dtype, width)`) and `overrides` (its
    fields, e.g. `s=2`) change the speed, never a row's values (a row's sum of squares may differ in
    its last bits between configurations, never between row shards of one configuration)."""
    if overrides:
        config = replace(config or config_for(x2d.dtype, width), **overrides)
    return launch(x2d, width, seed, row_offset=row_offset, col_offset=col_offset, config=config)[0]
