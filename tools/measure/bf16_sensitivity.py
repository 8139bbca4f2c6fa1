"""How small a systematic error each dtype's goldens catch, and whether any legitimate kernel fails.

Two tables, against the committed goldens of this machine's class:

1. **Minimum detectable perturbation**: for each scaled bug of tests/scaled_faults.py (every attention
   block, the last quarter of positions, one head, every routed expert, one expert, every input norm, the
   first layer's output with its residual, one weight's gradient) x model x dtype, the smallest scale in a
   ladder (10% down to 0.01%) whose check fails, "before" (the whole-model comparison alone: every tensor,
   with the gradients' projections where the golden has their bounds, and every route) and "after" (the
   verdict now, with the isolated parts).
2. **False alarms**: every legitimate candidate (other kernels, another thread count) x model x in-process
   layout in bfloat16: its status, the worst tensor ratio and the worst isolated statistic's ratio.

    python tools/measure/bf16_sensitivity.py                        # qwen3_moe and llama, every candidate
    python tools/measure/bf16_sensitivity.py --model qwen3 --legit sdpa --layout single --no-ladder
    python tools/measure/bf16_sensitivity.py --no-legit --fault one_gradient_scaled
    python tools/measure/bf16_sensitivity.py --no-legit --scenario train --ladder-layout packed --fault packed_attention_scaled
    python tools/measure/bf16_sensitivity.py --no-legit --fault one_expert_scaled+compile --fault miscompiled

The ladder runs one layout and scenario at a time (`--ladder-layout`, `--scenario`; a multi-process layout
runs 2 ranks), and a bug may be composed with a backend (`one_expert_scaled+compile`): the combinations an
isolated run once left out (a compiled candidate, a packed row, sequence parallel) are measured the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from veosnap.candidates import backends  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402
from veosnap.runs.check import check  # noqa: E402
from veosnap.runs.verdict import CheckReport  # noqa: E402

FAULTS = ["attention_scaled", "last_quarter_scaled", "one_head_scaled", "experts_scaled", "one_expert_scaled",
          "norm_scaled", "residual_scaled", "one_gradient_scaled", "packed_attention_scaled", "miscompiled"]
LADDER = [0.1, 0.03, 0.01, 0.003, 0.001, 0.0003, 0.0001]
LEGIT = ["eager", "sdpa", "sdpa_math", "flex_attention", "grouped_mm", "batched_mm", "sdpa+grouped_mm", "compile"]
LAYOUTS = ["single", "packed", "microbatch"]


def whole_model_passed(report: CheckReport) -> bool:
    """The verdict without the isolated parts."""
    return not report.error and not report.structure and report.routes_passed and all(t.passed for t in report.tensors)


def smallest_failing(project: Project, key: GoldenKey, fault: str, layout: str = "single") -> tuple[str, str]:
    """(before, after): the smallest scale of the ladder that fails, '> 10%' if none; 'n/a' where it declines.
    `fault`: a bug of tests/scaled_faults.py, optionally composed with backends (`one_expert_scaled+compile`)."""
    spec = backends.resolve(f"{ROOT / 'tests' / 'scaled_faults.py'}:{fault}")
    before = after = None
    for scale in LADDER:
        os.environ["VEOSNAP_FAULT_SCALE"] = str(scale)  # the ranks of a multi-process layout inherit it
        report = check(project, key, spec, layout, nproc=2)
        if report.skipped:
            return "n/a", "n/a"
        if report.error:
            return "error", report.error[:60]
        if not whole_model_passed(report):
            before = scale
        if not report.passed:
            after = scale
        if report.passed:  # a smaller scale fails no more than this one
            break
    os.environ.pop("VEOSNAP_FAULT_SCALE", None)
    return _pct(before), _pct(after)


def _pct(scale: float | None) -> str:
    if scale is None:
        return f"> {LADDER[0]:.0%}"
    return f"<= {scale * 100:g}%" if scale == LADDER[-1] else f"{scale * 100:g}%"


def ladder(project: Project, models: list[str], dtypes: list[str], faults: list[str] = FAULTS,
           layout: str = "single", scenario: str = "step") -> Table:
    table = Table(title=f"minimum detectable perturbation, {scenario} under {layout} (smallest failing scale; "
                        "before: whole-model comparison only)")
    for col in ("bug", "model", *(f"{d} {w}" for d in dtypes for w in ("before", "after"))):
        table.add_column(col)
    for fault in faults:
        for model in models:
            cells = []
            for dtype in dtypes:
                key = GoldenKey(project.hardware_class, model, scenario, dtype)
                cells += smallest_failing(project, key, fault, layout)
            if set(cells) != {"n/a"}:
                table.add_row(fault, model, *cells)
    return table


def false_alarms(project: Project, models: list[str], legit: list[str], layouts: list[str]) -> Table:
    table = Table(title="legitimate candidates in bfloat16 (ratio: error/bound; isolated: worst statistic)")
    for col in ("candidate", "model", "layout", "status", "worst tensor", "worst isolated", "s"):
        table.add_column(col)
    for spec in legit:
        threads = spec.startswith("eager@")
        for model in models:
            key = GoldenKey(project.hardware_class, model, "step", "bfloat16")
            for layout in layouts:
                saved = torch.get_num_threads()
                if threads:
                    torch.set_num_threads(int(spec.split("@")[1]))
                start = time.perf_counter()
                report = check(project, key, backends.resolve("eager" if threads else spec), layout)
                torch.set_num_threads(saved)
                seconds = f"{time.perf_counter() - start:.1f}"
                if report.skipped or report.error:
                    table.add_row(spec, model, layout, report.status, (report.skipped or report.error)[:70], "", seconds)
                    continue
                worst = report.worst
                iso = report.isolated_ranked()[0] if report.isolated else None
                table.add_row(spec, model, layout, report.status,
                              f"{worst.ratio:.3g}x {worst.name}" if worst else "",
                              f"{iso.ratio:.3g}x {iso.place} ({iso.statistic})" if iso else report.not_isolated, seconds)
    return table


def _fault(value: str) -> str:
    if value.split("+")[0] not in FAULTS:
        raise argparse.ArgumentTypeError(f"{value!r}: a bug of tests/scaled_faults.py ({', '.join(FAULTS)}), "
                                         "optionally +backend")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="zoo models (default: qwen3_moe, llama)")
    parser.add_argument("--legit", action="append", help=f"legitimate candidates (default: {', '.join(LEGIT)}, eager@1)")
    parser.add_argument("--layout", action="append", help=f"layouts of the false-alarm table (default: {', '.join(LAYOUTS)})")
    parser.add_argument("--no-ladder", action="store_true", help="only the false-alarm table")
    parser.add_argument("--fault", action="append", type=_fault,
                        help=f"the ladder's bugs, each optionally +backend (default: {', '.join(FAULTS)})")
    parser.add_argument("--ladder-layout", default="single", help="the ladder's layout (default: single)")
    parser.add_argument("--scenario", default="step", choices=["step", "train"], help="the ladder's scenario")
    parser.add_argument("--no-legit", action="store_true", help="only the ladder")
    args = parser.parse_args()
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    models = args.model or ["qwen3_moe", "llama"]
    console = Console(width=200)
    if not args.no_ladder:
        console.print(ladder(project, models, ["float32", "bfloat16"], args.fault or FAULTS, args.ladder_layout,
                             args.scenario))
    if not args.no_legit:
        legit = args.legit or [*LEGIT, "eager@1"]
        console.print(false_alarms(project, models, legit, args.layout or LAYOUTS))


if __name__ == "__main__":
    main()
