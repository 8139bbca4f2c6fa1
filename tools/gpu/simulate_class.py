"""Run the project's own pytest as if this machine were of another hardware class (default cuda-sm90).

    python tools/gpu/simulate_class.py [--hardware-class cuda-sm90] [--for suite] [--keep DIR [--rerecord]]
                                       [--model M ...] [-- PYTEST ARGS...]

What a GPU box changes for the suite is, first of all, its hardware class: the goldens it records and
checks are `goldens/cuda-sm90/...`, its reports say `cuda-sm90/llama/step-float32`, a cpu golden is
another class's. This tool makes a test run see exactly that on the CPU, to catch tests that assume
`cpu` before a GPU session is spent on them:

1. copies the working tree (tracked and untracked, not ignored files) into a temp directory; with `--for
   PRESET`, less the golden folders `tools/gpu/device_tree.py aside --for PRESET` leaves out of a device call
   (`--for suite`: the GPU suite's call, without the cpu goldens and the real tier), so a test that needs
   them shows here, as it would there, whether it skips saying why;
2. puts a `sitecustomize` on PYTHONPATH that makes `veosnap.reference.hardware.detect()` answer the
   class and `device_for` the CPU, in every Python process of the run (pytest, the CLI, torchrun
   ranks, the downstream-project subprocesses), except where CUDA_VISIBLE_DEVICES is empty (a process
   that hides the GPU, like tools/measure/kill_and_race.py, is a cpu machine, as it would be on the GPU box);
3. re-records that class's goldens there with `tools/gpu/gpu_session.py record` (every scenario; the
   committed cuda-sm90 goldens are the GPU's numbers, which a CPU does not reproduce); `--model M`
   (repeatable) records only those models, for a run narrowed with -k;
4. runs pytest there with the arguments given (default `-q`) and exits with its status, or 1 when the
   tests changed or added a file of the tree outside caches (a test writing into the checkout breaks
   parallel runs, tools/gpu/gpu_pytest.sh --jobs, and a user's parallel CI): the files are listed.

With --keep DIR the recorded goldens are kept in DIR/recorded and reused by the next run with the same
DIR (the slow step on 2 cores), unless --rerecord; the working tree is copied afresh each time.

It cannot simulate CUDA itself: GPU-only backends, NCCL ranks and the GPU's numerics are for the
real run (tools/gpu/gpu_pytest.sh, docs/gpu.md); multi-GPU tests skip here as on a one-GPU machine.
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

ROOT = Path(__file__).resolve().parents[2]

SITECUSTOMIZE = '''\
"""tools/gpu/simulate_class.py: this process's veosnap sees hardware class $SIMULATED_HARDWARE_CLASS on the CPU."""
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

        # A process that hides the GPU (tools/measure/kill_and_race.py) is a cpu machine, as on the GPU box.
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


def leave_out(repo: Path, preset: str) -> None:
    """Remove from the copy the golden folders a device call of `preset` leaves out (tools/gpu/device_tree.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import device_tree

    for folder in device_tree.chosen_aside(ROOT, device_tree.PRESETS[preset], device_tree.EXCLUDE.get(preset, [])):
        shutil.rmtree(repo / folder, ignore_errors=True)
    print(f"simulate_class: left out what `device_tree.py aside --for {preset}` leaves out", flush=True)


CACHES = {"__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache"}


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under `root` outside caches: what a test run may not change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in CACHES]
        for name in filenames:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            state[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware-class", default="cuda-sm90", help="the class to simulate (default cuda-sm90)")
    parser.add_argument("--for", dest="preset", help="copy only what `tools/gpu/device_tree.py aside --for PRESET` "
                        "sends to the device (e.g. suite)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp dir)")
    parser.add_argument("--model", action="append",
                        help="record only these models' goldens (repeatable; default: the whole toy tier), for a "
                             "pytest run that needs only them (-k)")
    parser.add_argument("--rerecord", action="store_true",
                        help="with --keep: record the class's goldens again instead of reusing the earlier ones")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --; default -q)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="veosnap-simulate-"))
    repo, shim = work / "repo", work / "shim"
    try:
        recorded = work / "recorded" / args.hardware_class  # a --keep directory's earlier recording
        if repo.exists():
            shutil.rmtree(repo)
        copy_tree(repo)
        if args.preset:
            leave_out(repo, args.preset)
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = {**os.environ, "SIMULATED_HARDWARE_CLASS": args.hardware_class,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(shim), str(repo), os.environ.get("PYTHONPATH")]))}
        env.pop("VEOSNAP_HARDWARE_CLASS", None)
        shutil.rmtree(repo / "goldens" / args.hardware_class, ignore_errors=True)
        if recorded.is_dir() and not args.rerecord:
            shutil.copytree(recorded, repo / "goldens" / args.hardware_class)
            print(f"simulate_class: reusing the {args.hardware_class} goldens recorded earlier in {recorded} "
                  "(--rerecord records them again)", flush=True)
        else:
            start = time.perf_counter()
            # no budget: the CPU takes far longer than the GPU's device-call limit the default is for
            models = [arg for m in args.model or [] for arg in ("--model", m)]
            subprocess.run([sys.executable, "tools/gpu/gpu_session.py", "record", *models, "--budget-s", "1e9",
                            "--out", str(work / "record")],
                           cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
            print(f"simulate_class: recorded {args.hardware_class} goldens in {time.perf_counter() - start:.0f} s "
                  f"under {repo / 'goldens'}", flush=True)
            if args.keep is not None:
                shutil.rmtree(recorded, ignore_errors=True)
                shutil.copytree(repo / "goldens" / args.hardware_class, recorded)
        before = tree_state(repo)
        status = subprocess.run([sys.executable, "-m", "pytest", *(args.pytest_args or ["-q"])], cwd=repo,
                                env=env).returncode
        after = tree_state(repo)
        touched = sorted(rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel))
        if touched:  # a test that writes into the checkout breaks parallel runs (tools/gpu/gpu_pytest.sh --jobs)
            print(f"simulate_class: the tests changed {len(touched)} file(s) of the checkout:", *touched[:20],
                  sep="\n  ", flush=True)
            return status or 1
        return status
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
