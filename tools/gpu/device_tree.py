"""Fit the work tree to one device call: set aside the goldens a call does not need, and put them back.

The device tool copies the tracked tree and the carried folders, 64 MiB in all; the goldens alone are now
larger (cpu and cuda-sm90, toy and real-shape). Each device call needs only some of them, so the folders
it does not need are moved out of the tree before the call and back after it:

    python tools/gpu/device_tree.py aside --keep 'goldens/cuda-sm90/*-real*' --carry .whl/s --carry .whl/l
    ... the device call ...
    python tools/gpu/device_tree.py restore

`aside` moves every golden folder (goldens/CLASS/MODEL) that no `--keep` pattern matches to a folder
outside the tree, records the moves there, and prints what travels (tracked files left plus the carried
folders) against the limit; it refuses a second `aside` before `restore`, and a plan over the limit unless
`--force`. `restore` moves everything back and checks that git sees the goldens unchanged. `plan` prints the
same sizes without moving anything. Presets: `--for real` (the real-shape cuda-sm90 goldens only) and
`--for bench` (cpu llama and qwen3_moe, and the toy cuda-sm90 goldens), the sets docs/gpu.md's and
docs/scale.md's device commands need.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 2**20  # the device tool's limit on the tracked tree and the carried folders together
ROOT = Path(__file__).resolve().parents[2]
STASH = Path("/tmp/veosnap-device-aside")
PRESETS = {
    "real": ["goldens/cuda-sm90/*-real*"],
    "bench": ["goldens/cpu/llama", "goldens/cpu/qwen3_moe", "goldens/cuda-sm90/*"],
}
EXCLUDE = {"bench": ["goldens/cuda-sm90/*-real*"]}  # kept by a broader pattern, still not needed


def tracked_sizes(root: Path) -> dict[str, int]:
    """Every tracked file's size, by path relative to `root`."""
    names = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], check=True, capture_output=True).stdout
    sizes = {}
    for name in filter(None, names.decode().split("\0")):
        path = root / name
        if path.is_file():
            sizes[name] = path.stat().st_size
    return sizes


def golden_folders(root: Path) -> list[str]:
    """goldens/CLASS/MODEL folders, relative to `root`."""
    return sorted(str(p.relative_to(root)) for p in (root / "goldens").glob("*/*") if p.is_dir())


def chosen_aside(root: Path, keep: list[str], exclude: list[str]) -> list[str]:
    return [folder for folder in golden_folders(root)
            if not any(fnmatch.fnmatch(folder, k) for k in keep) or any(fnmatch.fnmatch(folder, e) for e in exclude)]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def plan(root: Path, aside: list[str], carry: list[str]) -> tuple[int, str]:
    """Bytes that travel, and a table of them."""
    sizes = tracked_sizes(root)
    left = sum(size for name, size in sizes.items() if not any(name.startswith(a + "/") for a in aside))
    carried = {c: folder_bytes(root / c) for c in carry}
    total = left + sum(carried.values())
    lines = [f"tracked tree, {len(aside)} golden folder(s) set aside: {left / 2**20:.1f} MiB"]
    lines += [f"carry {c}: {b / 2**20:.1f} MiB" for c, b in carried.items()]
    verdict = "fits" if total <= LIMIT else "DOES NOT FIT"
    lines.append(f"total {total / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB: {verdict}")
    return total, "\n".join(lines)


def do_aside(root: Path, stash: Path, aside: list[str], carry: list[str], force: bool) -> int:
    record = stash / "moves.json"
    if record.exists():
        print(f"device_tree: {record} exists: run `restore` first", file=sys.stderr)
        return 2
    total, table = plan(root, aside, carry)
    print(table)
    if total > LIMIT and not force:
        print("device_tree: nothing moved (over the limit; --force to move anyway)", file=sys.stderr)
        return 2
    stash.mkdir(parents=True, exist_ok=True)
    moved = []
    for folder in aside:
        target = stash / folder
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(root / folder), str(target))
        moved.append(folder)
        record.write_text(json.dumps({"root": str(root), "moved": moved}))  # after each move: a crash loses none
    print(f"set aside {len(moved)} folder(s) in {stash}")
    return 0


def do_restore(root: Path, stash: Path) -> int:
    record = stash / "moves.json"
    if not record.exists():
        print(f"device_tree: nothing to restore ({record} does not exist)")
        return 0
    moved = json.loads(record.read_text())["moved"]
    for folder in moved:
        if (root / folder).exists():
            print(f"device_tree: {root / folder} exists again: left {stash / folder} where it is", file=sys.stderr)
            return 2
        (root / folder).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(stash / folder), str(root / folder))
    record.unlink()
    status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "goldens"], check=True,
                            capture_output=True, text=True).stdout
    print(f"restored {len(moved)} folder(s)" + (f"; git sees goldens changed:\n{status}" if status else
                                                  "; git sees the goldens unchanged"))
    return 1 if status else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["plan", "aside", "restore"])
    parser.add_argument("--keep", action="append", default=[], help="golden folders to keep (glob; repeatable)")
    parser.add_argument("--for", dest="preset", choices=sorted(PRESETS), help="a preset set of --keep patterns")
    parser.add_argument("--carry", action="append", default=[], help="a carried folder, counted (repeatable)")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--stash", type=Path, default=STASH)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.action == "restore":
        return do_restore(root, args.stash)
    keep = args.keep + PRESETS.get(args.preset, [])
    aside = chosen_aside(root, keep, EXCLUDE.get(args.preset, []))
    if args.action == "plan":
        print(plan(root, aside, args.carry)[1])
        return 0
    return do_aside(root, args.stash, aside, args.carry, args.force)


if __name__ == "__main__":
    sys.exit(main())
