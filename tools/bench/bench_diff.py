"""Time `veosnap diff` over the committed goldens: per golden (read, decode, compare) and in all.

    python tools/bench/bench_diff.py                  # worst case: every golden changed in every tensor
    python tools/bench/bench_diff.py HEAD~1 HEAD      # two revisions (or directories) of this repository

The worst case copies goldens/ into a temp git repository, commits, rewrites every golden with all
its float tensors scaled by (1 + 1e-3), commits again, and diffs HEAD~1 HEAD there, so every golden
is read from git, decoded on both sides and compared tensor by tensor. Prints a table.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from veosnap.golden import codec, store  # noqa: E402
from veosnap.reference.determinism import one_thread  # noqa: E402
from veosnap.runs.diff import diff, diff_goldens, open_tree  # noqa: E402


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@veosnap.invalid",
                    "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True, capture_output=True)


def worst_case_repo(dest: Path) -> Path:
    """A git repo whose HEAD changes every tensor of every committed golden; its goldens dir."""
    goldens = dest / "goldens"
    shutil.copytree(REPO / "goldens", goldens)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-qm", "base")
    for _, path in store.list_goldens(goldens):
        g = store.read(path)
        for name in g.manifest.tolerance:
            g.tensors[name] = g.tensors[name] * (1 + 1e-3)
        store.write(g, path)
    _git(dest, "commit", "-qam", "every tensor moved")
    return goldens


def per_golden(base: str, head: str | None, goldens_dir: Path) -> list[tuple[str, int, float, float, float, str]]:
    """(key, bytes, read s, decode s, compare s, verdict) for each golden on both sides."""
    old_tree, new_tree = open_tree(base, goldens_dir), open_tree(head, goldens_dir)
    old, new = old_tree.entries(), new_tree.entries()
    rows = []
    for key in sorted(old.keys() & new.keys()):
        t0 = time.perf_counter()
        a, b = old_tree.read(key), new_tree.read(key)
        t1 = time.perf_counter()
        if a == b:
            rows.append((str(key), len(a) + len(b), t1 - t0, 0.0, 0.0, "unchanged"))
            continue
        ga, gb = codec.decode(a, key), codec.decode(b, key)
        t2 = time.perf_counter()
        d = diff_goldens(ga, gb)
        t3 = time.perf_counter()
        rows.append((str(key), len(a) + len(b), t1 - t0, t2 - t1, t3 - t2, d.verdict))
    for tree in (old_tree, new_tree):
        getattr(tree, "close", lambda: None)()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", nargs="?", help="git revision or directory (default: synthetic worst case)")
    parser.add_argument("head", nargs="?", help="git revision or directory (default: working tree)")
    parser.add_argument("--goldens", type=Path, default=REPO / "goldens")
    parser.add_argument("--repeat", type=int, default=3, help="runs of the whole diff; the best is reported")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.base is None:
            goldens, base, head, cwd = worst_case_repo(Path(tmp)), "HEAD~1", "HEAD", Path(tmp)
        else:
            goldens, base, head, cwd = args.goldens, args.base, args.head, Path.cwd()

        with one_thread():
            rows = per_golden(base, head, goldens)
        print(f"{'golden':34s} {'KiB (both)':>10s} {'read ms':>8s} {'decode ms':>9s} {'compare ms':>10s} {'total ms':>8s}  verdict")
        for key, size, read, decode, compare, verdict in rows:
            total = read + decode + compare
            print(f"{key:34s} {size / 1024:10.0f} {read * 1e3:8.1f} {decode * 1e3:9.1f} {compare * 1e3:10.1f} {total * 1e3:8.1f}  {verdict}")
        summed = sum(r[2] + r[3] + r[4] for r in rows)
        print(f"{'sum over ' + str(len(rows)) + ' goldens':34s} {sum(r[1] for r in rows) / 1024:10.0f} "
              f"{'':8s} {'':9s} {'':10s} {summed * 1e3:8.1f}")

        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            report = diff(base, head, goldens)
            best = min(best, time.perf_counter() - t0)
        print(f"\ndiff() in process, {base} -> {head or 'working tree'}: {best:.3f} s "
              f"(best of {args.repeat}; {len(report.changed)} changed, {len(report.unchanged)} unchanged)")

        cmd = [sys.executable, "-m", "veosnap", "diff", base, *([head] if head else []), "--goldens", str(goldens)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        print(f"`veosnap diff` command, wall time incl. interpreter and torch import: {wall:.2f} s (exit {done.returncode})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
