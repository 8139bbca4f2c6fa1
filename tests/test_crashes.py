"""Crashes and concurrency never lose a golden or show a torn one.

The kills and races run in tools/measure/kill_and_race.py (a subprocess, so its forks never copy pytest's state);
these tests run it small enough for CI and judge its counts.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_repo import CLASS, golden_path

from veosnap.errors import GoldenError
from veosnap.golden import store

REPO = Path(__file__).resolve().parents[1]
SOURCE = golden_path("llama")


def faults(tmp_path: Path, *argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    script = REPO / "tools" / "measure" / "kill_and_race.py"
    done = subprocess.run([sys.executable, str(script), *argv, "--dir", str(tmp_path),
                           "--json"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.heavy
def test_sigkill_during_recording_never_loses_the_golden(tmp_path):
    stats = faults(tmp_path, "kill", "--mode", "record", "--kills", "21", "--seed", "1")
    assert stats["errors"] == []
    assert stats["readable"] == stats["whole_version"] == stats["listed_once"] == stats["kills"] == 21
    assert stats["lost"] == 0
    # The kills were not all harmless, however busy the machine: a third were staged inside a write (each
    # left its temp file, and the previous golden whole) and a third right after one (each changed the file).
    assert stats["staged_mid_write"] == stats["temps_left_by_staged"] == 7
    assert stats["staged_after_write"] == stats["changed_by_staged"] == 7


def test_sigkill_during_the_write_never_tears_the_golden(tmp_path):
    stats = faults(tmp_path, "kill", "--mode", "write", "--kills", "42", "--seed", "2")
    assert stats["errors"] == []
    assert stats["readable"] == stats["whole_version"] == stats["listed_once"] == stats["kills"] == 42
    # kills landed inside writes (each left its temp file) and between them (the file changed)
    assert stats["staged_mid_write"] == stats["temps_left_by_staged"] == 14
    assert stats["staged_after_write"] == stats["changed_by_staged"] == 14


@pytest.mark.heavy
def test_parallel_recorders_never_interfere(tmp_path):
    stats = faults(tmp_path, "race", "--rounds", "6")
    assert stats["errors"] == []
    assert stats["identical_to_serial"] == stats["different_goldens"] == 2
    assert stats["reads"] > 0
    assert stats["readable"] == stats["whole_version"] == stats["reads"]


def temp_of(path: Path, name: str, age_s: float) -> Path:
    tmp = path.parent / f".{path.name}.{name}.tmp"
    tmp.write_bytes(b"half a golden")
    then = time.time() - age_s
    os.utime(tmp, (then, then))
    return tmp


def test_the_next_write_removes_temp_files_of_killed_writers_only(tmp_path):
    path = tmp_path / CLASS / "llama" / "step-float32.safetensors.zst"
    path.parent.mkdir(parents=True)
    dead = temp_of(path, "dead", age_s=store.STALE_TMP_SECONDS + 5)
    young = temp_of(path, "young", age_s=0)  # its writer may be about to lock it
    busy = temp_of(path, "busy", age_s=store.STALE_TMP_SECONDS + 5)
    with open(busy, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # a live writer, however slow
        store.write_bytes(SOURCE.read_bytes(), path)
    assert store.temp_files(path) == sorted([young, busy])
    assert not dead.exists()
    assert path.read_bytes() == SOURCE.read_bytes()
    assert [p for _, p in store.list_goldens(tmp_path)] == [path]


def test_a_failed_write_leaves_the_previous_golden_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / CLASS / "llama" / "step-float32.safetensors.zst"
    store.write_bytes(SOURCE.read_bytes(), path)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(GoldenError, match=r"cannot write \(No space left on device\)$"):
        store.write_bytes(b"new bytes", path)
    assert path.read_bytes() == SOURCE.read_bytes()
    assert store.temp_files(path) == []
