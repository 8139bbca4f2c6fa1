"""Multi-process checks end cleanly however they are stopped, and blame the right rank; `verify` of a
directory with nothing to verify says so (issue 12, item 11).

The signal tests start `veosnap check --layout ddp` with a rank that hangs, in a subprocess whose temp
directory is private, find its torchrun and ranks by that directory in their command lines, stop the
parent, and wait (with a generous deadline: a liveness check, not a timing one) for all of them to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO, gpus_for

from veosnap.candidates.layouts import torchrun
from veosnap.surfaces.cli import main

FAULTS = REPO / "tests" / "layout_faults.py"
DEADLINE_S = 120


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line mentions `text` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def wait_for(condition, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"still waiting after {DEADLINE_S} s for {what}")


# `veosnap check`, getting Ctrl-C as a terminal's foreground command does. A test run started in the background
# by a non-interactive shell (`pytest ... &`, as a CI script may) ignores SIGINT, every child inherits that, and
# Python then installs no KeyboardInterrupt handler: the check would rightly ignore the SIGINT sent to it.
AS_IF_IN_A_TERMINAL = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "runpy.run_module('veosnap', run_name='__main__', alter_sys=True)")


def start_hanging_ddp_check(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    private = tmp_path / "tmp"
    private.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TMPDIR": str(private)}
    # -X faulthandler: a parent that does not end is made to print every thread's stack (`ended`).
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", AS_IF_IN_A_TERMINAL, "check", "--goldens", str(REPO / "goldens"),
                             "--configs", str(REPO / "toy_configs"), "--testdata", str(REPO / "testdata"),
                             "--hardware-class", CLASS, "--model", "llama", "--dtype", "float32",
                             "--layout", f"{FAULTS}:ddp_hang", "--timeout", "600"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Both ranks are up once the worker module runs in two processes besides torchrun.
    wait_for(lambda: len(processes_mentioning(f"{private}/veosnap-layouts-")) >= 3, "torchrun and its two ranks")
    return proc, private


def ended(proc: subprocess.Popen) -> str:
    """The stopped parent's stderr once it has ended; if it has not within the deadline, the test fails with
    where each of its threads was (SIGABRT makes faulthandler print them), not a bare timeout."""
    try:
        return proc.communicate(timeout=DEADLINE_S)[1].decode(errors="replace")
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, err = proc.communicate(timeout=DEADLINE_S)
        raise AssertionError(f"the parent still ran {DEADLINE_S} s after it was stopped; its threads:\n"
                             f"{err.decode(errors='replace')[-6000:]}") from None


@gpus_for(2)  # two ddp ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_item11_stopping_a_multi_process_check_ends_torchrun_its_ranks_and_its_temp_directory(tmp_path, sig):
    proc, private = start_hanging_ddp_check(tmp_path)
    proc.send_signal(sig)
    err = ended(proc)
    assert proc.returncode == 128 + sig, err
    wait_for(lambda: not processes_mentioning(str(private)), "torchrun and its ranks to end")
    assert list(private.glob("veosnap-layouts-*")) == list(private.glob("torchelastic_*")) == []


@gpus_for(2)  # two ddp ranks: NCCL, one GPU each, on a CUDA machine
def test_item11_a_killed_parent_takes_torchrun_along_and_the_next_run_removes_what_it_left(tmp_path):
    proc, private = start_hanging_ddp_check(tmp_path)
    proc.kill()
    proc.communicate(timeout=DEADLINE_S)
    wait_for(lambda: not processes_mentioning(str(private)), "torchrun and its ranks to end by parent death")
    (left,) = private.glob("veosnap-layouts-*")  # SIGKILL gives the parent no chance to clean up
    old = time.time() - torchrun.STALE_S - 1
    os.utime(left, (old, old))

    assert torchrun.remove_stale(private) == [left]
    assert list(private.glob("veosnap-layouts-*")) == []


@gpus_for(2)  # two ddp ranks: NCCL, one GPU each, on a CUDA machine
def test_item11_a_live_runs_temp_directory_is_never_taken_for_stale(tmp_path):
    proc, private = start_hanging_ddp_check(tmp_path)
    try:
        (live,) = private.glob("veosnap-layouts-*")
        old = time.time() - torchrun.STALE_S - 1
        os.utime(live, (old, old))
        assert torchrun.remove_stale(private) == [] and live.is_dir()
    finally:
        proc.terminate()
        proc.communicate(timeout=DEADLINE_S)


# torchrun's summary when the last rank raised (it wrote why) and torchrun then stopped rank 0 with SIGTERM.
STOPPED_AFTER = """\
W1130 11:40:46.819000 29273 torch/distributed/elastic/multiprocessing/api.py:900] Sending process 29277 closing signal SIGTERM
E1130 11:40:46.819000 29273 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 29278) of binary: python
Failures:
[1]:
  time      : 2026-11-30_11:40:46
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 29277)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 29277
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_11:40:46
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 29278)
  error_file: <N/A>
"""


def test_item11_the_rank_that_failed_first_is_blamed_not_the_one_torchrun_stopped_afterwards():
    errors = {1: "rank 1: RuntimeError: bad shard (at layout.py:3)"}
    assert torchrun.explain_failure(STOPPED_AFTER, errors, 1, 9.4) == errors[1]
    # Without its message, the rank that exited by itself is still the one named.
    assert torchrun.explain_failure(STOPPED_AFTER, {}, 1, 9.4) == "rank 1 exited with status 1 after 9 s"


@gpus_for(2)  # two ddp ranks: NCCL, one GPU each, on a CUDA machine
def test_item11_a_real_rank_failure_names_that_rank(tmp_path):
    from veosnap.candidates import backends
    from veosnap.golden.key import GoldenKey
    from veosnap.reference.zoo import Project
    from veosnap.runs.check import check

    project = Project.resolve(goldens=REPO / "goldens", configs=REPO / "toy_configs", testdata=REPO / "testdata",
                              hardware_class=CLASS)
    report = check(project, GoldenKey(CLASS, "llama", "step", "float32"), backends.resolve("eager"),
                   f"{FAULTS}:ddp_last_rank_raises", timeout_s=300)
    assert report.status == "ERROR"
    assert report.error.startswith("rank 1: RuntimeError: the last rank's sampler broke (at "), report.error


def test_item11_verify_of_an_empty_or_unreadable_directory_exits_non_zero_with_one_line(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"veosnap: error: {empty}: no goldens found "
                              "(expected <class>/<model>/<scenario>-<dtype>.safetensors.zst under it)\n")

    # Tests may run as root, which reads any directory: simulate what listing it raises for others.
    real_scandir = os.scandir

    def denied(path):  # noqa: ANN001, ANN202
        if Path(path) == empty:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", denied)
    assert main(["verify", str(empty)]) == 2
    assert capsys.readouterr().err == f"veosnap: error: {empty}: cannot read (Permission denied)\n"
