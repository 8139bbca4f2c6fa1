"""Slices of the test files for parallel pytest processes, and one table of their outcomes (tools/gpu/gpu_pytest.sh).

    python tools/gpu/pytest_slices.py plan N [FILE...] [--together FILE...]  # N lines: each slice's test files
    python tools/gpu/pytest_slices.py table JUNIT... [--merged FILE] [--seconds FILE]

`plan` spreads the files (default `tests/test_*.py`) over N slices so that the slowest slice is as
short as it can be made greedily: files longest first, each onto the slice with the least time so far
(LPT), timing each file by `tools/gpu/test_seconds.txt` (`test_file seconds [split]` per line; a file not
listed counts as the median of the listed ones). A file marked `split` that alone would take longer than
an even share (total / N) is cut into that many parts by its test functions (`file::test_name`, found in
its source, the file's time shared by function): mark only files whose module- and session-scoped
fixtures are cheap, since each part sets them up again. Files named by `--together` go whole into one
slice (one process runs them one after another): gpu_pytest.sh puts the tests that hold much GPU memory
there, so that no two of them run at once. Slices are disjoint and cover every test; a slice may be empty
when N exceeds the number of files.

`table` reads the junit reports of the slices and prints one table of outcomes and seconds per test file
(and the total); `--merged` writes them as one junit document, `--seconds` writes the per-file seconds in
the format of `tools/gpu/test_seconds.txt`, to refresh it from a run on the GPU. It exits 1 when a report is
missing or unreadable (that slice's pytest did not get as far as writing it).
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECONDS = ROOT / "tools" / "gpu" / "test_seconds.txt"


def read_weights(path: Path = SECONDS) -> tuple[dict[str, float], set[str]]:
    """`test_file -> seconds` from a weights file (comments after `#`), and the files marked `split`."""
    seconds, split = {}, set()
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) in (2, 3):
                seconds[fields[0]] = float(fields[1])
                if fields[2:] == ["split"]:
                    split.add(fields[0])
    return seconds, split


def known_seconds(path: Path = SECONDS) -> dict[str, float]:
    """`test_file -> seconds` from a weights file."""
    return read_weights(path)[0]


def test_functions(path: Path) -> list[str]:
    """`file::test_x` (and `file::TestX::test_y`) node ids of a test file's functions, from its source."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    ids = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            ids.append(f"{path.as_posix()}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            ids += [f"{path.as_posix()}::{node.name}::{m.name}" for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) and m.name.startswith("test")]
    return ids


def plan(files: list[str], n: int, seconds: dict[str, float], split: frozenset[str] | set[str] = frozenset(),
         functions=test_functions, together: list[str] | tuple[str, ...] = ()) -> list[list[str]]:  # noqa: ANN001
    """`files` in `n` disjoint slices, longest first onto the least loaded slice (ties: by name); a file in
    `split` longer than total / n goes in parts of its test functions (`functions(path)`); the `files` named
    in `together` go whole into one slice."""
    if n < 1:
        raise ValueError(f"--jobs needs at least 1 slice, not {n}")
    default = statistics.median(seconds.values()) if seconds else 1.0
    cost = {f: seconds.get(Path(f).stem, default) for f in files}
    share = sum(cost.values()) / n
    units: list[tuple[float, list[str]]] = []  # (seconds, pytest arguments) placed whole
    group = [f for f in files if f in together]
    if group:
        units.append((sum(cost[f] for f in group), group))
    for f in (f for f in files if f not in group):
        parts = math.ceil(cost[f] / share) if Path(f).stem in split and share > 0 else 1
        ids = functions(Path(f)) if parts > 1 else []
        parts = min(parts, len(ids))
        if parts > 1:
            for k in range(parts):
                chunk = ids[k::parts]
                units.append((cost[f] * len(chunk) / len(ids), chunk))
        else:
            units.append((cost[f], [f]))
    slices: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for seconds_of, args in sorted(units, key=lambda u: (-u[0], u[1])):
        i = min(range(n), key=lambda i: (load[i], i))
        slices[i] += args
        load[i] += seconds_of
    return [sorted(s) for s in slices]


def table(reports: list[Path], merged: Path | None, seconds_out: Path | None) -> int:
    rows, seconds = defaultdict(Counter), Counter()
    suites, missing = ET.Element("testsuites"), []
    for report in reports:
        try:
            root = ET.parse(report).getroot()
        except (OSError, ET.ParseError) as exc:
            missing.append(f"{report}: {exc}")
            continue
        suites.extend(root.iter("testsuite"))
        for case in root.iter("testcase"):
            if not case.get("name"):  # pytest's placeholder in the report of a session ended by the budget
                continue
            parts = (case.get("classname") or "?").split(".")
            where = next((part for part in parts if part.startswith("test_")), parts[0])
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            rows[where][outcome] += 1
            seconds[where] += float(case.get("time", 0))
    print(f"{'test file':28s} {'passed':>7s} {'failed':>7s} {'error':>7s} {'skipped':>8s} {'seconds':>8s}")
    for where in sorted(rows):
        c = rows[where]
        print(f"{where:28s} {c['passed']:7d} {c['failure']:7d} {c['error']:7d} {c['skipped']:8d} {seconds[where]:8.1f}")
    total = sum(rows.values(), Counter())
    print(f"{'total':28s} {total['passed']:7d} {total['failure']:7d} {total['error']:7d} {total['skipped']:8d} "
          f"{sum(seconds.values()):8.1f}")
    for line in missing:
        print(f"no junit report: {line}")
    if merged is not None:
        ET.ElementTree(suites).write(merged, encoding="utf-8", xml_declaration=True)
    if seconds_out is not None:
        seconds_out.write_text("".join(f"{where} {seconds[where]:.1f}\n" for where in sorted(seconds)),
                               encoding="utf-8")
    return 1 if missing else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="print N slices of tests/test_*.py, one per line")
    p.add_argument("n", type=int)
    p.add_argument("files", nargs="*", help="the test files to slice (default: tests/test_*.py)")
    p.add_argument("--together", nargs="*", default=[], help="test files to put whole into one slice")
    t = sub.add_parser("table", help="one table of the slices' junit reports")
    t.add_argument("reports", nargs="+", type=Path)
    t.add_argument("--merged", type=Path, help="write the reports as one junit document here")
    t.add_argument("--seconds", type=Path, help="write `test_file seconds` lines here")
    args = parser.parse_args()
    if args.command == "plan":
        files = args.files or sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py"))
        for s in plan(files, args.n, *read_weights(), together=args.together):
            print(" ".join(s))
        return 0
    return table(args.reports, args.merged, args.seconds)


if __name__ == "__main__":
    sys.exit(main())
