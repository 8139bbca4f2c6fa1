"""Record goldens from the HF eager reference, with tolerances calibrated against a float64 run.

Before the reference runs, the sketch planner chooses each tensor's form from shapes alone (`--sketch
auto`: whole while the golden fits `golden.limits.TARGET_BYTES`, else the largest tensors sketched;
`always`; `never`). The reference then keeps each tensor in that form, sketching on its device; the
float64 run reduces the same tensors with the same specs, so a sketched tensor's noise, and so its
bound, is in the currency a check computes. Before anything is written, the golden's bytes go through
the reader itself (`codec.decode`): record never writes a golden that check would refuse.

The reference is recorded from a pristine process: here when no candidate has run in this process, else
in a fresh one (`isolated`). A golden is written under the project's goldens directory only (`./goldens`
or `--goldens`, never the installed package, never through a directory linked out of it), and a golden
with an approval trail keeps it: recording it again is "unchanged" when the reference reproduces it, and
refused when it would change it without an approval (that is what `veosnap refresh --reason` is for).

Before a golden is written, the cheap legitimate variants of the reference that run here (`VARIANTS`:
the reference itself run again, sdpa attention where the model has it, the grouped_mm and batched_mm
experts kernels for MoE models; not compile, which takes a minute) are checked against it. A golden
that one of them fails is fragile: its bounds do not cover what an equally good kernel does (a router
deciding on a near-tie in a low precision, a tensor noisier than the float64 run says, a model that
samples in training mode and so never reproduces itself), and every real candidate would fail it too.
`record` refuses it, naming the variant, the tensor and the ratio, unless `allow_fragile`, or unless that
variant is excused: `--excuse VARIANT=REASON` says the variant is known to be wrong here (a library bug,
docs/findings/), and the golden keeps {variant: reason, worst tensor, ratio} in its manifest (`excused`,
absent when there is none), so every check of that variant still fails and its report says the reason.
An excuse for a variant that passes (or does not run) is refused: it would hide nothing. The variants
are veosnap's own, as shipped (not a same-named backend registered at run time), and leave the process
pristine (`pristine.own_variants`): a later recording here still runs in this process.
"""

from __future__ import annotations

import copy
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from torch import nn

from ..about import __version__
from ..candidates import pristine
from ..errors import GoldenError, Unsupported, VeosnapError
from ..golden import codec, names, store
from ..golden.codec import Golden
from ..golden.key import DTYPE_NAMES, SCENARIOS, GoldenKey
from ..golden.manifest import EXCUSABLE, BatchSpec, Excuse, Manifest, Provenance, Reference
from ..golden.limits import mib
from ..golden.sketches import MODES, SketchPlan
from ..numerics import fmt, projection
from ..numerics.routes import flips
from ..numerics.sketch import CandidateSketch, Plan, compare_sketch, plan
from ..numerics.tolerance import ALPHA, FLOOR, TIE_EPSILON, Sample, noise, pooled_noises, tolerance_for
from ..reference import coverage, hardware, inputs, limits, models, probes, scenarios, train
from ..reference.capture import run_step, step_shapes
from ..reference import determinism
from ..reference.determinism import deterministic
from ..reference.probes import RouteRecord, unread_routers
from ..reference.reduce import WHOLE, CandidateReducer, RecordReducer, Reducer
from ..reference.zoo import SIDECAR, Project, ToyConfig, load_config, writable
from .verdict import CheckReport, Judgment


@dataclass(frozen=True)
class RecordOutcome:
    """What `record` did for one key."""

    key: GoldenKey
    path: Path
    written: bool  # False when the file already held exactly these bytes
    min_margin: float | None  # smallest router margin over all MoE layers (None: dense model)
    note: str = ""  # what else the user should know (a trail kept, an unreadable golden replaced)
    fragile: tuple[str, ...] = ()  # variants that fail the golden (written anyway: allow_fragile)
    excused: tuple[str, ...] = ()  # variants that fail the golden, excused (`--excuse`): their figures
    routes_not_captured: str = ""  # the warning for routers whose routes the golden lacks ('' when none)
    random_off: str = ""  # the config's random settings the reference ran without ('' when none)
    sensitivity: dict[str, float] | None = None  # what the golden certifies it catches (None: not certified)
    config: Path | None = None  # the toy config it was recorded from (the project's, or the bundled zoo's)


