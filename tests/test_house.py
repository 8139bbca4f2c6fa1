"""The house rules of the package, checked on its source: subpackages depend one way, never on another
package's private names, and `import veosnap` stays cheap."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "veosnap"
# Each package may import only from packages to its left (and the shared top-level modules).
ORDER = ["golden", "numerics", "reference", "candidates", "runs", "render", "surfaces"]
SHARED = {"errors"}


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported veosnap module path, names imported, line) for every `veosnap` import in a file."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "veosnap":
                found.append((target, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "veosnap"]
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_depend_one_way_and_never_on_private_names():
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = package_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here not in ORDER:
            continue  # the top level: the public API, errors, __main__
        for target, imported, line in imports(path):
            there = package_of(target)
            names = [n for n in imported if n != "*"]
            if there in ORDER and ORDER.index(there) > ORDER.index(here):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target} ({here} may not depend on {there})")
            elif there not in ORDER and there not in SHARED and there:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            if there != here and any(n.startswith("_") and not n.endswith("__") for n in names + target.split(".")[2:]):
                broken.append(f"{path.relative_to(ROOT)}:{line} imports a private name of {target}: {names}")
    assert broken == []


def test_importing_veosnap_and_its_pytest_plugin_loads_no_torch():
    code = ("import sys, veosnap, veosnap.surfaces.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(veosnap.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
