"""Where the toy models, test data and goldens live, how a toy config is read, and which golden a
candidate is checked against.

The zoo has tiers. A config directory holds the HF `config.json`, untouched (its hash is the
golden's), and may hold a sidecar `veosnap.json` saying what veosnap does with it: its tier (`toy`,
the default without a sidecar, or `real`: the real model's widths with the layer count cut) and
the batch its golden is recorded on (`BatchRecipe`; default: the toy batch, sequences 0-3 of
`sequences.parquet` in left-padded rows). Commands and the plugin run the toys unless told
otherwise (`--tier real|all`, or `--model NAME` for any tier).

The project is found as git and pytest find theirs (`find_root`): the current directory or the nearest
one above it that has `goldens/` or `toy_configs/`, or a `pyproject.toml` with a `[tool.veosnap]` table;
the search stops at a repository's top (a directory holding `.git`). Lookup order for each directory:
an explicit flag, else the project's (`<root>/goldens`, `<root>/toy_configs`, `<root>/testdata`), else
the zoo bundled with veosnap (inside the wheel after `pip install`, or the repository root for an
editable install; the wheel's goldens are the cpu toy tier's, and the data packages of other classes and the
real tier install theirs into the same folder, see data/README.md). Goldens follow one rule (`default_goldens`): `--goldens DIR`, else `<root>/goldens`
in a project, else `./goldens` when recording (which makes the current directory a project), else
(reading only) the bundled goldens. So `record` and `refresh` write into the project, created on first
use, and never into the installed package.

Models merge: a name is looked up in the configs directory first, then in the bundled zoo, so a
project with models of its own still reaches `llama` by name (its golden is then recorded into the
project like any other). Listing models (`--model` left out) lists the configs directory only.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..errors import GoldenError, MissingGoldenError, VeosnapError
from ..golden import background as golden_background
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import DTYPE_NAMES, SCENARIOS, GoldenKey, check_name
from ..golden.manifest import config_hash, rerecord
from . import hardware

try:
    import tomllib
except ImportError:  # Python 3.10: the table's header line marks it as well
    tomllib = None

_PACKAGE = Path(__file__).resolve().parents[1]  # the veosnap package


def bundled_dir(kind: str) -> Path:
    """The bundled `goldens`, `toy_configs` or `testdata` directory."""
    inside_wheel = _PACKAGE / "_bundled" / kind
    if inside_wheel.is_dir():
        return inside_wheel
    return _PACKAGE.parent / kind  # editable install: the repository root


PROJECT_DIRS = ("goldens", "toy_configs")
PYPROJECT_TABLE = "[tool.veosnap]"


def is_project(directory: Path) -> bool:
    """Whether `directory` is a veosnap project's root: it has `goldens/` or `toy_configs/`, or a
    `pyproject.toml` with a `[tool.veosnap]` table (a project whose goldens are not recorded yet)."""
    if any((directory / name).is_dir() for name in PROJECT_DIRS):
        return True
    try:
        text = (directory / "pyproject.toml").read_text(encoding="utf-8")
        if tomllib is None:
            return re.search(r"^\s*\[tool\.veosnap[.\]]", text, re.M) is not None
        return "veosnap" in tomllib.loads(text).get("tool", {})
    except (OSError, UnicodeDecodeError, ValueError):  # none, or unreadable (TOMLDecodeError is a ValueError):
        return False  # not a marker; pip and pytest say what is wrong with it


def find_root(start: Path | None = None) -> Path | None:
    """The project `start` (default: the current directory) is in: itself or the nearest directory above
    it that `is_project`, not looking past a repository's top (a directory holding `.git`); None outside
    any project."""
    here = (start or Path.cwd()).resolve()
    for directory in (here, *here.parents):
        if is_project(directory):
            return directory
        if (directory / ".git").exists():
            return None
    return None


def _in_root(kind: str) -> Path | None:
    """`<root>/<kind>` of the project the current directory is in (relative when the root is the current
    directory: messages and listings then read `goldens/cpu/...`); None outside a project."""
    root = find_root()
    if root is None:
        return None
    return Path(kind) if root == Path.cwd().resolve() else root / kind


def resolve_dir(kind: str, flag: str | Path | None = None) -> Path:
    """The directory of `kind` to use: the flag, else the project's, else the bundled one."""
    if flag is not None:
        path = Path(flag)
        if not path.is_dir():
            raise VeosnapError(f"{path}: not a directory (given for {kind})")
        return path
    local = _in_root(kind)
    if local is not None and local.is_dir():
        return local
    return bundled_dir(kind)


