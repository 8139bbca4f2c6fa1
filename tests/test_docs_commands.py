"""Every `veosnap ...` command the README and docs/*.md show, and every `next:` command a report prints,
runs as printed; every other fenced block is run by a named test or says why it cannot run here.

A block's info string says what it is: `text` (a report, a message, a diagram, a synopsis: nothing to
run); a shell block (no language, or sh/bash/console: its `$ ` lines, or else its every line, are
commands); `python`, `toml`, `json` (code). Code and non-`veosnap` commands carry one of: `# file: PATH`
(or `file=PATH`: a file the doc's commands use), `run-by="tests/test_x.py"` (that test runs it, and
reads the doc), or `not-run="why"` (a GPU, minutes of CPU, a wheel directory only the GPU box has).

Commands are the lines of fenced shell blocks (no language, or sh/bash/console) that start with
`veosnap` (or `$ veosnap`); usage synopses with placeholders live in ```text blocks instead. Each is
parsed by the CLI's own parser, and every backend, layout, model and path it names is resolved; the
cheap ones (one toy model, in-process layouts, ls/show/verify) are also run, and must not end in a usage
error (exit 2). A doc's commands run in a scratch directory that sees the repository's goldens, toy
configs, test data, tests and examples, plus the files the doc itself declares (a fenced block whose
first line is `# file: PATH`, or whose info string says `file=PATH`); a doc that declares toy configs
of its own is a project of its own, and its commands (`record` too) run there alone.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from golden_repo import CLASS, REPO, WHY_ABSENT, committed_golden, golden_path, left_out

from veosnap.candidates import backends
from veosnap.candidates.layouts import registry
from veosnap.golden.key import GoldenKey
from veosnap.reference.zoo import load_config
from veosnap.surfaces import cli

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"", "sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```", re.S | re.M)
LINKED = ("goldens", "toy_configs", "testdata", "tests", "examples")


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)[1:]

    def __str__(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}: {self.text}"


def blocks(doc: Path) -> list[tuple[str, int, str]]:
    """(info string, line of the first body line, body) of every fenced block."""
    text = doc.read_text(encoding="utf-8")
    return [(m["info"].strip(), text.count("\n", 0, m.start("body")) + 1, m["body"]) for m in FENCE.finditer(text)]


def commands(doc: Path) -> list[Command]:
    found = []
    for info, first, body in blocks(doc):
        if info.split(" ")[0] not in SHELL:
            continue
        for offset, line in enumerate(body.splitlines()):
            line = line.strip().removeprefix("$ ")
            if re.match(r"veosnap\s", line):
                found.append(Command(doc, first + offset, line))
    return found


def declared_files(doc: Path) -> dict[str, str]:
    files = {}
    for info, _, body in blocks(doc):
        named = re.search(r"\bfile=(\S+)", info)
        first, _, rest = body.partition("\n")
        if named:
            files[named.group(1)] = body
        elif first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = body
    return files


ALL = [command for doc in DOCS for command in commands(doc)]


def test_the_docs_show_commands_and_keep_synopses_apart():
    assert len(ALL) > 30
    for doc in DOCS:
        for info, first, body in blocks(doc):
            if info == "text":
                for offset, line in enumerate(body.splitlines()):
                    if line.startswith("veosnap "):  # a synopsis: placeholders, so it cannot run as it stands
                        assert re.search(r"\[|\.\.\.|\b[A-Z]{3,}\b|path/to/|my_pkg|\bacme\b", line), \
                            f"{doc.name}:{first + offset}: {line}"


ATTRIBUTE = re.compile(r'\b(not-run|run-by)="([^"]*)"')
CODE = {"python", "toml", "json"}


def attributes(info: str) -> dict[str, str]:
    return dict(ATTRIBUTE.findall(info))


def shell_commands(body: str) -> list[str]:
    """A shell block's commands: its `$ ` lines if it has any (the rest is their output), else every line
    that is not a comment, continuation lines joined."""
    lines = body.replace("\\\n", " ").splitlines()
    prompted = [line.strip()[2:] for line in lines if line.strip().startswith("$ ")]
    return prompted or [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def unrun(doc: Path) -> list[str]:
    """The blocks of `doc` that nothing runs and that do not say why."""
    found = []
    for info, first, body in blocks(doc):
        kind, said = info.split(" ")[0], attributes(info)
        where = f"{doc.relative_to(REPO)}:{first}"
        if "run-by" in said:
            test = REPO / said["run-by"]
            if not test.is_file() or doc.stem not in test.read_text(encoding="utf-8"):
                found.append(f"{where}: run-by {said['run-by']}, which does not read {doc.name}")
            continue
        if "not-run" in said:
            if len(said["not-run"]) < 10:
                found.append(f"{where}: not-run needs its reason")
            continue
        if kind == "text":
            found += [f"{where}: a command in a text block: {line.strip()!r}" for line in body.splitlines()
                      if re.match(r"\s*(\$ |python3? |pip |pytest |bash |git |torchrun )", line)]
            continue
        if kind in SHELL:
            others = [c for c in shell_commands(body) if not re.match(r"veosnap\s", c)]
            if others:
                found.append(f"{where}: runs {others[0]!r}: give it run-by or not-run, or make an output block text")
            continue
        if kind in CODE and (re.search(r"\bfile=", info) or body.startswith("# file: ")):
            continue  # a file the doc's commands (or the test that reads the doc) use
        found.append(f"{where}: a {kind or 'shell'} block nothing runs: give it run-by or not-run")
    return found


def test_every_block_is_run_or_says_why_not():
    assert [line for doc in DOCS for line in unrun(doc)] == []


def test_the_readme_keeps_cis_set_up_command():
    """The README's two set-up commands are CI's contract: `.ci/run` runs the second one (quietly)."""
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").replace("pip install -q ", "pip install ")
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install = "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints/tested.txt"
    assert f"\n{install} . && veosnap check\n" in readme
    assert f"\n{install} -e '.[test]' && pytest -q -n 2\n" in readme and f"{install} -e '.[test]' && pytest -q -n 2" in ci


def own_project(doc: Path) -> bool:
    return any(name.startswith("toy_configs/") for name in declared_files(doc))


def sandbox(doc: Path, tmp_path: Path) -> Path:
    root = tmp_path / "here"
    root.mkdir()
    if not own_project(doc):
        for name in LINKED:
            (root / name).symlink_to(REPO / name)
    for name, text in declared_files(doc).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def resolve(command: Command) -> tuple[cli.argparse.Namespace, bool]:
    """The parsed command with everything it names resolved; whether it is cheap and safe to run here."""
    try:
        args = cli.build_parser().parse_args(command.argv)
    except SystemExit:
        pytest.fail(f"{command}: the CLI does not parse it")
    name = args.command
    project = cli._project(args) if hasattr(args, "configs") else None
    specs = [args.backend] if getattr(args, "backend", None) else []
    specs += (getattr(args, "backends", None) or "").split(",") if getattr(args, "backends", None) else []
    for spec in specs:
        backends.resolve(spec)
    layouts = [*(getattr(args, "layout", None) or []), *((getattr(args, "layouts", None) or "").split(",")
                                                          if getattr(args, "layouts", None) else [])]
    distributed = [registry.resolve(spec).distributed for spec in layouts]
    real_tier = False
    for model in getattr(args, "model", None) or []:
        real_tier |= load_config(project.configs, model).tier == "real"
    for path in [getattr(args, "golden", None), *(getattr(args, "paths", None) or [])]:
        if path is not None and not Path(path).exists():
            parts = Path(path).parts
            if len(parts) > 2 and parts[0] == "goldens" and left_out(parts[1], parts[2]):
                pytest.skip(f"{command}: names {path}, of goldens this checkout lacks: {WHY_ABSENT}")
            pytest.fail(f"{command}: {path} does not exist")
    if name in ("ls", "show", "verify"):
        return args, True
    if name == "check":
        # A real-shape check is 40-70 s of float32 on a 2-core CPU: tests/test_realshape.py checks the cpu
        # real-shape goldens themselves, so here the command is parsed and resolved only.
        return args, (bool(args.model) and not args.matrix and not any(distributed) and not args.cross_class
                      and not real_tier)
    return args, name in ("record", "refresh") and own_project(command.doc)  # never into the repository's goldens


@pytest.mark.parametrize("command", ALL, ids=str)
def test_every_documented_command_runs_as_printed(command: Command, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(sandbox(command.doc, tmp_path))
    if own_project(command.doc):  # a doc's own project: its commands run in order, so the earlier ones first
        for earlier in commands(command.doc):
            if earlier == command:
                break
            if resolve(earlier)[1]:
                cli.main(earlier.argv)
        capsys.readouterr()
    args, cheap = resolve(command)
    if not cheap:
        return  # parsed and resolved: a multi-process layout, the matrix, every model, or a write to the repo
    if args.command == "check" and not own_project(command.doc) and not args.hardware_class:
        # The repository's goldens of this machine's class: the real-shape tier has none on a GPU until
        # `gpu_session.py record-real` ran there; the command is still parsed and resolved above.
        for model in args.model:
            for scenario in (s for s in args.scenario or ["step"] if s != "all"):
                recorded = GoldenKey(CLASS, model, scenario, "float32").recorded.scenario  # frozen_vision: vision
                # without --dtype a check takes the dtypes recorded here: it needs one of them
                dtypes = args.dtype or [d for d in ("float32", "bfloat16") if golden_path(model, d, recorded).is_file()]
                for dtype in dtypes or ["float32"]:
                    committed_golden(model, dtype, recorded)
    code = cli.main(command.argv)
    err = capsys.readouterr().err
    assert code in (0, 1), f"{command}: exit {code}: {err}"  # 1: a check that fails by design (a planted bug)
    assert "veosnap: error" not in err, f"{command}: {err}"


# --- what reports advise -------------------------------------------------------------------------------

def advised(text: str) -> str:
    """The command of a report's `next:` line."""
    line = next(line.strip() for line in text.splitlines() if line.strip().startswith("next:"))
    command = line[line.index("veosnap "):]
    return command.split("  (", 1)[0]  # the explanation after two spaces is not part of it


