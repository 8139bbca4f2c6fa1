"""The verdict of checking one candidate against one golden: `CheckReport`.

Structure first (parameters, layers, MoE blocks the golden expects: a model-structure change is not a
numerics failure), then routes, then every tensor; where a check went wrong (the first diverging layer,
the first diverging gradient in the order the backward pass computes them) is derived from the
tensors' names. A report also says where the versions it ran with differ from the golden's provenance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..golden import names
from ..numerics import fmt
from ..numerics.compare import TensorResult
from ..numerics.isolation import IsolatedResult
from ..numerics.routes import RouteDiff


@dataclass(frozen=True)
class VersionDrift:
    """A package whose version here differs from the one the golden was recorded with."""

    package: str  # "torch", "transformers"
    golden: str
    here: str

    def __str__(self) -> str:
        return f"{self.package} {self.here} here, {self.golden} in the golden"


def drift_text(versions: list[VersionDrift]) -> str:
    """`transformers 5.22.2 here, 5.24.0 in the golden; ...` ('' when nothing differs)."""
    return "; ".join(map(str, versions))


@dataclass
class CheckReport:
    """The result of checking one candidate (a backend under a layout) against one golden."""

    golden: str  # the golden's key, e.g. cpu/qwen3_moe/step-float32
    model: str
    dtype: str
    backend: str
    layout: str = "single"
    tensors: list[TensorResult] = field(default_factory=list)
    routes: list[RouteDiff] = field(default_factory=list)
    route_replay: bool = False
    error: str = ""  # the candidate could not run: why
    skipped: str = ""  # the backend or layout does not apply to this model: why
    notes: list[str] = field(default_factory=list)
    absent: dict[str, str] = field(default_factory=dict)  # tensors the candidate does not produce: not compared, why
    structure: list[str] = field(default_factory=list)  # how the model's structure differs from the golden's
    versions: list[VersionDrift] = field(default_factory=list)  # packages whose version differs from the golden's
    # The command-line flags that select this check besides model, dtype, backend and layout (the
    # project's directories and class where not the defaults, the scenario, --cross-class, --nproc), so
    # a command a report advises runs as printed.
    selection: list[str] = field(default_factory=list)
    # The backend as a SPEC any process resolves, where `backend` names one registered in this process
    # only (a conftest's register_backend): `path/to/file.py:fn`. Empty: `backend` itself.
    portable_backend: str = ""
    sensitivity: dict[str, float] | None = None  # the golden's certified sensitivity (`runs/canaries.py`); None: not
    # Low precision: each layer's parts checked in isolation (`numerics.isolation`), and why not, where not.
    isolated: list[IsolatedResult] = field(default_factory=list)
    not_isolated: str = ""

    @property
    def routes_passed(self) -> bool:
        return all(r.passed for r in self.routes)

    @property
    def passed(self) -> bool:
        """True when nothing failed; a skipped check passes (its reason is reported)."""
        return not self.error and not self.structure and self.routes_passed and all(t.passed for t in self.tensors) \
            and all(i.passed for i in self.isolated)

    @property
    def structure_line(self) -> str | None:
        """The failure reason said before any numbers when the structure differs, naming version drift."""
        if not self.structure:
            return None
        versions = f" (versions differ: {drift_text(self.versions)})" if self.versions else ""
        return f"structure differs from the golden{versions}: " + "; ".join(self.structure)

    @property
    def status(self) -> str:
        return "skip" if self.skipped else "PASS" if self.passed else "ERROR" if self.error else "FAIL"

    def ranked(self) -> list[TensorResult]:
        """Tensors worst first."""
        return sorted(self.tensors, key=lambda t: (-t.ratio, t.name))

    def isolated_ranked(self) -> list[IsolatedResult]:
        """Isolated parts worst first (a failing one names its place: layer, part, head, expert, positions)."""
        return sorted(self.isolated, key=lambda i: (-i.ratio, i.place, i.statistic))

    @property
    def worst(self) -> TensorResult | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def _failing(self, kind: type[names.TensorName]) -> list[tuple[names.TensorName, TensorResult]]:
        return [(parsed, t) for t in self.tensors if not t.passed and isinstance(parsed := names.parse(t.name), kind)]

    @property
    def first_divergence(self) -> str | None:
        """The earliest block, in forward order (encoders, then the language model's decoder layers), whose
        output exceeds its bound."""
        return first_diverging([(t.name, t.ratio) for t in self.tensors if not t.passed])

    @property
    def first_gradient_divergence(self) -> str | None:
        """The first parameter group (layer, module), in the order backward computes them (the LM head
        first, the embeddings last), whose gradient exceeds its bound: where the backward pass first
        went wrong. After a forward divergence the whole backward differs, and the line says so."""
        failing = self._failing(names.Grad)
        if not failing:
            return None
        parsed, first = min(failing, key=lambda pair: _backward_order(pair[0], pair[1].name))
        where = parsed.within_layer if parsed.layer is None else f"layer {parsed.layer} {parsed.within_layer}"
        if parsed.encoder is not None:
            where = f"{parsed.encoder} encoder {parsed.module}"
        after = "; downstream of the forward divergence" if self.first_divergence or self._forward_failed() else ""
        return f"{where} ({first.name}, {fmt.times(first.ratio)} bound{after})"

    def _forward_failed(self) -> bool:
        return any(not t.passed and names.parse(t.name) in (names.LOSS, names.LOGITS) for t in self.tensors)


def first_diverging(over: list[tuple[str, float]]) -> str | None:
    """Of tensors over their bound, as (name, ratio): the earliest block in forward order (encoders, then the
    decoder layers) whose output is among them, as `layer 3 (<name>, 12x bound)`; None if no block output is."""
    blocks = [(parsed, name, ratio) for name, ratio in over
              if isinstance(parsed := names.parse(name), (names.LayerOutput, names.EncoderOutput))]
    if not blocks:
        return None
    parsed, name, ratio = min(blocks, key=lambda row: _forward_order(row[0]))
    where = parsed.describe() if isinstance(parsed, names.EncoderOutput) else f"layer {parsed.layer}"
    return f"{where} ({name}, {fmt.times(ratio)} bound)"


def _forward_order(name: names.TensorName) -> tuple:
    """Encoders first (in `names.ENCODERS` order, block by block), then the decoder layers."""
    if isinstance(name, names.EncoderOutput):
        return (0, *name.forward_order)
    return (1, name.layer, 0, 0)  # type: ignore[attr-defined]


_BLOCK_RE = re.compile(r"\.(?:blocks|layers)\.(\d+)\.")


def _backward_order(grad: names.Grad, name: str) -> tuple[int, int, int, str]:
    """Backward computes the LM head first, then the last layer down to the first, then the encoders (they ran
    after the embedding lookup: the last to run first, projection before blocks, the last block first), the
    embeddings last."""
    if grad.layer is not None:
        return (2, -grad.layer, 0, name)
    if grad.encoder is not None:
        block = _BLOCK_RE.search(grad.param)
        return (3, -names.ENCODERS.index(grad.encoder), -int(block.group(1)) if block else -(1 << 30), name)
    return (4 if "embed" in name else 0 if "lm_head" in name else 1, 0, 0, name)


@dataclass(frozen=True)
class Judgment:
    """One variant of the recorder's fragility check against a new golden: what its check's report says of it
    (`record.judgment`); here, below both the recorder and its fresh process (`isolated`), which pass it."""

    variant: str
    status: str  # "passed", "failed" or "not run"
    figures: str = ""  # failed: its routing difference or worst tensors with their ratios; not run: why
    tensor: str = ""  # failed: its worst tensor over the bound (a route name when only its routing differs)
    ratio: float | None = None  # that tensor's error/bound ratio (None: not finite, or a routing difference)

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def line(self) -> str:
        """The fragility line: the variant, then its figures."""
        name = "eager (the reference itself, run again)" if self.variant == "eager" else self.variant
        return f"{name}: {self.figures}"
