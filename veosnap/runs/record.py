"""Record goldens from the HF eager reference, with tolerances calibrated against a float64 run."""

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
from ..errors import Unsupported
from ..reference import hardware, inputs, models, scenarios, train
from ..reference.capture import run_step
from ..reference.determinism import deterministic
from ..reference.probes import RouteRecord
from ..reference.zoo import Project, ToyConfig, load_config


@dataclass(frozen=True)
class RecordOutcome:
    """What `record` did for one key."""

    key: GoldenKey
    path: Path
    written: bool  # False when the file already held exactly these bytes
    min_margin: float | None  # smallest router margin over all MoE layers (None: dense model)


def build_golden(project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False) -> Golden:
    """Run the reference (and its float64 twin) for `key` and assemble the golden in memory."""
    if key.scenario not in SCENARIOS:
        raise VeosnapError(f"unknown scenario {key.scenario!r} (known: {', '.join(SCENARIOS)})")
    if key.recorded != key:
        raise VeosnapError(f"{key}: scenario {key.scenario} has no golden of its own; it is checked against "
                           f"{key.recorded} (record that)")
    if key.dtype not in DTYPE_NAMES:
        raise VeosnapError(f"unknown dtype {key.dtype!r} for a golden (expected one of: {', '.join(DTYPE_NAMES)})")
    if key.hardware_class != hardware.detect():
        raise VeosnapError(
            f"cannot record hardware class {key.hardware_class} on this machine ({hardware.detect()}): "
            "goldens are only recorded on the hardware they describe"
        )
    toy = load_config(project.configs, key.model)
    scenario = scenarios.get(key.scenario)
    try:
        scenario.accept(toy.config)
    except Unsupported as exc:
        raise VeosnapError(f"{key}: {exc}") from None
    dtype = models.dtype_from_name(key.dtype)
    device = hardware.device_for(key.hardware_class)
    batch, spec = scenario_batch(project, toy, scenario)
    hyper = train.DEFAULT_HYPER if scenario.train else None
    with deterministic() as settings:
        torch.manual_seed(seed)
        model = scenario.freeze(models.build(toy, dtype, device, seed))
        batch = inputs.with_rope_positions(batch, model)
        high = scenario.freeze(models.upcast_copy(model, toy, torch.float64))  # before training moves the weights
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
            batch=spec,
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
    )
    return Golden(manifest=manifest, tensors=tensors)


def scenario_batch(project: Project, toy: ToyConfig, scenario: scenarios.Scenario) -> tuple[inputs.Batch, BatchSpec]:
    """The padded batch a golden of `scenario` holds for the model of `toy` (3-D positions still to add), and
    how it was made."""
    side = inputs.padding_side(toy.config)
    texts = tuple(row.text for row in scenario.rows if row.sample is None)
    if not scenario.multimodal:
        batch = inputs.padded(inputs.load_sequences(project.testdata, texts), side)
        return batch, BatchSpec(layout="padded", padding_side=side, sequences=texts, source=inputs.SEQUENCES_FILE)
    batch, family = inputs.multimodal_batch(project.testdata, list(scenario.rows), models.hf_config(toy), side)
    return batch, BatchSpec(layout="padded", padding_side=side, sequences=texts, source=inputs.MEDIA_SEQUENCES_FILE,
                            rows=tuple(str(row) for row in scenario.rows), media_family=family)


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


def record(project: Project, model: str, dtype: str, scenario: str = "step", seed: int = 0,
           allow_near_ties: bool = False) -> RecordOutcome:
    """Record one golden into the project's goldens directory; leaves an identical file untouched. A scenario
    checked against another's golden (`frozen_vision`) records that one."""
    key = GoldenKey(project.hardware_class, model, scenario, dtype).recorded
    new = build_golden(project, key, seed=seed, allow_near_ties=allow_near_ties)
    path = store.path_for(project.goldens, key)
    data = codec.encode(new)
    written = not (path.is_file() and path.read_bytes() == data)
    if written:
        store.write_bytes(data, path)
    margins = new.manifest.min_margin.values()
    return RecordOutcome(key=key, path=path, written=written, min_margin=min(margins) if margins else None)
