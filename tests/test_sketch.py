"""Row sketches (veosnap/numerics/sketch.py): the row-error metric at bounded size.

Read top to bottom as usage: the rule, its linear algebra, what an estimate is worth, embedding-like
gradients, the comparison a check makes, the planner, and the stored form.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from veosnap.errors import VeosnapError
from veosnap.numerics import sketch
from veosnap.numerics.sketch import (
    GoldenSketch,
    SketchSpec,
    TensorShape,
    compare_sketch,
    plan,
    record_sketch,
    rowsketch,
    sketch_noise,
)

sys.path.insert(0, str(Path(__file__).parent))
from sketch_shapes import REAL_SHAPES, golden_shapes, parameters  # noqa: E402

M32 = 0xFFFFFFFF


def rule_written_out(x2d: torch.Tensor, width: int, seed: int, row_offset: int = 0, col_offset: int = 0) -> torch.Tensor:
    """The rule of sketch.py's docstring, element by element in Python integers (the reference)."""

    def mix(v: int) -> int:
        v ^= v >> 16
        v = (v * 0x7FEB352D) & M32
        v ^= v >> 15
        v = (v * 0x846CA68B) & M32
        return v ^ (v >> 16)

    s = mix((seed ^ 0x5EED5EED) & M32)
    out = torch.zeros((x2d.shape[0], width), dtype=torch.float64)
    for r in range(x2d.shape[0]):
        a = mix(s ^ (r + row_offset))
        for c in range(x2d.shape[1]):
            t, u = divmod(c + col_offset, width)
            key = mix(a ^ ((t * 0x9E3779B9) & M32))
            j = (u + (key & (width - 1))) % width
            word = mix(key ^ (((j // 32 + 1) * 0x85EBCA6B) & M32))
            out[r, j] += (-1 if (word >> (j % 32)) & 1 else 1) * float(x2d[r, c])
    return out


def spec_for(x: torch.Tensor, width: int = 16, group: int = 1, seed: int = 7) -> SketchSpec:
    return SketchSpec(seed=seed, width=width, group=group, shape=tuple(x.shape))


# --- the rule -----------------------------------------------------------------------------------------


def test_mix32_is_the_same_function_on_python_ints_and_int64_tensors():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B9, 123456789]
    tensor = sketch.mix32(torch.tensor(values, dtype=torch.int64))
    assert tensor.tolist() == [sketch.mix32(v) for v in values]
    assert all(0 <= v <= M32 for v in tensor.tolist())


@pytest.mark.parametrize(("rows", "columns", "width", "row_offset", "col_offset"), [
    (3, 5, 4, 0, 0), (4, 70, 32, 7, 0), (3, 100, 64, 0, 13), (2, 300, 128, 5, 200), (2, 40, 1, 0, 0), (5, 1, 8, 0, 0),
])
def test_same_numbers_as_the_rule_written_out(rows, columns, width, row_offset, col_offset):
    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(rows * columns))
    got = rowsketch(x, width, seed=123, row_offset=row_offset, col_offset=col_offset)
    assert torch.equal(got.values, rule_written_out(x, width, 123, row_offset, col_offset))
    assert torch.allclose(got.sumsq, x.double().pow(2).sum(1), rtol=1e-13)


def test_a_row_no_wider_than_the_sketch_is_kept_isometrically():
    x = torch.randn(6, 20, dtype=torch.float64)
    values = rowsketch(x, 32, seed=1).values
    assert torch.allclose(values.norm(dim=1), x.norm(dim=1), rtol=1e-14)  # a signed permutation


def test_the_sketch_is_linear_and_shards_add_up_to_the_whole():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 300, generator=g), torch.randn(40, 300, generator=g)
    sa, sb, sd = (rowsketch(t, 64, seed=3).values for t in (a, b, a - b))
    assert torch.allclose(sa - sb, sd, atol=1e-5)  # a - b rounds in float32, the sketches in float64
    whole = rowsketch(a, 64, seed=3).values
    rows = torch.cat([rowsketch(a[:17], 64, seed=3).values, rowsketch(a[17:], 64, seed=3, row_offset=17).values])
    columns = rowsketch(a[:, :100], 64, seed=3).values + rowsketch(a[:, 100:], 64, seed=3, col_offset=100).values
    assert torch.equal(rows, whole)
    assert torch.allclose(columns, whole, rtol=0, atol=1e-12)  # a column split at 100 is not stripe-aligned


def test_reproducible_bytes_for_one_seed_and_other_bytes_for_another():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    first = record_sketch(x, spec_for(x, 32, 4, seed=11))
    again = record_sketch(x.clone(), spec_for(x, 32, 4, seed=11))
    other = record_sketch(x, spec_for(x, 32, 4, seed=12))
    assert first.values.numpy().tobytes() == again.values.numpy().tobytes()
    assert first.norms.numpy().tobytes() == again.norms.numpy().tobytes()
    assert not torch.equal(first.values, other.values)
    assert torch.equal(first.norms, other.norms)  # norms are exact, not sketched


def test_chunking_does_not_change_a_bit():
    x = torch.randn(50, 700, generator=torch.Generator().manual_seed(2))
    whole = sketch.rowsketch_torch(x, 32, 5)
    chunked = sketch.rowsketch_torch(x, 32, 5, chunk_elements=64)
    assert torch.equal(whole.values, chunked.values) and torch.equal(whole.sumsq, chunked.sumsq)


def test_float32_and_bfloat16_accumulate_and_store_as_documented():
    x = torch.randn(4, 100)
    assert rowsketch(x, 8, 0).values.dtype == torch.float64
    assert rowsketch(x.bfloat16(), 8, 0).values.dtype == torch.float32
    assert record_sketch(x, spec_for(x)).values.dtype == torch.float32
    assert record_sketch(x.double(), spec_for(x)).values.dtype == torch.float64
    with pytest.raises(VeosnapError, match="cannot sketch a int64 tensor"):
        rowsketch(torch.ones(2, 2, dtype=torch.int64), 8, 0)


# --- what an estimate is worth --------------------------------------------------------------------------


def estimate_ratios(diff: torch.Tensor, width: int, seed: int = 0) -> torch.Tensor:
    """||sketch(d_r)||^2 / ||d_r||^2 per row: 1 on average, variance at most 2/width."""
    return rowsketch(diff.double(), width, seed).values.pow(2).sum(1) / diff.double().pow(2).sum(1)


@pytest.mark.parametrize("width", [16, 64])
def test_spread_out_differences_are_estimated_within_the_countsketch_bound(width):
    diff = torch.randn(4000, 2048, generator=torch.Generator().manual_seed(width))
    ratio = estimate_ratios(diff, width)
    assert abs(ratio.mean().item() - 1) < 4 * math.sqrt(2 / width / ratio.numel())  # unbiased
    assert ratio.var().item() < 1.2 * 2 / width  # the bound, with room for sampling
    # Chebyshev, distribution-free: at most 1/9 of rows off by more than 3 standard deviations
    assert ((ratio - 1).abs() > 3 * math.sqrt(2 / width)).float().mean().item() <= 1 / 9


def test_a_difference_in_one_element_is_measured_exactly():
    diff = torch.zeros(300, 2048, dtype=torch.float64)
    diff[torch.arange(300), torch.randint(0, 2048, (300,), generator=torch.Generator().manual_seed(0))] = 3.5
    assert torch.allclose(estimate_ratios(diff, 32), torch.ones(300, dtype=torch.float64), rtol=1e-14)


def test_one_head_of_contiguous_columns():
    diff = torch.zeros(2000, 2048, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    diff[:, 128:144] = torch.randn(2000, 16, generator=g, dtype=torch.float64)  # 16 columns in one stripe
    assert torch.allclose(estimate_ratios(diff, 64), torch.ones(2000, dtype=torch.float64), rtol=1e-13)
    diff.zero_()
    diff[:, 256:384] = torch.randn(2000, 128, generator=g, dtype=torch.float64)  # a head_dim-128 head, 2 stripes
    ratio = estimate_ratios(diff, 64)
    assert ratio.var().item() < 2 / 64 and abs(ratio.mean().item() - 1) < 0.02


def test_a_difference_repeating_every_head_is_not_aliased():
    # The first dimension of each of 16 heads of 128 (a rotary bug): with buckets at column % width all
    # 16 would share one bucket and the estimate would be a single random sign sum (variance ~2);
    # per-stripe rotations keep it inside the 2/width bound.
    diff = torch.zeros(3000, 2048, dtype=torch.float64)
    diff[:, ::128] = torch.randn(3000, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ratio = estimate_ratios(diff, 64)
    assert ratio.var().item() < 1.2 * 2 / 64


def test_a_single_row_difference_in_a_group_reads_as_the_group_rms():
    golden = torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    candidate = golden.clone()
    candidate[37] += 0.5 * golden[37]
    exact_row_error = (candidate[37] - golden[37]).norm().item() / golden.norm(dim=1).pow(2).mean().sqrt().item()
    one = compare_sketch(record_sketch(golden, spec_for(golden, 256, 1)), candidate)
    four = compare_sketch(record_sketch(golden, spec_for(golden, 256, 4)), candidate)
    assert one.error == pytest.approx(exact_row_error, rel=1e-6)  # 256 wide: one stripe, exact
    assert (one.group, one.first_row, one.last_row) == (37, 37, 37)
    assert four.error == pytest.approx(exact_row_error / 2, rel=0.2)  # the RMS over 4 rows
    assert (four.group, four.first_row, four.last_row, four.group_rows) == (9, 36, 39, 4)
    assert four.estimate and four.width == 256 and four.group_size == 4


# --- the comparison a check makes ----------------------------------------------------------------------


def test_a_bit_identical_candidate_has_exactly_zero_error():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        golden = torch.randn(8, 16, 300, generator=g).to(dtype)
        mask = torch.rand(8, 16, generator=g) > 0.2
        record = record_sketch(golden, spec_for(golden, 32, 4), row_mask=mask)
        result = compare_sketch(record, golden.clone(), row_mask=mask)
        assert result.error == 0.0 and result.rows_over == 0


def test_padding_rows_are_left_out_like_the_exact_metric_leaves_them():
    golden = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(4, 8, dtype=torch.bool)
    mask[0, :3] = False  # left padding of the first sequence
    record = record_sketch(golden, spec_for(golden, 16, 2), row_mask=mask)
    candidate = golden.clone()
    candidate[0, :3] = 1e6  # garbage where nobody looks
    assert compare_sketch(record, candidate, row_mask=mask).error == 0.0
    assert record.rows_counted == 29
    assert record.tau == pytest.approx(golden[mask].norm(dim=1).pow(2).mean().sqrt().item(), rel=1e-6)


def test_rows_over_the_bound_and_non_finite_values():
    golden = torch.randn(100, 128, generator=torch.Generator().manual_seed(6))
    record = record_sketch(golden, spec_for(golden, 128, 1))
    candidate = golden.clone()
    candidate[[3, 50, 77]] *= 1.1  # three rows off by 10% of themselves
    result = compare_sketch(record, candidate, bound=0.05)
    assert result.rows_over == 3 and result.groups == 100 and result.rows == 100
    candidate[60, 5] = float("nan")
    bad = compare_sketch(record, candidate, bound=0.05)
    assert bad.error == float("inf") and bad.nonfinite_rows == 1 and bad.first_nonfinite_row == 60


def test_noise_is_measured_in_the_same_currency():
    # The float64 run sketched with the golden's spec; the estimate is close to the exact row error.
    g = torch.Generator().manual_seed(7)
    truth = torch.randn(512, 2048, generator=g, dtype=torch.float64)
    reference = (truth * (1 + 1e-5 * torch.randn(512, 2048, generator=g, dtype=torch.float64))).float()
    record = record_sketch(reference, spec_for(reference, 64, 1))
    noise = sketch_noise(record, truth)
    tau = reference.double().norm(dim=1).pow(2).mean().sqrt()
    exact = ((reference.double() - truth).norm(dim=1) / tau).max().item()
    assert noise.estimate and 0.9 * exact < noise.error < 1.5 * exact  # a max over rows of estimates inflates


def test_storing_a_sketch_in_float32_rounds_far_below_the_float32_floor():
    # The golden's sketch is stored in float32: its rounding (about 3e-8 of a row's norm) is as large as
    # float32's own rounding of the tensor, and 1/30 of the float32 floor (1e-6) every bound includes.
    truth = torch.randn(512, 2048, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    reference = truth.float()
    noise = sketch_noise(record_sketch(reference, spec_for(reference, 64, 1)), truth)
    assert noise.error < 1e-7


def test_wrong_shapes_and_masks_are_one_line_errors():
    golden = torch.randn(10, 20)
    record = record_sketch(golden, spec_for(golden))
    with pytest.raises(VeosnapError, match=r"shape \[10, 21\] but the sketch spec says \[10, 20\]"):
        compare_sketch(record, torch.randn(10, 21))
    with pytest.raises(VeosnapError, match="row mask has 9 entries for 10 rows"):
        compare_sketch(record, golden, row_mask=torch.ones(9, dtype=torch.bool))
    with pytest.raises(VeosnapError, match="non-finite"):
        record_sketch(torch.full((2, 3), float("inf")), spec_for(torch.empty(2, 3)))


# --- embedding-like gradients: the support -----------------------------------------------------------------


def embedding_gradient(vocab: int = 1000, hidden: int = 96, tokens: int = 60, seed: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    grad = torch.zeros(vocab, hidden)
    grad.index_add_(0, ids, torch.randn(tokens, hidden, generator=g))
    return grad, ids.unique()


def test_an_embedding_gradient_keeps_only_its_support():
    grad, used = embedding_gradient()
    record = record_sketch(grad, spec_for(grad, 32, 1), support_limit=60)
    assert record.spec.support == used.numel() and torch.equal(record.support, used)
    assert record.values.shape == (used.numel(), 32)
    assert record.nbytes < 0.05 * grad.numel() * 4
    assert compare_sketch(record, grad.clone()).error == 0.0


def test_a_candidate_writing_outside_the_support_is_caught_exactly():
    grad, used = embedding_gradient()
    record = record_sketch(grad, spec_for(grad, 32, 1), support_limit=60)
    candidate = grad.clone()
    outside = next(r for r in range(1000) if r not in set(used.tolist()))
    candidate[outside, 4] = 0.25  # a token that is not in the batch gets a gradient
    result = compare_sketch(record, candidate, bound=1e-3)
    assert not result.estimate and result.group == -1 and result.first_row == outside
    assert result.error == pytest.approx(0.25 / record.tau, rel=1e-6)
    assert result.rows_over == 1 and result.groups == 1000
    inside = grad.clone()
    inside[used[5]] *= 2  # a token of the batch gets twice its gradient: found by the sketch
    found = compare_sketch(record, inside, bound=1e-3)
    assert found.estimate and found.first_row == int(used[5])


def test_a_support_denser_than_planned_falls_back_to_wider_groups():
    grad, _ = embedding_gradient(tokens=60)
    record = record_sketch(grad, spec_for(grad, 32, 1), support_limit=10)  # the plan assumed 10 rows
    assert record.spec.support is None and record.spec.group == 100  # 1000 rows in 10 groups: planned bytes
    assert compare_sketch(record, grad.clone()).error == 0.0


# --- the planner ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", REAL_SHAPES, ids=lambda m: m.name)
@pytest.mark.parametrize("layers", [2, 4])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_real_width_golden_fits_the_target_budget(model, layers, dtype):
    shapes, fixed = golden_shapes(model, layers, tokens=8192, dtype=dtype)
    exact = fixed + sum(t.exact_bytes for t in shapes)
    chosen = plan(shapes, fixed_bytes=fixed)
    assert exact > 2 << 30  # gigabytes whole
    assert chosen.total_bytes <= sketch.TARGET_BYTES  # 16 MB
    assert chosen == plan(reversed(shapes), fixed_bytes=fixed)  # a function of the inputs only
    token = chosen.choice("logits").spec
    assert token.width >= 32 and token.group <= 2  # tokens localised to one or two positions
    assert chosen.choice("loss").exact and chosen.choice("grad.model.norm.weight").exact  # small stays whole
    assert all(c.spec.width >= 16 for c in chosen.choices if c.spec)
    assert all(c.exact for c in chosen.choices if c.name.startswith("routes."))


def test_the_shape_sets_span_about_a_billion_parameters():
    counts = {m.name: parameters(m, 4) for m in REAL_SHAPES}
    assert min(counts.values()) > 1.5e8 and max(counts.values()) > 1e9


def test_small_models_stay_whole_and_the_modes_override():
    toy = [TensorShape("logits", (4, 32, 256), "float32"), TensorShape("grad.w", (64, 64), "float32"),
           TensorShape("loss", (), "float32", sketchable=False)]
    assert all(c.exact for c in plan(toy).choices)  # fits: the sharper instrument
    forced = plan(toy, mode="always", ladder=((16, 4),))
    assert {c.name: (c.spec.width, c.spec.group) if c.spec else None for c in forced.choices} == {
        "logits": (16, 4), "grad.w": (16, 2), "loss": None}  # 64 rows: groups of 2 leave MIN_GROUPS groups
    huge = [TensorShape("logits", (8192, 151936), "bfloat16")]
    with pytest.raises(VeosnapError, match="over the 67108864 byte limit .*use --sketch auto"):
        plan(huge, mode="never")
    with pytest.raises(VeosnapError, match="unknown sketch mode 'sometimes'"):
        plan(toy, mode="sometimes")


def test_a_golden_that_cannot_fit_is_refused_with_the_limit():
    rows = [TensorShape(f"grad.w{i}", (1 << 20, 4096), "bfloat16") for i in range(1500)]  # 12 TB whole
    with pytest.raises(VeosnapError, match="over the 67108864 byte limit .*record fewer tokens or layers"):
        plan(rows)


def test_an_embedding_gradient_is_planned_on_its_support():
    shapes = [TensorShape("grad.model.embed_tokens.weight", (151936, 2048), "bfloat16", support_rows=8192),
              TensorShape("grad.lm_head.weight", (151936, 2048), "bfloat16")]
    chosen = plan(shapes, budget=4 << 20)
    embed, head = chosen.choice(shapes[0].name), chosen.choice(shapes[1].name)
    assert embed.support_limit == 8192 and embed.spec.group < head.spec.group


# --- the stored form ---------------------------------------------------------------------------------------


def test_a_sketched_tensor_round_trips_through_safetensors_and_json():
    grad, _ = embedding_gradient()
    record = record_sketch(grad, spec_for(grad, 32, 2), support_limit=60)
    name = "grad.model.embed_tokens.weight"
    stored = st_load(st_save(record.tensors(name)))
    assert sorted(stored) == [f"{name}#norms", f"{name}#sketch", f"{name}#support"]
    meta = json.loads(json.dumps(record.meta()))
    back = GoldenSketch.from_parts(name, meta, stored, source="x.safetensors.zst")
    assert back.spec == record.spec and back.tau == record.tau
    assert compare_sketch(back, grad.clone()).error == 0.0


def test_a_corrupt_sketch_entry_is_refused_with_one_line():
    golden = torch.randn(10, 20)
    record = record_sketch(golden, spec_for(golden))
    tensors, meta = record.tensors("t"), record.meta()
    bad = {**meta, "spec": {**meta["spec"], "width": 24}}
    with pytest.raises(VeosnapError, match=r"g\.zst: sketched tensor 't'.*width 24 is not a power of two"):
        GoldenSketch.from_parts("t", bad, tensors, source="g.zst")
    with pytest.raises(VeosnapError, match=r"rows/columns 10x21 do not match"):
        GoldenSketch.from_parts("t", {**meta, "spec": {**meta["spec"], "columns": 21}}, tensors, source="g.zst")
    with pytest.raises(VeosnapError, match=r"#sketch is float32 \[9, 16\]"):
        GoldenSketch.from_parts("t", meta, {**tensors, "t#sketch": tensors["t#sketch"][:9]}, source="g.zst")
    with pytest.raises(VeosnapError, match="tau nan"):
        GoldenSketch.from_parts("t", {**meta, "tau": float("nan")}, tensors, source="g.zst")
    with pytest.raises(VeosnapError, match="method 'rowsketch-v9'.*upgrade veosnap"):
        SketchSpec.from_dict({**meta["spec"], "method": "rowsketch-v9"})


# --- the CUDA kernel, through Triton's interpreter ---------------------------------------------------------

INTERPRETED = textwrap.dedent("""
    import torch
    from veosnap.numerics import sketch, sketch_triton
    from veosnap.numerics.sketch_triton import Config
    g = torch.Generator().manual_seed(0)
    # the table's choice, and others: narrow lanes and one chunk per program (the finest column
    # split), wide lanes with long steps, two rows per lane group
    configs = [None, Config(vec_bytes=4, s=2, levels=0), Config(vec_bytes=32, s=8, levels=1), Config(s=1, block_r=64)]
    worst = 0.0
    for rows, columns, width, ro, co, dtype, seed in [
            (37, 70, 32, 7, 0, torch.float32, 99), (9, 300, 64, 0, 13, torch.bfloat16, 1),
            (3, 1500, 8, 0, 0, torch.bfloat16, 2), (5, 700, 128, 5, 200, torch.float64, 3),
            (6, 1, 8, 0, 0, torch.float32, 4), (4, 900, 16, 0, 40, torch.float16, 5),
            (2, 50, 1, 3, 0, torch.float64, 6)]:
        x = torch.randn(rows, columns, generator=g, dtype=torch.float64).to(dtype)
        a = sketch.rowsketch_torch(x, width, seed, row_offset=ro, col_offset=co)
        for config in configs:
            b = sketch_triton.rowsketch(x, width, seed, row_offset=ro, col_offset=co, config=config)
            assert b.values.dtype == a.values.dtype and b.sumsq.dtype == a.sumsq.dtype
            assert torch.equal(a.values, b.values), (rows, columns, width, dtype, config)  # same pairwise order
            worst = max(worst, (a.sumsq - b.sumsq).abs().max().item() / x.double().norm(dim=1).max().item() ** 2)
    x = torch.randn(40, 3000, generator=g)  # row shards, one configuration: the whole tensor's bits
    whole = sketch_triton.rowsketch(x, 16, 5)
    top, rest = sketch_triton.rowsketch(x[:17], 16, 5), sketch_triton.rowsketch(x[17:], 16, 5, row_offset=17)
    assert torch.equal(whole.values, torch.cat([top.values, rest.values]))
    assert torch.equal(whole.sumsq, torch.cat([top.sumsq, rest.sumsq]))
    x = torch.randn(4, 3000, generator=g).bfloat16()  # another column split (the GPU's for few rows): same bits
    split = [sketch_triton.rowsketch(x, 16, 5, s=2, levels=levels) for levels in (0, 3, 6)]
    assert all(torch.equal(split[0].values, o.values) and torch.equal(split[0].sumsq, o.sumsq) for o in split[1:])
    print(worst)
""")


def test_the_triton_kernel_computes_the_torch_paths_values_in_the_interpreter():
    pytest.importorskip("triton", reason="triton is not installed (it comes with CUDA torch); the kernel is "
                                         "checked on the GPU by tools/bench/bench_sketch.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) < 1e-6  # sums of squares: float32 accumulation of 16-bit inputs


def test_the_kernels_tile_and_column_split():
    pytest.importorskip("triton", reason="triton is not installed")
    from veosnap.numerics.sketch_triton import CONFIGS, Config, config_for, launch_plan  # noqa: PLC0415

    assert config_for(torch.bfloat16, 64) is CONFIGS[(torch.bfloat16, 64)]  # measured on the H200
    assert config_for(torch.bfloat16, 16) is CONFIGS[(torch.bfloat16, None)]  # not measured: the default
    config = Config(vec_bytes=16, s=4, levels=5)
    tile = launch_plan(8192, 2374, 64, 2, config, programs_wanted=264)  # bfloat16 logits at width 64
    assert (tile.q, tile.e, tile.block_r, tile.steps_per_program, tile.parts) == (8, 8, 16, 32, 19)
    fp32 = launch_plan(8192, 32, 64, 4, config)
    assert (fp32.q, fp32.e, fp32.block_r, fp32.parts) == (16, 4, 8, 1)
    wide = launch_plan(4, 10, 1024, 2, config)
    assert (wide.q, wide.e) == (32, 32)  # a stripe never spans more than a warp
    few = launch_plan(64, 2374, 64, 2, config, programs_wanted=264)  # few rows: the columns are split more
    assert few.steps_per_program < 32 and 4 * few.parts >= 264
    assert launch_plan(1, 1 << 28, 16, 2, config).parts <= 65535  # the grid's limit


def test_the_batched_compare_finds_each_tensors_worst_group_and_first_bad_row_as_it_alone_would():
    """`compare_sketches` lays every tensor's groups end to end; each tensor's argmax (ties: the first;
    NaN: the largest) and first non-finite row must be the ones it has alone, empty tensors included."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        sizes = torch.randint(0, 6, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen).tolist()
        errors = [torch.randint(0, 3, (n,), generator=gen).double() for n in sizes]
        for e in errors:
            if e.numel() and torch.rand((), generator=gen) < 0.3:
                e[int(torch.randint(0, e.numel(), (), generator=gen))] = float("nan")
        masks = [torch.rand(n, generator=gen) < 0.3 for n in sizes]
        seg, starts, ends = sketch._segments(sizes, torch.device("cpu"))
        worst = sketch._argmax_per_tensor(torch.cat(errors), seg, starts, sizes)
        assert worst.tolist() == [int(e.argmax()) if e.numel() else 0 for e in errors]
        first = sketch._first_true_per_tensor(torch.cat(masks), starts, ends)
        assert first.tolist() == [int(sketch._first_true(m)) if m.numel() else 0 for m in masks]


def test_a_candidates_nonfinite_rows_are_isfinites():
    # The flags come from `x * 0` sums (fewer launches than isfinite on CUDA): the same rows, large values included.
    from veosnap.numerics.sketch import RowSketch, _nonfinite_rows

    for dtype in (torch.float32, torch.float64):
        inf, nan = float("inf"), float("nan")
        values = torch.tensor([[1, 2], [inf, 0], [nan, 1], [3e38, 3e38], [-0.0, -5], [1, 1], [-inf, 1]], dtype=dtype)
        sumsq = torch.tensor([1, 1, 1, 1, 1, inf, 1], dtype=dtype)
        expected = ~(torch.isfinite(sumsq) & torch.isfinite(values).all(dim=1))
        assert torch.equal(_nonfinite_rows(RowSketch(values, sumsq)), expected)
        assert expected.tolist() == [False, True, True, False, False, True, True]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def test_a_candidates_groups_are_the_general_paths_bits_with_reused_counts_and_one_row_groups():
    """A check reduces each sketched tensor with `candidate_from_rows`, passing the counts of an earlier tensor
    of the same spec, mask and support (they do not depend on values), and groups of one row skip the
    pairwise sum. Both give the general path's bits: the masked rows zeroed, padded, summed pairwise per
    group; signed zeros and NaNs included."""
    torch.manual_seed(0)
    mask = torch.rand(37) > 0.3
    for group, row_mask, support_limit in ((1, None, None), (1, mask, None), (3, None, None), (3, mask, None),
                                           (1, None, 20), (2, None, 20)):
        spec = SketchSpec(seed=5, width=8, group=group, shape=(37, 16))
        rows = sketch.RowSketch(torch.randn(37, 8), torch.rand(37))
        sparse = torch.zeros(37, dtype=torch.bool)
        sparse[::3] = True
        if support_limit is not None:  # an embedding-like gradient: only some rows non-zero
            rows = sketch.RowSketch(rows.values * sparse[:, None], rows.sumsq * sparse)
        golden = sketch.golden_from_rows(rows, spec, dtype=torch.float32, row_mask=row_mask,
                                         support_limit=support_limit)
        candidate = sketch.RowSketch(rows.values.clone(), rows.sumsq.clone())
        candidate.values[1, 0], candidate.values[2, 1], candidate.values[3] = -0.0, float("nan"), -0.0
        first = sketch.candidate_from_rows(candidate, golden, dtype=torch.bfloat16, row_mask=row_mask)
        again = sketch.candidate_from_rows(candidate, golden, dtype=torch.bfloat16, row_mask=row_mask,
                                           counts=first.counts)
        # the general path, written out
        values, counts = candidate.values, torch.ones(37, dtype=torch.int64)
        if golden.support is not None:
            values, counts = values.index_select(0, golden.support), torch.ones(golden.spec.support, dtype=torch.int64)
        elif row_mask is not None:
            values, counts = torch.where(row_mask[:, None], values, torch.zeros(())), row_mask.to(torch.int64)
        g, m = golden.spec.groups, golden.spec.group
        values = torch.nn.functional.pad(values, (0, 0, 0, g * m - values.shape[0]))
        counts = torch.nn.functional.pad(counts, (0, g * m - counts.shape[0]))
        expected = sketch.pairwise_sum(values.view(g, m, 8), 1).to(sketch.storage_dtype(torch.bfloat16))
        for made in (first, again):
            assert torch.equal(_bits(made.values), _bits(expected)), (group, row_mask is not None, support_limit)
            assert torch.equal(made.counts, counts.view(g, m).sum(1))
        assert again.counts is first.counts  # reused, not recomputed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: its reductions' thread layout depends on the shape"))])
def test_a_checks_gradients_finished_together_are_each_finished_alone(device):
    """`CandidateReducer.finish_all` (a step's gradients) stacks the plain tensors of one kind and makes their
    non-finite flags, stored values and group distances in one pass each: every figure is `finish`'s of each
    tensor alone, bit for bit (NaN, Inf and signed zeros planted), and what is not plain (a problem, a support,
    wider groups, a kind met once, another dtype) goes through `finish` as before, in the items' order."""
    from veosnap.reference.reduce import CandidateReducer, Rows

    torch.manual_seed(1)
    specs = {f"grad.w{i}": SketchSpec(seed=i, width=8, group=1, shape=(6, 16)) for i in range(4)}
    specs["grad.wide"] = SketchSpec(seed=9, width=8, group=2, shape=(6, 16))  # groups of two rows: alone
    specs["grad.odd"] = SketchSpec(seed=7, width=8, group=1, shape=(5, 16))  # a kind met once
    specs["grad.emb"] = SketchSpec(seed=8, width=8, group=1, shape=(6, 16))  # a support: alone
    for i in range(2):  # groups of two rows (padded: 5 rows), together
        specs[f"grad.g{i}"] = SketchSpec(seed=20 + i, width=8, group=2, shape=(5, 16))
    for i in range(3):  # token tensors (the row mask), one row a group and sixteen rows a group (padded)
        specs[f"layers.{i}.output"] = SketchSpec(seed=30 + i, width=8, group=1, shape=(2, 20, 16))
        specs[f"layers.{i + 3}.output"] = SketchSpec(seed=40 + i, width=8, group=16, shape=(2, 20, 16))
    for i in range(2):  # wide sketches: few groups (norms one by one on CUDA's account) and many
        specs[f"grad.few{i}"] = SketchSpec(seed=50 + i, width=64, group=1, shape=(9, 128))
        specs[f"grad.many{i}"] = SketchSpec(seed=60 + i, width=64, group=1, shape=(40, 128))
    mask = torch.rand(40) > 0.3

    def rows_of(spec: SketchSpec, dtype: torch.dtype) -> sketch.RowSketch:
        acc = sketch.accumulation_dtype(dtype)
        return sketch.RowSketch(torch.randn(spec.rows, spec.width, dtype=acc).to(device),
                                torch.rand(spec.rows, dtype=acc).to(device))

    for dtype in (torch.bfloat16, torch.float32):
        goldens = {}
        for name, spec in specs.items():
            golden_rows = rows_of(spec, dtype)
            if name == "grad.emb":
                even = (torch.arange(6, device=device) % 2 == 0)
                golden_rows = sketch.RowSketch(golden_rows.values * even[:, None], golden_rows.sumsq * even)
            goldens[name] = sketch.golden_from_rows(golden_rows, spec, dtype=dtype,
                                                    support_limit=3 if name == "grad.emb" else None,
                                                    row_mask=mask if name.startswith("layers.") else None)
        items = []
        for name, spec in specs.items():
            candidate = rows_of(spec, dtype)
            if name in ("grad.w1", "grad.g1", "layers.1.output", "layers.5.output"):  # NaN, Inf, signed zeros
                candidate.values[0, 0], candidate.sumsq[2], candidate.values[3] = float("nan"), float("inf"), -0.0
                candidate.values[4] = -candidate.values[4].abs()
            items.append((name, Rows(candidate, dtype)))
        items.insert(2, ("grad.w9", sketch.SketchProblem("shape (1,) but golden (6, 16)")))
        items.append(("grad.w3b", Rows(rows_of(specs["grad.w3"], torch.float16), torch.float16)))  # wrong dtype
        goldens["grad.w3b"] = goldens["grad.w3"]
        alone = CandidateReducer(goldens, mask, device=torch.device(device))
        together = CandidateReducer(goldens, mask, device=torch.device(device))
        expected = {name: alone.finish(name, rows) for name, rows in items}
        made = together.finish_all(items)
        assert list(made) == [name for name, _ in items]
        for name, want in expected.items():
            got = made[name]
            if isinstance(want, sketch.SketchProblem):
                assert got == want, name
                continue
            for field in ("values", "norms", "golden", "off_support"):
                a, b = getattr(want, field), getattr(got, field)
                assert (a is None) == (b is None), (name, field)
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b)), (name, field, dtype)
            assert torch.equal(want.counts, got.counts) and torch.equal(want.nonfinite, got.nonfinite), name
        assert made["grad.w1"].nonfinite.tolist() == [True, False, True, False, False, False]
        assert made["grad.w1"].norms.isnan().any()  # the NaN reaches the group distance as it does alone
        # each kind met more than once was done together: their distances are views of one result
        together_done = [*(f"grad.w{i}" for i in range(4)), "grad.g0", "grad.g1", "grad.many1",
                         *(f"layers.{i}.output" for i in range(6))]
        assert all(made[name].norms._base is not None for name in together_done)
        assert all(made[name].norms._base is None for name in ("grad.wide", "grad.odd", "grad.emb", "grad.few0"))
        assert made["grad.many0"].norms._base is not None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: there the hooks run on the autograd engine's own thread"))])
def test_gradients_sketched_in_the_backwards_hooks_are_the_ones_sketched_after_it_unless_changed_since(device):
    """A check's last pass reduces each sketched gradient in a post-accumulate-grad hook, while the backward still
    runs (`capture.sketched_as_accumulated`): the same rows, bit for bit, as reducing it after the backward; a
    gradient changed in place or replaced after its hook is reduced again, from what it is then."""
    from golden_repo import committed_golden

    from veosnap.golden import names, store
    from veosnap.reference import models
    from veosnap.reference.capture import reduce_gradients, sketched_as_accumulated
    from veosnap.reference.inputs import Batch
    from veosnap.reference.reduce import Reducer
    from veosnap.reference.zoo import Project, load_config

    project = Project.resolve()
    toy = load_config(project.configs, "llama")
    model = models.build(toy, torch.float32, device)
    matrices = {str(names.Grad(n)): SketchSpec(seed=3, width=8, group=1, shape=tuple(p.shape))
                for n, p in model.named_parameters() if p.ndim == 2}

    class Counting(Reducer):  # sketches every matrix's gradient, counts the sketches, keeps rows as they are
        made = 0

        def spec(self, name: str) -> SketchSpec | None:
            return matrices.get(name)

        def keep_rows(self, name, tensor, row_offset=None):  # noqa: ANN001, ANN201
            Counting.made += 1
            return super().keep_rows(name, tensor, row_offset)

        def finish_all(self, items):  # noqa: ANN001, ANN201
            return dict(items)

    reducer = Counting()
    batch = Batch.from_golden(store.read(committed_golden("llama"))).to(device)  # this machine's class
    with sketched_as_accumulated(model, reducer) as accumulated:
        model(**batch.model_kwargs(), use_cache=False).loss.backward()
    assert Counting.made == len(matrices) and set(accumulated) == set(matrices)
    changed, replaced = "grad.model.layers.0.mlp.up_proj.weight", "grad.model.layers.1.self_attn.q_proj.weight"
    model.get_submodule("model.layers.0.mlp.up_proj").weight.grad.mul_(2)
    q = model.get_submodule("model.layers.1.self_attn.q_proj").weight
    q.grad = q.grad.clone()
    Counting.made = 0
    _, hooked = reduce_gradients(model, reducer, accumulated)
    assert Counting.made == 2  # only those two again
    _, after = reduce_gradients(model, reducer)
    assert hooked.keys() == after.keys() == matrices.keys()
    for name in matrices:
        for field in ("values", "sumsq"):
            assert torch.equal(getattr(hooked[name].sketch, field), getattr(after[name].sketch, field)), name
    before = accumulated[changed][2].sketch.values
    assert not torch.equal(before, after[changed].sketch.values)  # the hook's rows were of the gradient before