TIERS = ("toy", "real")
TIER_CHOICES = (*TIERS, "all")
SIDECAR = "veosnap.json"
# tier; batch (a BatchRecipe); golden_budget_mib (what a golden aims for before compression: the real
# tier keeps goldens small enough to travel with the repository); real_config and note (for people).
SIDECAR_FIELDS = ("tier", "batch", "golden_budget_mib", "real_config", "note")
TOY_SEQUENCES_FILE = "sequences.parquet"


@dataclass(frozen=True)
class BatchRecipe:
    """How a config's golden batch is made from the test data.

    `rows`: per batch row, the ids of the sequences packed into it (one id: a plain row; several:
    packed, position ids restarting per sequence), rows left-padded to the longest. `distinct`: when
    set, every sequence's token ids are drawn from that many ids spread over the vocabulary (so an
    MoE batch leaves experts without tokens: at most distinct x top_k experts are chosen per layer).
    """

    source: str = TOY_SEQUENCES_FILE
    rows: tuple[tuple[int, ...], ...] = ((0,), (1,), (2,), (3,))
    distinct: int | None = None

    @property
    def sequences(self) -> tuple[int, ...]:
        return tuple(i for row in self.rows for i in row)

    @property
    def packed_rows(self) -> bool:
        return any(len(row) > 1 for row in self.rows)


@dataclass(frozen=True)
class ToyConfig:
    """One zoo model: its name, its HF config as a dict, where it was read from, its tier and batch."""

    name: str
    config: dict
    path: Path
    tier: str = "toy"
    batch: BatchRecipe = BatchRecipe()
    golden_budget: int | None = None  # bytes a golden aims for (sketching the rest); None: golden.limits' target

    @property
    def hash(self) -> str:
        return config_hash(self.config)


def list_models(configs_dir: Path, tier: str = "all") -> list[str]:
    """Names of the zoo models of `tier` (`toy`, `real` or `all`) under a configs directory, sorted."""
    if tier not in TIER_CHOICES:
        raise VeosnapError(f"--tier {tier!r}: expected one of {', '.join(TIER_CHOICES)}")
    if not configs_dir.is_dir():
        return []
    names = sorted(p.parent.name for p in configs_dir.glob("*/config.json"))
    if tier == "all":
        return names
    return [n for n in names if read_sidecar(configs_dir / n)[0] == tier]


def read_json(path: Path) -> object:
    """A config file's JSON, or one line naming the file: unreadable, not JSON, or nested too deep for the
    parser (100,000 `[` raise RecursionError, not a JSON error)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VeosnapError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise VeosnapError(f"{path}: not usable JSON (nested too deeply to parse)") from None


def read_sidecar(directory: Path) -> tuple[str, BatchRecipe, int | None]:
    """The tier, batch recipe and golden budget (bytes) a config directory's `veosnap.json` declares
    (toy defaults without one)."""
    path = directory / SIDECAR
    if not path.is_file():
        return "toy", BatchRecipe(), None
    data = read_json(path)
    if not isinstance(data, dict):
        raise VeosnapError(f"{path}: expected an object like {{\"tier\": \"real\"}}")
    unknown = sorted(set(data) - set(SIDECAR_FIELDS))
    if unknown:
        raise VeosnapError(f"{path}: unknown field {unknown[0]!r} (known: {', '.join(SIDECAR_FIELDS)})")
    tier = data.get("tier", "toy")
    if tier not in TIERS:
        raise VeosnapError(f"{path}: tier {tier!r} is not one of {', '.join(TIERS)}")
    budget = data.get("golden_budget_mib")
    if budget is not None and (type(budget) not in (int, float) or not 0 < budget <= 64):
        raise VeosnapError(f"{path}: golden_budget_mib must be a number of MiB in (0, 64], not {budget!r}")
    return tier, _recipe(path, data.get("batch")), None if budget is None else int(budget * 2**20)


def _recipe(path: Path, value: object) -> BatchRecipe:
    if value is None:
        return BatchRecipe()
    if not isinstance(value, dict) or set(value) - {"source", "rows", "distinct"}:
        raise VeosnapError(f"{path}: 'batch' must be an object with 'source', 'rows' and optionally 'distinct'")
    source, rows, distinct = value.get("source"), value.get("rows"), value.get("distinct")
    if not isinstance(source, str) or "/" in source or "\\" in source or source.startswith("."):
        raise VeosnapError(f"{path}: batch source {source!r} must name a file in the test data directory")
    if (not isinstance(rows, list) or not rows
            or not all(isinstance(r, list) and r and all(type(i) is int and i >= 0 for i in r) for r in rows)):
        raise VeosnapError(f"{path}: batch rows must be a non-empty list of non-empty lists of sequence ids")
    if distinct is not None and (type(distinct) is not int or distinct < 1):
        raise VeosnapError(f"{path}: batch distinct must be a positive integer")
    return BatchRecipe(source=source, rows=tuple(tuple(r) for r in rows), distinct=distinct)


def load_config(configs_dir: Path, name: str) -> ToyConfig:
    """Read `<configs_dir>/<name>/config.json`, else the bundled zoo's, with a one-line error for any problem."""
    check_name(name)
    path = configs_dir / name / "config.json"
    bundled = bundled_dir("toy_configs")
    if not path.is_file() and (bundled / name / "config.json").is_file():
        path = bundled / name / "config.json"
    if not path.is_file():
        known = ", ".join(list_models(configs_dir)) or "none"
        zoo = "" if same_dir(configs_dir, bundled) else f"; bundled: {', '.join(list_models(bundled)) or 'none'}"
        raise VeosnapError(f"{configs_dir / name / 'config.json'}: no such toy config (models in {configs_dir}: "
                           f"{known}{zoo})")
    config = read_json(path)
    if not isinstance(config, dict) or "model_type" not in config:
        raise VeosnapError(f"{path}: a HF config needs a 'model_type' field")
    tier, batch, budget = read_sidecar(path.parent)
    return ToyConfig(name=name, config=config, path=path, tier=tier, batch=batch, golden_budget=budget)


