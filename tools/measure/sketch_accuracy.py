"""How good a row-sketch estimate is, and whether sketching loses power (docs/sketch.md).

Part `accuracy`: the sketch's estimate of a group's error against the exact one, for widths 8..256
and groups of 1..16 rows, on differences between the toy zoo's committed goldens (bfloat16 against
float32: real precision differences, and planted patterns) and on real-width synthetic tensors
(2048 columns); quantiles of |estimate / exact - 1|, and how much a tensor's maximum over groups
inflates (estimate max / exact max).

Part `power`: the planted bugs of tests/faults.py and the legitimate backends on every toy model in
float32 and bfloat16, checked exactly (veosnap's compare, against the committed goldens) and with
every tensor sketched (the golden sketched at each level, bounds recalibrated on the sketched
float64 run). Every bug the exact check catches must still fail; no legitimate backend may pass 1x.

Part `sizes`: the planner's choice for real-width goldens (Qwen3-like shapes, 8192 tokens).

    python tools/measure/sketch_accuracy.py [--part sizes|accuracy|power|all] [--model NAME]... [--json PATH]

CPU only, one thread; about 20 s for all parts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import faults  # noqa: E402
from sketch_shapes import REAL_SHAPES, golden_shapes, parameters  # noqa: E402

from veosnap import Unsupported  # noqa: E402
from veosnap.candidates import backends  # noqa: E402
from veosnap.candidates.layouts import engine, registry  # noqa: E402
from veosnap.candidates.layouts.protocol import LayoutContext  # noqa: E402
from veosnap.golden import codec, names, store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.golden.manifest import Tolerance  # noqa: E402
from veosnap.numerics import tolerance  # noqa: E402
from veosnap.numerics.metric import is_token_tensor  # noqa: E402
from veosnap.numerics.sketch import (  # noqa: E402
    GoldenSketch,
    Plan,
    SketchSpec,
    clamp_group,
    compare_sketch,
    pairwise_sum,
    plan,
    record_sketch,
    row_layout,
    rowsketch,
    seed_for,
    sketch_noise,
)
from veosnap.reference import models  # noqa: E402
from veosnap.reference.capture import run_step  # noqa: E402
from veosnap.reference.determinism import deterministic  # noqa: E402
from veosnap.reference.inputs import Batch  # noqa: E402
from veosnap.reference.zoo import Project, load_config  # noqa: E402
from veosnap.runs.check import judge  # noqa: E402

WIDTHS = (8, 16, 32, 64, 128, 256)
GROUPS = (1, 2, 4, 8, 16)
# Levels of the power experiment, each applied to every tensor (groups narrowed to leave a tensor at
# least MIN_GROUPS groups, as the planner does): the planner's finest ones, what it gives a
# 1B-parameter golden (tokens in pairs, the largest gradients in groups of up to 64 at width 16),
# and two below anything it chooses for tokens (to show where power goes).
POWER_LEVELS = {
    "64x1": lambda name: (64, 1),
    "32x1": lambda name: (32, 1),
    "32x4": lambda name: (32, 4),
    "1B-like": lambda name: (32, 2) if is_token_tensor(name) else (16, 64),
    "16x16": lambda name: (16, 16),
    "8x1": lambda name: (8, 1),
}
LEGIT = ("sdpa", "grouped_mm", "batched_mm")
console = Console(width=170)


# --- part 1: accuracy ----------------------------------------------------------------------------------


@dataclass
class Estimates:
    """Per (source, difference, width, group): relative errors of group estimates, and inflations."""

    relative: dict[tuple, list[torch.Tensor]] = field(default_factory=dict)
    inflation: dict[tuple, list[float]] = field(default_factory=dict)  # estimate max / exact group max
    row_inflation: dict[tuple, list[float]] = field(default_factory=dict)  # estimate max / exact row max

    def add(self, source: str, kind: str, diff: torch.Tensor, mask: torch.Tensor | None, seed: int) -> None:
        rows = diff.reshape(-1, diff.shape[-1]).double() if diff.ndim > 1 else diff.reshape(-1, 1).double()
        keep = torch.ones(rows.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1)
        row_sq = torch.where(keep, rows.pow(2).sum(1), torch.zeros(()))
        if row_sq.max() == 0:
            return
        for width in WIDTHS:
            per_row = rowsketch(rows, width, seed).values
            per_row = torch.where(keep[:, None], per_row, torch.zeros(()))
            for group in GROUPS:
                groups = -(-rows.shape[0] // group)
                pad = groups * group - rows.shape[0]
                est = pairwise_sum(torch.nn.functional.pad(per_row, (0, 0, 0, pad)).view(groups, group, width), 1)
                est = est.pow(2).sum(1)
                exact = torch.nn.functional.pad(row_sq, (0, pad)).view(groups, group).sum(1)
                counts = torch.nn.functional.pad(keep.long(), (0, pad)).view(groups, group).sum(1).clamp(min=1)
                live = exact > 0
                key = (source, kind, width, group)
                self.relative.setdefault(key, []).append((est[live] / exact[live]).sqrt() - 1)
                est_max = (est / counts).sqrt().max().item()
                self.inflation.setdefault(key, []).append(est_max / (exact / counts).sqrt().max().item())
                self.row_inflation.setdefault(key, []).append(est_max / row_sq.sqrt().max().item())


def patterns(g: torch.Tensor, gen: torch.Generator, head: int) -> dict[str, torch.Tensor]:
    """Planted differences on a golden tensor (rows are its last dimension)."""
    rows = g.reshape(-1, g.shape[-1]).double()
    scale = rows.norm(dim=1, keepdim=True).clamp(min=1e-12) / math.sqrt(rows.shape[1])
    out = {"spread": 1e-3 * scale * torch.randn(rows.shape, generator=gen, dtype=torch.float64)}
    one_row = torch.zeros_like(rows)
    r = int(torch.randint(0, rows.shape[0], (1,), generator=gen))
    one_row[r] = 1e-2 * rows[r] + 1e-3 * scale[r] * torch.randn(rows.shape[1], generator=gen, dtype=torch.float64)
    out["one row"] = one_row
    element = torch.zeros_like(rows)
    element[r, int(torch.randint(0, rows.shape[1], (1,), generator=gen))] = scale[r, 0]
    out["one element"] = element
    if rows.shape[1] >= 2 * head:
        block = torch.zeros_like(rows)
        start = head * int(torch.randint(0, rows.shape[1] // head, (1,), generator=gen))
        block[:, start : start + head] = 1e-3 * scale * torch.randn(rows.shape[0], head, generator=gen, dtype=torch.float64)
        out[f"one head ({head} cols)"] = block
        strided = torch.zeros_like(rows)
        strided[:, ::head] = 1e-3 * scale * torch.randn(rows.shape[0], rows.shape[1] // head, generator=gen, dtype=torch.float64)
        out["every head's dim 0"] = strided
    return {k: v.reshape(g.shape) for k, v in out.items()}


def accuracy(project: Project, model_names: list[str]) -> Estimates:
    est = Estimates()
    gen = torch.Generator().manual_seed(0)
    for model in model_names:
        f32 = store.read(store.path_for(project.goldens, GoldenKey("cpu", model, "step", "float32")))
        bf16 = store.read(store.path_for(project.goldens, GoldenKey("cpu", model, "step", "bfloat16")))
        mask = Batch.from_golden(f32).token_mask
        head = int(f32.manifest.config.get("head_dim", 16))
        for name in f32.compared_names():
            g = f32.tensors[name]
            if g.ndim < 2 or isinstance(names.parse(name), names.Route):
                continue  # a 1-D tensor's rows are single elements: sketched exactly
            m = mask if is_token_tensor(name) else None
            seed = seed_for(name)
            est.add("toy goldens", "bf16 vs f32 golden", bf16.tensors[name].double() - g.double(), m, seed)
            for kind, diff in patterns(g, gen, head).items():
                est.add("toy goldens", kind, diff, m, seed)
    # Real widths: 2048 columns (hidden 2048, 16 heads of 128), golden-like rows of varying norms.
    rows = 2048
    g = torch.randn(rows, 2048, generator=gen, dtype=torch.float64) * torch.rand(rows, 1, generator=gen).add(0.5)
    for kind, diff in patterns(g, gen, 128).items():
        est.add("width 2048", kind, diff, None, 1)
    return est


def print_accuracy(est: Estimates) -> dict:
    out = {}
    for source in ("toy goldens", "width 2048"):
        table = Table(title=f"sketch estimate of a group's error vs exact ({source}): |estimate/exact - 1| "
                            "quantiles over groups, and max-over-groups inflation (median, max over tensors)")
        for col in ("width", "rows/group", "1/sqrt(2k)", "median", "p90", "p99", "max",
                    "inflation of max (group)", "inflation of max (row)"):
            table.add_column(col, justify="right")
        for width in WIDTHS:
            for group in GROUPS:
                rel = [torch.cat(v) for k, v in est.relative.items() if k[0] == source and k[2:] == (width, group)]
                if not rel:
                    continue
                rel = torch.cat(rel).abs()
                infl = [x for k, v in est.inflation.items() if k[0] == source and k[2:] == (width, group) for x in v]
                rinfl = [x for k, v in est.row_inflation.items() if k[0] == source and k[2:] == (width, group) for x in v]
                q = torch.quantile(rel.float(), torch.tensor([0.5, 0.9, 0.99])).tolist()
                row = [f"{q[0]:.3f}", f"{q[1]:.3f}", f"{q[2]:.3f}", f"{rel.max().item():.3f}",
                       f"{_median(infl):.2f} / {max(infl):.2f}", f"{_median(rinfl):.2f} / {max(rinfl):.2f}"]
                out[f"{source}|{width}|{group}"] = row
                table.add_row(str(width), str(group), f"{1 / math.sqrt(2 * width):.3f}", *row)
        console.print(table)
    kinds = sorted({k[1] for k in est.relative})
    table = Table(title="p99 of |estimate/exact - 1| per difference, one row per group, all sources")
    table.add_column("difference")
    for width in WIDTHS:
        table.add_column(f"k={width}", justify="right")
    for kind in kinds:
        cells = []
        for width in WIDTHS:
            rel = [torch.cat(v) for k, v in est.relative.items() if k[1] == kind and k[2:] == (width, 1)]
            cells.append(f"{torch.quantile(torch.cat(rel).abs().float(), 0.99).item():.3f}" if rel else "-")
        table.add_row(kind, *cells)
    console.print(table)
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# --- sizes: the planner on real widths -------------------------------------------------------------------


def sizes() -> dict:
    """The planner's choice for real-width goldens (shapes only; nothing is allocated)."""
    table = Table(title="golden bytes at real widths, 8192 tokens (planner: 16 MiB target, 64 MiB hard limit)")
    for col in ("model", "layers", "params", "dtype", "whole", "planned", "whole tensors", "logits", "layer outputs",
                "q_proj grad", "embed grad", "largest group"):
        table.add_column(col, justify="right")
    out = {}
    for model in REAL_SHAPES:
        for layers in (2, 4):
            for dtype in ("bfloat16", "float32"):
                shapes, fixed = golden_shapes(model, layers, dtype=dtype)
                chosen = plan(shapes, fixed_bytes=fixed)
                whole = fixed + sum(t.exact_bytes for t in shapes)

                def level(name: str, chosen: Plan = chosen) -> str:
                    spec = chosen.choice(name).spec
                    return "whole" if spec is None else f"{spec.width}x{spec.group}"

                coarsest = max((c for c in chosen.choices if c.spec), key=lambda c: (c.spec.group, c.name))
                out[f"{model.name}|{layers}|{dtype}"] = {"whole": whole, "planned": chosen.total_bytes}
                table.add_row(model.name, str(layers), f"{parameters(model, layers) / 1e9:.2f}B", dtype,
                              f"{whole / 2**30:.1f} GiB", f"{chosen.total_bytes / 2**20:.1f} MiB",
                              str(sum(c.exact for c in chosen.choices)), level("logits"), level("layers.0.output"),
                              level("grad.model.layers.0.self_attn.q_proj.weight"),
                              level("grad.model.embed_tokens.weight"),
                              f"{coarsest.spec.width}x{coarsest.spec.group} {coarsest.name.removeprefix('grad.model.')}")
    console.print(table)
    return out