# Legitimate kernels whose gradients calibrate a low-precision golden's projection noise (`numerics.projection`):
# attention computed by SDPA (its softmax keeps float32 where eager rounds the probabilities), and the MoE
# experts by grouped_mm. Measured on the CPU: sdpa's projection against eager reaches 3-4x eager's own bias
# along a Qwen2-VL q_proj gradient, which eager's rounding alone would have bounded too tightly.
PROJECTION_VARIANTS = (("set_attn_implementation", "sdpa"), ("set_experts_implementation", "grouped_mm"))


def variant_gradients(model: nn.Module, batch: inputs.Batch) -> list[dict[str, torch.Tensor]]:
    """The whole gradients of `model` (the reference, before anything moved it) under each legitimate variant
    that transformers lets it switch to (`PROJECTION_VARIANTS`); none it refuses."""
    found = []
    for setter, implementation in PROJECTION_VARIANTS:
        variant = copy.deepcopy(model)
        try:
            getattr(variant, setter)(implementation)
        except (AttributeError, ValueError, ImportError, NotImplementedError):
            continue
        if implementation == "grouped_mm" and not probes.find_moe_layers(variant):
            continue
        capture = run_step(variant, batch)
        found.append({n: t for n, t in capture.tensors.items() if isinstance(names.parse(n), names.Grad)})
        del variant
    return found