def same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def data_package_hint(goldens: Path, hardware_class: str, tier: str) -> str:
    """Reading the bundled goldens: where the wheel leaves a class's or tier's goldens out, the data package
    that installs them beside it (data/README.md), as a clause of a message; else ''."""
    installed = _PACKAGE / "_bundled" / "goldens"  # an editable install reads the repository's, which has them all
    if (hardware_class, tier) == ("cpu", "toy") or not installed.is_dir() or not same_dir(goldens, installed):
        return ""
    package = f"veosnap-goldens-{hardware_class}" + ("-real" if tier == "real" else "")
    return f"; or install the bundled zoo's: pip install {package}"


def default_goldens(recording: bool = False) -> Path:
    """`<root>/goldens` in a project (`find_root`), else `./goldens` when `recording`, else the bundled
    goldens (read only)."""
    local = _in_root("goldens")
    if local is not None:
        return local
    return Path("goldens") if recording else bundled_dir("goldens")


@dataclass(frozen=True)
class Where:
    """Where a command's project is: its root (None: no project in or above the current directory), its
    goldens directory, and which of goldens, toy_configs and testdata are veosnap's bundled zoo."""

    root: Path | None
    goldens: Path
    bundled: tuple[str, ...]
    start: Path  # where the search for the project began: the current directory


