"""tools/gpu/pytest_slices.py: the test files spread over parallel pytest processes (tools/gpu/gpu_pytest.sh --jobs N),
and one table of their junit reports."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from golden_repo import REPO

spec = importlib.util.spec_from_file_location("pytest_slices", REPO / "tools" / "gpu" / "pytest_slices.py")
slices = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slices)

FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))


@pytest.mark.parametrize("n", [1, 2, 6, 8, 10, len(FILES) + 3])
def test_slices_are_disjoint_and_cover_every_test_file(n, monkeypatch):
    monkeypatch.chdir(REPO)  # as gpu_pytest.sh runs it: test files relative to the repository root
    seconds, split = slices.read_weights()
    plan = slices.plan(FILES, n, seconds, split)
    assert len(plan) == n
    flat = [f for s in plan for f in s]
    assert len(set(flat)) == len(flat)
    whole = sorted(f for f in flat if "::" not in f)
    parts = {f.split("::")[0] for f in flat if "::" in f}
    assert sorted([*whole, *parts]) == FILES and not parts & set(whole)
    for f in parts:  # a file cut in parts: every test function of it in exactly one
        assert sorted(i for i in flat if i.startswith(f + "::")) == sorted(slices.test_functions(Path(f)))


def test_a_file_marked_split_and_longer_than_a_share_goes_in_parts_by_test_function(tmp_path):
    heavy = tmp_path / "test_heavy.py"
    heavy.write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n\n\nclass TestC:\n"
                     "    def test_d(self):\n        pass\n\n\ndef helper():\n    pass\n")
    light = [str(tmp_path / f"test_l{i}.py") for i in range(3)]
    seconds = {"test_heavy": 300, "test_l0": 50, "test_l1": 50, "test_l2": 50}
    plan = slices.plan([str(heavy), *light], 3, seconds, {"test_heavy"})  # a share: 150 s, so 2 parts
    heavy_parts = [[i for i in s if "test_heavy" in i] for s in plan]
    assert sorted(map(len, heavy_parts)) == [0, 1, 2]
    assert sorted(i for p in heavy_parts for i in p) == [f"{heavy}::TestC::test_d", f"{heavy}::test_a",
                                                         f"{heavy}::test_b"]
    assert slices.plan([str(heavy), *light], 3, seconds)[0] == [str(heavy)]  # not marked: whole


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


def test_files_named_together_share_one_slice_whole_even_when_marked_split():
    seconds = {"test_a": 300, "test_b": 250, "test_c": 100, "test_d": 90, "test_e": 60, "test_f": 10}
    files = [f"tests/{name}.py" for name in seconds]
    together = ["tests/test_c.py", "tests/test_e.py", "tests/test_f.py"]
    plan = slices.plan(files, 3, seconds, {"test_c"}, together=together)
    [heavy] = [s for s in plan if "tests/test_c.py" in s]
    assert set(together) <= set(heavy) and not any("::" in f for s in plan for f in s)
    assert sorted(f for s in plan for f in s) == sorted(files)
    assert slices.plan(files, 3, seconds) != plan  # without it, c and e go to different slices


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
