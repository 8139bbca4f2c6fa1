"""Record goldens from the HF eager reference, with tolerances calibrated against a float64 run.

Before a golden is written, the cheap legitimate variants of the reference that run here (`VARIANTS`:
the reference itself run again, sdpa attention where the model has it, the grouped_mm and batched_mm
experts kernels for MoE models; not compile, which takes a minute) are checked against it. A golden
that one of them fails is fragile: its bounds do not cover what an equally good kernel does (a router
deciding on a near-tie in a low precision, a tensor noisier than the float64 run says, a model that
samples in training mode and so never reproduces itself), and every real candidate would fail it too.
`record` refuses it, naming the variant, the tensor and the ratio, unless `allow_fragile`.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from .. import __version__
from ..errors import VeosnapError
from ..golden import codec, names, store
from ..golden.codec import Golden
from ..golden.key import DTYPE_NAMES, SCENARIOS, GoldenKey
from ..golden.manifest import BatchSpec, Manifest, Provenance, Reference
from ..numerics import fmt
from ..numerics.routes import flips
from ..numerics.tolerance import ALPHA, FLOOR, TIE_EPSILON, noise, pooled_noises, tolerance_for
from ..reference import hardware, inputs, limits, models, train
from ..reference.capture import run_step
from ..reference.determinism import deterministic
from ..reference.probes import RouteRecord, not_captured, unread_routers
from ..reference.zoo import Project, load_config


@dataclass(frozen=True)
class RecordOutcome:
    """What `record` did for one key."""

    key: GoldenKey
    path: Path
    written: bool  # False when the file already held exactly these bytes
    min_margin: float | None  # smallest router margin over all MoE layers (None: dense model)
    fragile: tuple[str, ...] = ()  # variants that fail the golden (written anyway: allow_fragile)
    routes_not_captured: str = ""  # the warning for routers whose routes the golden lacks ('' when none)
    config: Path | None = None  # the toy config it was recorded from (the project's, or the bundled zoo's)


def build_golden(project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False) -> Golden:
    """Run the reference (and its float64 twin) for `key` and assemble the golden in memory."""
    if key.scenario not in SCENARIOS:
        raise VeosnapError(f"unknown scenario {key.scenario!r} (known: {', '.join(SCENARIOS)})")
    if key.dtype not in DTYPE_NAMES:
        raise VeosnapError(f"unknown dtype {key.dtype!r} for a golden (expected one of: {', '.join(DTYPE_NAMES)})")
    if key.hardware_class != hardware.detect():
        raise VeosnapError(
            f"cannot record hardware class {key.hardware_class} on this machine ({hardware.detect()}): "
            "goldens are only recorded on the hardware they describe"
        )
    toy = load_config(project.configs, key.model)
    dtype = models.dtype_from_name(key.dtype)
    device = hardware.device_for(key.hardware_class)
    sequence_ids = inputs.DEFAULT_SEQUENCES
    batch = inputs.padded(inputs.load_sequences(project.testdata, sequence_ids))
    hyper = train.DEFAULT_HYPER if key.scenario == train.SCENARIO else None
    with deterministic() as settings:
        torch.manual_seed(seed)
        model = models.build(toy, dtype, device, seed)
        source = f"{project.testdata / inputs.SEQUENCES_FILE}, sequences {', '.join(map(str, sequence_ids))}"
        limits.check_batch(toy, model, batch, source)
        high = models.upcast_copy(model, toy, torch.float64)  # before training moves the weights
        with unread_routers(model) as unread:
            if hyper is None:
                reference = run_step(model, batch)
                reference_steps = [reference.routes]
            else:
                run = train.run_train(model, batch, hyper)
                reference, reference_steps = run.capture, run.step_routes
        del model
        with models.KeepFloat64():
            if hyper is None:
                truth = run_step(high, batch, own_loss=True)
                truth_steps = [truth.routes]
            else:
                run = train.run_train(high, batch, hyper, own_loss=True)
                truth, truth_steps = run.capture, run.step_routes
        del high
    mask = batch.token_mask
    # A train golden holds the first step's routes, but every step must route clearly: a near-tie in a
    # later step would flip a candidate's routes there, and its updates with them.
    min_margin = {}
    for ref_routes, truth_routes in zip(reference_steps, truth_steps):
        for layer, value in _check_routes(key, ref_routes, truth_routes, mask, allow_near_ties).items():
            min_margin[layer] = min(value, min_margin.get(layer, value))

    tensors: dict[str, torch.Tensor] = dict(batch.tensors())
    measured = {}
    ref_all, truth_all = reference.all_tensors(), truth.all_tensors()
    for name, value in ref_all.items():
        if name == str(names.LOSS):  # stored in float32, whatever the model dtype
            value = value.float()
        tensors[name] = value
        if names.parse(name).compared:  # route ids and margins are not compared numerically
            measured[name] = noise(name, value, truth_all[name], mask)
    tolerance = {name: tolerance_for(value, key.dtype) for name, value in pooled_noises(measured).items()}

    manifest = Manifest(
        key=key,
        config=toy.config,
        config_hash=toy.hash,
        inputs_hash=codec.tensors_hash(batch.tensors()),
        reference=Reference(
            attn_implementation=models.REFERENCE_ATTN,
            experts_implementation=models.REFERENCE_EXPERTS,
            seed=seed,
            batch=BatchSpec(layout="padded", padding_side="left", sequences=tuple(sequence_ids),
                            source=inputs.SEQUENCES_FILE),
            noise_run="float64",
            train=hyper,
        ),
        provenance=Provenance(
            veosnap=__version__,
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            **hardware.describe_device(device),
            **settings,
        ),
        tolerance=tolerance,
        alpha=ALPHA[key.dtype],
        floor=FLOOR[key.dtype],
        tie_epsilon=TIE_EPSILON[key.dtype],
        min_margin=dict(min_margin),
        routes_not_captured=dict(sorted(unread.items())),
    )
    return Golden(manifest=manifest, tensors=tensors)


def _check_routes(key: GoldenKey, reference: dict[int, RouteRecord], truth: dict[int, RouteRecord],
                  mask: torch.Tensor, allow_near_ties: bool) -> dict[int, float]:
    """The smallest router margin per MoE layer; refuses near-ties unless allowed."""
    margins = {layer: float(rec.margin[mask].min()) for layer, rec in sorted(reference.items())}
    if allow_near_ties:
        return margins
    eps = TIE_EPSILON[key.dtype]
    for layer, value in margins.items():
        if value < eps:
            raise VeosnapError(
                f"{key}: router margin {fmt.num(value)} in layer {layer} is under the tie epsilon {eps:g}: a near-tie "
                "would make this golden flaky across hardware; make the toy router decide clearly, or pass --allow-near-ties"
            )
        flipped = flips(reference[layer].experts, truth[layer].experts, mask)
        if flipped.any():
            raise VeosnapError(f"{key}: layer {layer} routes {int(flipped.sum())} token(s) differently in float64; near-ties")
    return margins


# Cheap legitimate variants: eager is the reference run again (a golden it fails does not reproduce
# itself); the experts kernels are tried on MoE models only.
VARIANTS = ("eager", "sdpa", "grouped_mm", "batched_mm")
_MOE_ONLY = ("grouped_mm", "batched_mm")


def fragility(project: Project, golden: Golden) -> list[str]:
    """The cheap legitimate variants (`VARIANTS`) that fail `golden`, one line each: the variant, then its
    routing difference or its worst tensors over their bounds with their ratios."""
    from ..candidates import backends
    from .check import check

    moe = bool(golden.route_layers())
    found = []
    for variant in VARIANTS:
        if variant in _MOE_ONLY and not moe:
            continue
        report = check(project, golden.manifest.key, backends.resolve(variant), gold=golden)
        if report.passed or report.skipped or report.error:
            continue  # passed, does not apply, or could not run: nothing said about the golden
        flipped = [r for r in report.routes if not r.passed]
        over = [t for t in report.ranked() if not t.passed][:3]
        parts = [f"routing differs in layer {r.layer} ({r.clear_flips} of {r.tokens} tokens)" for r in flipped]
        parts += [f"{t.name} {fmt.times(t.ratio)}" for t in over]
        name = "eager (the reference itself, run again)" if variant == "eager" else variant
        found.append(f"{name}: {', '.join(parts)}")
    return found


def fragile_error(key: GoldenKey, fragile: list[str], command: str) -> VeosnapError:
    return VeosnapError(
        f"{key}: fragile golden, not written: legitimate variants of the reference exceed its bounds "
        f"({'; '.join(fragile)}); every candidate would fail where they do. Look for near-tie routers or "
        f"a precision the toy config cannot carry, or keep it with `{command} --allow-fragile`")


def record(project: Project, model: str, dtype: str, scenario: str = "step", seed: int = 0,
           allow_near_ties: bool = False, allow_fragile: bool = False) -> RecordOutcome:
    """Record one golden into the project's goldens directory; leaves an identical file untouched.

    A golden that cheap legitimate variants fail (`fragility`) is refused unless `allow_fragile`
    (then written, and the outcome lists them)."""
    key = GoldenKey(project.hardware_class, model, scenario, dtype)
    new = build_golden(project, key, seed=seed, allow_near_ties=allow_near_ties)
    path = store.path_for(project.goldens, key)
    data = codec.encode(new)
    written = not (path.is_file() and path.read_bytes() == data)
    fragile: list[str] = []
    if written:  # an identical golden on disk was judged when it was written
        fragile = fragility(project, new)
        if fragile and not allow_fragile:
            scenario_args = [] if scenario == "step" else ["--scenario", scenario]
            raise fragile_error(key, fragile, project.command("record", "--model", model, "--dtype", dtype,
                                                              *scenario_args, hardware_class=False))
        store.write_bytes(data, path)
    margins = new.manifest.min_margin.values()
    unread = new.manifest.routes_not_captured
    return RecordOutcome(key=key, path=path, written=written, min_margin=min(margins) if margins else None,
                         fragile=tuple(fragile), routes_not_captured=not_captured(unread) if unread else "",
                         config=load_config(project.configs, model).path)