def projection_noises(reference: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                      variants: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Each whole gradient's projection noise (`numerics.projection.noise`): the reference's against its float64
    twin, or a legitimate variant's projection onto the reference where larger."""
    found = {}
    for name, value in reference.items():
        if not isinstance(names.parse(name), names.Grad) or name not in exact:
            continue
        spread = [abs(projection.projection(v[name], value)) for v in variants if name in v]
        found[name] = projection.rounded(max([projection.noise(value, exact[name]), *spread]))
    return found


def build_golden(project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False,
                 sketch: str = "auto") -> Golden:
    """Run the reference (and its float64 twin) for `key` and assemble the golden in memory.

    `sketch`: `auto` (sketch the largest tensors only when the golden would not fit the target),
    `always` (every sketchable tensor: tests, and the no-loss-of-power experiment) or `never`.
    """
    if sketch not in MODES:
        raise VeosnapError(f"--sketch {sketch!r}: expected one of {', '.join(MODES)}")
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
    toy, scenario, batch, spec = _admitted(project, key)
    dtype = models.dtype_from_name(key.dtype)
    device = hardware.device_for(key.hardware_class)
    hyper = train.DEFAULT_HYPER if scenario.train else None
    with deterministic() as settings:
        torch.manual_seed(seed)
        model = scenario.freeze(models.build(toy, dtype, device, seed))
        made = coverage.produces(model)
        batch = inputs.with_rope_positions(batch, model)
        determinism.require_deterministic(toy.path, model, batch.model_kwargs(with_labels=False))
        chosen = _plan(key, model, batch, sketch, seed, toy.golden_budget)
        reducer: Reducer = RecordReducer(chosen, batch.token_mask) if chosen.sketched else WHOLE
        high = scenario.freeze(models.upcast_copy(model, toy, torch.float64))  # before training moves the weights
        with unread_routers(model) as unread:
            if hyper is None:
                reference = run_step(model, batch, reducer=reducer)
                reference_steps = [reference.routes]
            else:
                run = train.run_train(model, batch, hyper)
                reference, reference_steps = run.capture, run.step_routes
        # The gradients' projection noise is also calibrated on legitimate kernels' roundings, not eager's alone
        variants = variant_gradients(model, batch) \
            if hyper is None and key.dtype in projection.LOW_PRECISION and not chosen.sketched else []
        del model
        # The float64 run reduces the sketched tensors with the reference's own specs: noise in the
        # currency of the check.
        truth_reducer = CandidateReducer(reference.sketches, batch.token_mask, check_dtype=False) \
            if reference.sketches else WHOLE
        with models.KeepFloat64():
            if hyper is None:
                truth = run_step(high, batch, own_loss=True, reducer=truth_reducer)
                truth_steps = [truth.routes]
            else:
                run = train.run_train(high, batch, hyper, own_loss=True)
                truth, truth_steps = run.capture, run.step_routes
        del high
    for name, why in sorted(reference.absent.items()):  # the reference must give every tensor a golden holds
        raise VeosnapError(f"{key}: the reference's {name} cannot be captured: {why}")
    mask = batch.token_mask
    # A train golden holds the first step's routes, but every step must route clearly: a near-tie in a
    # later step would flip a candidate's routes there, and its updates with them.
    min_margin = {}
    for ref_routes, truth_routes in zip(reference_steps, truth_steps):
        for layer, value in _check_routes(key, ref_routes, truth_routes, mask, allow_near_ties).items():
            min_margin[layer] = min(value, min_margin.get(layer, value))

    tensors: dict[str, torch.Tensor] = dict(batch.tensors())
    measured: dict[str, object] = {}
    ref_all, truth_all = reference.all_tensors(), truth.all_tensors()
    for name, value in ref_all.items():
        if name == str(names.LOSS):  # stored in float32, whatever the model dtype
            value = value.float()
        tensors[name] = value
        if names.parse(name).compared:  # route ids and margins are not compared numerically
            measured[name] = noise(name, value, truth_all[name], mask)
    for name, gold in reference.sketches.items():
        twin = truth.sketches[name]
        if not isinstance(twin, CandidateSketch):
            raise VeosnapError(f"{key}: the float64 run's {name} cannot be reduced like the reference's ({twin})")
        err = compare_sketch(gold, twin, name=name)  # a maximum over groups: pooled on the group count
        measured[name] = Sample(err.error, err.groups)
    tolerance = {name: tolerance_for(value, key.dtype) for name, value in pooled_noises(measured).items()}
    if key.dtype in projection.LOW_PRECISION:  # each whole gradient's projection bound, from the same runs
        for name, value in projection_noises(ref_all, truth_all, variants).items():
            if name in tolerance:
                tolerance[name] = projection.with_projection(tolerance[name], value)

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
            random_off=models.random_off(toy) or None,
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
        absent=coverage.absences(made, unread),
        sketch=SketchPlan(mode=chosen.mode, budget=chosen.budget, hard_limit=chosen.hard_limit,
                          planned_bytes=chosen.total_bytes,
                          tensors={name: gold.entry for name, gold in sorted(reference.sketches.items())})
        if reference.sketches else None,
    )
    golden = Golden(manifest=manifest, tensors=tensors, sketches=dict(reference.sketches))
    stored = sum(t.numel() * t.element_size() for t in golden.stored_tensors().values())
    if stored > chosen.hard_limit:
        raise VeosnapError(f"{key}: golden would hold {stored} bytes, over the {chosen.hard_limit} byte limit "
                           f"({mib(chosen.hard_limit)}); " + ("use --sketch auto" if sketch == "never"
                                                                     else "record fewer tokens or layers"))
    return golden


