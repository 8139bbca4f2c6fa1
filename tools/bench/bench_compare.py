"""A check's compare phase alone: host time and operator counts, per size (prints a table).

One `veosnap check` of the size's candidate is run (the golden is recorded first, into `--work`, and
reused when it is there); its judge's inputs are kept, and `runs.check.compare` (every tensor against the
golden: routes, whole tensors, sketched tensors, the verdicts) is then run again on them alone: the
median of `--repeat` runs, and one run under torch.profiler, whose operators are counted (all of them,
and the host reads of a tensor's value, `aten::_local_scalar_dense`: a device sync each on a GPU).
No model is built or run in the timed part, so the figure is free of the candidate's noise.

    python tools/bench/bench_compare.py --sizes llama-17m,qwen3_moe-60m --dtypes bfloat16
    OUT=/tmp/out python tools/bench/bench_compare.py ...    # also writes $OUT/bench_compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_scale  # noqa: E402  (puts the repository first on sys.path)

import veosnap.runs.check as check_module  # noqa: E402
from veosnap.candidates import backends  # noqa: E402
from veosnap.golden import store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.determinism import one_thread  # noqa: E402
from veosnap.reference.zoo import Project  # noqa: E402
from veosnap.runs.record import build_golden, encode_checked  # noqa: E402

import veosnap.numerics.compare as compare_module  # noqa: E402, I001

# The parts of the compare timed apart (medians, ms): routes, whole tensors, sketched tensors, the projections,
# their one read, structure. The middle three queue device work and return (`readback.Later`): with the sync
# after each part, their time is their launches and their arithmetic, and `read_together` the transfer.
PARTS = [(check_module, "compare_route_sets"), (compare_module, "row_errors_later"),
         (compare_module, "compare_sketches_later"), (compare_module, "projections_later"),
         (compare_module, "read_together"), (check_module, "structure_changes")]


# Operators that make or name memory and launch nothing on a GPU (views, allocations).
NO_LAUNCH = {"aten::as_strided", "aten::view", "aten::select", "aten::slice", "aten::unbind", "aten::empty",
             "aten::empty_strided", "aten::expand", "aten::alias", "aten::detach", "aten::unsqueeze",
             "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::permute",
             "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::empty_like", "aten::narrow",
             "aten::squeeze", "aten::movedim", "aten::split", "aten::chunk", "aten::unflatten", "aten::flatten"}


def part_counts(events) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """Per `part.NAME` range (and `rest`: outside every part): (aten ops, launching ops: leaves that are
    kernels on a GPU, not a view or an allocation)."""
    counts: dict[str, list[int]] = {}
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        part, up = "rest", e.cpu_parent
        while up is not None:
            if up.name.startswith("part."):
                part = up.name.removeprefix("part.")
                break
            up = up.cpu_parent
        c = counts.setdefault(part, [0, 0])
        c[0] += 1
        c[1] += not e.cpu_children and e.name not in NO_LAUNCH and e.name != "aten::_local_scalar_dense"
    return {k: (v[0], v[1]) for k, v in counts.items()}


def project_for(size: bench_scale.Size, work: Path) -> Project:
    root = work / size.name
    if (root / "toy_configs").exists():
        return Project.resolve(goldens=root / "goldens", configs=root / "toy_configs", testdata=root / "testdata",
                               hardware_class=bench_scale.hardware.detect())
    return bench_scale.make_project(root, size)


def check_candidate(project, key: GoldenKey, size: bench_scale.Size):  # noqa: ANN001, ANN201
    """One check of the size's first candidate that runs (None when none does)."""
    for spec in size.candidate:
        try:
            return check_module.check(project, key, backends.resolve(spec))
        except Exception:  # noqa: BLE001 - the next candidate of the size
            continue
    return None


