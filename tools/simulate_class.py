"""Run the project's own pytest as if this machine were of another hardware class (default cuda-sm90).

    python tools/simulate_class.py [--hardware-class cuda-sm90] [--keep DIR] [--model M ...] [-- PYTEST ARGS...]

What a GPU box changes for the suite is, first of all, its hardware class: the goldens it records and
checks are `goldens/cuda-sm90/...`, its reports say `cuda-sm90/llama/step-float32`, a cpu golden is
another class's. This tool makes a test run see exactly that on the CPU, to catch tests that assume
`cpu` before a GPU session is spent on them:

1. copies the working tree (tracked and untracked, not ignored files) into a temp directory;
2. puts a `sitecustomize` on PYTHONPATH that makes `veosnap.reference.hardware.detect()` answer the
   class and `device_for` the CPU, in every Python process of the run (pytest, the CLI, torchrun
   ranks, the downstream-project subprocesses), except where CUDA_VISIBLE_DEVICES is empty (a process
   that hides the GPU, like tools/kill_and_race.py, is a cpu machine, as it would be on the GPU box);
3. re-records that class's goldens there with `tools/gpu_session.py record` (every scenario; the
   committed cuda-sm90 goldens are the GPU's numbers, which a CPU does not reproduce); `--model M`
   (repeatable) records only those models, for a run narrowed with -k;
4. runs pytest there with the arguments given (default `-q`) and exits with its status.

It cannot simulate CUDA itself: GPU-only backends, NCCL ranks and the GPU's numerics are for the
real run (tools/gpu_pytest.sh, docs/gpu.md); multi-GPU tests skip here as on a one-GPU machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = '''\
"""tools/simulate_class.py: this process's veosnap sees hardware class $SIMULATED_HARDWARE_CLASS on the CPU."""
import os
import sys

_CLASS = os.environ.get("SIMULATED_HARDWARE_CLASS")
_TARGET = "veosnap.reference.hardware"


class _Patching:
    """The module's loader, then the simulated class and device."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        import torch

        # A process that hides the GPU (tools/kill_and_race.py) is a cpu machine, as on the GPU box.
        module.detect = lambda: "cpu" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else _CLASS
        module.device_for = lambda _class: torch.device("cpu")


class _SimulatedHardware:
    """A meta path finder that stays first (pytest puts its assertion rewriter first), so it sees the import."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Patching(spec.loader)
                return spec
        return None


class _FirstStays(list):
    def insert(self, index, item):
        super().insert(max(index, 1) if index >= 0 else index, item)


if _CLASS:
    sys.meta_path = _FirstStays([_SimulatedHardware(), *sys.meta_path])
'''


def copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, not ignored ones)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware-class", default="cuda-sm90", help="the class to simulate (default cuda-sm90)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir)")
    parser.add_argument("--model", action="append",
                        help="record only these models' goldens (repeatable; default: the whole toy tier), for a "
                             "pytest run that needs only them (-k)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --; default -q)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="veosnap-simulate-"))
    repo, shim = work / "repo", work / "shim"
    try:
        if repo.exists():
            shutil.rmtree(repo)
        copy_tree(repo)
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = {**os.environ, "SIMULATED_HARDWARE_CLASS": args.hardware_class,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(repo), os.environ.get("PYTHONPATH")]))}
        env.pop("VEOSNAP_HARDWARE_CLASS", None)
        shutil.rmtree(repo / "goldens" / args.hardware_class, ignore_errors=True)
        start = time.perf_counter()
        # no budget: the CPU takes far longer than the GPU's device-call limit the default is for
        models = [arg for m in args.model or [] for arg in ("--model", m)]
        subprocess.run([sys.executable, "tools/gpu_session.py", "record", *models, "--budget-s", "1e9",
                        "--out", str(work / "record")],
                       cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
        print(f"simulate_class: recorded {args.hardware_class} goldens in {time.perf_counter() - start:.0f} s "
              f"under {repo / 'goldens'}", flush=True)
        return subprocess.run([sys.executable, "-m", "pytest", *(args.pytest_args or ["-q"])], cwd=repo,
                              env=env).returncode
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