def _plan(key: GoldenKey, model: torch.nn.Module, batch: inputs.Batch, mode: str, seed: int,
          budget: int | None = None) -> Plan:
    """Each tensor's form (whole or sketched with which spec), from shapes, before the reference runs.

    The train scenario's goldens are stored whole (sketching covers the step scenario): a train golden
    that would need sketches is refused with the limit, not silently sketched.
    """
    shapes, fixed = step_shapes(model, batch)
    if key.scenario == train.SCENARIO:
        if mode == "always":
            raise VeosnapError(f"{key}: --sketch always: train goldens are stored whole (sketching covers the "
                               "step scenario); record it with --sketch auto or never")
        chosen = plan(shapes, mode="never", fixed_bytes=fixed, seed=seed)
        if mode == "auto" and chosen.total_bytes > chosen.budget:
            raise VeosnapError(f"{key}: a train golden would hold {chosen.total_bytes} bytes, over the "
                               f"{mib(chosen.budget)} target, and train goldens are not sketched; record "
                               "fewer layers, or pass --sketch never (up to the hard limit)")
        return chosen
    try:
        return plan(shapes, mode=mode, fixed_bytes=fixed, seed=seed,
                    **({} if budget is None else {"budget": budget}))  # a config's own budget (veosnap.json)
    except VeosnapError as exc:
        raise VeosnapError(f"{key}: {exc}") from None


def encode_checked(golden: Golden, path: Path | str) -> bytes:
    """The golden's file bytes, after the reader itself has accepted them: every cap, the manifest,
    the hashes, the tensor set. Refuses with the limit and the fix, so record never writes a golden that
    check would refuse."""
    data = codec.encode(golden)
    try:
        codec.decode(data, path)
    except GoldenError as exc:
        raise _refused(path, exc) from None
    return data


def _refused(where: object, exc: GoldenError) -> VeosnapError:
    return VeosnapError(f"{where}: not written: a check would refuse this golden ({exc.problem}); record it with "
                        "--sketch auto, or fewer tokens or layers")


def _admitted(project: Project, key: GoldenKey) -> tuple[ToyConfig, scenarios.Scenario, inputs.Batch, BatchSpec]:
    """The config, scenario and batch of a golden this machine can record; else a one-line VeosnapError
    (a scenario the model cannot run, a config or batch over veosnap's limits, more memory than it has)."""
    toy = load_config(project.configs, key.model)
    scenario = scenarios.get(key.scenario)
    try:
        scenario.accept(toy.config)
    except Unsupported as exc:
        raise VeosnapError(f"{key}: {exc}") from None
    parameters = limits.check_config(toy)
    batch, spec = scenario_batch(project, toy, scenario)
    limits.check_memory(toy, parameters, batch.rows * batch.width, models.dtype_from_name(key.dtype),
                        hardware.device_for(key.hardware_class), recording=True, width=batch.width)
    return toy, scenario, batch, spec


def refusal(project: Project, key: GoldenKey) -> str:
    """Why `veosnap record` would refuse the golden of `key` on this machine before recording ('' when it
    would record it): what a message that advises recording checks first, so it never advises a refused one.
    A golden of another class is judged as its own hardware would record it (that hardware's memory aside)."""
    if key.hardware_class != hardware.detect():
        return ""
    try:
        _admitted(project, key.recorded)
    except VeosnapError as exc:
        return str(exc)
    return ""


def scenario_batch(project: Project, toy: ToyConfig, scenario: scenarios.Scenario) -> tuple[inputs.Batch, BatchSpec]:
    """The batch a golden of `scenario` holds for the model of `toy` (3-D positions still to add), and how it
    was made: a text scenario runs the config's recipe (`golden_batch`), a multimodal one its own rows."""
    side = inputs.padding_side(toy.config)
    if not scenario.multimodal:
        recipe = toy.batch
        return golden_batch(project, toy), BatchSpec(layout="packed-rows" if recipe.packed_rows else "padded",
                                                     padding_side=side, sequences=recipe.sequences,
                                                     source=recipe.source)
    texts = tuple(row.text for row in scenario.rows if row.sample is None)
    batch, family = inputs.multimodal_batch(project.testdata, list(scenario.rows), models.hf_config(toy), side)
    return batch, BatchSpec(layout="padded", padding_side=side, sequences=texts, source=inputs.MEDIA_SEQUENCES_FILE,
                            rows=tuple(str(row) for row in scenario.rows), media_family=family)


