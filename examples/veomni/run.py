"""Run the VeOmni example: every zoo model x VeOmni backend x layout against the cpu goldens; one table.

    python examples/veomni/run.py [--quick] [--models a,b] [--out DIR]

Needs `veomni` importable (build its environment with `tools/veomni_env.sh`, which then runs this).
One veosnap call per (model, dtype, backend): its in-process layouts run here, its multi-process ones in
one torchrun (the plugin is told which layout builds it). Writes `DIR/results.json` (one record per
cell: model, dtype, backend, layout, status, worst tensor and ratio, reason, notes) and `DIR/table.md`,
and prints the table. Every zoo model runs (VeOmni's own registry decides which it builds). A cell that
does not pass must match an expectation in `expected.toml` (data: model, cell selector, expected status,
why, the upstream cause; never an ERROR); an expectation whose cells no longer show it is reported as
stale. Exit status 0 when every cell passes or is expected and no expectation is stale, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib.metadata as md
import json
import os
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLUGIN = str((HERE / "plugin.py").relative_to(ROOT))

IN_PROCESS = ("single", "packed", "microbatch")
DISTRIBUTED = ("ddp", "fsdp2", "hsdp", "ep", "tp")
QUICK_MODELS = ("qwen3", "qwen3_moe", "deepseek_v3", "qwen3_vl", "mixtral")
EXPECTED = HERE / "expected.toml"
NO_LOGITS = "*"  # the cell's mark: the candidate computes its loss without logits, so they were not compared


@dataclass(frozen=True, eq=False)
class Cell:
    """One check: what ran, how it ended and why."""

    model: str
    dtype: str
    backend: str
    layout: str
    status: str  # PASS, FAIL, ERROR, skip
    worst: str = ""
    ratio: float | None = None
    reason: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    no_logits: bool = False

    @property
    def label(self) -> str:
        ratio = "" if self.ratio is None else f" {self.ratio:.2f}x" if self.ratio < 100 else f" {self.ratio:.2g}x"
        return f"{self.status}{ratio}{NO_LOGITS if self.no_logits and self.status != 'skip' else ''}"


def plan(models: list[str], quick: bool) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(model, dtype, backend name, layouts) in the order they run; one tuple = one veosnap call."""
    distributed = ("fsdp2", "ep") if quick else DISTRIBUTED
    runs = []
    for model in models:
        runs.append((model, "float32", "veomni", IN_PROCESS + distributed))
        runs.append((model, "bfloat16", "veomni", ("single",)))
        runs.append((model, "float32", "veomni_chunk_loss", ("single",)))
        runs.append((model, "float32", "veomni_sdpa", ("single",)))
        runs.append((model, "float32", "veomni_collator", ("single", "fsdp2") if quick else ("single", "ddp", "fsdp2")))
        runs.append((model, "float32", "veomni_fsdp2", ("fsdp2",) if quick else ("fsdp2", "hsdp")))
        runs.append((model, "float32", "eager", ("single",)))  # after VeOmni in this process: restored?
    return runs


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """What VeOmni prints while the checks run (its INFO logger writes to stdout) goes to stderr: stdout is the
    table (the `veosnap` command does the same for its reports)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_cells(models: list[str], quick: bool, nproc: int, timeout_s: float, start: float) -> list[Cell]:
    from veosnap import GoldenKey, Project
    from veosnap.candidates import backends
    from veosnap.runs.check import check_layouts

    project = Project.resolve(goldens=ROOT / "goldens", configs=ROOT / "toy_configs", testdata=ROOT / "testdata")
    cells = []
    runs = plan(models, quick)
    with _stdout_to_stderr():  # loading the plugin imports VeOmni, which prints
        said = registrations()
    print(f"VeOmni's import-time registrations (present before every check, not patches of a candidate): "
          f"{', '.join(said) or 'none'}", file=sys.stderr, flush=True)
    for index, (model, dtype, name, names) in enumerate(runs, 1):
        spec = name if name == "eager" else f"{PLUGIN}:{name}"
        backend = backends.resolve(spec)
        began = time.monotonic()
        print(f"[{index}/{len(runs)} {began - start:.0f} s] {model}/{dtype} {name}: {', '.join(names)}",
              file=sys.stderr, flush=True)
        with _stdout_to_stderr():
            reports = check_layouts(project, GoldenKey(project.hardware_class, model, "step", dtype), backend,
                                    list(names), nproc=nproc, timeout_s=timeout_s)
        seconds = (time.monotonic() - began) / len(reports)
        for report in reports:
            worst = report.worst
            reason = report.skipped or report.error or "; ".join(
                filter(None, [report.structure_line, *(r.message() for r in report.routes if not r.passed),
                              report.first_divergence, report.first_gradient_divergence]))
            cells.append(Cell(model, dtype, name, report.layout, report.status,
                              worst.name if worst and not (report.skipped or report.error) else "",
                              worst.ratio if worst and not (report.skipped or report.error) else None,
                              reason, round(seconds, 1), list(report.notes), "logits" in report.absent))
            print(f"{cells[-1].label:12s} {model}/{dtype} {name} {report.layout}  {reason[:110]}", file=sys.stderr,
                  flush=True)
    return cells


@dataclass(frozen=True)
class Expectation:
    """A known non-PASS outcome (`expected.toml`): which cells (an fnmatch pattern, or a list of them, per
    field), the status they show and the text their reason holds, why, and the upstream cause."""

    model: str | list[str]
    status: str
    why: str
    upstream: str
    reason: str = ""  # a substring the cell's reason must contain
    dtype: str | list[str] = "*"
    backend: str | list[str] = "*"
    layout: str | list[str] = "*"

    def selects(self, cell: Cell) -> bool:
        def any_of(value: str, patterns: str | list[str]) -> bool:
            return any(fnmatch.fnmatchcase(value, p) for p in ([patterns] if isinstance(patterns, str) else patterns))

        return all(any_of(getattr(cell, k), getattr(self, k)) for k in ("model", "dtype", "backend", "layout"))

    def shown_by(self, cell: Cell) -> bool:
        return self.selects(cell) and cell.status == self.status and self.reason in cell.reason

    def label(self) -> str:
        def text(value: str | list[str]) -> str:
            return value if isinstance(value, str) else "|".join(value)

        return (f"{self.status} {text(self.model)}/{text(self.dtype)} {text(self.backend)} {text(self.layout)} "
                f"({self.reason!r})")


def load_expectations(path: Path = EXPECTED) -> list[Expectation]:
    """The expectations in `path`; an ERROR, or an entry without why or upstream cause, is refused."""
    entries = tomllib.loads(path.read_text(encoding="utf-8")).get("expect", [])
    out = []
    for i, entry in enumerate(entries):
        where = f"{path.name} entry {i + 1}"
        if entry.get("status") not in ("skip", "FAIL"):
            raise SystemExit(f"{where}: status {entry.get('status')!r}: only skip or FAIL can be expected (an ERROR "
                             "is a bug in the candidate, the plugin or veosnap, never an expectation)")
        if not entry.get("why") or not entry.get("upstream"):
            raise SystemExit(f"{where}: says neither why nor the upstream cause")
        out.append(Expectation(**entry))
    return out


def judge(cells: list[Cell], expectations: list[Expectation]) -> tuple[dict[Cell, Expectation], list[Cell],
                                                                         list[Expectation]]:
    """(each expected non-PASS cell -> its expectation, the unexpected cells, the stale expectations: those that
    select cells of this run of which none shows them any more)."""
    matched = {}
    for cell in cells:
        found = next((e for e in expectations if e.shown_by(cell)), None) if cell.status != "PASS" else None
        if found is not None:
            matched[cell] = found
    unexpected = [c for c in cells if c.status != "PASS" and c not in matched]
    stale = [e for e in expectations
             if any(e.selects(c) for c in cells) and not any(e.shown_by(c) for c in cells)]
    return matched, unexpected, stale


def table(cells: list[Cell], grouped: bool = False) -> str:
    """Model rows, a column per (backend, dtype, layout); under it each non-PASS cell's reason (`grouped`: one line
    per backend, layout, status and reason, naming its cells)."""
    columns = list(dict.fromkeys((c.backend, c.dtype, c.layout) for c in cells))
    models = list(dict.fromkeys(c.model for c in cells))
    by = {(c.model, c.backend, c.dtype, c.layout): c for c in cells}
    head = ["model", *(f"{b} {'f32' if d == 'float32' else 'bf16'} {layout}" for b, d, layout in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        row = [model] + [by[(model, *col)].label if (model, *col) in by else "" for col in columns]
        lines.append("| " + " | ".join(row) + " |")
    notes = sorted({f"- {c.label.split()[0]} {c.model}/{c.dtype} {c.backend} {c.layout}: {c.reason}"
                    for c in cells if c.status != "PASS"})
    if grouped:
        groups: dict[tuple[str, str, str, str], list[str]] = {}
        for c in cells:
            if c.status != "PASS":
                key = (c.backend, c.layout, c.label.split()[0], c.reason)
                groups.setdefault(key, []).append(f"{c.model}/{c.dtype}")
        notes = [f"- {status} {backend} {layout} ({', '.join(which)}): {reason}"
                 for (backend, layout, status, reason), which in groups.items()]
    if any(c.no_logits for c in cells):
        notes.append(f"- {NO_LOGITS}: the candidate computes its loss without logits (GPT-OSS; a chunked or fused "
                     "linear loss): logits not compared, every other tensor is")
    return "\n".join(lines + [""] + notes)


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "veomni", "veosnap", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="examples/veomni/run.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated zoo models (default: all)")
    p.add_argument("--quick", action="store_true", help=f"models {','.join(QUICK_MODELS)}; layouts fsdp2 and ep only")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--out", type=Path, help="write results.json and table.md here")
    args = p.parse_args(argv)
    from veosnap import Project

    models = args.models.split(",") if args.models else list(QUICK_MODELS) if args.quick else \
        Project.resolve(configs=ROOT / "toy_configs").models()
    expectations = load_expectations()
    env = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in env.items()), file=sys.stderr, flush=True)
    os.environ.setdefault("VEOSNAP_RANK_STDERR", "1")  # the ranks' output reaches this console (stderr)
    start = time.monotonic()
    cells = run_cells(models, args.quick, args.nproc, args.timeout, start)
    matched, unexpected, stale = judge(cells, expectations)
    text = table(cells)
    summary = (f"{len(cells)} cells: {sum(c.status == 'PASS' for c in cells)} pass, "
               f"{sum(c.status == 'skip' for c in cells)} skip, {sum(c.status == 'FAIL' for c in cells)} fail, "
               f"{sum(c.status == 'ERROR' for c in cells)} error; {len(matched)} expected, "
               f"{len(unexpected)} unexpected, {len(stale)} stale expectations; "
               f"{len({c.model for c in cells if c.status == 'PASS' and c.backend != 'eager'})} models with passing "
               f"VeOmni cells; in {time.monotonic() - start:.0f} s")
    print(text + "\n\n" + summary)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "table.md").write_text(text + "\n\n" + summary + "\n", encoding="utf-8")
        (args.out / "results.json").write_text(json.dumps(
            {"versions": env, "import_registrations": list(registrations()),
             "cells": [{**asdict(c), "expected": asdict(matched[c]) if c in matched else None} for c in cells],
             "unexpected": [asdict(c) for c in unexpected], "stale": [asdict(e) for e in stale]}, indent=1) + "\n",
            encoding="utf-8")
    for cell in unexpected:
        print(f"unexpected: {cell.label} {cell.model}/{cell.dtype} {cell.backend} {cell.layout}: {cell.reason}",
              file=sys.stderr)
    for entry in stale:
        print(f"stale expectation (no cell shows it any more; update {EXPECTED.name}): {entry.label()}: {entry.why}",
              file=sys.stderr)
    return 1 if unexpected or stale else 0


def registrations() -> tuple[str, ...]:
    """What `import veomni` registered in transformers (the plugin imports it when it loads, before any check)."""
    from veosnap.candidates import backends

    backends.resolve(f"{PLUGIN}:veomni")  # loads the plugin, which puts its package on sys.path
    import veosnap_veomni

    return veosnap_veomni.IMPORT_REGISTRATIONS


if __name__ == "__main__":
    sys.exit(main())