def measure(size: bench_scale.Size, dtype: str, work: Path, repeat: int, sketch: str = "auto") -> dict:
    project = project_for(size, work)
    key = GoldenKey(project.hardware_class, size.name, "step", dtype)
    path = store.path_for(project.goldens, key)
    if not path.exists():
        store.write_bytes(encode_checked(build_golden(project, key, allow_near_ties=True, sketch=sketch), path),
                          path, project.goldens)
    kept = []
    judge = check_module.judge

    def keep(golden, batch, result, fields, scenario=None):  # noqa: ANN001, ANN202
        kept.append((golden, batch, result))
        return judge(golden, batch, result, fields, scenario)

    check_module.judge = keep
    try:
        report = check_candidate(project, key, size)
    finally:
        check_module.judge = judge
    golden, batch, result = kept[-1]

    def once() -> None:
        with one_thread():  # as a check judges
            check_module.compare(golden, batch, result.capture, result.replayed, device=result.device,
                                 golden_on=result.golden_on, backend="b", layout="single")
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    once()
    parts: dict[str, list[float]] = {}
    saved = {name: getattr(owner, name) for owner, name in PARTS}

    def timed(name, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                parts.setdefault(name, []).append(time.perf_counter() - start)
        return wrapper

    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    for owner, name in PARTS:  # once more, its parts timed (a sync after each)
        setattr(owner, name, timed(name, saved[name]))
    try:
        for _ in range(repeat):
            once()
    finally:
        for owner, name in PARTS:
            setattr(owner, name, saved[name])
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])

    def marked(name, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            with torch.profiler.record_function(f"part.{name}"):
                return fn(*args, **kwargs)
        return wrapper

    for owner, name in PARTS:
        setattr(owner, name, marked(name, saved[name]))
    try:
        with profile(activities=activities) as prof:
            once()
    finally:
        for owner, name in PARTS:
            setattr(owner, name, saved[name])
    ops = Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
    part_ops = part_counts(prof.events())
    if os.environ.get("BENCH_COMPARE_CPROFILE"):  # where the host time goes, by Python function
        import cProfile
        import pstats

        stats = cProfile.Profile()
        stats.runcall(once)
        pstats.Stats(stats).sort_stats("tottime").print_stats(25)
    whole = sum(1 for n in golden.compared_names() if n not in golden.sketches)
    return {"size": size.name, "dtype": dtype, "passed": report.passed, "tensors": len(golden.compared_names()),
            "sketched": len(golden.sketches), "whole": whole, "compare_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3, "aten_ops": sum(ops.values()),
            "host_reads": ops.get("aten::_local_scalar_dense", 0), "top_ops": ops.most_common(8),
            "parts_ms": {name: statistics.median(v) * 1e3 for name, v in parts.items()}, "part_ops": part_ops}


def parse_args(description: str, repeat: int) -> argparse.Namespace:
    """The options of the benchmarks that replay one check's phase (this one and bench_finish): sizes, dtypes,
    repeats, and the scratch folder they share."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="llama-17m,qwen3_moe-60m",
                        help=f"comma list of {', '.join(bench_scale.SIZES)}")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=repeat)
    parser.add_argument("--work", type=Path, default=Path("/tmp/veosnap-bench-compare"),
                        help="scratch folder for the projects and goldens (reused; shared by bench_compare and "
                             "bench_finish)")
    parser.add_argument("--sketch", default="auto", choices=("auto", "always"),
                        help="the goldens' sketch mode: `always` gives a narrow size the large sizes' compare (every "
                             "tensor sketched), as bench_scale.py's --sketch")
    args = parser.parse_args()
    if args.sketch != "auto":  # its goldens apart from the auto ones, which the same key would name
        args.work = args.work / f"sketch-{args.sketch}"
    return args


def main() -> None:
    args = parse_args(__doc__, repeat=5)
    rows = [measure(bench_scale.SIZES[s], d, args.work, args.repeat, args.sketch)
            for s in args.sizes.split(",") for d in args.dtypes.split(",")]
    print("| size | dtype | tensors (sketched/whole) | compare ms (median, min) | aten ops | host reads | passed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['dtype']} | {r['tensors']} ({r['sketched']}/{r['whole']}) | "
              f"{r['compare_ms']:.1f} ({r['min_ms']:.1f}) | {r['aten_ops']} | {r['host_reads']} | {r['passed']} |")
    for r in rows:
        parts = ", ".join(f"{k} {v:.1f} ms ({r['part_ops'].get(k, (0, 0))[0]} ops, {r['part_ops'].get(k, (0, 0))[1]} "
                          f"launching)" for k, v in r["parts_ms"].items())
        parts += f", rest ({r['part_ops'].get('rest', (0, 0))[0]} ops, {r['part_ops'].get('rest', (0, 0))[1]} launching)"
        print(f"{r['size']} {r['dtype']} parts (ms): {parts}; top ops: {r['top_ops']}")
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_compare.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