@pytest.mark.parametrize("fault, scenario", [
    ("pad_leak", "train"),  # a forward bug, in the train scenario
    ("one_token_rerouted", "step"),  # a routing flip
    ("raises", "step"),  # a backend that raises
])
def test_the_next_command_of_a_report_runs_as_printed_with_the_projects_flags(fault, scenario, repo_project, tmp_path,
                                                                             monkeypatch, capsys):
    (tmp_path / "broken.py").write_text("def raises(model):\n    raise RuntimeError('kernel not built for sm_75')\n")
    spec = f"{tmp_path / 'broken.py'}:raises" if fault == "raises" else f"{REPO / 'tests' / 'faults.py'}:{fault}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no project here: the goldens are found only through the flags
    dirs = ["--goldens", str(repo_project.goldens), "--configs", str(repo_project.configs),
            "--testdata", str(repo_project.testdata)]
    if scenario == "train":
        committed_golden("qwen3_moe", "float32", "train")
    assert cli.main(["check", *dirs, "--model", "qwen3_moe", "--dtype", "float32", "--scenario", scenario,
                     "--backend", spec]) == 1
    command = advised(capsys.readouterr().out)
    argv = shlex.split(command)
    assert argv[0] == "veosnap" and ("--scenario" in argv) == (scenario == "train")
    assert cli.main(argv[1:]) == 1  # it runs (the check still fails: the bug is still there)
    out, err = capsys.readouterr()
    assert err == ""
    (result,) = json.loads(out)["results"]
    assert result["model"] == "qwen3_moe" and result["backend"] == spec and not result["passed"]
    assert result["next"] and advised("next: " + result["next"]) == command  # the JSON's next is the same command
