"""What a golden is the reference for, and where it lives: `<class>/<model>/<scenario>-<dtype>.safetensors.zst`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import VeosnapError

SUFFIX = ".safetensors.zst"
# What a golden's step runs (defined in `reference.scenarios`): the text batch once or over a few optimizer
# steps, or a multimodal batch once.
SCENARIOS = ("step", "train", "vision", "audio", "frozen_vision")
# Scenarios checked against another scenario's golden (they have no file of their own): freezing an encoder
# changes no forward value and no other gradient.
CHECKED_AGAINST = {"frozen_vision": "vision"}
DTYPE_NAMES = ("float32", "bfloat16")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_name(name: str, what: str = "model") -> str:
    """Refuse names that could escape a directory (separators, `..`, hidden files)."""
    if not _NAME_RE.match(name) or ".." in name:
        raise VeosnapError(f"{name!r}: invalid {what} name (letters, digits, '_', '-', '.'; no path separators or '..')")
    return name


@dataclass(frozen=True, order=True)
class GoldenKey:
    """What a golden is the reference for: (hardware class, model, scenario, dtype)."""

    hardware_class: str
    model: str
    scenario: str = "step"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        check_name(self.hardware_class, "hardware class")
        check_name(self.model, "model")
        check_name(self.scenario, "scenario")
        check_name(self.dtype, "dtype")

    @property
    def recorded(self) -> GoldenKey:
        """The key of the golden file that holds this key's reference (itself, or per `CHECKED_AGAINST`)."""
        other = CHECKED_AGAINST.get(self.scenario)
        return self if other is None else GoldenKey(self.hardware_class, self.model, other, self.dtype)

    @property
    def relpath(self) -> Path:
        return Path(self.hardware_class) / self.model / f"{self.scenario}-{self.dtype}{SUFFIX}"

    def __str__(self) -> str:
        return f"{self.hardware_class}/{self.model}/{self.scenario}-{self.dtype}"

    @classmethod
    def from_relpath(cls, relpath: Path) -> GoldenKey:
        """Parse `<class>/<model>/<scenario>-<dtype>.safetensors.zst`."""
        parts = relpath.parts
        if len(parts) != 3 or not parts[2].endswith(SUFFIX) or "-" not in parts[2]:
            raise VeosnapError(f"{relpath}: not a golden path (<class>/<model>/<scenario>-<dtype>{SUFFIX})")
        scenario, dtype = parts[2][: -len(SUFFIX)].rsplit("-", 1)
        return cls(hardware_class=parts[0], model=parts[1], scenario=scenario, dtype=dtype)

    @classmethod
    def from_name(cls, name: str) -> GoldenKey:
        """`cpu/llama/step-float32` (how a key prints) -> GoldenKey."""
        return cls.from_relpath(Path(f"{name}{SUFFIX}"))
