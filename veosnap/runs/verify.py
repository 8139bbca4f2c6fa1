"""Integrity of golden files (`veosnap verify`): is each one exactly what a recorder wrote?

`golden.read` already refuses bad compression, oversized parts, unknown schemas, payload hash and
inputs hash mismatches, and tensors without a tolerance. Verify adds what a reader need not pay for on
every check: the manifest's config hash recomputed from its own config, the key against the path,
finite tensors, and finite positive bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import GoldenError, VeosnapError
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import SUFFIX, GoldenKey


@dataclass(frozen=True)
class VerifyResult:
    """One file's verdict: `problem` is empty when the golden is sound."""

    path: Path
    key: GoldenKey | None
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem

    def line(self) -> str:
        return f"{self.path}: {self.problem}" if self.problem else f"{self.path}: ok"


def consistency_problem(g: Golden) -> str:
    """What `golden.read` does not look for: a non-finite value in a stored tensor ('' when none).

    The reader already refuses bad hashes (payload, inputs, config), schema, tensor sets and
    non-finite or non-positive tolerances.
    """
    for name in sorted(g.tensors):
        t = g.tensors[name]
        if t.is_floating_point():
            bad = ~torch.isfinite(t)
            if bad.any():
                first = tuple(int(i) for i in bad.nonzero()[0]) if t.ndim else ()
                return f"tensor {name!r} has {int(bad.sum())} non-finite value(s) (NaN/Inf), first at {first}"
    return ""


def verify_file(path: Path) -> VerifyResult:
    """Read and check one golden; its key must match the last three parts of its path."""
    path = Path(path)
    try:
        expected = GoldenKey.from_relpath(Path(*path.parts[-3:]))
    except (VeosnapError, TypeError):
        return VerifyResult(path, None, f"not a golden path (<class>/<model>/<scenario>-<dtype>{SUFFIX})")
    try:
        g = store.read(path)
    except GoldenError as exc:
        return VerifyResult(path, expected, exc.cause)
    if g.key != expected:
        return VerifyResult(path, expected, f"manifest key {g.key} disagrees with its path ({expected})")
    return VerifyResult(path, expected, consistency_problem(g))


def collect(paths: list[Path]) -> list[Path]:
    """Golden files named by `paths`: files as given, directories searched as goldens roots."""
    found: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            found += [p for _, p in store.list_goldens(path)]
        elif path.exists():
            found.append(path)
        else:
            raise VeosnapError(f"{path}: no such file or directory")
    return found


def verify(paths: list[Path]) -> list[VerifyResult]:
    """Verify every golden named by `paths` (files, or goldens directories)."""
    return [verify_file(p) for p in collect(paths)]