def golden_batch(project: Project, toy: ToyConfig) -> inputs.Batch:
    """The text batch a golden of `toy` is recorded on, made from the test data by the config's recipe (padded
    on the model's side, `inputs.padding_side`)."""
    recipe = toy.batch
    vocab = getattr(models.hf_config(toy).get_text_config(), "vocab_size", None)
    sequences = inputs.load_sequences(project.testdata, recipe.sequences, recipe.source, vocab, recipe.distinct)
    limits.check_sequences(project.testdata, recipe.sequences, sequences, toy, table=recipe.source)
    rows, at = [], 0
    for row in recipe.rows:
        rows.append(sequences[at:at + len(row)])
        at += len(row)
    # The caps on what the model will see, before the batch is made: a packed row is one sequence to attention.
    sidecar = toy.path.parent / SIDECAR
    limits.check_shape(sidecar if sidecar.is_file() else Path(project.testdata) / recipe.source, len(rows),
                       max((sum(len(s) for s in row) for row in rows), default=0))
    if not recipe.packed_rows:
        return inputs.padded(sequences, inputs.padding_side(toy.config))
    lengths = {sum(len(s) for s in row) for row in rows}
    if len(lengths) > 1:
        # transformers finds packed sequences from restarting position ids only when no attention mask is
        # given; padding would make it pass one, and the packed sequences would attend to each other.
        raise VeosnapError(f"{toy.path.parent / 'veosnap.json'}: rows of packed sequences must all hold the same "
                           f"number of tokens (no padding), not {sorted(lengths)}")
    return inputs.packed_rows(rows)


def _check_routes(key: GoldenKey, reference: dict[int, RouteRecord], truth: dict[int, RouteRecord],
                  mask: torch.Tensor, allow_near_ties: bool) -> dict[int, float]:
    """The smallest router margin per MoE layer; refuses near-ties unless allowed."""
    margins = {layer: float(rec.margin[mask].min()) for layer, rec in sorted(reference.items())}
    if allow_near_ties:
        return margins
    eps = TIE_EPSILON[key.dtype]
    for layer, value in margins.items():
        if value != value:  # NaN: the margins of a router whose logits could not be read
            raise VeosnapError(f"{key}: layer {layer}'s router margins are unknown (its logits could not be read "
                               "at the router's output); a golden needs them to tell near-ties")
        if value < eps:
            raise VeosnapError(
                f"{key}: router margin {fmt.num(value)} in layer {layer} is under the tie epsilon {eps:g}: a near-tie "
                "would make this golden flaky across hardware; make the toy router decide clearly, or pass --allow-near-ties"
            )
        flipped = flips(reference[layer].experts, truth[layer].experts, mask)
        if flipped.any():
            raise VeosnapError(f"{key}: layer {layer} routes {int(flipped.sum())} token(s) differently in float64; near-ties")
    return margins


@dataclass
class Recorded:
    """A new golden and, when it was recorded in a fresh process, its variants' judgments made there."""

    golden: Golden
    judgments: list[Judgment] | None = None  # None: not judged yet (`judge` runs the variants here)

    def judge(self, project: Project) -> list[Judgment]:
        """The fragility check's judgments: from the fresh process that recorded it, else run here."""
        if self.judgments is None:
            self.judgments = judge_variants(project, self.golden)
        return self.judgments


def recorded(project: Project, key: GoldenKey, seed: int = 0, allow_near_ties: bool = False,
             sketch: str = "auto") -> Recorded:
    """The golden for `key` from a pristine process: this one if no candidate ran here, else a fresh one
    (which also judges it: the variants must run against the reference the golden came from)."""
    if pristine.touched():
        from .isolated import record_judged

        data, judgments = record_judged(project, key, seed=seed, allow_near_ties=allow_near_ties, sketch=sketch)
        try:
            return Recorded(codec.decode(data, f"the fresh recording of {key}"), judgments)
        except GoldenError as exc:
            raise _refused(key, exc) from None
    return Recorded(build_golden(project, key, seed=seed, allow_near_ties=allow_near_ties, sketch=sketch))


