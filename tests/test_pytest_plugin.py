"""The pytest plugin, from a downstream project's side.

The project is the complete example of docs/pytest-plugin.md (its files are read from the doc, so the
doc cannot drift from what is tested), with two toy configs copied in. Each test runs pytest in a
subprocess in its own copy of that project; goldens are recorded there once per module by the
plugin itself (`pytest --snapshot-update`), never into this repository.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from golden_repo import CLASS, ON_CUDA, built_once, committed_golden

import veosnap

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "pytest-plugin.md"
MODELS = ("llama", "qwen3_moe")
LLAMA = Path(f"goldens/{CLASS}/llama/step-float32.safetensors.zst")  # recorded on this machine, in its class
QWEN3_MOE = Path(f"goldens/{CLASS}/qwen3_moe/step-float32.safetensors.zst")
QWEN2 = Path(f"goldens/{CLASS}/qwen2/step-float32.safetensors.zst")  # committed for every class; no test checks it
PLANTED_BUG = ("running_sum = running_sum * rescale + ", "running_sum = running_sum + ")
# The unused-golden bookkeeping (which goldens a run reached, what it may delete) is the same on every
# device, and its tests are the file's slowest (4-6 fresh pytest processes each, 230 s of the H200's 455 s):
# a GPU run leaves them to the CPU suite and keeps the tests whose checks and recordings run on the device.
bookkeeping = pytest.mark.skipif(ON_CUDA, reason="device-independent unused-golden bookkeeping: the CPU suite "
                                                 "runs it")


def example_files() -> dict[str, str]:
    """The doc's downstream example: every fenced block that starts with `# file: <path>`."""
    blocks = re.findall(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert blocks, f"{DOC}: no example files found"
    return dict(blocks)


@dataclass
class Run:
    ret: int
    output: str


def pytest_in(project: Path, *args: str, cwd: Path | None = None) -> Run:
    """Run pytest in `project` (or its subdirectory `cwd`) in a fresh interpreter, with this checkout's veosnap."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VEOSNAP_"))}
    # This checkout's veosnap first; the rest of the path stays (a GPU machine may carry packages there).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(veosnap.__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    plugin = [] if any(ep.value == "veosnap.surfaces.pytest_plugin" for ep in entry_points(group="pytest11")) \
        else ["-p", "veosnap.surfaces.pytest_plugin"]
    # The downstream project has no property tests: hypothesis, in this repository's test extra, would only
    # load its plugin there, which imports hypothesis for its summary (about a second of each run here).
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                           *plugin, "-q", *args], cwd=cwd or project, env=env, capture_output=True, text=True,
                          timeout=600)
    return Run(proc.returncode, proc.stdout + proc.stderr)


def git(project: Path, *args: str) -> str:
    if shutil.which("git") is None:
        pytest.skip("needs git, which is not installed here")
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=project, check=True,
                          capture_output=True, text=True).stdout


def record_example(project: Path) -> None:
    """The doc's example project in `project`, its goldens recorded by the plugin (`pytest --snapshot-update`)."""
    for name, text in example_files().items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text, encoding="utf-8")
    for model in MODELS:
        shutil.copytree(REPO / "toy_configs" / model, project / "toy_configs" / model)
    run = pytest_in(project, "--snapshot-update")
    assert run.ret == 0, run.output
    assert "3 passed" in run.output
    assert "2 golden(s) recorded from the HF eager reference in a fresh process: 2 written, 0 unchanged." in run.output
    assert (project / LLAMA).is_file() and (project / QWEN3_MOE).is_file()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example project with its goldens recorded by `pytest --snapshot-update`: once per run, under xdist
    too (`built_once`; tests change copies of it only)."""
    return built_once(tmp_path_factory, "downstream", record_example)


@pytest.fixture
def project(recorded: Path, tmp_path: Path) -> Path:
    """A fresh copy of the recorded example project, under git."""
    copy = tmp_path / "project"
    shutil.copytree(recorded, copy)
    # as a Python project's repository does: byte code is no change of the project's (Python writes it
    # beside the sources unless PYTHONDONTWRITEBYTECODE is set, and this suite's processes write it)
    (copy / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    git(copy, "init", "-q", ".")
    git(copy, "add", "-A")
    git(copy, "commit", "-qm", "recorded")
    return copy


@pytest.mark.heavy
def test_readme_example_passes(project: Path) -> None:
    run = pytest_in(project)
    assert run.ret == 0, run.output
    assert "3 passed" in run.output
    assert "unused" not in run.output


@pytest.mark.heavy
def test_snapshot_update_on_an_unchanged_tree_leaves_the_goldens_byte_identical(project: Path) -> None:
    run = pytest_in(project, "--snapshot-update")
    assert run.ret == 0, run.output
    assert "2 golden(s) recorded from the HF eager reference in a fresh process: 0 written, 2 unchanged." in run.output
    assert "3 candidate check(s) ran under --snapshot-update" in run.output
    assert git(project, "status", "--porcelain") == ""


@pytest.mark.heavy
def test_a_deleted_golden_is_reported_missing_and_recreated_by_snapshot_update(project: Path) -> None:
    original = (project / LLAMA).read_bytes()
    (project / LLAMA).unlink()

    run = pytest_in(project)
    assert run.ret == 1, run.output
    assert "1 failed, 2 passed" in run.output
    assert f"no golden for {CLASS}/llama/step-float32" in run.output
    assert "pytest --snapshot-update 'tests/test_kernels.py::test_attention_matches_reference[llama-float32-blockwise]'" \
        in run.output
    assert "veosnap record --model llama --dtype float32" in run.output

    run = pytest_in(project, "--snapshot-update")
    assert run.ret == 0, run.output
    assert "1 written, 1 unchanged" in run.output
    assert (project / LLAMA).read_bytes() == original
    assert git(project, "status", "--porcelain") == ""


@pytest.mark.heavy
def test_a_planted_bug_in_the_backend_fails_with_veosnaps_report(project: Path) -> None:
    kernel = project / "mypkg" / "attention.py"
    old, new = PLANTED_BUG
    assert old in kernel.read_text()
    kernel.write_text(kernel.read_text().replace(old, new))

    run = pytest_in(project)
    assert run.ret == 1, run.output
    assert "3 failed" in run.output
    assert "GoldenMismatch" in run.output
    assert f"FAIL  {CLASS}/llama/step-float32  backend=blockwise  layout=single" in run.output
    assert "first diverging layer: layer 0 (layers.0.output" in run.output
    assert re.search(r"E\s+logits\s+\S+\s+\S+\s+\S+x\s+FAIL", run.output), run.output
    # The next step names the backend as the command line can reach it (conftest's name exists under pytest only).
    advice = re.search(r"next: (veosnap check --model llama [^\n]*?)  \(", run.output)
    assert advice and "--backend mypkg/attention.py:patch" in advice.group(1), run.output
    done = subprocess.run([sys.executable, "-m", "veosnap", *shlex.split(advice.group(1))[1:]], cwd=project,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [str(Path(veosnap.__file__).resolve().parents[1]),
                                            os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 1 and json.loads(done.stdout)["results"][0]["first_divergence"].startswith("layer 0")

    # --snapshot-update does not bless the bug: the candidate is still checked and writes nothing.
    run = pytest_in(project, "--snapshot-update", "-k", "llama")
    assert run.ret == 1, run.output
    assert "this candidate was checked, not written" in run.output
    assert "1 candidate check(s) ran under --snapshot-update: checked against the goldens, never written" in run.output
    assert git(project, "status", "--porcelain") == " M mypkg/attention.py\n"


@pytest.mark.heavy
def test_veosnap_html_writes_one_page_per_failing_check_named_after_the_test(project: Path) -> None:
    kernel = project / "mypkg" / "attention.py"
    old, new = PLANTED_BUG
    kernel.write_text(kernel.read_text().replace(old, new))

    run = pytest_in(project, "--veosnap-html", "reports/html", "-k", "not grouped")
    assert run.ret == 1, run.output
    pages = sorted(p.name for p in (project / "reports" / "html").iterdir())
    assert pages == [f"tests_test_kernels.py_test_attention_matches_reference_{model}-float32-blockwise.html"
                     for model in ("llama", "qwen3_moe")]
    assert "HTML report: reports/html/tests_test_kernels.py_test_attention_matches_reference_llama-float32-blockwise" \
           ".html" in run.output
    page = (project / "reports" / "html" / pages[0]).read_text(encoding="utf-8")
    assert f'data-golden="{CLASS}/llama/step-float32" data-status="FAIL"' in page
    assert "first diverging layer" in page

    (project / "not-a-dir").write_text("")
    run = pytest_in(project, "--veosnap-html", "not-a-dir")
    assert run.ret == 4, run.output
    assert "veosnap: --veosnap-html not-a-dir: not a directory" in run.output


@pytest.mark.heavy
def test_a_layout_checked_through_the_fixture_fails_on_a_planted_layout_bug(project: Path) -> None:
    planted = REPO / "tests" / "layout_faults.py"
    (project / "tests" / "test_layouts.py").write_text(
        "def test_packed(veosnap_check):\n"
        "    veosnap_check('llama', backend='blockwise', layout='packed')\n\n\n"
        "def test_packed_with_a_bug(veosnap_check):\n"
        f"    veosnap_check('llama', backend='blockwise', layout='{planted}:packed_no_restart')\n"
    )
    run = pytest_in(project, "tests/test_layouts.py")
    assert run.ret == 1, run.output
    assert "1 failed, 1 passed" in run.output
    assert f"FAIL  {CLASS}/llama/step-float32  backend=blockwise  layout={planted}:packed_no_restart" in run.output
    assert "first diverging layer: layer 0 (layers.0.output" in run.output


@pytest.mark.heavy
def test_file_paths_in_tests_are_the_projects_wherever_pytest_starts(project: Path) -> None:
    planted = Path("tests") / "planted_layout.py"
    shutil.copy(REPO / "tests" / "layout_faults.py", project / planted)
    (project / "tests" / "test_paths.py").write_text(
        "def test_file_backend(veosnap_check):\n"
        "    veosnap_check('llama', backend='mypkg/attention.py:patch', layout='packed')\n\n\n"
        "def test_file_layout_with_a_bug(veosnap_check):\n"
        f"    veosnap_check('llama', backend='blockwise', layout='{planted}:packed_no_restart')\n"
    )
    for where in (project, project / "tests"):  # `pytest` at the root, and `cd tests && pytest`
        run = pytest_in(project, "test_paths.py" if where != project else "tests/test_paths.py", cwd=where)
        assert run.ret == 1, run.output
        assert "1 failed, 1 passed" in run.output, run.output
        assert "file not found" not in run.output
        assert "first diverging layer: layer 0 (layers.0.output" in run.output


def unused_golden(project: Path) -> Path:
    """A golden no test checks, of a class, scenario and dtype the tests use (so it may be deleted)."""
    unused = project / QWEN2
    unused.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / QWEN2, unused)
    return unused


@bookkeeping
@pytest.mark.heavy
def test_unused_goldens_fail_a_full_run_are_kept_by_partial_runs_and_deleted_only_on_request(project: Path) -> None:
    unused = unused_golden(project)

    run = pytest_in(project)
    assert run.ret == 1, run.output
    assert "3 passed" in run.output
    assert "1 golden(s) unused." in run.output
    assert f"Unused {CLASS}/qwen2/step-float32" in run.output

    for partial in (["-k", "grouped"], ["tests/test_kernels.py"]):
        run = pytest_in(project, "--snapshot-update", "--veosnap-delete-unused", *partial)
        assert run.ret == 0, run.output
        assert "unused" not in run.output.lower(), run.output
        assert unused.is_file()

    run = pytest_in(project, "--snapshot-update")
    assert run.ret == 0, run.output
    assert "1 golden(s) unused (kept: pass --veosnap-delete-unused with --snapshot-update" in run.output
    assert unused.is_file()

    run = pytest_in(project, "--snapshot-update", "--veosnap-delete-unused")
    assert run.ret == 0, run.output
    assert "1 unused golden(s) deleted." in run.output
    assert f"Deleted {CLASS}/qwen2/step-float32" in run.output
    assert not unused.exists()
    assert git(project, "status", "--porcelain") == ""


@pytest.mark.heavy
def test_a_real_shape_golden_is_not_unused_when_the_suite_checks_toys_only(project: Path) -> None:
    """A tier the run did not check is not the run's to call unused: toy checks leave real-shape goldens be."""
    committed = committed_golden("qwen3-real")  # this class's; skips where none is recorded (cuda: record-real)
    shutil.copytree(REPO / "toy_configs" / "qwen3-real", project / "toy_configs" / "qwen3-real")
    real = project / "goldens" / CLASS / "qwen3-real" / "step-float32.safetensors.zst"
    real.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(committed, real)

    run = pytest_in(project)
    assert run.ret == 0, run.output
    assert "unused" not in run.output.lower(), run.output
    assert real.is_file()


