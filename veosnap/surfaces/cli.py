"""The `veosnap` command: a thin skin over the library (record, check, diff, refresh, verify, show, ls).

Exit status: 0 all passed, 1 a check failed (diff --fail-on-change: a material change; verify: a bad
golden), 2 usage error, missing golden or bad input; 130 and 143 when stopped by SIGINT and SIGTERM
(after ending what it started: torchrun and its ranks, temp directories).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..about import __version__
from ..candidates import backends, guard, threads
from ..candidates.layouts import registry as layouts
from ..errors import GoldenError, VeosnapError
from ..golden import limits, store
from ..golden.key import DTYPE_NAMES, SCENARIOS, GoldenKey
from ..golden.sketches import MODES
from ..numerics import fmt
from ..reference.zoo import TIER_CHOICES, Project, default_goldens, find_root
from ..render import json as render_json
from ..render import markdown as render_markdown
from ..render import text as render_text
from ..runs.check import DEFAULT_TIMEOUT_S

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _project(args: argparse.Namespace) -> Project:
    return Project.resolve(goldens=args.goldens, configs=args.configs, testdata=args.testdata,
                           hardware_class=args.hardware_class)


def _recording_project(args: argparse.Namespace) -> Project:
    """Where `record` and `refresh` write: --goldens, else ./goldens (never the bundled goldens; see
    `zoo.default_goldens`)."""
    return Project.for_recording(goldens=args.goldens, configs=args.configs, testdata=args.testdata,
                                 hardware_class=args.hardware_class)


def _selection(args: argparse.Namespace, project: Project) -> list[tuple[str, str]]:
    if args.model and args.tier is not None:
        raise VeosnapError("--model and --tier do not go together (--model NAME reaches a model of any tier)")
    models = args.model or project.models(args.tier or "toy")
    if not models:
        raise VeosnapError(f"{project.configs}: no {args.tier or 'toy'} configs found (expected <name>/config.json"
                           f"{'' if (args.tier or 'toy') == 'toy' else ' with a veosnap.json declaring the tier'})")
    dtypes = args.dtype or list(DTYPE_NAMES)
    return [(m, d) for m in models for d in dtypes]


def _checked(args: argparse.Namespace, project: Project) -> list[tuple[str, str, str]]:
    """What `check` (and `--matrix`) checks, as (model, scenario, dtype): without --dtype, the dtypes that
    have a golden of that scenario on this class; a model named by --model with none is an error saying how
    to record them, a model of a --tier with none is left out with a note, unless none of the tier has any."""
    from ..reference import scenarios
    from ..reference.zoo import load_config
    from ..runs.record import refusal

    if args.dtype:
        return [(m, s, d) for m, d in _selection(args, project) for s in _scenarios(args, project, m)]
    models = list(dict.fromkeys(m for m, _ in _selection(args, project)))
    chosen, missing = [], []
    for model in models:
        config = load_config(project.configs, model).config
        for scenario in _scenarios(args, project, model):
            dtypes = project.recorded_dtypes(model, scenario)
            if not dtypes and not scenarios.get(scenario).applies(config):
                dtypes = [DTYPE_NAMES[0]]  # a scenario the model cannot run: its check is a skip saying why
            elif not dtypes:
                missing.append((model, scenario))
            chosen += [(model, scenario, d) for d in dtypes]

    def no_golden(model: str, scenario: str) -> VeosnapError:
        # advise recording only what this machine records (a real-shape model may need more memory than it has)
        key = GoldenKey(project.hardware_class, model, scenario, DTYPE_NAMES[0])
        return project.no_golden(model, scenario, refused=refusal(project, key))

    if missing and (args.model or not chosen):
        raise no_golden(*missing[0])
    for model, scenario in missing:
        print(f"veosnap: {no_golden(model, scenario)} (left out)", file=sys.stderr)
    return chosen


def _scenarios(args: argparse.Namespace, project: Project, model: str, recording: bool = False) -> list[str]:
    """The scenarios to run for `model`: those named (`all`: every one the model can run; a scenario the
    model cannot run is left out unless the model was named too, so its report says why)."""
    from ..reference import scenarios
    from ..reference.zoo import load_config

    named = args.scenario or ["step"]
    config = load_config(project.configs, model).config
    if "all" in named:
        chosen = [s.name for s in scenarios.applicable(config)]
    else:
        chosen = [name for name in named if args.model or scenarios.get(name).applies(config)]
    if recording:  # a scenario checked against another's golden records that one, once
        chosen = [GoldenKey("cpu", model, name).recorded.scenario for name in chosen]
    return list(dict.fromkeys(chosen))


def _certify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-certify", action="store_true",
                   help="write the golden without planting veosnap's canaries (by default an error of 1e-3 in "
                        "float32, 1-10%% in bfloat16, in one layer's output, one gradient and one expert must fail it, "
                        "or it is refused; the sensitivity they certify is kept in the manifest and shown by every "
                        "check); it then says 'not certified'")
    p.add_argument("--certify", action="store_true", help=argparse.SUPPRESS)  # the default now: kept for a release


def _certifying(args: argparse.Namespace) -> bool:
    if args.certify:
        print("veosnap: warning: --certify is the default now and the flag goes in the next release; "
              "--no-certify turns certification off", file=sys.stderr)
    if args.no_certify:
        print("veosnap: warning: recording without certification (--no-certify): the golden's sensitivity is "
              "not tested and every check of it says 'not certified'", file=sys.stderr)
    return not args.no_certify


def cmd_record(args: argparse.Namespace) -> int:
    from ..runs.canaries import sensitivity_note
    from ..runs.record import parse_excuses, record

    excuses = parse_excuses(args.excuse or [])
    project = _recording_project(args)
    for model, dtype in _selection(args, project):
        for scenario in _scenarios(args, project, model, recording=True):
            outcome = record(project, model, dtype, scenario=scenario, seed=args.seed,
                             allow_near_ties=args.allow_near_ties, allow_fragile=args.allow_fragile,
                             sketch=args.sketch, excuses=excuses, certify=_certifying(args))
            margin = "" if outcome.min_margin is None else f"  min router margin {fmt.num(outcome.min_margin)}"
            note = f"  ({outcome.note})" if outcome.note else ""
            state = "wrote" if outcome.written else "unchanged"
            bundled = outcome.config is not None and not outcome.config.is_relative_to(project.configs)
            zoo = f"  (config from veosnap's bundled zoo: {outcome.config})" if bundled else ""
            print(f"{state:9s} {outcome.path}{margin}{note}{zoo}")
            if outcome.routes_not_captured:
                print(f"veosnap: warning: {outcome.path}: {outcome.routes_not_captured}", file=sys.stderr)
            if outcome.random_off:
                print(f"veosnap: note: {outcome.path}: {outcome.random_off}", file=sys.stderr)
            if outcome.sensitivity:
                print(f"          {sensitivity_note(outcome.sensitivity)}")
            if outcome.fragile:
                print(f"veosnap: warning: {outcome.path}: fragile golden written (--allow-fragile): legitimate "
                      f"variants exceed its bounds ({'; '.join(outcome.fragile)})", file=sys.stderr)
            for line in outcome.excused:
                print(f"veosnap: warning: {outcome.path}: excused (--excuse), its checks still fail: {line}",
                      file=sys.stderr)
    return EXIT_OK


@contextmanager
def _candidates_print_to_stderr() -> Iterator[bool]:
    """Within the block file descriptor 1 is stderr, so what candidates print (print, logging handlers bound
    to stdout, C extensions) cannot mix with the report; after it, stdout is stdout again. Yields whether
    the real stdout is a terminal (the report's colours)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with guard.report_to(saved):  # a candidate ended past its timeout still leaves its ERROR block there
            yield os.isatty(saved)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_check(args: argparse.Namespace) -> int:
    if args.matrix:
        return cmd_matrix(args)
    if args.backends or args.layouts:
        raise VeosnapError("--backends and --layouts go with --matrix (for one backend: --backend SPEC)")
    html_path = _html_target(args.html) if args.html else None  # a bad path fails before the checks run
    from ..runs.check import check_layouts

    guard.check_timeout(args.timeout)
    project = _project(args)
    chosen = args.layout or ["single"]
    with _candidates_print_to_stderr() as terminal:
        backend = backends.resolve(args.backend or "eager")  # importing a backend's file may print too
        checked = _checked(args, project)
        progress = _long(project, checked, chosen)
        reports = []
        for done, (model, scenario, dtype) in enumerate(checked, 1):
            key = GoldenKey(project.hardware_class, model, scenario, dtype)
            if progress:
                print(f"[{done}/{len(checked)}] {key} backend={backend.spec} layout={','.join(chosen)}: started "
                      f"({progress})", file=sys.stderr)
            start = time.perf_counter()
            reports += (ran := check_layouts(project, key, backend, chosen, nproc=args.nproc, timeout_s=args.timeout,
                                             cross_class=args.cross_class, isolate=args.isolate))
            if progress:
                said = ", ".join(f"{r.layout} {r.status}" for r in ran)
                print(f"[{done}/{len(checked)}] {key}: {said} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    where = project.where()
    out = render_json.checks(reports, where) if args.format == "json" else \
        render_text.where(where) + "\n\n" + render_text.checks(reports, color=terminal)
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    if html_path is not None:
        from ..render import html as render_html

        store.write_bytes(render_html.checks(reports, where).encode(), html_path)
        print(f"wrote {html_path}", file=sys.stderr)
    return EXIT_OK if all(r.passed for r in reports) else EXIT_FAILED


def _long(project: Project, checked: list[tuple[str, str, str]], chosen: list[str]) -> str:
    """Why a check run is long enough to say on stderr what starts and how far it is ('' when it is not):
    a multi-process layout (torchrun starts in tens of seconds) or a real-shape model (a minute a check)."""
    from ..reference.zoo import load_config

    why = []
    spawned = [spec for spec in chosen if layouts.resolve(spec).distributed]
    if spawned:
        why.append(f"{', '.join(spawned)} on torchrun")
    if any(load_config(project.configs, model).tier == "real" for model in dict.fromkeys(m for m, _, _ in checked)):
        why.append("real-shape models")
    return "; ".join(why)


def _html_target(path: Path) -> Path:
    """The file `--html` writes: a new or existing file in an existing directory."""
    if path.is_dir():
        raise VeosnapError(f"--html {path}: is a directory; name the page to write, e.g. {path / 'veosnap.html'}")
    if not path.parent.is_dir():
        raise VeosnapError(f"--html {path}: directory {path.parent} does not exist")
    return path


def cmd_diff(args: argparse.Namespace) -> int:
    from ..runs.diff import diff

    goldens = Path(args.goldens) if args.goldens else default_goldens()
    result = diff(args.base, args.head, goldens)
    render = {"text": render_text.diff, "markdown": render_markdown.diff, "json": render_json.diff}[args.format]
    out = render(result)
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return EXIT_FAILED if args.fail_on_change and result.material else EXIT_OK


def cmd_drift(args: argparse.Namespace) -> int:
    from ..runs.drift import drift

    project = _project(args)
    if args.model and args.tier is not None:
        raise VeosnapError("--model and --tier do not go together (--model NAME reaches a model of any tier)")
    models = set(args.model or project.models(args.tier or "toy"))
    keys = [key for key, _ in store.scan(project.goldens).goldens
            if key.hardware_class == project.hardware_class and key.model in models
            and (not args.dtype or key.dtype in args.dtype) and (not args.scenario or key.scenario in args.scenario)]
    if not keys:
        raise VeosnapError(f"{project.goldens}: no {project.hardware_class} goldens match the selection to record again")

    def progress(i: int, total: int, key: GoldenKey) -> None:
        print(f"[{i + 1}/{total}] recording {key} under this machine's versions", file=sys.stderr, flush=True)

    with _candidates_print_to_stderr():
        report = drift(project, keys, progress=progress)
    render = {"text": render_text.drift, "markdown": render_markdown.drift, "json": render_json.drift}[args.format]
    out = render(report)
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return EXIT_FAILED if args.fail_on_move and report.moved else EXIT_OK


def cmd_refresh(args: argparse.Namespace) -> int:
    from ..runs.record import parse_excuses
    from ..runs.refresh import refresh
    from ..runs.refresh import stale as refresh_stale

    excuses = parse_excuses(args.excuse) if args.excuse else None
    project = _recording_project(args)
    for model, dtype in _selection(args, project):
        chosen = _scenarios(args, project, model, recording=True)
        stale = [key.scenario for key in refresh_stale(project, model, [dtype]) if key.scenario not in chosen]
        if args.scenario is None:
            chosen += stale  # every golden recorded from another config than today's, unless scenarios are named
        else:
            for scenario in stale:
                key = GoldenKey(project.hardware_class, model, scenario, dtype)
                print(f"veosnap: warning: {store.path_for(project.goldens, key)}: recorded from another config than "
                      f"today's, left as it is (--scenario {' '.join(args.scenario)}); refresh it with --scenario "
                      f"{scenario}", file=sys.stderr)
        for scenario in chosen:
            outcome = refresh(project, model, dtype, args.reason, force=args.force, scenario=scenario,
                              allow_near_ties=args.allow_near_ties, allow_fragile=args.allow_fragile,
                              sketch=args.sketch, excuses=excuses, certify=_certifying(args))
            print(f"{outcome.action:9s} {outcome.path}  ({outcome.why})")
            if outcome.diff is not None:
                print("\n".join(render_text.diff_golden(outcome.diff)))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from ..runs.verify import verify

    paths = args.paths or [Path(args.goldens) if args.goldens else default_goldens()]
    results = verify(paths, configs=_project(args).configs)  # each golden against its model's config today
    bad = [r for r in results if not r.ok]
    for r in results:
        if not r.ok or r.excused:  # a sound golden recorded despite a failing variant says so
            print(r.line())
    print(f"verified {len(results)} golden(s): {len(bad)} bad")
    return EXIT_FAILED if bad else EXIT_OK


def cmd_matrix(args: argparse.Namespace) -> int:
    from ..runs import matrix

    if args.html:
        raise VeosnapError("--html goes with a check of one backend (not --matrix)")
    if args.backend:
        raise VeosnapError("--matrix takes --backends a,b,c (not --backend)")
    guard.check_timeout(args.timeout)
    project = _project(args)
    scenario = _one_scenario(args)
    selection = [(m, d) for m, _, d in _checked(args, project)]
    models = list(dict.fromkeys(m for m, _ in selection))
    dtypes = list(dict.fromkeys(d for _, d in selection))
    default_specs, unavailable = matrix.default_backends()
    specs = _list_option(args.backends, "--backends") or default_specs
    layouts = _list_option(args.layouts, "--layouts") or [matrix.SINGLE]
    if args.backends:
        unavailable = {}
    # One line per cell on stderr, always: with stdout redirected (or in CI) nothing else shows for minutes.
    progress = _progress
    with _candidates_print_to_stderr() as terminal:
        result = matrix.run_matrix(project, models, dtypes, specs, layouts,
                                   check_cells=matrix.default_check(args.nproc, args.timeout, args.isolate), on_cell=progress,
                                   unavailable=unavailable, scenario=scenario, rows=selection)
    out = render_json.matrix(result) if args.format == "json" else \
        render_text.where(project.where()) + "\n" + render_text.matrix(result, color=terminal)
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return EXIT_OK if result.passed else EXIT_FAILED


def _one_scenario(args: argparse.Namespace) -> str:
    named = args.scenario or ["step"]
    if len(named) > 1 or named[0] == "all":
        raise VeosnapError("--matrix checks one scenario: give one --scenario")
    return named[0]


def _list_option(value: str | None, flag: str) -> list[str]:
    if value is None:
        return []
    items = [v.strip() for v in value.split(",")]
    if not all(items):
        raise VeosnapError(f"{flag} {value!r}: empty name in the comma-separated list")
    return list(dict.fromkeys(items))


def _progress(cell, done: int, total: int) -> None:  # noqa: ANN001 - a matrix.Cell
    print(f"[{done}/{total}] {cell.model} {cell.dtype} {cell.backend}/{cell.layout}: {cell.status} "
          f"({cell.seconds:.1f} s)", file=sys.stderr)


def cmd_show(args: argparse.Namespace) -> int:
    print(render_text.golden(store.read(args.golden), full=args.full))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    project = _project(args)
    scan = store.scan(project.goldens)
    for path, why in scan.skipped:  # named like goldens, but never read
        print(f"veosnap: skipped {path}: {why}", file=sys.stderr)
    entries = [(key, path) for key, path in scan.goldens
               if (args.hardware_class is None or key.hardware_class == project.hardware_class)
               and (not args.model or key.model in args.model) and (not args.dtype or key.dtype in args.dtype)
               and (args.scenario is None or key.scenario == args.scenario)]
    excused = {path: _excused(path, project.goldens) for _, path in entries}
    if args.format == "json":
        print(json.dumps([{"key": str(k), "path": str(p), "bytes": p.stat().st_size,
                           **({"excused": excused[p]} if excused[p] else {})} for k, p in entries], indent=2))
        return EXIT_OK
    if not entries:
        print(f"no goldens under {project.goldens}" + (" matching the filters" if _filtered(args) else ""))
    for key, path in entries:
        said = "".join(f"  excused {variant}: {reason}" for variant, reason in excused[path].items())
        print(f"{str(key):45s} {path.stat().st_size / 1024:8.1f} KiB  {path}{said}")
    return EXIT_OK


def _excused(path: Path, root: Path) -> dict[str, str]:
    """The variants a golden was recorded despite (`record --excuse`), from its manifest; a golden whose
    manifest cannot be read lists none here (`veosnap verify` says what is wrong with it)."""
    try:
        manifest = store.read_manifest(path, root)
    except GoldenError:
        return {}
    return {variant: excuse.reason for variant, excuse in sorted(manifest.excused.items())}


def _filtered(args: argparse.Namespace) -> bool:
    return bool(args.hardware_class or args.model or args.dtype or args.scenario)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goldens", metavar="DIR", help="goldens directory (default: ./goldens, else the bundled zoo)")
    p.add_argument("--configs", metavar="DIR", help="toy configs directory (default: ./toy_configs, else bundled)")
    p.add_argument("--testdata", metavar="DIR", help="test data directory (default: ./testdata, else bundled)")
    p.add_argument("--hardware-class", metavar="CLASS",
                   help="cpu or cuda-sm<NN> (default: $VEOSNAP_HARDWARE_CLASS, else this machine's)")


def _selectors(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="NAME",
                   help="a zoo model of any tier (repeatable; default: every model of --tier)")
    p.add_argument("--tier", choices=TIER_CHOICES, default=None,
                   help="without --model: the toys (default), the real-shape configs, or all")
    p.add_argument("--dtype", action="append", choices=DTYPE_NAMES, help="repeatable; default: both")


def _scenario(p: argparse.ArgumentParser, repeatable: bool = True) -> None:
    p.add_argument("--scenario", action="append" if repeatable else "store",
                   choices=[*SCENARIOS, "all"] if repeatable else SCENARIOS, default=None if repeatable else "step",
                   help="step: one forward and backward of the text batch; train: a few AdamW steps with clipping; "
                        "vision, audio: one step of a multimodal batch; frozen_vision: vision with the vision "
                        "encoder frozen" + ("; all: every one a model can run (repeatable; default step)"
                                            if repeatable else " (default step)"))


def _excuse(p: argparse.ArgumentParser, default: str) -> None:
    from ..golden.manifest import EXCUSABLE

    p.add_argument("--excuse", action="append", metavar="VARIANT=REASON",
                   help=f"write the golden although the fragility check's VARIANT ({', '.join(EXCUSABLE)}) fails it, "
                        "for a known reason outside veosnap (a library bug): kept in the golden with the figures, "
                        "shown by every check of VARIANT, which still fails; refused if VARIANT passes (repeatable)"
                        + default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veosnap", description="Golden-reference snapshot regression for HF models.")
    parser.add_argument("--version", action="version", version=f"veosnap {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("record", help="record goldens from the HF eager reference on this machine")
    _common(p), _selectors(p)
    _scenario(p)
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--allow-near-ties", action="store_true", help="record even if a router has near-ties")
    p.add_argument("--sketch", choices=MODES, default="auto",
                   help="store large tensors as sketches: auto (only when the golden would not fit "
                        f"{limits.mib(limits.TARGET_BYTES)}), always, never (default auto; see docs/sketch.md)")
    p.add_argument("--allow-fragile", action="store_true",
                   help="write a golden even if cheap legitimate variants (sdpa, grouped_mm, batched_mm) exceed "
                        "its bounds (warns, naming them)")
    _certify(p)
    _excuse(p, "")
    commands["record"] = cmd_record

    p = sub.add_parser("check", help="check a backend against the goldens")
    _common(p), _selectors(p)
    _scenario(p)
    p.add_argument("--backend", metavar="SPEC",
                   help=f"built-in ({', '.join(backends.builtin_names())}), path/file.py:fn, module:fn; "
                        "join with + (default: eager)")
    p.add_argument("--layout", action="append", metavar="LAYOUT",
                   help=f"repeatable; default single; one of: {', '.join(layouts.names())}, "
                        "or path/file.py:layout, module:layout")
    p.add_argument("--matrix", action="store_true",
                   help="check every model with every backend and layout; print one table")
    p.add_argument("--backends", metavar="A,B", help="with --matrix: backend specs (default: built-ins that run here)")
    p.add_argument("--layouts", metavar="X,Y", help="with --matrix: layouts (default: single)")
    p.add_argument("--nproc", type=int, default=2, metavar="N", help="processes for multi-process layouts (default 2)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help="seconds before a candidate that has not finished is ended as an error, in every layout "
                        "(default %(default)g)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: the report, worst tensors first (default); json: one document with every tensor, "
                        "its worst rows and the next command")
    p.add_argument("--html", metavar="FILE", type=Path,
                   help="also write the report as one self-contained HTML page: error/bound per layer, forward "
                        "and backward, route flips per expert, worst rows")
    p.add_argument("--cross-class", action="store_true",
                   help="allow goldens of another hardware class than this machine's (measures the gap)")
    p.add_argument("--isolate", action="store_true",
                   help="bfloat16/float16 real-shape goldens: also check each layer in isolation, fed the "
                        "reference's inputs, where a 1%% systematic error shows above rounding (costs the "
                        "reference's forward and a float64 copy's; toy goldens are always isolated)")
    commands["check"] = cmd_check

    p = sub.add_parser("diff", help="how goldens moved between two git revisions or directories")
    p.add_argument("base", metavar="BASE", help="git revision (e.g. HEAD~1, origin/main) or goldens directory")
    p.add_argument("head", metavar="HEAD", nargs="?", help="git revision or directory (default: the working tree)")
    p.add_argument("--goldens", metavar="DIR", help="goldens directory in the working tree (default: ./goldens)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="text: for a terminal (default); markdown: a pull-request comment, summary table first; "
                        "json: every moved tensor, route and field")
    p.add_argument("--fail-on-change", action="store_true",
                   help="exit 1 on a material change (tensor over 1x bound, routes, config/inputs, goldens added/removed)")
    commands["diff"] = cmd_diff

    p = sub.add_parser("drift", help="what the torch and transformers installed here move in the goldens, "
                                      "recorded again in memory (nothing written)")
    _common(p), _selectors(p)
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="repeatable; default: every scenario")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="text: one line per golden, moved first (default); markdown: a table for a pull request "
                        "or the docs; json: every golden's status, worst tensor and first moved layer")
    p.add_argument("--fail-on-move", action="store_true",
                   help="exit 1 when a golden moved beyond its bounds, routes differently or records other tensors")
    commands["drift"] = cmd_drift

    p = sub.add_parser("refresh", help="re-record goldens that moved beyond noise, with an approval reason")
    _common(p), _selectors(p)
    _scenario(p)
    p.add_argument("--reason", required=True, metavar="TEXT", help="why the goldens change (kept in the approval trail)")
    p.add_argument("--force", action="store_true", help="rewrite even goldens that did not move beyond noise")
    p.add_argument("--allow-near-ties", action="store_true", help="record even if a router has near-ties")
    p.add_argument("--sketch", choices=MODES, default=None,
                   help="auto, always or never (default: the mode the golden was recorded with, auto if it "
                        "has no sketched tensor)")
    p.add_argument("--allow-fragile", action="store_true",
                   help="rewrite even if cheap legitimate variants exceed the new golden's bounds")
    _excuse(p, " (default: the old golden's excuses, dropping one whose variant no longer fails)")
    _certify(p)
    commands["refresh"] = cmd_refresh

    p = sub.add_parser("verify", help="check golden files for corruption and inconsistency")
    p.add_argument("paths", metavar="PATH", nargs="*", type=Path, help="golden files or directories (default: the goldens dir)")
    p.add_argument("--goldens", metavar="DIR", help="goldens directory (default: ./goldens, else the bundled zoo)")
    p.add_argument("--configs", metavar="DIR",
                   help="toy configs the goldens must be recorded from (default: ./toy_configs, else bundled); a "
                        "golden recorded from another config than its model's there is bad (stale)")
    p.set_defaults(testdata=None, hardware_class=None)
    commands["verify"] = cmd_verify

    p = sub.add_parser("show", help="print a golden's manifest and tensors")
    p.add_argument("golden", metavar="GOLDEN", help="path to a .safetensors.zst golden")
    p.add_argument("--full", action="store_true", help="every tensor with its tolerance")
    commands["show"] = cmd_show

    p = sub.add_parser("ls", help="list goldens (every class; --hardware-class, --model, --dtype, --scenario filter)")
    _common(p), _selectors(p)
    p.add_argument("--scenario", choices=SCENARIOS, help="only goldens of this scenario (default: all)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: one line per golden (key, size, path); json: a list of {key, path, bytes}")
    commands["ls"] = cmd_ls

    parser.set_defaults(_commands=commands)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the command runs so that what it started is ended on the way out."""


def _terminated(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextmanager
def _importing_from_the_project() -> Iterator[None]:
    """Within the block, `package.module:fn` SPECs import from the project's root and the current directory
    (after everything installed), as they do under pytest (its rootdir) and `python -m`: so the `next:`
    command a pytest failure prints, `--backend mypkg.kernels:patch`, runs as printed. torchrun ranks
    inherit the path."""
    saved = list(sys.path)
    for path in (find_root(), Path.cwd()):
        if path is not None and str(path) not in sys.path:
            sys.path.append(str(path))
    try:
        yield
    finally:
        sys.path[:] = saved


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    old = signal.signal(signal.SIGTERM, _terminated) if _main_thread() else None
    try:
        with _importing_from_the_project():
            return args._commands[args.command](args)
    except Terminated:
        return 128 + signal.SIGTERM
    except VeosnapError as exc:
        print(f"veosnap: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `veosnap show ... | head`: the reader has gone, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush stays quiet
        return EXIT_OK
    except OSError as exc:  # a directory or file the command could not use: still one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"veosnap: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def command() -> int:
    """The `veosnap` command (and `python -m veosnap`): `main` in a process of its own.

    Its imports (torch, transformers, veosnap: some 360,000 objects) are frozen out of the garbage collector
    first (`gc.freeze`): a full collection during a check scanned them all, about 170 ms, and one landed on a
    check's path on the H200 (docs/scale.md, round 7). Only here, never in `main`, which tests and other
    programs call in their own process. It ends the process without waiting for threads candidates left
    running (`candidates.threads.settle`).
    """
    import gc

    gc.freeze()
    return threads.settle(main())


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
