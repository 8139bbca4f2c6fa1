"""How a golden stores a sketched tensor, and the manifest's account of it (format only; the arithmetic
that makes and compares sketches is `numerics.sketch`).

A golden tensor `N` that is sketched is not stored under `N`. Its file holds instead

    N#sketch    float32 [groups, width]   the group sketches (float64 for a float64 tensor)
    N#norms     same dtype [groups]       the golden groups' exact L2 norms
    N#support   int64 [support]           with a support only: the sorted non-zero rows sketched

and the manifest's `sketch` section (schema 2) holds, per sketched tensor, its `SketchSpec` (method,
seed, width, group, shape, support), `tau` (the RMS of the golden's exact row norms over the rows the
metric counts), `rows_counted` and the original `dtype`: enough for any tool to recompute the sketch
from a tensor (`numerics.sketch`'s docstring has the rule). `#` never occurs in a parameter name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import VeosnapError

METHOD = "rowsketch-v1"
WIDTHS = tuple(1 << i for i in range(11))  # 1 .. 1024: powers of two, so a bucket is a mask
MAX_ROWS = (1 << 31) - 1  # row and stripe indices are hashed as 32-bit words
M32 = 0xFFFFFFFF
SUFFIXES = ("#sketch", "#norms", "#support")  # stored tensor names: f"{name}{suffix}"
MODES = ("auto", "always", "never")
DTYPES = ("float32", "bfloat16", "float16", "float64")


def row_layout(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of a tensor as the row-error metric cuts it."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


def split_name(stored: str) -> tuple[str, str] | None:
    """`N#sketch` -> (`N`, `#sketch`); None for a name that is not a sketch part."""
    for suffix in SUFFIXES:
        if stored.endswith(suffix) and len(stored) > len(suffix):
            return stored[: -len(suffix)], suffix
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- the spec ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SketchSpec:
    """How one tensor was sketched: enough for any tool to recompute the sketch."""

    seed: int
    width: int  # k: numbers per group
    group: int  # m: consecutive rows (or support rows) summed per group
    shape: tuple[int, ...]  # the original tensor's shape
    support: int | None = None  # rows of the golden's support (its non-zero rows), or None: all rows
    method: str = METHOD

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        problems = []
        if self.method != METHOD:
            problems.append(f"method {self.method!r} is not one this veosnap computes ({METHOD}); upgrade veosnap")
        if not _is_int(self.seed) or not 0 <= self.seed <= M32:
            problems.append(f"seed {self.seed!r} is not an integer in 0..2^32-1")
        if not _is_int(self.width) or self.width not in WIDTHS:
            problems.append(f"width {self.width!r} is not a power of two in 1..{WIDTHS[-1]}")
        if not _is_int(self.group) or self.group < 1:
            problems.append(f"group {self.group!r} is not a positive integer")
        if any(s < 0 for s in self.shape):
            problems.append(f"shape {list(self.shape)} has a negative size")
        elif self.rows > MAX_ROWS:
            problems.append(f"{self.rows} rows: over the {MAX_ROWS} rows a sketch can index")
        if self.support is not None and (not _is_int(self.support) or not 0 <= self.support <= self.rows):
            problems.append(f"support {self.support!r} is not a row count in 0..{self.rows}")
        if problems:
            raise VeosnapError(f"sketch spec: {'; '.join(problems)}")

    # Cached (the spec is frozen; not fields, so neither equality nor the manifest sees them): a check reads
    # them several times per tensor, and each was a `row_layout` over the shape.
    @cached_property
    def rows(self) -> int:
        return row_layout(self.shape)[0]

    @cached_property
    def columns(self) -> int:
        return row_layout(self.shape)[1]

    @cached_property
    def sketched_rows(self) -> int:
        """Rows that enter the sketch: the support's, or all."""
        return self.rows if self.support is None else self.support

    @cached_property
    def groups(self) -> int:
        return -(-self.sketched_rows // self.group)

    def describe(self) -> str:
        """`64x2`, `32x16 on 37 rows`: width x rows per group (and the support)."""
        support = "" if self.support is None else f" on {self.support} rows"
        return f"{self.width}x{self.group}{support}"

    def to_dict(self) -> dict:
        """JSON-ready; `rows` and `columns` are written for readers and checked on load."""
        return {"method": self.method, "seed": self.seed, "width": self.width, "group": self.group,
                "shape": list(self.shape), "rows": self.rows, "columns": self.columns, "support": self.support}

    @classmethod
    def from_dict(cls, data: object, source: object = "sketch spec") -> SketchSpec:
        """Parse and validate; any problem is one `VeosnapError` line naming `source`."""
        try:
            if not isinstance(data, dict):
                raise TypeError("not a JSON object")
            unknown = set(data) - {"method", "seed", "width", "group", "shape", "rows", "columns", "support"}
            if unknown:
                raise ValueError(f"unknown field(s) {sorted(unknown)}")
            shape = data["shape"]
            if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
                raise TypeError(f"shape {shape!r} is not a list of integers")
            spec = cls(seed=data["seed"], width=data["width"], group=data["group"], shape=tuple(shape),
                       support=data.get("support"), method=data["method"])
            if (data.get("rows"), data.get("columns")) != (spec.rows, spec.columns):
                raise ValueError(f"rows/columns {data.get('rows')}x{data.get('columns')} do not match shape {shape}")
        except VeosnapError as exc:
            raise VeosnapError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise VeosnapError(f"{source}: malformed sketch spec ({type(exc).__name__}: {exc})") from None
        return spec


# --- the manifest's account --------------------------------------------------------------------------


@dataclass(frozen=True)
class SketchEntry:
    """The manifest's entry for one sketched tensor: its spec, tau, counted rows and original dtype."""

    spec: SketchSpec
    tau: float  # RMS of the golden's exact row norms over the counted rows
    rows_counted: int  # rows the metric counts (token tensors: real tokens)
    dtype: str  # the golden tensor's dtype (a candidate of another dtype is a problem, as for whole tensors)

    def to_dict(self) -> dict:
        return {"spec": self.spec.to_dict(), "tau": self.tau, "rows_counted": self.rows_counted, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, data: object, where: str) -> SketchEntry:
        if not isinstance(data, dict) or set(data) != {"spec", "tau", "rows_counted", "dtype"}:
            raise VeosnapError(f"{where}: malformed sketch entry (expected spec, tau, rows_counted, dtype)")
        spec = SketchSpec.from_dict(data["spec"], where)
        tau, counted, dtype = data["tau"], data["rows_counted"], data["dtype"]
        if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau) or tau < 0:
            raise VeosnapError(f"{where}: tau {tau!r} is not a finite non-negative number")
        if not _is_int(counted) or not 0 <= counted <= spec.sketched_rows:
            raise VeosnapError(f"{where}: rows_counted {counted!r} is not in 0..{spec.sketched_rows}")
        if dtype not in DTYPES:
            raise VeosnapError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        return cls(spec, float(tau), int(counted), dtype)


