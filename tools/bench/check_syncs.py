"""Where a check waits for the GPU: every synchronizing CUDA call from its step's start to its end, by place.

A check's host work after the candidate's backward (finishing the gradients, assembling, comparing) costs
nothing on the path while the device is still busy with the backward, and all of it once anything waits
for the device. This records a golden of a zoo model (sketching every tensor, as at scale) in a scratch
project, checks a candidate against it once to warm up, then once more under
`torch.cuda.set_sync_debug_mode("warn")` from the step's start, and prints one table: each place in
veosnap that synchronized (its innermost veosnap frame, and the outermost below the check), how often,
and the CUDA call. A check reads its figures once at the end (the compare); anything before that is a
place where the host stopped queueing work behind the device.

    python tools/bench/check_syncs.py                          # llama, bfloat16, sdpa
    python tools/bench/check_syncs.py --model qwen3_moe --dtype float32 --backend eager

Needs CUDA (on the CPU nothing synchronizes: it says so and exits).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import veosnap.candidates.layouts.engine as engine_module  # noqa: E402
from veosnap.candidates import backends  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402
from veosnap.runs.check import check  # noqa: E402
from veosnap.runs.record import record  # noqa: E402

console = Console()
PACKAGE = str(Path(__file__).resolve().parents[2] / "veosnap")


def _places(stack: list[traceback.FrameSummary]) -> tuple[str, str]:
    """The innermost veosnap frame, and the outermost one below the check's entry."""
    ours = [f for f in stack if f.filename.startswith(PACKAGE)]
    if not ours:
        return "(outside veosnap)", ""
    short = lambda f: f"{Path(f.filename).relative_to(Path(PACKAGE).parent)}:{f.lineno} {f.name}"  # noqa: E731
    below = [f for f in ours if f.name not in ("check", "check_layouts", "_check_loaded", "_in_process")]
    return short(ours[-1]), short(below[0]) if below else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--sketch", default="always", choices=("always", "auto", "never"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        console.print("no CUDA device: nothing synchronizes on the CPU")
        return
    with tempfile.TemporaryDirectory(prefix="check-syncs-") as tmp:
        project = Project.resolve(goldens=Path(tmp) / "goldens")
        record(project, args.model, args.dtype, sketch=args.sketch)
        key = GoldenKey(project.hardware_class, args.model, "step", args.dtype)
        backend = backends.resolve(args.backend)
        check(project, key, backend)  # warm: first launches, compiled kernels
        seen: collections.Counter = collections.Counter()
        calls: dict[tuple[str, str], str] = {}
        step = engine_module.forward_backward

        def watched(*a, **k):  # noqa: ANN002, ANN003, ANN202
            torch.cuda.set_sync_debug_mode("warn")
            return step(*a, **k)

        def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001, ARG001
            place = _places(traceback.extract_stack()[:-1])
            seen[place] += 1
            calls.setdefault(place, str(message).split("\n")[0][:60])

        engine_module.forward_backward = watched
        saved = warnings.showwarning
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                report = check(project, key, backend)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = saved
            engine_module.forward_backward = step
    table = Table(title=f"synchronizing calls of one check ({args.model} {args.dtype} {args.backend}, sketch "
                        f"{args.sketch}; {report.status}), from its step's start")
    for column in ("innermost veosnap frame", "outermost below the check", "calls", "warning"):
        table.add_column(column, justify="right" if column == "calls" else "left")
    for (inner, outer), count in seen.most_common():
        table.add_row(inner, outer, str(count), calls[(inner, outer)])
    console.print(table)
    console.print(f"{sum(seen.values())} synchronizing calls at {len(seen)} places")


if __name__ == "__main__":
    main()