@bookkeeping
@pytest.mark.heavy
def test_a_veosnap_test_skipped_before_its_check_keeps_unused_goldens(project: Path) -> None:
    unused = unused_golden(project)
    (project / "tests" / "test_gpu.py").write_text(
        "import pytest\n\n\n"
        "@pytest.mark.skip(reason='needs a GPU')\n"
        "def test_on_gpu(veosnap_check):\n"
        "    veosnap_check('qwen2', dtype='float32')\n"
    )
    run = pytest_in(project, "--snapshot-update", "--veosnap-delete-unused")
    assert run.ret == 0, run.output
    assert "1 golden(s) look unused, but 1 selected veosnap test(s) did not reach their check" in run.output
    assert unused.is_file()


@pytest.mark.heavy
def test_a_hardware_class_without_goldens_skips_with_the_reason(project: Path) -> None:
    other = "cuda-sm90" if CLASS != "cuda-sm90" else "cuda-sm89"
    run = pytest_in(project, "-rs", "--veosnap-hardware-class", other)
    assert run.ret == 0, run.output
    assert "3 skipped" in run.output
    assert f"no goldens for hardware class {other}" in run.output


@pytest.mark.heavy
def test_goldens_of_other_versions_get_one_note_at_the_end_of_the_run(project: Path) -> None:
    from dataclasses import replace

    from veosnap.golden import codec, store

    for path in (LLAMA, QWEN3_MOE):
        golden = store.read(project / path, project / "goldens")
        golden.manifest.provenance = replace(golden.manifest.provenance, transformers="5.0.0")
        store.write_bytes(codec.encode(golden), project / path)
    for args in ((), ("-n", "2")):
        run = pytest_in(project, *args)
        assert run.ret == 0, run.output
        assert "3 passed" in run.output
        assert run.output.count("other versions than their goldens") == 1, run.output
        import transformers
        assert (f"note: 3 of 3 checks ran on other versions than their goldens: transformers {transformers.__version__} "
                "here, 5.0.0 in the golden.") in run.output


@bookkeeping
@pytest.mark.heavy
def test_under_xdist_only_the_unused_golden_is_deleted(project: Path) -> None:
    pytest.importorskip("xdist")
    unused = unused_golden(project)

    run = pytest_in(project, "-n", "2", "--snapshot-update", "--veosnap-delete-unused")
    assert run.ret == 0, run.output
    assert "3 passed" in run.output
    assert run.output.count(f"Deleted {CLASS}/") == 1, run.output
    assert f"Deleted {CLASS}/qwen2/step-float32" in run.output
    assert not unused.exists()
    assert git(project, "status", "--porcelain") == ""
