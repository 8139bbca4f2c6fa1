"""Hatchling build hook: which of the repository's goldens a wheel carries.

The repository keeps every golden (goldens/CLASS/MODEL). The veosnap wheel carries the cpu toy tier,
enough for `veosnap check` on the bundled zoo; every other class and the real tier ship as data
packages (data/*/pyproject.toml), each the folders of one class and tier. All of them install their
folders at `veosnap/_bundled/goldens/CLASS/MODEL`, so an install with a data package beside veosnap
reads those goldens where it reads the bundled ones: the zoo lookup needs nothing new.

Configured per wheel (`[tool.hatch.build.targets.wheel.hooks.custom]`): `classes` (hardware classes,
e.g. ["cpu"]), `tier` ("toy" or "real", as the model's toy_configs/MODEL/veosnap.json says) and `required`
(default true: a data package without goldens is an error; veosnap's own wheel says false, so that a
checkout fitted to a GPU box, without the cpu goldens, still builds it, with a warning; tests/test_wheel.py
holds a full checkout's wheel to carrying them).
"""

from __future__ import annotations

import json
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

REPO = Path(__file__).resolve().parent.parent
TARGET = "veosnap/_bundled/goldens"


def tier_of(model: str) -> str:
    """A zoo model's tier, as its sidecar declares it (toy without one)."""
    sidecar = REPO / "toy_configs" / model / "veosnap.json"
    return json.loads(sidecar.read_text(encoding="utf-8")).get("tier", "toy") if sidecar.is_file() else "toy"


def golden_folders(classes: list[str], tier: str) -> list[Path]:
    """goldens/CLASS/MODEL folders of these classes and this tier, sorted."""
    return sorted(folder for cls in classes for folder in (REPO / "goldens" / cls).glob("*")
                  if folder.is_dir() and tier_of(folder.name) == tier)


class GoldensHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        classes, tier = list(self.config.get("classes", [])), self.config.get("tier", "toy")
        folders = golden_folders(classes, tier)
        if not folders and not self.config.get("required", True):
            self.app.display_warning(f"data/hatch_goldens.py: no golden folders of class {classes} and tier {tier!r} "
                                     "in this checkout: the wheel carries none")
        elif not folders:
            raise ValueError(f"data/hatch_goldens.py: no golden folders of class {classes} and tier {tier!r} under "
                             f"{REPO / 'goldens'}")
        for folder in folders:
            build_data["force_include"][str(folder)] = f"{TARGET}/{folder.parent.name}/{folder.name}"
