"""A check's per-tensor reduce (`CandidateReducer.finish`) and its report alone: host ms and operator counts.

One `veosnap check` of the size's candidate is run (the golden recorded into `--work` first, reused when
there); every `finish` call's inputs (and every `finish_all`'s: a step's gradients, finished together) and
the check's report are kept. Then, with no model in the timed part: every kept call again (median of
`--repeat` rounds over all of them, per sketched tensor), and the report's
text and JSON renderings (as `veosnap check` writes them), each once more under torch.profiler, whose
`aten::` operators are counted per call. On a GPU each `aten::` op is at least one kernel launch's host
time (~5-20 us there), so the count is the figure that carries over from this CPU.

    python tools/bench/bench_finish.py --sizes llama-17m,qwen3_moe-60m --dtypes bfloat16
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compare  # noqa: E402
import bench_scale  # noqa: E402  (puts the repository first on sys.path)

from veosnap.golden import store  # noqa: E402
from veosnap.golden.key import GoldenKey  # noqa: E402
from veosnap.reference.reduce import CandidateReducer  # noqa: E402
from veosnap.render import json as render_json  # noqa: E402
from veosnap.render import text as render_text  # noqa: E402
from veosnap.runs.record import build_golden, encode_checked  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# Operators that make or name memory and launch nothing on a GPU (views, allocations).
_NO_LAUNCH = {"aten::as_strided", "aten::view", "aten::select", "aten::slice", "aten::unbind", "aten::empty",
              "aten::empty_strided", "aten::expand", "aten::alias", "aten::detach", "aten::unsqueeze",
              "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::permute",
              "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::empty_like", "aten::narrow"}
_LAUNCHES = "launching"  # the key under which `_ops` also counts the leaf operators not in _NO_LAUNCH
_TOP = "top-level"  # the key under which `_ops` also counts the operators called from Python directly


def _ops(fn) -> Counter:  # noqa: ANN001
    """`aten::` operators under `fn`, nested ones included, by name; plus `_TOP` (those called by Python
    itself) and `_LAUNCHES` (leaf operators that are kernels on a GPU: a launch's host time each there)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    counts[_TOP] = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    counts[_LAUNCHES] = sum(1 for e in events if not e.cpu_children and e.name not in _NO_LAUNCH)
    return counts


def _median_ms(fn, repeat: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(size: bench_scale.Size, dtype: str, work: Path, repeat: int, sketch: str = "auto") -> dict:
    project = bench_compare.project_for(size, work)
    key = GoldenKey(project.hardware_class, size.name, "step", dtype)
    path = store.path_for(project.goldens, key)
    if not path.exists():
        store.write_bytes(encode_checked(build_golden(project, key, allow_near_ties=True, sketch=sketch), path),
                          path, project.goldens)
    kept: list[tuple] = []  # (reducer, [(name, rows), ...]): one `finish` call, or one `finish_all` of a step's gradients
    finish, finish_all = CandidateReducer.finish, CandidateReducer.finish_all
    inside = []

    def keep(self, name, rows):  # noqa: ANN001, ANN202
        if self.check_dtype and not inside:  # the check's own reducer, not the float64 noise run's
            kept.append((self, [(name, rows)]))
        return finish(self, name, rows)

    def keep_all(self, items):  # noqa: ANN001, ANN202
        if self.check_dtype:
            kept.append((self, list(items)))
        inside.append(1)
        try:
            return finish_all(self, items)
        finally:
            inside.pop()

    CandidateReducer.finish, CandidateReducer.finish_all = keep, keep_all
    try:
        report = bench_compare.check_candidate(project, key, size)
    finally:
        CandidateReducer.finish, CandidateReducer.finish_all = finish, finish_all

    def finishes() -> None:
        for reducer, items in kept:
            finish_all(reducer, items)  # one item: `finish` itself

    def reports() -> None:
        render_text.checks([report])
        render_json.checks([report])

    finishes(), reports()
    finish_ops, report_ops = _ops(finishes), _ops(reports)
    calls = max(1, sum(len(items) for _, items in kept))  # per sketched tensor, as before `finish_all`
    return {"size": size.name, "dtype": dtype, "passed": report.passed, "finish_calls": calls,
            "finish_ms_per_call": _median_ms(finishes, repeat) / calls,
            "finish_top_level_per_call": finish_ops.pop(_TOP) / calls,
            "finish_launches_per_call": finish_ops.pop(_LAUNCHES) / calls,
            "finish_ops_per_call": sum(finish_ops.values()) / calls,
            "finish_top": [(k, round(v / calls, 1)) for k, v in finish_ops.most_common(8)],
            "report_ms": _median_ms(reports, repeat),
            "report_ops": sum(report_ops.values()) - report_ops[_TOP] - report_ops[_LAUNCHES],
            "tensors": len(report.tensors)}


def main() -> None:
    args = bench_compare.parse_args(__doc__, repeat=15)
    rows = [measure(bench_scale.SIZES[s], d, args.work, args.repeat, args.sketch)
            for s in args.sizes.split(",") for d in args.dtypes.split(",")]
    print("| size | dtype | sketched tensors finished | finish ms/tensor (median) | aten ops/tensor (all / top-level "
          "/ launching) | report ms (median) | report aten ops | tensors | passed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['dtype']} | {r['finish_calls']} | {r['finish_ms_per_call']:.3f} | "
              f"{r['finish_ops_per_call']:.1f} / {r['finish_top_level_per_call']:.1f} / "
              f"{r['finish_launches_per_call']:.1f} | {r['report_ms']:.1f} | {r['report_ops']} | {r['tensors']} | "
              f"{r['passed']} |")
    for r in rows:
        print(f"{r['size']} {r['dtype']} finish ops per call: {r['finish_top']}")


if __name__ == "__main__":
    main()