@dataclass(frozen=True)
class SketchPlan:
    """The manifest's `sketch` section: how the golden chose between whole and sketched tensors (the
    mode and the budget it planned for) and every sketched tensor's entry."""

    mode: str  # auto | always | never
    budget: int  # the planner's target, bytes
    hard_limit: int  # the planner's refusal limit, bytes
    planned_bytes: int  # what the plan expected the tensors to take
    tensors: dict[str, SketchEntry]

    def to_dict(self) -> dict:
        return {"mode": self.mode, "budget": self.budget, "hard_limit": self.hard_limit,
                "planned_bytes": self.planned_bytes,
                "tensors": {name: entry.to_dict() for name, entry in sorted(self.tensors.items())}}

    @classmethod
    def from_dict(cls, data: object, where: str = "sketch") -> SketchPlan:
        if not isinstance(data, dict) or set(data) != {"mode", "budget", "hard_limit", "planned_bytes", "tensors"}:
            raise VeosnapError(f"{where}: malformed sketch section (expected mode, budget, hard_limit, planned_bytes, "
                               "tensors)")
        if data["mode"] not in MODES:
            raise VeosnapError(f"{where}: mode {data['mode']!r} is not one of {', '.join(MODES)}")
        for field in ("budget", "hard_limit", "planned_bytes"):
            if not _is_int(data[field]) or data[field] < 0:
                raise VeosnapError(f"{where}: {field} {data[field]!r} is not a byte count")
        if not isinstance(data["tensors"], dict):
            raise VeosnapError(f"{where}: tensors is not an object")
        tensors = {name: SketchEntry.from_dict(entry, f"{where}.tensors.{name}")
                   for name, entry in data["tensors"].items()}
        return cls(data["mode"], data["budget"], data["hard_limit"], data["planned_bytes"], tensors)


# --- a sketched golden tensor ------------------------------------------------------------------------