# --- part 2: power --------------------------------------------------------------------------------------


@dataclass
class Verdict:
    candidate: str
    kind: str  # legit, large, small, precision
    model: str
    dtype: str
    exact: float  # worst ratio (inf: routes differ or a problem)
    sketched: dict[tuple[int, int], float]
    where: str = ""
    note: str = ""


def reference_and_truth(project: Project, gold: codec.Golden) -> dict[str, torch.Tensor]:
    """The float64 run of the golden's reference, as record.build_golden makes it (step scenario)."""
    key = gold.key
    toy = load_config(project.configs, key.model)
    seed = gold.manifest.reference.seed
    with deterministic():
        torch.manual_seed(seed)
        model = models.build(toy, models.dtype_from_name(key.dtype), "cpu", seed)
        high = models.upcast_copy(model, toy, torch.float64)
        del model
        with models.KeepFloat64():
            truth = run_step(high, Batch.from_golden(gold), own_loss=True)
    return truth.all_tensors()


def sketched_tolerances(gold: codec.Golden, truth: dict[str, torch.Tensor], level
                        ) -> tuple[dict[str, GoldenSketch], dict[str, Tolerance]]:
    """Every compared tensor but the loss and routes sketched at `level(name)`, bounds from the sketched
    noise (pooled as record pools exact noise, a group counting as a row)."""
    mask = Batch.from_golden(gold).token_mask
    sketches, measured = {}, {}
    for name in gold.compared_names():
        g = gold.tensors[name]
        if name == str(names.LOSS) or isinstance(names.parse(name), names.Route) or g.ndim == 0:
            continue
        width, group = level(name)
        spec = SketchSpec(seed=seed_for(name), width=width, group=clamp_group(group, row_layout(g.shape)[0]),
                          shape=tuple(g.shape))
        m = mask if is_token_tensor(name) else None
        sketches[name] = record_sketch(g, spec, row_mask=m, name=name)
        err = sketch_noise(sketches[name], truth[name], row_mask=m, name=name)
        measured[name] = SimpleNamespace(error=err.error, rows=err.groups)  # a max over this many groups
    pooled = tolerance.pooled_noises(measured)
    return sketches, {n: tolerance.tolerance_for(v, gold.key.dtype) for n, v in pooled.items()}


