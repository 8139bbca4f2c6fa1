"""tools/pytest_slices.py: the test files spread over parallel pytest processes (tools/gpu_pytest.sh --jobs N),
and one table of their junit reports."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from golden_repo import REPO

spec = importlib.util.spec_from_file_location("pytest_slices", REPO / "tools" / "pytest_slices.py")
slices = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slices)

FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))


@pytest.mark.parametrize("n", [1, 2, 6, 8, len(FILES) + 3])
def test_slices_are_disjoint_and_cover_every_test_file(n):
    plan = slices.plan(FILES, n, slices.known_seconds())
    assert len(plan) == n
    flat = [f for s in plan for f in s]
    assert sorted(flat) == FILES and len(set(flat)) == len(flat)


def test_the_longest_files_go_to_different_slices_and_the_slowest_slice_is_near_the_best():
    seconds = {"test_a": 300, "test_b": 250, "test_c": 100, "test_d": 90, "test_e": 60, "test_f": 10}
    files = [f"tests/{name}.py" for name in seconds]
    plan = slices.plan(files, 3, seconds)
    load = [sum(seconds[Path(f).stem] for f in s) for s in plan]
    assert ["tests/test_a.py" in s for s in plan].count(True) == 1
    assert not any("tests/test_a.py" in s and "tests/test_b.py" in s for s in plan)
    assert max(load) == 300  # a alone: nothing is added to the longest file


def test_a_file_without_a_measured_time_counts_as_the_median():
    plan = slices.plan(["tests/test_new.py", "tests/test_a.py", "tests/test_b.py"], 2,
                       {"test_a": 10, "test_b": 30, "test_c": 20})
    assert plan == [["tests/test_b.py"], ["tests/test_a.py", "tests/test_new.py"]]


def junit(path: Path, cases: list[tuple[str, str, float, str | None]]) -> Path:
    suite = ET.Element("testsuite")
    for classname, name, seconds, outcome in cases:
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=str(seconds))
        if outcome:
            ET.SubElement(case, outcome)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path)
    return path


def test_the_table_merges_the_slices_reports_and_writes_the_seconds(tmp_path, capsys):
    one = junit(tmp_path / "junit-1.xml", [("tests.test_a", "t1", 1.5, None), ("tests.test_a", "t2", 2.0, "failure")])
    two = junit(tmp_path / "junit-2.xml", [("tests.test_b.TestX", "t3", 4.0, "skipped")])
    merged, seconds = tmp_path / "junit.xml", tmp_path / "seconds.txt"
    assert slices.table([one, two], merged, seconds) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["test_a", "1", "1", "0", "0", "3.5"]
    assert lines[2].split() == ["test_b", "0", "0", "0", "1", "4.0"]
    assert lines[3].split() == ["total", "1", "1", "0", "1", "7.5"]
    assert len(list(ET.parse(merged).getroot().iter("testcase"))) == 3
    assert slices.known_seconds(seconds) == {"test_a": 3.5, "test_b": 4.0}


def test_a_slice_without_a_report_is_said_and_fails_the_table(tmp_path, capsys):
    one = junit(tmp_path / "junit-1.xml", [("tests.test_a", "t1", 1.0, None)])
    assert slices.table([one, tmp_path / "junit-2.xml"], None, None) == 1
    assert f"no junit report: {tmp_path / 'junit-2.xml'}" in capsys.readouterr().out
