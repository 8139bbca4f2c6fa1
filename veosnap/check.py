"""Check a candidate (a backend applied to the reference model) against its golden."""

from __future__ import annotations

import traceback

import torch

from .reference import hardware, models, train
from .backends import Backend, Candidate, Unsupported
from .reference.capture import run_step
from .compare import compare
from .runs.verdict import CheckReport
from .errors import GoldenError, MissingGoldenError, VeosnapError
from .golden import store
from .golden.codec import Golden
from .golden.key import GoldenKey
from .reference.inputs import Batch
from .reference.determinism import deterministic
from .reference.probes import replay_routes
from .reference.zoo import Project, ToyConfig, load_config


def load_golden(project: Project, key: GoldenKey) -> Golden:
    """The golden for `key`, validated; a clear error when it (or its whole hardware class) is missing."""
    path = store.path_for(project.goldens, key)
    if not path.is_file():
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


def cross_class_notes(key: GoldenKey) -> list[str]:
    """The report note for a cross-class check (none for a same-class one)."""
    here = hardware.detect()
    if key.hardware_class == here:
        return []
    return [f"cross-class: a {key.hardware_class} golden checked on {here}; ratios measure how far the classes are apart"]


def check(project: Project, key: GoldenKey, backend: Backend, device: torch.device | None = None,
          cross_class: bool = False, gold: Golden | None = None) -> CheckReport:
    """Build the reference model for `key`, apply `backend`, run the golden's batch, compare.

    `gold` is the golden for `key` when the caller has already read it (the pytest plugin does).
    Bad goldens and configs raise `VeosnapError`; a backend that raises is reported as an error in
    the returned report so other checks can still run. Goldens of another hardware class than this
    machine's are refused unless `cross_class`, which measures how far the two classes are apart.
    """
    gold, toy = load_checked(project, key, cross_class, gold)
    device = device or hardware.device_for(hardware.detect())
    # Fixed threads and deterministic algorithms: checking twice gives the same report, even for
    # kernels whose reductions otherwise vary from run to run (batched_mm on CPU does).
    with deterministic():
        report = _run_candidate(gold, toy, key, backend, device)
    report.notes[:0] = cross_class_notes(key)
    return report


def _run_candidate(gold: Golden, toy: ToyConfig, key: GoldenKey, backend: Backend, device: torch.device) -> CheckReport:
    fields = {"backend": backend.spec}
    try:
        model = models.build(toy, models.dtype_from_name(key.dtype), device, gold.manifest.reference.seed)
        with backend.prepare(model) as candidate:
            report = _run_and_compare(gold, candidate, fields)
    except VeosnapError:
        raise
    except Unsupported as exc:
        return CheckReport(golden=str(key), model=key.model, dtype=key.dtype, skipped=str(exc), **fields)
    except Exception as exc:  # noqa: BLE001 - the candidate's own failure is a result, not a crash
        return CheckReport(golden=str(key), model=key.model, dtype=key.dtype, error=describe_failure(exc), **fields)
    return report


def _run_and_compare(gold: Golden, candidate: Candidate, fields: dict[str, str]) -> CheckReport:
    """Run the candidate on the golden's batch and compare; routes differ: again under route replay."""
    if gold.key.scenario == train.SCENARIO:
        return _train_and_compare(gold, candidate, fields)
    backward = not candidate.forward_only
    capture = run_step(candidate.model, Batch.from_golden(gold), backward=backward)
    report = compare(gold, capture, **fields)
    if not report.routes_passed:
        with replay_routes(candidate.model, gold.experts()):
            replayed = run_step(candidate.model, Batch.from_golden(gold), backward=backward)
        report = compare(gold, capture, replayed=replayed, **fields)
    if candidate.forward_only:
        unchecked = sum(name.startswith("grad.") for name in gold.compared_names())
        report.notes.append(f"forward only ({candidate.forward_only}): loss, logits, layer outputs and routes "
                            f"checked; {unchecked} gradients not checked")
    return report


def _train_and_compare(gold: Golden, candidate: Candidate, fields: dict[str, str]) -> CheckReport:
    """The golden's optimizer steps on the candidate; compared as a step is (routes first)."""
    if candidate.forward_only:
        raise Unsupported(f"runs forward only here ({candidate.forward_only}); the train scenario needs gradients")
    hyper = gold.manifest.reference.train
    report = compare(gold, train.run_train(candidate.model, Batch.from_golden(gold), hyper).capture, **fields)
    if not report.routes_passed:
        # Only the first step's routes are recorded, so later steps cannot be replayed onto the golden's.
        report.notes.append("routes differ in the first step: updates are compared without route replay")
    return report


def describe_failure(exc: BaseException) -> str:
    """A candidate's exception in one line, with where it was raised."""
    return (f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__])[0] + _origin(exc)


def _origin(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