def stored_bytes(project: Project, new: Golden) -> tuple[bytes, str]:
    """What recording `new` stores in `project`, and a note for the user.

    An existing golden's approval trail is kept: the new golden carries it, and must then reproduce the
    stored file byte for byte (a recording cannot extend the trail, having no reason to give). A golden
    without a trail that the recording reproduces but for its canaries' measured ratios stays as stored. An
    unreadable golden is replaced (it has no trail anyone can trust), and the note says so.
    """
    root = project.goldens
    path = store.path_for(root, new.key)
    if not os.path.lexists(path):
        return encode_checked(new, path), ""
    try:
        old = store.read(path, root)
    except GoldenError as exc:
        return encode_checked(new, path), f"replaced an unreadable golden: {exc.problem}"
    trail = old.manifest.approvals
    # The same canaries caught at the same scales: the ratios measured when the golden was certified are kept
    # (another machine of the class measures them in other digits: 138.55 against 138.58 on two CPUs).
    same_canaries = bool(old.manifest.reference.sensitivity and new.manifest.reference.sensitivity
                         and set(old.manifest.reference.sensitivity) == set(new.manifest.reference.sensitivity))
    fresh = new.manifest
    if same_canaries:
        certified = old.manifest.reference.sensitivity
        new.manifest = replace(fresh, reference=replace(fresh.reference, sensitivity=certified))
    if not trail:
        data = encode_checked(new, path)
        if same_canaries and data != store.read_file(path):  # changed beyond those figures: its own ratios
            new.manifest = fresh
            data = encode_checked(new, path)
        return data, ""
    new.manifest.approvals = list(trail)
    data = encode_checked(new, path)
    if data != store.read_file(path):
        count = f"{len(trail)} approval{'s' if len(trail) > 1 else ''}"
        refresh = project.recording_command("refresh", new.key, "--reason", "<why>")
        raise GoldenError(path, f"has an approval trail ({count}, last {trail[-1].reason!r}): recording it again "
                                f"would change it without an approval; re-record it with `{refresh}`")
    return data, f"approval trail of {len(trail)} kept"


# Cheap legitimate variants: eager is the reference run again (a golden it fails does not reproduce
# itself); the experts kernels are tried on MoE models only.
VARIANTS = ("eager", *EXCUSABLE)
_MOE_ONLY = ("grouped_mm", "batched_mm")


def judgment(variant: str, report: CheckReport) -> Judgment:
    """What `report` (a check of `variant` against the new golden) says about the golden."""
    if report.passed:
        return Judgment(variant, "passed")
    if report.skipped or report.error:  # does not apply, or could not run: nothing said about the golden
        return Judgment(variant, "not run", report.skipped or report.error)
    flipped = [r for r in report.routes if not r.passed]
    over = [t for t in report.ranked() if not t.passed][:3]
    parts = [f"routing differs in layer {r.layer} ({r.clear_flips} of {r.tokens} tokens)" for r in flipped]
    parts += [f"{t.name} {fmt.times(t.ratio)}" for t in over]
    if over:
        tensor, ratio = over[0].name, over[0].ratio if math.isfinite(over[0].ratio) else None
    else:
        tensor, ratio = (str(names.Route(flipped[0].layer, "experts")) if flipped else ""), None
    return Judgment(variant, "failed", ", ".join(parts) or report.status, tensor, ratio)


def judge_variants(project: Project, golden: Golden) -> list[Judgment]:
    """Each cheap legitimate variant (`VARIANTS`) against `golden`, in order.

    They run here, as shipped, and leave this process as pristine as it was (`pristine.own_variants`)."""
    from ..candidates import backends
    from .check import check

    moe = bool(golden.route_layers())
    found = []
    for variant in VARIANTS:
        if variant in _MOE_ONLY and not moe:
            found.append(Judgment(variant, "not run", "a dense model has no experts"))
            continue
        if variant == "batched_mm" and batched_mm_too_large(project, golden):
            # at real shapes its gathered expert weights would dwarf the recording (docs/how-it-works.md, "Two tiers")
            found.append(Judgment(variant, "not run", "its copies of the experts' weights would exceed "
                                                      f"{mib(BATCHED_MM_JUDGE_LIMIT)}"))
            continue
        with pristine.own_variants():
            report = check(project, golden.manifest.key, backends.shipped(variant), gold=golden)
        found.append(judgment(variant, report))
    return found


