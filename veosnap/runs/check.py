"""The one check orchestrator: a candidate (a backend under one or more layouts) against its golden.

The CLI, the support matrix and the pytest plugin all call `check_layouts` (or `check`, for one
layout). For one golden it: reads and validates the golden and the config the candidate is built from,
and refuses, before any number, a golden that does not cover what the model produces (`coverage`) or
whose batch or config veosnap cannot run (`limits`); asks each layout whether it applies (a decline is a
skipped report); runs the in-process layouts here, deterministically, guarded (`candidates.guard`: an
exit or an overrun is the candidate's ERROR) and restored after (`candidates.pristine`), and every
multi-process one in ONE torchrun; then judges each result against the golden (routes first, tensors
under route replay when routes differ) and says what a report must say (forward-only candidates, the
train scenario's routes, a cross-class check, routers the golden has no routes for, patches a candidate
left behind), and the selection a command it advises must carry to run as printed.

Bad goldens, configs and SPECs raise `VeosnapError`; a candidate that raises, exits or hangs is an ERROR
report and a backend or layout that declines a skipped one, so the other checks still run.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..candidates import backends, guard, pristine
from ..candidates.backends import Backend
from ..candidates.layouts import engine, registry, torchrun
from ..candidates.layouts.engine import LayoutResult
from ..candidates.layouts.protocol import Layout, LayoutContext
from ..errors import GoldenError, Unsupported, VeosnapError, describe
from ..golden import background, names, store
from ..golden.background import PendingGolden, errors_after
from ..golden.codec import Golden
from ..golden.key import GoldenKey
from ..golden.manifest import Excuse, rerecord
from ..numerics import fmt, projection
from ..numerics.compare import TensorResult, compare_route_sets, compare_tensors, same_route_tokens, structure_changes
from ..numerics.isolation import judge_parts
from ..reference import coverage, determinism, hardware, limits, models, scenarios
from ..reference.capture import Capture
from ..reference.determinism import deterministic, one_thread
from ..reference.inputs import Batch
from ..reference.prebuild import Plan, Prebuild
from ..reference.scenarios import Scenario
from ..reference.zoo import Project, ToyConfig, load_checked, load_config
from . import letgo
from .verdict import CheckReport, VersionDrift

DEFAULT_TIMEOUT_S = torchrun.DEFAULT_TIMEOUT_S
DEFAULT_NPROC = 2


def check(project: Project, key: GoldenKey, backend: Backend, layout: str = "single", *, nproc: int = DEFAULT_NPROC,
          timeout_s: float = DEFAULT_TIMEOUT_S, cross_class: bool = False, gold: Golden | None = None,
          isolate: bool = False) -> CheckReport:
    """Check `backend` under one `layout` (a SPEC) against the golden for `key`; see `check_layouts`."""
    return check_layouts(project, key, backend, [layout], nproc=nproc, timeout_s=timeout_s,
                         cross_class=cross_class, gold=gold, isolate=isolate)[0]


def check_layouts(project: Project, key: GoldenKey, backend: Backend, layouts: Sequence[str] = ("single",), *,
                  nproc: int = DEFAULT_NPROC, timeout_s: float = DEFAULT_TIMEOUT_S, cross_class: bool = False,
                  gold: Golden | None = None, isolate: bool = False) -> list[CheckReport]:
    """Check `backend` under each of `layouts` (SPECs) against the golden for `key`: one report each, in order.

    Multi-process layouts share one torchrun of `nproc` ranks, ended after `timeout_s` seconds. `gold` is
    the golden for `key` when the caller has already read it (the pytest plugin does). Goldens of another
    hardware class than this machine's are refused unless `cross_class`, which measures the gap. `isolate`: a
    low-precision real-shape golden's layers are checked in isolation too (toy goldens' always are), at the cost
    of the reference's forward and a float64 copy's beside the candidate's.
    """
    with collector_paused():
        return _check_layouts(project, key, backend, layouts, nproc, timeout_s, cross_class, gold, isolate)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off within, as it was after. A check allocates tens of thousands of
    objects, nearly all freed by their reference counts, and the collector's scans of them cost a 12-layer 1B
    check 2-3 ms on the H200 (a dozen young collections); what survives in cycles waits for the next collection
    after the check."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _check_layouts(project: Project, key: GoldenKey, backend: Backend, layouts: Sequence[str], nproc: int,
                   timeout_s: float, cross_class: bool, gold: Golden | None, isolate: bool) -> list[CheckReport]:
    timeout_s = guard.check_timeout(timeout_s)
    chosen = [(spec, registry.resolve(spec)) for spec in layouts]
    scenario = scenarios.get(key.scenario)
    config = load_config(project.configs, key.model)
    try:
        scenario.accept(config.config)
    except Unsupported as exc:  # a scenario the model cannot run (no encoder for it) is a skip, not an error
        return [CheckReport(golden=str(key), model=key.model, dtype=key.dtype, backend=backend.spec, layout=spec,
                            skipped=str(exc)) for spec, _ in chosen]
    # The model is built on a thread from now on (reference.prebuild), while the golden is read and the
    # setup below refuses what it must, as before: at scale the build takes seconds, the rest milliseconds.
    prebuilt = _prebuild(project, key, config, chosen, backend, gold, cross_class)
    if prebuilt is not None:
        prebuilt.begun()
        letgo.let_go()  # the last check's golden, freed while this check's weights are drawn
    else:
        letgo.let_go()
        # The meta-device skeleton the limits and coverage need is built on a thread while the golden is read
        # (its errors, if any, come where the limits ask for it, after the golden's own). Beside a prebuild it
        # would only hold up the build's construction (they take turns: `models._CONSTRUCTING`).
        limits.prefetch_skeleton(config)
    golden: Golden | None = None
    try:
        # The golden's manifest and batch are read now; its other tensors are decoded on a thread while the
        # model is built and the candidate runs (golden.background, started after the setup below): the first
        # use of them waits for it.
        with one_thread():  # a golden's tensors are small: a thread pool would cost more than the work
            golden, toy = load_checked(project, key, cross_class, gold, background=True)
        with errors_after(golden):  # a golden still decoding: its own error, if any, comes first
            return _check_loaded(project, key, backend, chosen, golden, toy, nproc, timeout_s, cross_class, scenario,
                                 prebuilt, isolate)
    finally:
        if prebuilt is not None:
            prebuilt.cancel()
        if golden is not None:
            letgo.hold(golden)  # freeing it here was most of the check's last milliseconds (runs.letgo)


def _prebuild(project: Project, key: GoldenKey, toy: ToyConfig, chosen: list[tuple[str, Layout]], backend: Backend,
              gold: Golden | None, cross_class: bool) -> Prebuild | None:
    """The model of the check's first in-process layout, built on a thread from the seed and batch the golden
    declares, once the limits allow it (see `reference.prebuild`); None when no layout here would take it."""
    local = [layout for _, layout in chosen if not layout.distributed]
    if not local or (type(local[0]).load is not Layout.load and not backend.parallelizes):
        return None  # torchrun ranks build their own; a layout loading its own model would not take it
    device = hardware.device_for(hardware.detect())
    path = store.path_for(project.goldens, key.recorded)

    def plan() -> Plan | None:
        if key.hardware_class != hardware.detect() and not cross_class:
            return None  # refused as soon as the golden is read
        if gold is not None:
            batch = Batch.from_golden(gold)
            seed, config_hash, tokens = gold.manifest.reference.seed, gold.manifest.config_hash, batch.rows * batch.width
        else:
            peeked = background.peek(path, project.goldens)
            if peeked is None:
                return None
            seed, config_hash, tokens = peeked.seed, peeked.config_hash, peeked.tokens
        if config_hash != toy.hash:
            return None  # likewise
        limits.check_layers(toy)  # before anything is constructed

        def vet(model: nn.Module) -> Vetted:  # the limits on the model as constructed, before its weights are drawn
            parameters = limits.check_config(toy, model)
            limits.check_memory(toy, parameters, tokens, models.dtype_from_name(key.dtype), device, recording=False)
            return Vetted(parameters, weakref.ref(model))

        return seed, vet

    return Prebuild(toy, key.dtype, device, plan)


@dataclass(frozen=True)
class Vetted:
    """What a check's prebuild found on the model it constructed, its limits passed: the parameter count the
    check's own limits need, and that model, while the build holds it, for what it produces (the coverage).

    The coverage is no limit: it is found on the check's thread while the weights are drawn, not in the vetting,
    which is on the build's path (3 of the vetting's 4.8 ms on the CPU at llama-1b-12l's structure)."""

    parameters: int
    model: weakref.ref[nn.Module]

    def produces(self) -> coverage.Produces | None:
        """What the constructed model produces (its parameters' names and flags, its layers and routers: its
        structure, which the draw and the copy to the device leave as they are); None once the build dropped it."""
        model = self.model()
        return None if model is None else coverage.produces(model)


