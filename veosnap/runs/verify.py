"""Integrity of golden files (`veosnap verify`): is each one exactly what a recorder wrote, for the model it names?

Each file goes through the one reader every command uses (`golden.store.read`: a regular file only, the key
from its path and never from where a symlink leads, compression, schema, the manifest hash (required),
payload and inputs hashes, the tensor set). Verify adds what a check need not pay for on every run: finite
tensors, and coverage without running the model: the model the manifest's config describes is built on
the meta device (no memory) and the golden must hold its every parameter's gradient (or update), every
layer's output and every router's routes, unless the manifest says why not (`reference.coverage`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GoldenError, VeosnapError
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import SUFFIX, GoldenKey
from ..reference import coverage
from ..reference.zoo import load_config, same_dir


@dataclass(frozen=True)
class VerifyResult:
    """One file's verdict: `problem` is empty when the golden is sound."""

    path: Path
    key: GoldenKey | None
    problem: str = ""
    excused: tuple[str, ...] = ()  # a sound golden's variants recorded despite (`record --excuse`), with why

    @property
    def ok(self) -> bool:
        return not self.problem

    def line(self) -> str:
        if self.problem:
            return f"{self.path}: {self.problem}"
        return f"{self.path}: ok" + "".join(f"; excused {line}" for line in self.excused)


def consistency_problem(g: Golden) -> str:
    """What `golden.read` does not look for: a non-finite value in a stored tensor ('' when none)."""
    for name in sorted(g.tensors):
        t = g.tensors[name]
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = tuple(int(i) for i in bad.nonzero()[0]) if t.ndim else ()
                return f"tensor {name!r} has {int(bad.sum())} non-finite value(s) (NaN/Inf), first at {first}"
    return ""


def stale_problem(g: Golden, configs: Path) -> str:
    """Why a sound golden is stale: recorded from another config than its model's in `configs` today ('' when
    it is not, or `configs` has no config of that model)."""
    try:
        toy = load_config(configs, g.key.model)
    except VeosnapError:
        return ""  # no config to hold it against here (verify checks the file; check refuses a missing config)
    if toy.hash == g.manifest.config_hash or not same_dir(toy.path.parent.parent, configs):
        return ""  # current, or only the bundled zoo's config of that name: not the one it was recorded from
    scenario = "" if g.key.scenario == "step" else f" --scenario {g.key.scenario}"
    return (f"recorded from another config than {toy.path} today (config hash {g.manifest.config_hash[:19]}..., today "
            f"{toy.hash[:19]}...): stale; re-record it with `veosnap refresh --reason \"...\" --model {g.key.model} "
            f"--dtype {g.key.dtype}{scenario}`")


def verify_file(path: Path, root: Path | None = None, configs: Path | None = None) -> VerifyResult:
    """Read and check one golden (under `root` when it was found there); its key is the one its path names.
    With `configs`, a golden recorded from another config than its model's there today is bad (stale)."""
    path = Path(path)
    expected = store.key_of(path, root)
    if expected is None:
        return VerifyResult(path, None, f"not a golden path (<class>/<model>/<scenario>-<dtype>{SUFFIX})")
    try:
        g = store.read(path, root)
        coverage.require(g, coverage.manifest_config(g))  # the config's limits first, then the meta model
    except GoldenError as exc:
        return VerifyResult(path, expected, exc.cause)
    except VeosnapError as exc:
        return VerifyResult(path, expected, str(exc).removeprefix(f"{path}: "))
    excused = tuple(f"{variant}: {e.reason}" for variant, e in sorted(g.manifest.excused.items()))
    problem = consistency_problem(g) or (stale_problem(g, configs) if configs is not None else "")
    return VerifyResult(path, expected, problem, excused)


def collect(paths: list[Path]) -> list[tuple[Path, Path | None]]:
    """Golden files named by `paths`, each with the goldens root it was found under (None: given as a file).

    A directory is a goldens root: every file named like a golden under it (specials included: they are
    reported, never read); one with nothing to verify, or that cannot be listed, is an error.
    """
    found: list[tuple[Path, Path | None]] = []
    for path in map(Path, paths):
        if path.is_dir():
            entries = store.scan(path, strict=True).entries
            if not entries:
                raise VeosnapError(f"{path}: no goldens found (expected <class>/<model>/<scenario>-<dtype>{SUFFIX} "
                                   "under it)")
            found += [(e.path, path) for e in entries]
        elif path.exists() or path.is_symlink():
            found.append((path, None))
        else:
            raise VeosnapError(f"{path}: no such file or directory")
    return found


def verify(paths: list[Path], configs: Path | None = None) -> list[VerifyResult]:
    """Verify every golden named by `paths` (files, or goldens directories); with `configs`, each against its
    model's config there too (a golden recorded from another config is stale)."""
    return [verify_file(path, root, configs) for path, root in collect(paths)]