def fragility(project: Project, golden: Golden) -> list[str]:
    """The cheap legitimate variants (`VARIANTS`) that fail `golden`, one line each: the variant, then its
    routing difference or its worst tensors over their bounds with their ratios."""
    return [j.line() for j in judge_variants(project, golden) if j.failed]


def parse_excuses(items: Sequence[str]) -> dict[str, str]:
    """`--excuse VARIANT=REASON` options as {variant: reason}; a bad one is a one-line error naming it."""
    excuses: dict[str, str] = {}
    for item in items:
        variant, sep, reason = item.partition("=")
        variant, reason = variant.strip(), reason.strip()
        if variant == "eager":
            raise VeosnapError(f"--excuse {item!r}: eager is the reference itself, run again; a golden it fails "
                               f"does not reproduce itself and cannot be excused (excusable: {', '.join(EXCUSABLE)})")
        if variant not in EXCUSABLE:
            raise VeosnapError(f"--excuse {item!r}: unknown variant {variant!r} (the fragility check's variants "
                               f"that can be excused: {', '.join(EXCUSABLE)})")
        if not sep or not reason:
            raise VeosnapError(f"--excuse {item!r}: give the reason, as --excuse {variant}=REASON (it is kept in "
                               "the golden and shown by every check of that variant)")
        if variant in excuses and excuses[variant] != reason:
            raise VeosnapError(f"--excuse {variant}: given twice with different reasons")
        excuses[variant] = reason
    return excuses


def excused(key: GoldenKey, judgments: Sequence[Judgment], excuses: dict[str, str]) -> dict[str, Excuse]:
    """The manifest's `excused` entries for `excuses` ({variant: reason}), with the figures each variant
    failed by. An excuse for a variant that passes, or did not run, is refused: it would hide nothing now
    and whatever the variant does later."""
    by_variant = {j.variant: j for j in judgments}
    entries = {}
    for variant, reason in sorted(excuses.items()):
        found = by_variant.get(variant)
        if found is None or not found.failed:
            how = "passes it" if found is not None and found.status == "passed" else \
                f"did not run on it ({found.figures if found is not None else 'not judged'})"
            raise VeosnapError(f"{key}: --excuse {variant}: {variant} {how}; a stale excuse hides nothing, "
                               "drop it")
        if not found.tensor:  # a structure change, say: nothing the manifest could name
            raise VeosnapError(f"{key}: --excuse {variant}: its failure names no tensor or route ({found.figures}); "
                               "only a numerical failure can be excused")
        entries[variant] = Excuse(reason, found.tensor, found.ratio)
    return entries


def settle(key: GoldenKey, golden: Golden, judgments: Sequence[Judgment], excuses: dict[str, str],
           allow_fragile: bool, command: str) -> tuple[list[str], list[str]]:
    """Decide on a new golden from its judgments: the excused variants go into its manifest (`excused`),
    any other variant that fails it refuses it unless `allow_fragile`. Returns the lines of the variants
    that fail it, not excused (allowed) and excused, for the user."""
    golden.manifest.excused = excused(key, judgments, excuses)
    unexcused = [j.line() for j in judgments if j.failed and j.variant not in excuses]
    if unexcused and not allow_fragile:
        raise fragile_error(key, unexcused, command)
    return unexcused, [j.line() for j in judgments if j.failed and j.variant in excuses]


# The fragility check leaves batched_mm out where its copies of the experts' weights (`limits.batched_mm_bytes`)
# exceed this: at real shapes (600 tokens x top-8 of 128 experts) they take 15-30 GB, three times the
# recording itself; the toys gather under 50 MiB. `veosnap check --backend batched_mm` still runs it.
BATCHED_MM_JUDGE_LIMIT = 2 << 30


