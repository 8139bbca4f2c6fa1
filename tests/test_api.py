"""The public API, as docs/api.md shows it: its example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "api.md"


@pytest.mark.heavy
def test_the_documented_session_runs(tmp_path: Path) -> None:
    (example,) = re.findall(r"### A session in Python.*?```python[^\n]*\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    script = tmp_path / "session.py"
    script.write_text(example, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"PASS  \S+/qwen3_moe/step-float32  backend=my_attention\+grouped_mm  layout=halves", done.stdout)


def test_the_api_is_what_the_docs_list() -> None:
    import veosnap

    for name in ("record", "check", "register_backend", "register_layout", "Unsupported", "forward_only", "GoldenKey",
                 "Project", "VeosnapError", "NothingToChange", "__version__"):
        assert hasattr(veosnap, name) and f"`veosnap.{name}" in DOC.read_text(encoding="utf-8"), name


def test_every_module_path_the_docs_name_imports() -> None:
    import importlib

    from veosnap import _moved

    text = DOC.read_text(encoding="utf-8")
    paths = set(re.findall(r"from (veosnap(?:\.\w+)+) import", text)) | set(re.findall(r"`(veosnap(?:\.\w+)+)`", text))
    assert "veosnap.candidates.backends" in paths
    for path in sorted(paths - set(_moved.MOVED)):  # the moved ones: the next test, in a process of its own
        module, _, attribute = path, "", ""
        while True:  # `veosnap.x.y.Name`: the longest importable module, then its attribute
            try:
                found = importlib.import_module(module)
                break
            except ModuleNotFoundError:
                module, _, last = module.rpartition(".")
                attribute = f"{last}.{attribute}".strip(".")
        for name in filter(None, attribute.split(".")):
            found = getattr(found, name)


def test_a_module_path_of_the_last_release_imports_and_says_where_it_moved() -> None:
    """A plugin written against 0.0.x's `veosnap.backends` keeps working for a release, warned."""
    script = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
              "import veosnap\n"
              "try:\n    from veosnap.backends import register\nexcept DeprecationWarning as w:\n    print(w)\n"
              "warnings.simplefilter('ignore')\n"
              "from veosnap.backends import register, Candidate\n"
              "from veosnap.candidates import backends\n"
              "from veosnap import _moved\n"
              "import importlib\n"
              "for old, new in _moved.MOVED.items():\n"
              "    module = importlib.import_module(old)\n"
              "    assert dir(module) == dir(importlib.import_module(new)), old\n"
              "print(register is backends.register and Candidate is backends.Candidate)\n"
              "print(callable(veosnap.record), callable(veosnap.check))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "veosnap.backends moved to veosnap.candidates.backends: import it from there (veosnap.backends goes away "
        "in the next release)", "True", "True True"]
