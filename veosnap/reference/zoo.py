"""Where the toy models, test data and goldens live, and how a toy config is read.

Lookup order for each directory: an explicit flag, else the project in the current directory
(`./goldens`, `./toy_configs`, `./testdata`), else the zoo bundled with veosnap (inside the wheel
after `pip install`, or the repository root for an editable install).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import VeosnapError
from ..golden.key import check_name
from ..golden.manifest import config_hash

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
        from . import hardware

        return cls(
            # An explicit goldens directory may not exist yet: `record` creates it.
            goldens=Path(goldens) if goldens is not None else resolve_dir("goldens"),
            configs=resolve_dir("toy_configs", configs),
            testdata=resolve_dir("testdata", testdata),
            hardware_class=hardware.resolve(hardware_class),
        )

    def models(self) -> list[str]:
        return list_models(self.configs)