def batched_mm_too_large(project: Project, golden: Golden) -> bool:
    toy = load_config(project.configs, golden.manifest.key.model)
    tokens = golden.inputs()["input_ids"].numel()
    return limits.batched_mm_bytes(toy, tokens, models.dtype_from_name(golden.manifest.key.dtype)) \
        > BATCHED_MM_JUDGE_LIMIT


def fragile_error(key: GoldenKey, fragile: list[str], command: str) -> VeosnapError:
    return VeosnapError(
        f"{key}: fragile golden, not written: legitimate variants of the reference exceed its bounds "
        f"({'; '.join(fragile)}); every candidate would fail where they do. Look for near-tie routers or "
        f"a precision the toy config cannot carry; where a variant is known to be wrong (a library bug), record "
        f"it with --excuse VARIANT=REASON; or keep it with `{command} --allow-fragile`")


def certified(project: Project, golden: Golden) -> None:
    """Plant the canaries against `golden` and keep the sensitivity they certify in its manifest (`canaries`):
    here if no candidate ran in this process, else in a fresh one, so no candidate's leftovers can make a
    canary fail."""
    if pristine.touched():
        from .isolated import certify_fresh

        sensitivity = certify_fresh(project, golden)
    else:
        from .canaries import certify

        sensitivity = certify(project, golden)
    golden.manifest = replace(golden.manifest, reference=replace(golden.manifest.reference, sensitivity=sensitivity))


def record(project: Project, model: str, dtype: str, scenario: str = "step", seed: int = 0,
           allow_near_ties: bool = False, allow_fragile: bool = False, sketch: str = "auto",
           excuses: dict[str, str] | None = None, certify: bool = True) -> RecordOutcome:
    """Record one golden into the project's goldens directory; leaves an identical file untouched. A scenario
    checked against another's golden (`frozen_vision`) records that one.

    A golden that cheap legitimate variants fail (`fragility`) is refused unless `allow_fragile` (then
    written, and the outcome lists them) or each failing variant is excused (`excuses`: {variant: reason},
    kept in the manifest; an excuse for a variant that passes is refused). `certify` (the default): plant
    veosnap's canaries and keep the sensitivity they certify in the manifest, refusing a golden that one passes
    (`canaries`); without it the golden says `not certified`."""
    key = GoldenKey(project.hardware_class, model, scenario, dtype).recorded
    writable(project.goldens)
    path = store.path_for(project.goldens, key)
    store.check_writable(path, project.goldens)  # before the minutes a recording may take
    fresh = recorded(project, key, seed=seed, allow_near_ties=allow_near_ties, sketch=sketch)
    new = fresh.golden
    if certify:  # in the manifest, so before the bytes
        certified(project, new)
    command = project.recording_command("record", key)
    fragile: list[str] = []
    excused_lines: list[str] = []
    if excuses:  # judged before the bytes: the excuses, with the figures they are made for, are in them
        fragile, excused_lines = settle(key, new, fresh.judge(project), excuses, allow_fragile, command)
    data, note = stored_bytes(project, new)
    try:
        written = store.read_file(path) != data
    except GoldenError:
        written = True
    if written:  # an identical golden on disk was judged when it was written
        if not excuses:
            fragile, _ = settle(key, new, fresh.judge(project), {}, allow_fragile, command)
        store.write_bytes(data, path, project.goldens)
    margins = new.manifest.min_margin.values()
    return RecordOutcome(key=key, path=path, written=written, min_margin=min(margins) if margins else None,
                         note=note, fragile=tuple(fragile), excused=tuple(excused_lines),
                         routes_not_captured=coverage.routes_not_captured(new.manifest),
                         random_off=determinism.random_off_note(new.manifest.reference.random_off),
                         sensitivity=new.manifest.reference.sensitivity,
                         config=load_config(project.configs, model).path)