@dataclass
class GoldenSketch:
    """A sketched golden tensor: its spec, group sketches, exact group norms, support, tau, dtype."""

    spec: SketchSpec
    values: torch.Tensor  # (groups, width), float32 (float64 for a float64 tensor)
    norms: torch.Tensor  # (groups,): the exact L2 norm of each golden group, same dtype
    support: torch.Tensor | None  # (spec.support,) int64, sorted: the rows sketched (None: all)
    tau: float  # RMS of the golden's exact row norms over the counted rows
    rows_counted: int  # rows the metric counts (token tensors: real tokens)
    dtype: str = "float32"  # the golden tensor's own dtype

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The tensors a golden file holds for the sketched tensor `name`."""
        out = {f"{name}#sketch": self.values.cpu().contiguous(), f"{name}#norms": self.norms.cpu().contiguous()}
        if self.support is not None:
            out[f"{name}#support"] = self.support.cpu().contiguous()
        return out

    @property
    def entry(self) -> SketchEntry:
        return SketchEntry(self.spec, self.tau, self.rows_counted, self.dtype)

    def meta(self) -> dict:
        """JSON-ready manifest entry: the spec, tau, the counted rows and the dtype."""
        return self.entry.to_dict()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors("_").values())

    @classmethod
    def from_parts(cls, name: str, meta: object, tensors: dict[str, torch.Tensor],
                   source: object = "golden") -> GoldenSketch:
        """Rebuild from a JSON manifest entry and a golden's tensors, refusing anything inconsistent."""
        where = f"{source}: sketched tensor {name!r}"
        return cls.from_entry(name, SketchEntry.from_dict(meta, where), tensors, source)

    @classmethod
    def from_entry(cls, name: str, entry: SketchEntry, tensors: dict[str, torch.Tensor],
                   source: object = "golden") -> GoldenSketch:
        """Rebuild from a typed manifest entry and a golden's tensors, refusing anything inconsistent."""
        where = f"{source}: sketched tensor {name!r}"
        spec = entry.spec
        values, norms = tensors.get(f"{name}#sketch"), tensors.get(f"{name}#norms")
        support = tensors.get(f"{name}#support")
        if values is None or norms is None:
            raise VeosnapError(f"{where}: its #sketch or #norms tensor is missing")
        floats = (torch.float32, torch.float64)
        if values.dtype not in floats or tuple(values.shape) != (spec.groups, spec.width):
            raise VeosnapError(f"{where}: #sketch is {describe(values)}, "
                               f"expected float32 [{spec.groups}, {spec.width}]")
        if norms.dtype != values.dtype or tuple(norms.shape) != (spec.groups,):
            raise VeosnapError(f"{where}: #norms is {describe(norms)}, "
                               f"expected {describe_dtype(values.dtype)} [{spec.groups}]")
        if not torch.isfinite(values).all() or not torch.isfinite(norms).all() or (norms < 0).any():
            raise VeosnapError(f"{where}: non-finite sketch values or negative norms (corrupt)")
        if (support is None) != (spec.support is None):
            raise VeosnapError(f"{where}: #support tensor {'missing' if support is None else 'present'} but the spec "
                               f"says support={spec.support}")
        if support is not None:
            if support.dtype != torch.int64 or tuple(support.shape) != (spec.support,):
                raise VeosnapError(f"{where}: #support is {describe(support)}, expected int64 [{spec.support}]")
            if support.numel() and (support[0] < 0 or support[-1] >= spec.rows or (support[1:] <= support[:-1]).any()):
                raise VeosnapError(f"{where}: #support is not sorted distinct rows in 0..{spec.rows - 1}")
        tau = tau_of(norms, entry.rows_counted)
        if not math.isclose(entry.tau, tau, rel_tol=TAU_REL_TOL, abs_tol=0.0):
            raise VeosnapError(f"{where}: tau {entry.tau!r} is not the RMS of its #norms over {entry.rows_counted} "
                               f"counted rows ({tau!r}): edited apart from them")
        return cls(spec, values, norms, support, entry.tau, entry.rows_counted, entry.dtype)


# tau is computed in float64 from the group sums of squares, the norms stored in float32: recomputed from
# them it agrees within float32 rounding (7e-10 relative on the committed real-shape goldens).
TAU_REL_TOL = 1e-5


def tau_of(norms: torch.Tensor, rows_counted: int) -> float:
    """tau as the recorder makes it: the RMS row norm over the counted rows, from the groups' norms."""
    return math.sqrt(float(norms.double().pow(2).sum()) / rows_counted) if rows_counted else 0.0


def describe(t: torch.Tensor) -> str:
    return f"{describe_dtype(t.dtype)} {list(t.shape)}"


def describe_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
