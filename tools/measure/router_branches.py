"""How much each branch of each MoE family's routing code changes the toy goldens' result.

Checks every perturbation of `tests/router_branches.py` against the committed cpu `step` goldens and
prints, per family and branch: the tokens sent elsewhere (clear route flips, summed over MoE layers,
out of real tokens x layers) and, when every token is routed as the golden, the worst routing-weight
tensor's error/bound ratio. docs/routers.md quotes the table.

    python tools/measure/router_branches.py [--dtype float32] [--family NAME]...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import router_branches as rb  # noqa: E402

from veosnap.candidates import backends  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402
from veosnap.runs.check import check  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--family", action="append")
    args = parser.parse_args()
    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    branches_file = ROOT / "tests" / "router_branches.py"
    print(f"| family | backend | branch changed | tokens moved ({args.dtype}) | worst routes.N.weights ratio | verdict |")
    print("|---|---|---|---|---|---|")
    for family in args.family or list(rb.BRANCHES):
        key = GoldenKey(project.hardware_class, family, "step", args.dtype)
        for backend, what, _notice in rb.BRANCHES[family]:
            report = check(project, key, backends.resolve(f"{branches_file}:{backend}"))
            if report.error or report.skipped:
                print(f"| {family} | {backend} | {what} | - | - | {report.error or report.skipped} |")
                continue
            moved = sum(r.clear_flips for r in report.routes)
            slots = sum(r.tokens for r in report.routes)
            weights = [t.ratio for t in report.tensors if t.name.startswith("routes.") and t.name.endswith(".weights")]
            ratio = f"{max(weights):.3g}" if weights and moved == 0 else "-"
            verdict = "pass" if report.passed else "FAIL"
            print(f"| {family} | `{backend}` | {what} | {moved} of {slots} | {ratio} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