@dataclass(frozen=True)
class Project:
    """The directories a command works on and the hardware class it works for."""

    goldens: Path
    configs: Path
    testdata: Path
    hardware_class: str

    @classmethod
    def resolve(
        cls,
        goldens: str | Path | None = None,
        configs: str | Path | None = None,
        testdata: str | Path | None = None,
        hardware_class: str | None = None,
    ) -> Project:
        return cls(
            # An explicit goldens directory may not exist yet: `record` creates it.
            goldens=Path(goldens) if goldens is not None else default_goldens(),
            configs=resolve_dir("toy_configs", configs),
            testdata=resolve_dir("testdata", testdata),
            hardware_class=hardware.resolve(hardware_class),
        )

    @classmethod
    def for_recording(
        cls,
        goldens: str | Path | None = None,
        configs: str | Path | None = None,
        testdata: str | Path | None = None,
        hardware_class: str | None = None,
    ) -> Project:
        """A project whose goldens are written: `goldens` if given, else `./goldens` (created on the first
        write), never the bundled goldens (configs and test data still default to the bundled zoo)."""
        return cls.resolve(writable(Path(goldens) if goldens is not None else default_goldens(recording=True)),
                           configs, testdata, hardware_class)

    def where(self) -> Where:
        """Which project this is and which of its directories are veosnap's bundled zoo: a report's header."""
        return Where(root=find_root(), goldens=self.goldens, start=Path.cwd().resolve(),
                     bundled=tuple(kind for kind, path in (("goldens", self.goldens), ("toy_configs", self.configs),
                                                           ("testdata", self.testdata))
                                   if same_dir(path, bundled_dir(kind))))

    def bundled_hint(self, model: str, scenario: str = "step", dtype: str | None = None) -> str:
        """'' or the sentence saying veosnap's bundled zoo has the golden this project lacks (of `dtype`; None:
        of any), with the command that checks against it, as it runs from here."""
        bundled = bundled_dir("goldens")
        recorded = GoldenKey(self.hardware_class, model, scenario).recorded.scenario
        dtypes = [dtype] if dtype else list(DTYPE_NAMES)
        if same_dir(self.goldens, bundled) or not any(
                store.path_for(bundled, GoldenKey(self.hardware_class, model, recorded, d)).is_file() for d in dtypes):
            return ""
        other = Project(goldens=bundled, configs=self.configs, testdata=self.testdata,
                        hardware_class=self.hardware_class)
        use = other.command("check", "--model", model, *(["--dtype", dtype] if dtype else []),
                            *([] if scenario == "step" else ["--scenario", scenario]))
        return f"veosnap's bundled zoo has it: `{use}` checks against it"

    def models(self, tier: str = "toy") -> list[str]:
        """The zoo models of `tier`: the toys unless asked (`real`, `all`)."""
        return list_models(self.configs, tier)

    def flags(self, hardware_class: bool = True, recording: bool = False) -> list[str]:
        """The command-line flags that select this project from the current directory: the directories
        (and, with `hardware_class`, the class) that differ from what a command would pick by itself.
        Every command a message advises carries them, so it runs as printed. A `recording` command writes
        to ./goldens by itself, and is not pointed at goldens it read by default (the bundled ones, outside
        a project): it records into ./goldens, which the next command then reads."""
        goldens = [default_goldens(), *([default_goldens(recording=True)] if recording else [])]
        out = []
        for flag, path, defaults in (("--goldens", self.goldens, goldens),
                                     ("--configs", self.configs, [resolve_dir("toy_configs")]),
                                     ("--testdata", self.testdata, [resolve_dir("testdata")])):
            if not any(same_dir(path, default) for default in defaults):
                out += [flag, shown(path)]
        if hardware_class and self.hardware_class != hardware.resolve():
            out += ["--hardware-class", self.hardware_class]
        return out

    def command(self, *args: str, hardware_class: bool = True) -> str:
        """`veosnap <args> <this project's flags>`, quoted for a shell."""
        recording = bool(args) and args[0] in ("record", "refresh")
        return shlex.join(["veosnap", *args, *self.flags(hardware_class, recording)])

    def recording_command(self, verb: str, key: GoldenKey, *options: str) -> str:
        """`veosnap record` or `refresh` (`verb`, with `options`) for the golden of `key`, as run on the
        hardware it describes (which detects its own class), with this project's flags."""
        scenario = [] if key.scenario == "step" else ["--scenario", key.scenario]
        return self.command(verb, *options, "--model", key.model, "--dtype", key.dtype, *scenario,
                            hardware_class=False)

    def recorded_dtypes(self, model: str, scenario: str = "step") -> list[str]:
        """The dtypes `model` has a golden of (`scenario`, this project's class) in this project's goldens:
        what a check without --dtype checks."""
        return [d for d in DTYPE_NAMES
                if os.path.lexists(store.path_for(self.goldens, GoldenKey(self.hardware_class, model, scenario, d).recorded))]

    def no_golden(self, model: str, scenario: str = "step", refused: str = "") -> MissingGoldenError:
        """The error for a model with no golden of `scenario` in any dtype on this class: the command that
        records them (as run on that hardware, with this project's flags), or why this machine cannot
        (`refused`: what `record` would say), and where goldens of it do exist."""
        toy = load_config(self.configs, model)  # an unknown model: say that, not how to record
        # The cpu real tier is float32 only (bfloat16 at real shapes is the GPU's): advise what runs here.
        dtypes = ["--dtype", "float32"] if toy.tier == "real" and self.hardware_class == "cpu" else []
        scenario_flag = [] if scenario == "step" else ["--scenario", scenario]
        record = self.command("record", "--model", model, *dtypes, *scenario_flag, hardware_class=False)
        what = model if scenario == "step" else f"{model} ({scenario} scenario)"
        hints = []
        other = [s for s in SCENARIOS if s != scenario and self.recorded_dtypes(model, s)]
        if other:
            hints.append(f"{model} has {self.hardware_class} goldens of scenario {', '.join(other)} "
                         f"(add --scenario {other[0]})")
        classes = sorted(p.name for p in self.goldens.iterdir() if p.is_dir()) if self.goldens.is_dir() else []
        elsewhere = [c for c in classes if c != self.hardware_class and (self.goldens / c / model).is_dir()]
        if elsewhere:
            hints.append(f"goldens of {model} exist for {', '.join(elsewhere)} (another hardware class: "
                         f"--hardware-class {elsewhere[0]} --cross-class compares across classes)")
        bundled = self.bundled_hint(model, scenario)
        if bundled:
            hints.insert(0, bundled)
        how = f"this machine cannot record it ({refused})" if refused else \
            f"record with `{record}` on {self.hardware_class} hardware" \
            + data_package_hint(self.goldens, self.hardware_class, toy.tier)
        return MissingGoldenError(f"no golden for {what} on {self.hardware_class} in {shown(self.goldens)}: {how}"
                                  + "".join(f"; {h}" for h in hints))


