"""The public API, as docs/api.md shows it: its example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "api.md"


def test_the_documented_session_runs(tmp_path: Path) -> None:
    (example,) = re.findall(r"### A session in Python.*?```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    script = tmp_path / "session.py"
    script.write_text(example, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"PASS  \S+/qwen3_moe/step-float32  backend=my_attention\+grouped_mm  layout=halves", done.stdout)


def test_the_api_is_what_the_docs_list() -> None:
    import veosnap

    for name in ("record", "check", "register_backend", "register_layout", "Unsupported", "forward_only", "GoldenKey",
                 "Project", "VeosnapError", "__version__"):
        assert hasattr(veosnap, name) and f"`veosnap.{name}" in DOC.read_text(encoding="utf-8"), name
