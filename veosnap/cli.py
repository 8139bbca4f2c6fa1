"""The `veosnap` command: a thin skin over the library (record, check, show, ls).

Exit status: 0 all passed, 1 a check failed, 2 usage error, missing golden or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from . import backends, golden, report
from .errors import VeosnapError
from .golden import GoldenKey
from .zoo import Project

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _project(args: argparse.Namespace) -> Project:
    return Project.resolve(goldens=args.goldens, configs=args.configs, testdata=args.testdata,
                           hardware_class=args.hardware_class)


def _selection(args: argparse.Namespace, project: Project) -> list[tuple[str, str]]:
    models = args.model or project.models()
    if not models:
        raise VeosnapError(f"{project.configs}: no toy configs found (expected <name>/config.json)")
    dtypes = args.dtype or list(golden.DTYPE_NAMES)
    return [(m, d) for m in models for d in dtypes]


def cmd_record(args: argparse.Namespace) -> int:
    from .record import record

    project = _project(args)
    for model, dtype in _selection(args, project):
        outcome = record(project, model, dtype, seed=args.seed, allow_near_ties=args.allow_near_ties)
        margin = "" if outcome.min_margin is None else f"  min router margin {outcome.min_margin:.3g}"
        state = "wrote" if outcome.written else "unchanged"
        print(f"{state:9s} {outcome.path}{margin}")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    from .check import check

    project = _project(args)
    backend = backends.resolve(args.backend)
    reports = [
        check(project, GoldenKey(project.hardware_class, model, "step", dtype), backend)
        for model, dtype in _selection(args, project)
    ]
    out = report.json_text(reports) if args.format == "json" else report.text(reports, color=sys.stdout.isatty())
    sys.stdout.write(out if out.endswith("\n") else out + "\n")
    return EXIT_OK if all(r.passed for r in reports) else EXIT_FAILED


def cmd_show(args: argparse.Namespace) -> int:
    from .show import describe

    print(describe(golden.read(args.golden), full=args.full))
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    project = _project(args)
    entries = golden.list_goldens(project.goldens)
    if args.format == "json":
        print(json.dumps([{"key": str(k), "path": str(p), "bytes": p.stat().st_size} for k, p in entries], indent=2))
        return EXIT_OK
    if not entries:
        print(f"no goldens under {project.goldens}")
    for key, path in entries:
        print(f"{str(key):45s} {path.stat().st_size / 1024:8.1f} KiB  {path}")
    return EXIT_OK


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goldens", metavar="DIR", help="goldens directory (default: ./goldens, else the bundled zoo)")
    p.add_argument("--configs", metavar="DIR", help="toy configs directory (default: ./toy_configs, else bundled)")
    p.add_argument("--testdata", metavar="DIR", help="test data directory (default: ./testdata, else bundled)")
    p.add_argument("--hardware-class", metavar="CLASS",
                   help="cpu or cuda-sm<NN> (default: $VEOSNAP_HARDWARE_CLASS, else this machine's)")


def _selectors(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="NAME", help="a zoo model (repeatable; default: all)")
    p.add_argument("--dtype", action="append", choices=golden.DTYPE_NAMES, help="repeatable; default: both")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veosnap", description="Golden-reference snapshot regression for HF models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    p = sub.add_parser("record", help="record goldens from the HF eager reference on this machine")
    _common(p), _selectors(p)
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--allow-near-ties", action="store_true", help="record even if a router has near-ties")
    commands["record"] = cmd_record

    p = sub.add_parser("check", help="check a backend against the goldens")
    _common(p), _selectors(p)
    p.add_argument("--backend", default="eager", metavar="SPEC",
                   help=f"built-in ({', '.join(backends.builtin_names())}), path/file.py:fn, module:fn; join with +")
    p.add_argument("--format", choices=("text", "json"), default="text")
    commands["check"] = cmd_check

    p = sub.add_parser("show", help="print a golden's manifest and tensors")
    p.add_argument("golden", metavar="GOLDEN", help="path to a .safetensors.zst golden")
    p.add_argument("--full", action="store_true", help="every tensor with its tolerance")
    commands["show"] = cmd_show

    p = sub.add_parser("ls", help="list goldens")
    _common(p)
    p.add_argument("--format", choices=("text", "json"), default="text")
    commands["ls"] = cmd_ls

    parser.set_defaults(_commands=commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args._commands[args.command](args)
    except VeosnapError as exc:
        print(f"veosnap: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a directory or file the command could not use: still one line, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"veosnap: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
