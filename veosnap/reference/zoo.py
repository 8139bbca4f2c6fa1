"""Where the toy models, test data and goldens live, how a toy config is read, and which golden a
candidate is checked against.

Lookup order for each directory: an explicit flag, else the project in the current directory
(`./goldens`, `./toy_configs`, `./testdata`), else the zoo bundled with veosnap (inside the wheel
after `pip install`, or the repository root for an editable install).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import GoldenError, MissingGoldenError, VeosnapError
from ..golden import store
from ..golden.codec import Golden
from ..golden.key import GoldenKey, check_name
from ..golden.manifest import config_hash
from . import hardware

_PACKAGE = Path(__file__).resolve().parents[1]  # the veosnap package


def bundled_dir(kind: str) -> Path:
    """The bundled `goldens`, `toy_configs` or `testdata` directory."""
    inside_wheel = _PACKAGE / "_bundled" / kind
    if inside_wheel.is_dir():
        return inside_wheel
    return _PACKAGE.parent / kind  # editable install: the repository root


def resolve_dir(kind: str, flag: str | Path | None = None) -> Path:
    """The directory of `kind` to use: the flag, else ./<kind>, else the bundled one."""
    if flag is not None:
        path = Path(flag)
        if not path.is_dir():
            raise VeosnapError(f"{path}: not a directory (given for {kind})")
        return path
    local = Path.cwd() / kind
    if local.is_dir():
        return local
    return bundled_dir(kind)


@dataclass(frozen=True)
class ToyConfig:
    """One zoo model: its name, its HF config as a dict, and where it was read from."""

    name: str
    config: dict
    path: Path

    @property
    def hash(self) -> str:
        return config_hash(self.config)


def list_models(configs_dir: Path) -> list[str]:
    """Names of the toy models under a configs directory, sorted."""
    if not configs_dir.is_dir():
        return []
    return sorted(p.parent.name for p in configs_dir.glob("*/config.json"))


def load_config(configs_dir: Path, name: str) -> ToyConfig:
    """Read `<configs_dir>/<name>/config.json`, with a one-line error for any problem."""
    check_name(name)
    path = configs_dir / name / "config.json"
    if not path.is_file():
        known = ", ".join(list_models(configs_dir)) or "none"
        raise VeosnapError(f"{path}: no such toy config (models in {configs_dir}: {known})")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VeosnapError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise VeosnapError(f"{path}: a HF config needs a 'model_type' field")
    return ToyConfig(name=name, config=config, path=path)


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
            goldens=Path(goldens) if goldens is not None else resolve_dir("goldens"),
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
        return cls(goldens=writable(Path(goldens) if goldens is not None else Path.cwd() / "goldens"),
                   configs=resolve_dir("toy_configs", configs), testdata=resolve_dir("testdata", testdata),
                   hardware_class=hardware.resolve(hardware_class))

    def models(self) -> list[str]:
        return list_models(self.configs)


def writable(goldens: Path) -> Path:
    """`goldens`, unless it lies inside the installed veosnap package (whose bundled goldens are never written)."""
    try:
        Path(goldens).resolve().relative_to(_PACKAGE)
    except ValueError:
        return Path(goldens)
    raise VeosnapError(f"{goldens}: inside the installed veosnap package; goldens are written to ./goldens or to "
                       "--goldens DIR of your project")


def load_golden(project: Project, key: GoldenKey) -> Golden:
    """The golden for `key`, validated; a clear error when it (or its whole hardware class) is missing."""
    key = key.recorded  # a scenario checked against another's golden (`frozen_vision`: `vision`)
    path = store.path_for(project.goldens, key)
    if not os.path.lexists(path):  # anything there (a FIFO, a link) is for the reader to refuse
        classes = sorted(p.name for p in project.goldens.iterdir() if p.is_dir()) if project.goldens.is_dir() else []
        if key.hardware_class not in classes:
            raise MissingGoldenError(
                f"{project.goldens}: no goldens for hardware class {key.hardware_class} "
                f"(present: {', '.join(classes) or 'none'}); record them on that hardware with "
                f"`veosnap record --goldens {project.goldens}`, or pick a class with --hardware-class"
            )
        raise MissingGoldenError(
            f"{path}: no golden for {key}; record it with "
            f"`veosnap record --model {key.model} --dtype {key.dtype}"
            f"{'' if key.scenario == 'step' else f' --scenario {key.scenario}'}` on {key.hardware_class} hardware"
        )
    return store.read(path, root=project.goldens)


def load_checked(project: Project, key: GoldenKey, cross_class: bool = False,
                 gold: Golden | None = None) -> tuple[Golden, ToyConfig]:
    """The golden for `key` and the toy config a candidate is built from, both validated.

    Refuses a golden recorded from another config, and goldens of another hardware class than this
    machine's unless `cross_class` (which measures how far the two classes are apart).
    """
    gold = gold if gold is not None else load_golden(project, key)
    here = hardware.detect()
    if key.hardware_class != here and not cross_class:
        raise VeosnapError(
            f"{gold.path}: a {key.hardware_class} golden cannot check a candidate running on {here}; "
            f"use the {here} goldens, or pass --cross-class to measure how far the two classes are apart"
        )
    toy = load_config(project.configs, key.model)
    if toy.hash != gold.manifest.config_hash:
        raise GoldenError(gold.path, f"recorded from another config than {toy.path} (config hash differs); "
                          f"re-record with `veosnap record --model {key.model} --dtype {key.dtype}`")
    return gold, toy