def run_candidate(project: Project, gold: codec.Golden, spec: str):  # noqa: ANN201
    """The candidate's report and capture as `veosnap check` makes them (route replay when routes differ)."""
    ctx = LayoutContext.checking(gold, load_config(project.configs, gold.key.model), torch.device("cpu"))
    with deterministic():
        result = engine.run(registry.LAYOUTS["single"], backends.resolve(spec), ctx)
    report = judge(gold, ctx.batch, result, {"backend": spec})
    return report, (result.replayed if result.replayed is not None else result.capture)


def power(project: Project, model_names: list[str]) -> list[Verdict]:
    candidates = [(b, "legit", b) for b in LEGIT]
    candidates += [(f"tests/faults.py:{n}", size, n) for n, (size, _) in faults.FAULTS.items()]
    candidates += [(f"tests/faults.py:{n}", "precision", n) for n in faults.PRECISION_FAULTS]
    verdicts = []
    for model in model_names:
        for dtype in ("float32", "bfloat16"):
            started = time.perf_counter()
            gold = store.read(store.path_for(project.goldens, GoldenKey("cpu", model, "step", dtype)))
            truth = reference_and_truth(project, gold)
            _check_truth(gold, truth)
            levels = {label: sketched_tolerances(gold, truth, level) for label, level in POWER_LEVELS.items()}
            mask = Batch.from_golden(gold).token_mask
            for spec, kind, label in candidates:
                try:
                    report, source = run_candidate(project, gold, str(ROOT / spec) if spec.startswith("tests/") else spec)
                except Unsupported as exc:
                    verdicts.append(Verdict(label, kind, model, dtype, float("nan"), {}, note=f"skipped: {exc}"))
                    continue
                exact = {t.name: t for t in report.tensors}
                routes_ok = report.routes_passed
                worst = report.worst
                exact_ratio = worst.ratio if routes_ok and worst else float("inf")
                produced = source.all_tensors()
                sketched = {}
                for level, (sketches, tols) in levels.items():
                    ratio = 0.0 if routes_ok else float("inf")
                    for name, result in exact.items():
                        if name not in sketches or result.problem:
                            ratio = max(ratio, result.ratio)
                            continue
                        m = mask if is_token_tensor(name) else None
                        err = compare_sketch(sketches[name], produced[name], bound=tols[name].bound, row_mask=m, name=name)
                        ratio = max(ratio, err.error / tols[name].bound)
                    sketched[level] = ratio
                where = "routes" if not routes_ok else (worst.name if worst else "")
                verdicts.append(Verdict(label, kind, model, dtype, exact_ratio, sketched, where))
            console.print(f"  {model} {dtype}: {time.perf_counter() - started:.1f}s", style="dim")
    return verdicts