def shown(path: Path) -> str:
    """A path as a message shows it: relative to the current directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def writable(goldens: Path) -> Path:
    """`goldens`, unless it lies inside the installed veosnap package (whose bundled goldens are never written)."""
    try:
        Path(goldens).resolve().relative_to(_PACKAGE)
    except ValueError:
        return Path(goldens)
    raise VeosnapError(f"{goldens}: inside the installed veosnap package; goldens are written to ./goldens or to "
                       "--goldens DIR of your project")


def load_golden(project: Project, key: GoldenKey, background: bool = False) -> Golden:
    """The golden for `key`, validated; a clear error when it (or its whole hardware class) is missing.

    `background`: decode it on a thread (`golden.background`): its manifest and inputs now, its other
    tensors when first used, where its errors (the same ones) are then raised.
    """
    key = key.recorded  # a scenario checked against another's golden (`frozen_vision`: `vision`)
    path = store.path_for(project.goldens, key)
    if not os.path.lexists(path):  # anything there (a FIFO, a link) is for the reader to refuse
        toy = load_config(project.configs, key.model)  # no config either: say that, not how to record
        record = project.recording_command("record", key)
        package = data_package_hint(project.goldens, key.hardware_class, toy.tier)
        classes = sorted(p.name for p in project.goldens.iterdir() if p.is_dir()) if project.goldens.is_dir() else []
        bundled = project.bundled_hint(key.model, key.scenario, key.dtype)
        bundled = f"; {bundled}" if bundled else ""
        if key.hardware_class not in classes:
            raise MissingGoldenError(
                f"{shown(project.goldens)}: no goldens for hardware class {key.hardware_class} "
                f"(present: {', '.join(classes) or 'none'}); record this one on that hardware with "
                f"`{record}`, or pick a class with --hardware-class{package}{bundled}"
            )
        raise MissingGoldenError(f"{shown(path)}: no golden for {key}; record it with `{record}` on {key.hardware_class} "
                                 f"hardware{package}{bundled}")

    def advise(exc: GoldenError) -> GoldenError:
        if not exc.fix:
            return exc
        # the same advice, with this project's flags, so it runs as printed
        return GoldenError(exc.path, exc.problem, rerecord(key, project.recording_command(
            "refresh", key, "--force", "--reason", "<why>")))

    if background:
        return golden_background.read(path, project.goldens, advise, start=False)
    try:
        return store.read(path, root=project.goldens)
    except GoldenError as exc:
        raise advise(exc) from None


def load_checked(project: Project, key: GoldenKey, cross_class: bool = False,
                 gold: Golden | None = None, background: bool = False) -> tuple[Golden, ToyConfig]:
    """The golden for `key` and the toy config a candidate is built from, both validated.

    Refuses a golden recorded from another config, and goldens of another hardware class than this
    machine's unless `cross_class` (which measures how far the two classes are apart). `background`:
    see `load_golden`.
    """
    gold = gold if gold is not None else load_golden(project, key, background)
    with golden_background.errors_after(gold):
        here = hardware.detect()
        if key.hardware_class != here and not cross_class:
            raise VeosnapError(
                f"{gold.path}: a {key.hardware_class} golden cannot check a candidate running on {here}; "
                f"use the {here} goldens, or pass --cross-class to measure how far the two classes are apart"
            )
        toy = load_config(project.configs, key.model)
        if toy.hash != gold.manifest.config_hash:
            # refresh, not record: the golden changes with an approval trail, reviewed in the diff
            refresh = project.recording_command("refresh", key, "--reason", "config changed: <why>")
            raise GoldenError(gold.path, f"recorded from another config than {toy.path} (config hash differs); "
                              f"if the change is intended, re-record it with `{refresh}`")
    return gold, toy
