"""Candidates cannot end the process, outlive their timeout, or leave the reference patched (issue 12).

    item 5  a candidate (backend, its hooks, a layout) that exits or hangs is an ERROR naming it, in every
            layout; one stuck outside Python still ends with its ERROR line and status 1; --timeout is validated
    item 6  after every candidate veosnap restores what it patched and says so; recording runs on a pristine
            process (a fresh one once anything may have touched this one)

The candidates are files written into tmp_path, as a user would write them; anything that could end the
process runs `veosnap check` in a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO, eager_report, gpus_for, recorded_here

import veosnap
from veosnap.candidates import backends
from veosnap.errors import VeosnapError
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import Project
from veosnap.runs.check import check_layouts
from veosnap.surfaces.cli import main

# Every test here checks candidates against the committed goldens of this machine's class.
LLAMA = GoldenKey(CLASS, "llama", "step", "float32")
DIRS = ["--goldens", str(REPO / "goldens"), "--configs", str(REPO / "toy_configs"), "--testdata",
        str(REPO / "testdata"), "--hardware-class", CLASS, "--dtype", "float32"]

CANDIDATES = textwrap.dedent('''
    import ctypes, os, signal, sys, threading, time

    from veosnap.candidates.layouts.registry import LAYOUTS


    def exits(model):
        kind = model.config.model_type
        if kind == "llama":
            os._exit(0)  # LINE os._exit
        if kind == "qwen2":
            model.model.layers[0].register_forward_hook(lambda *_: sys.exit(0))  # LINE sys.exit
        if kind == "qwen3":
            raise KeyboardInterrupt  # LINE KeyboardInterrupt
        if kind == "mixtral":
            model.model.layers[1].register_forward_hook(lambda *_: os.abort())  # LINE os.abort
        if kind == "deepseek_v3":
            def in_a_thread(*_):
                thread = threading.Thread(target=os._exit, args=(3,))
                thread.start()
                thread.join()
            model.model.layers[0].register_forward_hook(in_a_thread)
        return model


    def exits_in_a_hook(model):
        model.model.layers[0].register_forward_hook(lambda *_: os._exit(0))
        return model


    class ExitingLayout(type(LAYOUTS["microbatch"])):
        def shard(self, ctx, setup):
            sys.exit(7)  # LINE layout sys.exit


    exiting_layout = ExitingLayout()


    def hangs(model):
        model.model.layers[1].register_forward_hook(lambda *_: time.sleep(10**6))
        return model


    def stuck(model):
        # SIGALRM blocked in this thread: the sleep is never interrupted, as if stuck in C code.
        def hook(*_):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(10**6)
        model.model.layers[1].register_forward_hook(hook)
        return model


    def stuck_holding_the_gil(model):
        def hook(*_):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            ctypes.PyDLL(None).sleep(10**6)  # libc's sleep, called without releasing the GIL
        model.model.layers[1].register_forward_hook(hook)
        return model
''')


@pytest.fixture
def candidates(tmp_path: Path) -> Path:
    path = tmp_path / "candidates.py"
    path.write_text(CANDIDATES)
    return path


def line(text: str) -> int:
    return next(i for i, source in enumerate(CANDIDATES.splitlines(), 1) if f"# LINE {text}" in source)


def veosnap_check(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "veosnap", "check", *DIRS, *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def errors(stdout: str) -> dict[str, str]:
    """`ERROR  <golden>  backend=...  layout=L` -> its `error:` line, by '<model> <layout>'."""
    found, header = {}, None
    for text in stdout.splitlines():
        if text.startswith("ERROR  "):
            golden, _, layout = text.split()[1], text.split()[2], text.split()[3]
            header = f"{golden.split('/')[1]} {layout.removeprefix('layout=')}"
        elif header and text.strip().startswith("error: "):
            found[header] = text.strip().removeprefix("error: ")
            header = None
    return found


# --- item 5: exits --------------------------------------------------------------------------------

def test_item5_a_backend_or_hook_that_ends_the_process_is_an_error_naming_it(candidates):
    models = ["llama", "qwen2", "qwen3", "mixtral", "deepseek_v3", "qwen3_moe"]
    done = veosnap_check("--backend", f"{candidates}:exits", *(a for m in models for a in ("--model", m)))
    assert done.returncode == 1, (done.stdout, done.stderr)
    found = errors(done.stdout)
    at = lambda what: f"(at {candidates}:{line(what)}): a candidate may not end the process"  # noqa: E731
    assert found["llama single"] == f"the candidate called os._exit(0) {at('os._exit')}"
    assert found["qwen2 single"] == f"the candidate called sys.exit(0) {at('sys.exit')}"
    assert found["qwen3 single"] == f"the candidate raised KeyboardInterrupt {at('KeyboardInterrupt')}"
    assert found["mixtral single"] == f"the candidate called os.abort() {at('os.abort')}"
    assert found["deepseek_v3 single"].startswith("a thread of the candidate called os._exit(3) (at ")
    assert f"PASS  {CLASS}/qwen3_moe/step-float32" in done.stdout  # the checks after them still ran
    assert done.stdout.rstrip().endswith("1 passed, 5 failed")


@gpus_for(2)  # two ranks: NCCL, one GPU each, on a CUDA machine
@pytest.mark.heavy
def test_item5_exits_are_errors_in_every_layout(candidates):
    done = veosnap_check("--model", "llama", "--backend", f"{candidates}:exits_in_a_hook", "--layout", "microbatch",
                         "--layout", "packed", "--layout", "ddp")
    assert done.returncode == 1, (done.stdout, done.stderr)
    found = errors(done.stdout)
    for layout in ("microbatch", "packed"):
        assert found[f"llama {layout}"].startswith("the candidate called os._exit(0) (at "), found
    # Both ranks run the hook; whichever wrote first is named.
    assert re.match(r"rank [01]: the candidate called os\._exit\(0\) \(at .*candidates\.py:\d+\): a candidate may not",
                    found["llama ddp"]), found

    done = veosnap_check("--model", "llama", "--layout", f"{candidates}:exiting_layout")
    assert done.returncode == 1
    where = f"{candidates}:{line('layout sys.exit')}"
    assert errors(done.stdout)[f"llama {candidates}:exiting_layout"] == \
        f"the candidate called sys.exit(7) (at {where}): a candidate may not end the process"


def test_item5_a_backend_file_that_exits_while_imported_is_refused_in_one_line(tmp_path):
    file = tmp_path / "exits_on_import.py"
    file.write_text("import os\nos._exit(0)\n")
    done = veosnap_check("--model", "llama", "--backend", f"{file}:patch")
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (f"veosnap: error: {file}: error while importing backend file (the candidate called "
                           f"os._exit(0) (at {file}:2): a candidate may not end the process)\n")


# --- item 5: timeouts -----------------------------------------------------------------------------

@pytest.mark.heavy
def test_item5_a_hanging_candidate_is_ended_at_its_timeout_in_process_layouts(candidates):
    done = veosnap_check("--model", "llama", "--backend", f"{candidates}:hangs", "--layout", "single", "--layout",
                         "microbatch", "--timeout", "2", timeout=240)
    assert done.returncode == 1, (done.stdout, done.stderr)
    for layout in ("single", "microbatch"):
        error = errors(done.stdout)[f"llama {layout}"]
        assert error.startswith("timed out after 2 s (ended by veosnap, at "), done.stdout


def test_item5_the_timeout_counts_from_the_guards_ready_and_a_failing_wait_undoes_the_guard():
    # A check's guard is set up while its model's weights are still drawn and waits for them (`ready`): that wait
    # is not the candidate's time. A wait that fails leaves nothing of the guard behind.
    import signal
    import time

    from veosnap.candidates import guard

    with guard.running("", 2.0, ready=lambda: time.sleep(2.5)):
        pass  # not timed out: the 2 s started after the wait
    alarm, interrupt, exit_ = signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGINT), os._exit

    def build_fails() -> None:
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError, match="the build failed"):
        with guard.running("", 2.0, ready=build_fails):
            pass
    assert (signal.getsignal(signal.SIGALRM), signal.getsignal(signal.SIGINT), os._exit) == (alarm, interrupt, exit_)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


STUCK_AFTER_A_LONG_WAIT = textwrap.dedent('''
    import signal, sys, time
    from veosnap.candidates import guard

    def ready():  # longer than the timeout and twice its grace (1 s): the last resort's own delay
        time.sleep(4.5)
        print("ready", flush=True)

    with guard.running("ERROR  the check's line", 1.0, ready=ready):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the timeout cannot interrupt it
        time.sleep(float(sys.argv[1]))
    time.sleep(4)  # past both deadlines had they been armed
    print("not ended", flush=True)
''')


@pytest.mark.parametrize("stuck_s", [30, 0.1])
def test_item5_the_watchdog_set_up_beside_the_wait_still_counts_from_the_candidates_start(tmp_path, stuck_s):
    # The watchdog is handed the run (and faulthandler armed) before the wait, so the check's path does not wake
    # a thread: neither may end the process during the wait, however long (a large model's draw), and a stuck
    # candidate still meets the watchdog.
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_AFTER_A_LONG_WAIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script), str(stuck_s)], capture_output=True, text=True, env=env,
                          timeout=120)
    if stuck_s > 1:
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert done.stdout == ("ready\nERROR  the check's line\n  error: timed out after 1 s and stuck outside "
                               "Python for 1 s more; veosnap ends the process\n"), done.stderr
    else:  # a run that ends in time: nothing fires later either (faulthandler was cancelled)
        assert (done.returncode, done.stdout) == (0, "ready\nnot ended\n"), done.stderr


def test_item5_a_candidate_stuck_outside_python_still_ends_with_its_error_line_and_status_1(candidates):
    done = veosnap_check("--model", "llama", "--backend", f"{candidates}:stuck", "--timeout", "2", timeout=240)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith(f"ERROR  {CLASS}/llama/step-float32  backend={candidates}:stuck  layout=single\n"
                                  "  error: timed out after 2 s and stuck outside Python for 1 s more; veosnap ends "
                                  "the process\n")


def test_item5_even_a_candidate_holding_the_gil_ends_with_status_1_and_where_it_was_stuck(candidates):
    done = veosnap_check("--model", "llama", "--backend", f"{candidates}:stuck_holding_the_gil", "--timeout", "2",
                         timeout=240)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Timeout (0:00:" in done.stderr and f'File "{candidates}"' in done.stderr


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_item5_a_timeout_that_is_not_a_positive_finite_number_is_refused(capsys, value):
    assert main(["check", *DIRS, "--model", "llama", "--timeout", value]) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"veosnap: error: --timeout {value}: give a positive, finite number of seconds\n")
    with pytest.raises(VeosnapError, match="give a positive, finite number of seconds"):
        veosnap.check("llama", timeout_s=float(value))


# --- item 6: the reference stays pristine ---------------------------------------------------------

LEAKY = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.models.llama import modeling_llama


    def leak(model):
        original = modeling_llama.LlamaRMSNorm.forward
        modeling_llama.LlamaRMSNorm.forward = lambda self, x: original(self, x) * 1.01  # never undone
        AttentionInterface.register("veosnap_test_leak", modeling_llama.eager_attention_forward)
        F.silu = lambda x, inplace=False: x * torch.sigmoid(x)
        return model
''')


@pytest.fixture
def leaky(tmp_path: Path) -> Path:
    path = tmp_path / "leaky.py"
    path.write_text(LEAKY)
    return path


def test_item6_a_candidate_that_leaves_patches_behind_is_restored_and_the_next_eager_cell_is_the_reference(
        capsys, leaky):
    # The reference's worst tensor on this machine (a ratio of 0 where the golden was recorded), before the leak.
    reference = eager_report(Project(REPO / "goldens", REPO / "toy_configs", REPO / "testdata", CLASS), "llama").worst
    code = main(["check", *DIRS, "--model", "llama", "--matrix", "--backends", f"{leaky}:leak,eager",
                 "--format", "json"])
    cells = {c["backend"]: c for c in json.loads(capsys.readouterr().out)["cells"]}
    assert code == 1 and cells[f"{leaky}:leak"]["status"] == "fail"
    assert cells["eager"]["status"] == "pass"
    assert (cells["eager"]["worst_tensor"], cells["eager"]["worst_ratio"]) == (reference.name, reference.ratio)
    (note,) = [n for n in cells[f"{leaky}:leak"]["notes"] if "left patches behind" in n]
    assert note == (f"candidate {leaky}:leak left patches behind (restored): torch.nn.functional.silu, "
                    "transformers.models.llama.modeling_llama.LlamaRMSNorm.forward, "
                    "AttentionInterface['veosnap_test_leak']")


def test_item6_recording_after_a_candidate_ran_happens_in_a_fresh_process(tmp_path, monkeypatch, leaky):
    from transformers.models.llama import modeling_llama

    project = Project.resolve(goldens=tmp_path / "goldens", configs=REPO / "toy_configs", testdata=REPO / "testdata",
                              hardware_class=CLASS)
    check_layouts(project.__class__(REPO / "goldens", project.configs, project.testdata, CLASS), LLAMA,
                  backends.resolve("eager"))
    pristine = recorded_here("llama")  # what this machine's reference records, before anything is patched
    # Something outside veosnap (a test, a plugin's import) patched the reference and did not restore it.
    original = modeling_llama.LlamaRMSNorm.forward
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", lambda self, x: original(self, x) * 1.01)

    outcome = veosnap.record("llama", "float32", project=project)

    assert outcome.written
    assert outcome.path.read_bytes() == pristine


@pytest.mark.heavy
def test_item6_the_fresh_recording_process_is_reused_only_while_it_vouches_for_itself(tmp_path, monkeypatch):
    from veosnap.runs import isolated

    project = Project.resolve(goldens=tmp_path / "goldens", configs=REPO / "toy_configs", testdata=REPO / "testdata",
                              hardware_class=CLASS)
    data, judged = isolated.record_judged(project, LLAMA)
    child = isolated._SHARED._proc.pid
    assert judged and isolated._SHARED.pristine  # its own variants ran there and left it pristine

    assert isolated.record_judged(project, LLAMA)[0] == data and isolated._SHARED._proc.pid == child  # reused
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # pytest's bookkeeping: still reused
    isolated.record_judged(project, LLAMA)
    assert isolated._SHARED._proc.pid == child

    monkeypatch.chdir(tmp_path)  # a project given relative to where the caller is now, as a new child would read it
    relative = Project.resolve(goldens=Path("goldens"), configs=Path(os.path.relpath(REPO / "toy_configs")),
                               testdata=Path(os.path.relpath(REPO / "testdata")), hardware_class=CLASS)
    assert isolated.record_judged(relative, LLAMA)[0] == data and isolated._SHARED._proc.pid == child

    monkeypatch.setenv("VEOSNAP_SOMETHING", "set after it started")  # what a recording might read: a new child
    assert isolated.record_judged(project, LLAMA)[0] == data and isolated._SHARED._proc.pid != child
    child = isolated._SHARED._proc.pid
    isolated._SHARED.pristine = False  # as when a variant left patches behind in it
    isolated.record_judged(project, LLAMA)
    assert isolated._SHARED._proc.pid != child


def _downstream(root: Path) -> Path:
    project = root / "downstream"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    shutil.copytree(REPO / "toy_configs" / "llama", project / "toy_configs" / "llama")
    (project / "tests" / "test_a_patches.py").write_text(textwrap.dedent('''
        from transformers.models.llama import modeling_llama


        def test_something_that_patches_and_forgets():
            original = modeling_llama.LlamaRMSNorm.forward
            modeling_llama.LlamaRMSNorm.forward = lambda self, x: original(self, x) * 1.01
    '''))
    (project / "tests" / "test_b_checks.py").write_text(
        "def test_reference(veosnap_check):\n    veosnap_check('llama', dtype='float32')\n")
    return project


@pytest.mark.heavy
def test_item6_pytest_snapshot_update_records_from_a_pristine_process(tmp_path):
    project = _downstream(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VEOSNAP_")) and k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    plugin = [] if any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")) \
        else ["-p", "veosnap.surfaces.pytest_plugin"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *plugin, "-q",
                           "--snapshot-update"], cwd=project, env=env, capture_output=True, text=True, timeout=600)
    golden = project / "goldens" / LLAMA.relpath
    assert golden.is_file(), done.stdout + done.stderr
    assert golden.read_bytes() == recorded_here("llama"), done.stdout  # what this machine's reference records
    assert "1 golden(s) recorded from the HF eager reference in a fresh process: 1 written, 0 unchanged." in done.stdout