def _vetted(prebuilt: Prebuild | None, toy: ToyConfig) -> Vetted | None:
    """The prebuild's facts when it vetted this very config; else None (the check finds them itself, on a
    meta-device skeleton, and meets whatever the prebuild met, in its turn)."""
    if prebuilt is None or prebuilt.toy.hash != toy.hash:
        return None
    found = prebuilt.vetted()
    return found if isinstance(found, Vetted) else None


def _check_loaded(project: Project, key: GoldenKey, backend: Backend, chosen: list[tuple[str, Layout]],
                  golden: Golden, toy: ToyConfig, nproc: int, timeout_s: float,
                  cross_class: bool, scenario: Scenario, prebuilt: Prebuild | None = None,
                  isolate: bool = False) -> list[CheckReport]:
    """`check_layouts` once its golden and config are read."""
    batch = Batch.from_golden(golden)
    # Beside a build, the facts of the model it constructed: a skeleton built here would be Python beside the
    # build's draw, 25 ms of it at 12 layers of Llama-3.2-1B, all of it stretching the build (the GIL).
    vetted = _vetted(prebuilt, toy)
    parameters = vetted.parameters if vetted is not None else limits.check_config(toy)
    limits.check_batch(golden, toy)
    device = hardware.device_for(hardware.detect())
    limits.check_memory(toy, parameters, batch.rows * batch.width, models.dtype_from_name(key.dtype), device,
                        recording=False, width=batch.width)
    coverage.require(golden, toy, vetted.produces() if vetted is not None else None)
    random_off = models.random_off(toy)
    if (golden.manifest.reference.random_off or {}) != random_off:
        raise GoldenError(golden.path, f"its reference ran with its config's randomness on ("
                          f"{', '.join(f'{k} {v:g}' for k, v in random_off.items())}), so its bounds measure that "
                          "noise; re-record it (veosnap runs every model without it now)" if random_off else
                          "declares random settings its config does not have (reference.random_off)")
    family = models.modeling_module(toy)
    if isinstance(golden, PendingGolden):
        # Decode its tensors now, while the model is built: started earlier, the decode's Python parse took
        # the GIL from the setup above (the skeleton thread the limits wait for).
        golden.start()
    # The first in-process run's reducer and the golden's tensors on its device, made while the model is built.
    staged = engine.Staged(golden, batch.token_mask, device) if any(not layout.distributed for _, layout in chosen) \
        else None
    # What every report carries besides its run's results, known now: made while the model is built, not after
    # the run (the project's flags alone stat its directories, a millisecond).
    flags, portable, drift = project.flags(), backends.portable(backend.spec) or "", version_drift(golden)
    head_notes = cross_class_notes(key) + routes_not_captured_notes(golden) + excused_notes(golden, backend.spec) \
        + [n for n in [determinism.random_off_note(random_off), unprojected_note(golden)] if n]
    reports: dict[int, CheckReport] = {}
    spawned: list[int] = []
    for index, (spec, layout) in enumerate(chosen):
        fields = {"backend": backend.spec, "layout": spec}
        try:
            with guard.running():  # the layout's own code: it may not end the process
                layout.accept(golden, nproc)
        except Unsupported as exc:
            reports[index] = _report(golden, fields, skipped=str(exc))
            continue
        except guard.CandidateError as exc:
            reports[index] = _report(golden, fields, error=str(exc))
            continue
        if layout.distributed:
            spawned.append(index)
        else:
            reports[index] = _in_process(golden, batch, toy, backend, layout, fields, timeout_s, family, scenario,
                                         prebuilt, staged, isolate)
            staged = None  # made once, for the first
    if isinstance(golden, PendingGolden):
        # A corrupt golden is refused even when no layout ran (all declined, or the candidate failed first).
        golden = golden.result()
    if spawned:
        _check_nproc(batch, nproc)
        for index in spawned:
            registry.check_reachable(chosen[index][0])
        outcomes = torchrun.run(project, key, backend.spec, [chosen[index][0] for index in spawned], nproc, timeout_s,
                                isolate)
        for index, outcome in zip(spawned, outcomes):
            fields = {"backend": backend.spec, "layout": chosen[index][0]}
            if outcome.result is None:
                reports[index] = _report(golden, fields, skipped=outcome.skipped, error=outcome.error)
                continue
            with one_thread():
                reports[index] = judge(golden, batch, outcome.result, fields, scenario)
    ordered = [reports[index] for index in range(len(chosen))]
    selection = [*flags, *(["--scenario", key.scenario] if key.scenario != "step" else []),
                 *(["--cross-class"] if cross_class else []), *(["--isolate"] if isolate else []),
                 *(["--nproc", str(nproc)] if spawned and nproc != DEFAULT_NPROC else []),
                 *(["--timeout", f"{timeout_s:g}"] if timeout_s != DEFAULT_TIMEOUT_S else [])]  # every layout
    for report in ordered:
        if not cross_class:
            refuse_passing_excuse(golden, report)
        report.notes[:0] = list(head_notes)
        report.selection = list(selection)
        report.portable_backend = portable if portable != backend.spec else ""
        report.versions = drift
        report.sensitivity = golden.manifest.reference.sensitivity
    return ordered


