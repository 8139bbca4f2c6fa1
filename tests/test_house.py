"""The house rules of the package, checked on its source: subpackages depend one way, never on another
package's private names, no module imports another that imports it back, nothing inside imports the
package face (`veosnap/__init__.py`), and `import veosnap` stays cheap."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "veosnap"
# Each package may import only from packages to its left (and the shared top-level modules).
ORDER = ["golden", "numerics", "reference", "candidates", "runs", "render", "surfaces"]
SHARED = {"errors", "about"}


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


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports, wherever in it (a function's lazy
    import included: it closes a circle as well, only later)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    found = {}
    for module, path in modules.items():
        imported = set()
        for target, names, _ in imports(path):
            submodules = {f"{target}.{n}" for n in names} & modules.keys()  # `from . import backends`
            imported |= submodules
            if len(submodules) < len(names) or not names:
                imported.add(target)
        found[module] = imported - {module}
    return found


def test_nothing_inside_the_package_imports_its_face():
    # The face re-exports the subpackages; a module that imports it depends on all of them.
    inside = sorted(m for m, imported in module_imports().items() if "veosnap" in imported and m != "veosnap")
    assert not inside, "import the package face (veosnap/__init__.py): " + ", ".join(inside)


def test_no_module_imports_one_that_imports_it_back():
    graph = module_imports()
    graph["veosnap"] = set()  # the face's own lazy imports of the subpackages are its job; importing it is not
    circles = []
    while True:
        try:
            tuple(graphlib.TopologicalSorter(graph).static_order())
            break
        except graphlib.CycleError as exc:
            circle = exc.args[1]  # [a, b, ..., a]: each imports the one before it
            circles.append(" -> ".join(reversed(circle)))
            graph[circle[1]].discard(circle[0])  # break this circle to find the next
    assert not circles, "import circles (a -> b: a imports b):\n" + "\n".join(circles)


def test_importing_veosnap_and_its_pytest_plugin_loads_no_torch():
    code = ("import sys, veosnap, veosnap.surfaces.pytest_plugin; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(veosnap.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


# Imported where they are used, not when veosnap loads: every rank, CLI run and fresh recorder imports the
# package, and a check reads its batch from the golden, not from a parquet table (pyarrow: 0.3 s a start).
LAZY = {"pyarrow"}


def test_optional_heavy_libraries_are_imported_inside_the_functions_that_use_them():
    eager = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        top = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside]
        for node in top:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            eager += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[0] in LAZY]
    assert not eager, "\n".join(eager)
