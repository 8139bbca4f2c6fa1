"""The reproductions of upstream findings, where the docs under docs/findings/ show them: each is a fenced
python block whose first line is `# file: NAME.py`, to save and run as it is (the upstream library alone,
no veosnap). Tests and tools load them from the doc, so the code a reader copies is the code that is tested.

    python3 tests/findings.py repro_fa4.py > repro_fa4.py     # the script, to run on a GPU machine
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

FINDINGS = Path(__file__).resolve().parents[1] / "docs" / "findings"


def source(name: str) -> str:
    """The block of docs/findings/ that declares the file `name`."""
    block = re.compile(rf"^```python\n(# file: {re.escape(name)}\n.*?)^```$", re.S | re.M)
    for doc in sorted(FINDINGS.glob("*.md")):
        found = block.search(doc.read_text(encoding="utf-8"))
        if found:
            return found.group(1)
    raise LookupError(f"docs/findings/: no ```python block whose first line is '# file: {name}'")


def write(name: str, directory: Path) -> Path:
    """The reproduction saved as `directory/name`, as a reader would save it, to run as a script."""
    path = directory / name
    path.write_text(source(name), encoding="utf-8")
    return path


def load(name: str) -> ModuleType:
    """The reproduction imported as a module named after its file (its `main` is not run)."""
    spec = importlib.util.spec_from_loader(name.removesuffix(".py"), loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    exec(compile(source(name), f"docs/findings ({name})", "exec"), module.__dict__)  # noqa: S102
    return module


if __name__ == "__main__":
    print(source(sys.argv[1]), end="")