def version_drift(golden: Golden) -> list[VersionDrift]:
    """The packages (torch, transformers) whose version here differs from the golden's provenance."""
    import transformers

    here = {"torch": torch.__version__, "transformers": transformers.__version__}
    recorded = golden.manifest.provenance
    return [VersionDrift(package, getattr(recorded, package), version) for package, version in here.items()
            if getattr(recorded, package) != version]


def _in_process(golden: Golden, batch: Batch, toy: ToyConfig, backend: Backend, layout: Layout,
                fields: dict[str, str], timeout_s: float, family: str, scenario: Scenario,
                prebuilt: Prebuild | None = None, staged: engine.Staged | None = None,
                isolate: bool = False) -> CheckReport:
    """Run a layout here, on this machine's device, guarded and restored; its failure or decline becomes
    its report, and patches it left behind a note on it."""
    ctx = LayoutContext.checking(golden, toy, hardware.device_for(hardware.detect()), scenario, prebuilt=prebuilt,
                                 isolate_real=isolate)
    header = f"ERROR  {golden.key}  backend={fields['backend']}  layout={fields['layout']}"
    # A prebuild patched transformers only while it constructed the model, which `check_layouts` waited for: the
    # modeling code is snapshot and the guard set up while its weights are drawn, and the guard waits for the
    # model before the candidate's time starts (the guard's entry took 2-8 ms after the build at llama-1b-12l on the H200).
    with pristine.kept(family, candidate=fields["backend"]) as left:
        try:
            # Fixed threads and deterministic algorithms: checking twice gives the same report, even for
            # kernels whose reductions otherwise vary from run to run (batched_mm on CPU does). Set after the
            # build: its draw runs on torch's CPU threads.
            with guard.running(header, timeout_s, ready=prebuilt.wait if prebuilt is not None else None), \
                    deterministic():
                result = engine.run(layout, backend, ctx, staged)
        except VeosnapError:
            raise
        except Unsupported as exc:
            report = _report(golden, fields, skipped=str(exc))
        except guard.CandidateError as exc:
            report = _report(golden, fields, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the candidate's own failure is a result, not a crash
            report = _report(golden, fields, error=describe(exc))
        else:
            report = None
    if report is None:
        with one_thread():  # comparing is many small ops: a thread pool would cost more than the work
            report = judge(golden, batch, result, fields, scenario)
    if left.tainted:  # another candidate's thread changed the reference: this run says nothing of this one
        report = _report(golden, fields, error=left.tainted)
    report.notes.extend(left.notes())
    return report


def judge(golden: Golden, batch: Batch, result: LayoutResult, fields: dict[str, str],
          scenario: Scenario | None = None) -> CheckReport:
    """A layout's result against its golden (for `scenario`, when it is not the golden's own), with the notes
    its report must carry."""
    frozen = scenario.frozen if scenario is not None else ()
    report = compare(golden, batch, result.capture, result.replayed, frozen=frozen, device=result.device,
                     golden_on=result.golden_on, **fields)
    if scenario is not None and scenario.name != golden.key.scenario:
        report.notes.append(f"scenario {scenario.name}: the {' and '.join(frozen) or 'same'} encoder frozen, checked "
                            f"against the {golden.key.scenario} golden without its gradients")
    report.notes.extend(result.notes)
    if result.isolated is not None:
        reference, candidate = result.isolated
        report.isolated = judge_parts(candidate.outputs, reference.own.outputs, reference.exact.outputs,
                                      batch.token_mask, batch.position_ids, golden.experts(), reference.heads,
                                      reference.experts, candidate.filled)
        missing = list(dict.fromkeys(reference.own.missing))
        report.not_isolated = f"not isolated: {'; '.join(missing)}" if missing else ""
    elif result.not_isolated != "float32":
        report.not_isolated = result.not_isolated
    for reason, which in _by_reason(report.absent).items():
        report.notes.append(f"{', '.join(which)}: {reason}; not compared")
    if golden.key.scenario == "train" and not report.routes_passed:
        # Only the first step's routes are recorded, so later steps cannot be replayed onto the golden's.
        report.notes.append("routes differ in the first step: updates are compared without route replay")
    if result.forward_only:
        unchecked = sum(isinstance(names.parse(name), names.Grad) for name in golden.compared_names())
        report.notes.append(f"forward only ({result.forward_only}): loss, logits, layer outputs and routes "
                            f"checked; {unchecked} gradients not checked")
    return report


def compare(golden: Golden, batch: Batch, capture: Capture, replayed: Capture | None = None,
            frozen: tuple[str, ...] = (), device: torch.device | None = None,
            golden_on: dict[str, torch.Tensor] | None = None, **report_fields: str) -> CheckReport:
    """Routes first; then every tensor. With `replayed` (the candidate re-run on the golden's routes),
    tensors downstream of routing are judged from the replayed run so a kernel error is never mistaken
    for a routing flip, or the other way round. The gradients of the `frozen` encoders' parameters are not
    compared, and a candidate that produced one fails on it. Whole tensors are compared on `device` (the
    candidate's; None: the host), `golden_on` the golden's tensors already there."""
    tokens = batch.tokens()
    unreadable = _unreadable(capture.absent)
    routes = compare_route_sets(golden, capture.experts(), tokens, unreadable)
    source = replayed if replayed is not None else capture
    absent = {**capture.absent, **source.absent}
    produced = source.all_tensors()
    skip = frozen_gradients(golden.compared_names(), frozen)
    tensors = compare_tensors(golden, produced, tokens, gradients=source.backward,
                              same_routes=same_route_tokens(golden, source.experts()), sketches=source.sketches,
                              absent=absent, skip=skip, device=device, golden_on=golden_on)
    tensors += frozen_gradients_produced(golden, produced, frozen)
    # Parameters the golden holds as sketches are not in `tensors` on either side: a missing or extra
    # one still fails, as the tensor comparison's "missing from the candidate". A frozen encoder's
    # parameters have no gradient on purpose: not a structure change.
    present = {**source.tensors, **{name: golden.tensors[name] for name in skip if name in golden.tensors}}
    structure = structure_changes(golden, present, {*capture.routes, *unreadable}, parameters=source.backward)
    return CheckReport(golden=str(golden.key), model=golden.key.model, dtype=golden.key.dtype, tensors=tensors,
                       routes=routes, route_replay=replayed is not None, absent=absent, structure=structure,
                       **report_fields)


def _unreadable(absent: dict[str, str]) -> dict[int, str]:
    """MoE layers whose routes the candidate could not give, and why."""
    return {parsed.layer: why for name, why in absent.items()
            if isinstance(parsed := names.try_parse(name), names.Route) and parsed.part == "experts"}


def _by_reason(absent: dict[str, str]) -> dict[str, list[str]]:
    """Absent tensors other than routes (their route line says it), grouped by why."""
    grouped: dict[str, list[str]] = {}
    for name, why in sorted(absent.items()):
        if not isinstance(names.try_parse(name), names.Route):
            grouped.setdefault(why, []).append(name)
    return grouped


def frozen_gradients(names_: list[str], frozen: tuple[str, ...]) -> set[str]:
    """The gradient names among `names_` of parameters inside the `frozen` encoders."""
    return {name for name in names_ if isinstance(parsed := names.try_parse(name), names.Grad)
            and parsed.encoder in frozen}


def frozen_gradients_produced(golden: Golden, produced: dict, frozen: tuple[str, ...]) -> list[TensorResult]:
    """A failed result for each gradient the candidate produced for a frozen encoder's parameter."""
    results = []
    for name in sorted(frozen_gradients(list(produced), frozen)):
        tol = golden.manifest.tolerance.get(name)
        results.append(TensorResult(name, float("inf"), tol.bound if tol else 1.0, tol.noise if tol else 0.0,
                                    problem=f"a gradient for a frozen parameter (the scenario freezes the "
                                            f"{names.parse(name).encoder} encoder: it must not train)"))
    return results


def cross_class_notes(key: GoldenKey) -> list[str]:
    """The report note for a cross-class check (none for a same-class one)."""
    here = hardware.detect()
    if key.hardware_class == here:
        return []
    return [f"cross-class: a {key.hardware_class} golden checked on {here}; ratios measure how far the classes are apart"]


def unprojected_note(golden: Golden) -> str:
    """The report note for a low-precision golden whose whole gradients hold no projection bound (recorded
    before `numerics.projection`): they are judged by row error alone, which a 1% scale passes."""
    m = golden.manifest
    if m.key.dtype not in projection.LOW_PRECISION:
        return ""
    bare = [n for n, t in m.tolerance.items() if t.scale_bound is None and n in golden.tensors
            and isinstance(names.try_parse(n), names.Grad)]
    if not bare:
        return ""
    return (f"{len(bare)} gradient(s) judged by row error alone: this golden was recorded before projection bounds "
            f"(a {m.key.dtype} gradient 1% off passes row error); refresh it to add them")


def routes_not_captured_notes(golden: Golden) -> list[str]:
    """The report note for a golden whose routers veosnap could not read (none when it read them all)."""
    unread = coverage.routes_not_captured(golden.manifest)
    return [f"{unread}: routing is not compared, a routing bug shows only in the outputs"] if unread else []


def excused_notes(golden: Golden, spec: str) -> list[str]:
    """The report note for each variant of the recorder's fragility check that `spec` runs (alone or joined
    with `+`) and that the golden was recorded despite (`veosnap record --excuse`): the check still fails,
    and says it was known."""
    parts = {part.strip() for part in spec.split("+")}
    notes = []
    for variant, excuse in sorted(golden.manifest.excused.items()):
        if variant in parts:
            notes.append(f"{variant} fails this golden, known at record time: {excuse.reason} (then: "
                         f"{excuse_figures(excuse)})")
    return notes


def refuse_passing_excuse(golden: Golden, report: CheckReport) -> None:
    """An excuse is only for a variant that fails the golden (`record --excuse` refuses one for a variant that
    passes): a check of the excused variant itself, as the recorder ran it (alone, single layout), that passes
    shows the excuse stale or forged, and is an error naming it, not a pass."""
    excuse = golden.manifest.excused.get(report.backend)
    if excuse is None or report.layout != "single" or report.skipped or not report.passed:
        return
    report.error = (f"the golden excuses {report.backend} ({excuse.reason!r}, then {excuse_figures(excuse)}), but "
                    f"{report.backend} passes it: the excuse is stale or forged, and an excuse is only for a variant "
                    f"that fails; {rerecord(golden.key)}")


def excuse_figures(excuse: Excuse) -> str:
    """What the excused variant failed by when the golden was recorded: its worst tensor and ratio."""
    return f"{excuse.tensor} {fmt.times(excuse.ratio)}" if excuse.ratio is not None else excuse.tensor


def _report(golden: Golden, fields: dict[str, str], **outcome: str) -> CheckReport:
    return CheckReport(golden=str(golden.key), model=golden.key.model, dtype=golden.key.dtype, **fields, **outcome)


def _check_nproc(batch: Batch, nproc: int) -> None:
    if nproc < 2:
        raise VeosnapError(f"--nproc {nproc}: multi-process layouts need at least 2 processes")
    if nproc > batch.rows:
        raise VeosnapError(f"--nproc {nproc}: the golden's batch has {batch.rows} rows, one at least per rank")
    if hardware.device_for(hardware.detect()).type == "cuda" and nproc > torch.cuda.device_count():
        raise VeosnapError(f"--nproc {nproc}: only {torch.cuda.device_count()} GPU(s) visible")
