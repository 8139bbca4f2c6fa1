"""Fit the work tree to one device call: leave out of the checkout the goldens a call does not need, and
bring them back; git's sparse checkout does both, so git sees nothing changed all along.

The device tool copies the files of the checkout (tracked ones present on disk, untracked ones not ignored)
and the carried folders, 64 MiB in all; the goldens alone are larger (cpu and cuda-sm90, toy and real-shape,
about 90 MiB). Each device call needs only some of them:

    python tools/gpu/device_tree.py aside --for suite --carry .whl/s    # the GPU suite: this class's toy goldens
    ... the device calls ...
    python tools/gpu/device_tree.py restore

A benchmark compares two trees in one device call (docs/scale.md: a base tree beside the new one, on one
machine); `base REV` writes what `tools/bench/bench_scale.py` needs of commit REV (the package, the tools, the
toy configs and test data: `BASE_PATHS`) into an ignored folder that a call carries:

    python tools/gpu/device_tree.py base f896a92 --into .whl/base    # then --carry .whl (the wheels beside it)

`aside` makes every golden folder (goldens/CLASS/MODEL) that no `--keep` pattern matches a path git leaves
out of the working tree (`git sparse-checkout set --no-cone`: the files stay in the index and the repository,
`git status` stays clean, nothing is stashed anywhere), after printing what travels (the tracked files left,
the untracked ones and the carried folders) against the limit; it refuses a plan over the limit unless
`--force`. Another `aside` replaces the set (no `restore` between calls of different needs). `restore` brings
every file back (`git sparse-checkout disable`) and checks that git sees the goldens unchanged. `plan` prints
the sizes without changing anything. Presets: `--for suite` (the cuda-sm90 toy goldens: tools/gpu/gpu_pytest.sh,
docs/gpu.md), `--for real` (the real-shape cuda-sm90 goldens only), `--for bench` (cpu llama and qwen3_moe
and the toy cuda-sm90 goldens: docs/scale.md).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20  # the device tool's limit on the files it copies and the carried folders together
ROOT = Path(__file__).resolve().parents[2]
PRESETS = {
    "suite": ["goldens/cuda-sm90/*"],
    "real": ["goldens/cuda-sm90/*-real*"],
    "bench": ["goldens/cpu/llama", "goldens/cpu/qwen3_moe", "goldens/cuda-sm90/*"],
}
EXCLUDE = {"suite": ["goldens/cuda-sm90/*-real*"], "bench": ["goldens/cuda-sm90/*-real*"]}  # kept by a broader pattern


# What a benchmark run from a base tree reads of it: bench_scale records its goldens from the toy configs and
# test data (round 16's first call sent a base tree without them, and its base rows did not run).
BASE_PATHS = ("veosnap", "tools", "pyproject.toml", "toy_configs", "testdata")


def git(root: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True,
                          input=stdin).stdout


def tracked_sizes(root: Path) -> dict[str, int]:
    """Every tracked file's size, by path relative to `root`, from the index (also for files left out of the
    working tree by an earlier `aside`)."""
    entries = [line.split("\t", 1) for line in git(root, "ls-files", "-z", "--stage").split("\0") if line]
    paths, blobs = [path for _, path in entries], [meta.split()[1] for meta, _ in entries]
    sizes = git(root, "cat-file", "--batch-check=%(objectsize)", stdin="\n".join(blobs) + "\n").split()
    return dict(zip(paths, map(int, sizes)))


def untracked_bytes(root: Path) -> int:
    """The untracked files git does not ignore: they travel too."""
    names = git(root, "ls-files", "-z", "--others", "--exclude-standard").split("\0")
    return sum((root / n).stat().st_size for n in names if n and (root / n).is_file())


def golden_folders(root: Path) -> list[str]:
    """goldens/CLASS/MODEL folders of the index, relative to `root`."""
    return sorted({"/".join(name.split("/")[:3]) for name in tracked_sizes(root)
                   if name.startswith("goldens/") and name.count("/") >= 3})


def chosen_aside(root: Path, keep: list[str], exclude: list[str], named: list[str] = ()) -> list[str]:
    """Golden folders to leave out: those no `keep` pattern matches, and those a preset's `exclude` takes back
    from its broader patterns, unless a pattern `named` on the command line (`--keep`) keeps them."""
    def matches(folder: str, patterns: list[str]) -> bool:
        return any(fnmatch.fnmatch(folder, pattern) for pattern in patterns)

    return [folder for folder in golden_folders(root)
            if not matches(folder, named) and (not matches(folder, keep) or matches(folder, exclude))]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def plan(root: Path, aside: list[str], carry: list[str]) -> tuple[int, str]:
    """Bytes that travel, and a table of them."""
    left = sum(size for name, size in tracked_sizes(root).items() if not any(name.startswith(a + "/") for a in aside))
    untracked = untracked_bytes(root)
    carried = {c: folder_bytes(root / c) for c in carry}
    total = left + untracked + sum(carried.values())
    lines = [f"tracked tree, {len(aside)} golden folder(s) left out: {left / 2**20:.1f} MiB",
             f"untracked, not ignored: {untracked / 2**20:.1f} MiB"]
    lines += [f"carry {c}: {b / 2**20:.1f} MiB" for c, b in carried.items()]
    verdict = "fits" if total <= LIMIT else "DOES NOT FIT"
    lines.append(f"total {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB: {verdict}")
    return total, "\n".join(lines)


def do_aside(root: Path, aside: list[str], carry: list[str], force: bool) -> int:
    total, table = plan(root, aside, carry)
    print(table)
    if total > LIMIT and not force:
        print("device_tree: nothing left out (over the limit; --force to go on)", file=sys.stderr)
        return 2
    # Non-cone patterns: everything, but these folders. The files stay tracked (skip-worktree).
    git(root, "sparse-checkout", "set", "--no-cone", "/*", *(f"!/{folder}/" for folder in aside))
    present = [folder for folder in aside if any(p.is_file() for p in (root / folder).rglob("*"))]
    if present:  # a modified or untracked file keeps its folder: it would travel
        print(f"device_tree: {len(present)} folder(s) are still on disk (modified or untracked files in them): "
              f"{', '.join(present[:5])}", file=sys.stderr)
        return 2
    print(f"left out {len(aside)} folder(s) (git sparse-checkout; `python tools/gpu/device_tree.py restore` brings "
          "them back)")
    return 0


def do_restore(root: Path) -> int:
    sparse = subprocess.run(["git", "-C", str(root), "config", "--bool", "core.sparseCheckout"], capture_output=True,
                            text=True).stdout.strip()
    if sparse != "true":
        print("device_tree: nothing to restore (no sparse checkout here)")
        return 0
    git(root, "sparse-checkout", "disable")
    status = git(root, "status", "--porcelain", "--", "goldens")
    print("restored every golden" + (f"; git sees goldens changed:\n{status}" if status else
                                      "; git sees the goldens unchanged"))
    return 1 if status else 0


def do_base(root: Path, rev: str, into: Path) -> int:
    """`BASE_PATHS` of commit `rev` into `into` (replaced), a folder inside `root` that git ignores."""
    into = (root / into).resolve() if not into.is_absolute() else into.resolve()
    if root not in into.parents:
        print(f"device_tree: {into}: not inside {root}, so no device call could carry it", file=sys.stderr)
        return 2
    relative = str(into.relative_to(root))
    if subprocess.run(["git", "-C", str(root), "check-ignore", "-q", relative]).returncode != 0:
        print(f"device_tree: {relative}: git does not ignore it, so it would travel as untracked files and show in "
              "`git status`; put it under an ignored folder (.whl/)", file=sys.stderr)
        return 2
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "-q", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        print(f"device_tree: {rev}: no such commit here", file=sys.stderr)
        return 2
    commit = found.stdout.strip()
    paths = [p for p in BASE_PATHS if git(root, "ls-tree", "--name-only", commit, p).strip()]
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, *paths], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    print(f"{relative}: {commit[:12]}'s {', '.join(paths)} ({folder_bytes(into) / 2**20:.1f} MiB); its bench runs its own "
          f"veosnap: cd {relative} && python tools/bench/bench_scale.py ...")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["plan", "aside", "restore", "base"])
    parser.add_argument("rev", nargs="?", help="base: the commit whose tree a benchmark compares against")
    parser.add_argument("--into", type=Path, default=Path(".whl/base"), help="base: the ignored folder to write")
    parser.add_argument("--keep", action="append", default=[], help="golden folders to keep (glob; repeatable)")
    parser.add_argument("--for", dest="preset", choices=sorted(PRESETS), help="a preset set of --keep patterns")
    parser.add_argument("--carry", action="append", default=[], help="a carried folder, counted (repeatable)")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    os.environ.pop("GIT_DIR", None)  # a hook's environment would point git elsewhere
    if args.action == "restore":
        return do_restore(root)
    if args.action == "base":
        if not args.rev:
            parser.error("base needs the commit: device_tree.py base REV [--into .whl/base]")
        return do_base(root, args.rev, args.into)
    keep = args.keep + PRESETS.get(args.preset, [])
    aside = chosen_aside(root, keep, EXCLUDE.get(args.preset, []), args.keep)
    if args.action == "plan":
        print(plan(root, aside, args.carry)[1])
        return 0
    return do_aside(root, aside, args.carry, args.force)


if __name__ == "__main__":
    sys.exit(main())
