"""The benchmark scripts' own surfaces that need no run: reading back saved rows, and the library functions they
time (a tool that times a moved function fails at its first use, on the device, where a run is dear)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "h100-2026-12-07-r10"


def bench_scale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_scale.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_saved_rows_of_two_trees_are_shown_side_by_side_as_markdown():
    # A device call runs the benchmark in the tree and in a baseline tree and brings back their JSON rows; the path
    # table of both is printed here, each row named by its file.
    done = bench_scale("--show", str(RESULTS / "bench_scale-round8-llama-hd128.json"),
                       str(RESULTS / "bench_scale-guard-llama-hd128.json"))
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if "llama-hd128 |" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| bench_scale-round8-llama-hd128/llama-hd128",
                                                     "| bench_scale-guard-llama-hd128/llama-hd128"]
    assert "| 21.4 |" in rows[1]  # the guard tree's path sum, as docs/scale.md round 10 gives it


def test_a_file_that_is_not_saved_rows_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bench.log"
    bad.write_text("not json")
    done = bench_scale("--show", str(bad))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"{bad}: not rows of bench_scale.py's --json (Expecting value: line 1 "
                                                "column 1 (char 0))"]


def in_bench(code: str) -> subprocess.CompletedProcess:
    """`code` run beside the benchmark scripts, in a process of its own (they wrap library functions)."""
    return subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'tools' / 'bench')!r}); "
                           + code], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_benchmarks_time_functions_the_check_still_calls():
    # bench_scale wraps the check's phases (a moved one is reported, its phase reading 0); bench_compare, the
    # compare's parts. One process for both: each import of torch and transformers costs seconds.
    done = in_bench("import bench_scale, bench_compare; bench_scale.instrument()\n"
                    "for owner, name in bench_compare.PARTS:\n"
                    "    assert callable(getattr(owner, name, None)), f'{owner.__name__}.{name}'")
    assert done.returncode == 0, done.stderr
    assert "(moved?)" not in done.stdout