def _check_truth(gold: codec.Golden, truth: dict[str, torch.Tensor]) -> None:
    """The re-run float64 twin must give the golden's own recorded noise (else the experiment is off)."""
    mask = Batch.from_golden(gold).token_mask
    for name in ("logits", "layers.0.output"):
        recorded = gold.manifest.tolerance[name].noise
        again = tolerance.noise(name, gold.tensors[name], truth[name], mask).error
        if not math.isclose(recorded, again, rel_tol=1e-9, abs_tol=1e-15):
            raise SystemExit(f"{gold.key}: float64 re-run gives noise {again:.6g} for {name}, golden says {recorded:.6g}")


def print_power(verdicts: list[Verdict]) -> dict:
    table = Table(title="worst err/bound, exact vs every tensor sketched (bounds from the sketched float64 run); "
                        "bugs: smallest over the models the exact check fails, legit: largest")
    for col in ("candidate", "kind", "dtype", "exact", *POWER_LEVELS):
        table.add_column(col, justify="right")
    summary = {}
    keys = sorted({(v.candidate, v.kind, v.dtype) for v in verdicts}, key=lambda k: (k[1] != "legit", k[1], k[0], k[2]))
    for cand, kind, dtype in keys:
        rows = [v for v in verdicts if (v.candidate, v.kind, v.dtype) == (cand, kind, dtype) and v.sketched]
        if not rows:
            continue
        if kind == "legit":
            exact = max(v.exact for v in rows)
            cells = [max(v.sketched[lv] for v in rows) for lv in POWER_LEVELS]
            ok = [c <= 1 for c in cells]
        else:
            caught = [v for v in rows if v.exact > 1]
            if not caught:
                exact = max(v.exact for v in rows)
                cells = [max(v.sketched[lv] for v in rows) for lv in POWER_LEVELS]
                ok = [True] * len(cells)
            else:
                exact = min(v.exact for v in caught)
                cells = [min(v.sketched[lv] for v in caught) for lv in POWER_LEVELS]
                ok = [c > 1 for c in cells]
        label = f"{len(caught)}/{len(rows)} fail" if kind != "legit" else f"{len(rows)} models"
        table.add_row(cand, kind, dtype, f"{_r(exact)} ({label})",
                      *(f"{_r(c)}" + ("" if good else " !") for c, good in zip(cells, ok)))
        summary[f"{cand}|{dtype}"] = {"exact": exact, **dict(zip(POWER_LEVELS, cells))}
    console.print(table)
    for level in POWER_LEVELS:
        missed = [v for v in verdicts if v.kind != "legit" and v.sketched and v.exact > 1 and v.sketched[level] <= 1]
        alarms = [v for v in verdicts if v.kind == "legit" and v.sketched and v.sketched[level] > 1]
        console.print(f"{level}: bugs the exact check catches and the sketch misses: "
                      f"{', '.join(f'{v.candidate}/{v.model}/{v.dtype}' for v in missed) or 'none'}; "
                      f"legitimate backends over 1x: {', '.join(f'{v.candidate}/{v.model}/{v.dtype}' for v in alarms) or 'none'}")
    return summary


def _r(x: float) -> str:
    return "routes" if x == float("inf") else "-" if math.isnan(x) else f"{x:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("sizes", "accuracy", "power", "all"), default="all")
    parser.add_argument("--model", action="append")
    parser.add_argument("--json", type=Path, help="write the tables' numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest on a shared machine, and reproducible
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    names = args.model or project.models()
    results = {}
    started = time.perf_counter()
    if args.part in ("sizes", "all"):
        results["sizes"] = sizes()
    if args.part in ("accuracy", "all"):
        results["accuracy"] = print_accuracy(accuracy(project, names))
    if args.part in ("power", "all"):
        results["power"] = print_power(power(project, names))
    console.print(f"{time.perf_counter() - started:.0f}s on {torch.get_num_threads()} threads")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
