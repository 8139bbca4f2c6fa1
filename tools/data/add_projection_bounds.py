"""Give committed low-precision goldens their gradients' projection bounds, in place, and certify them again.

A golden recorded before `numerics.projection` holds no projection bound for its whole gradients, so a check
judges them by row error alone (a 10% scaled gradient passes a bfloat16 one). A refresh adds the bounds but
re-records the tensors; on another CPU of the class than the one that recorded them that churns every
tensor. This script keeps the tensors: it runs the golden's float64 twin here (the same weights, from the
golden's seed, and the same batch, as `record.build_golden` does) and its legitimate variants
(`record.PROJECTION_VARIANTS`), measures each whole gradient's projection noise of the stored gradient,
stores the bounds and plants the canaries again (what the golden catches changed). No approval is appended
(the commit is the review). Train goldens hold updates, not gradients: left as they are. `--again`
measures goldens that have their bounds already.

    python tools/data/add_projection_bounds.py goldens/cpu/*/step-bfloat16*.zst
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from veosnap.errors import VeosnapError
from veosnap.golden import names, store
from veosnap.numerics import projection
from veosnap.reference import hardware, inputs, models
from veosnap.reference.capture import run_step
from veosnap.reference.determinism import deterministic
from veosnap.reference.zoo import Project
from veosnap.runs import record
from veosnap.runs.canaries import sensitivity_note


def calibration(project: Project, golden) -> tuple[dict, list[dict]]:  # noqa: ANN001 - a Golden
    """The golden's float64 twin's gradients and its legitimate variants' (`record.variant_gradients`), run here
    on its weights (from its seed) and batch, as `record.build_golden` runs them."""
    key = golden.manifest.key
    toy, scenario, batch, _ = record._admitted(project, key)
    with deterministic():
        torch.manual_seed(golden.manifest.reference.seed)
        model = scenario.freeze(models.build(toy, models.dtype_from_name(key.dtype),
                                             hardware.device_for(key.hardware_class), golden.manifest.reference.seed))
        batch = inputs.with_rope_positions(batch, model)
        high = scenario.freeze(models.upcast_copy(model, toy, torch.float64))
        variants = record.variant_gradients(model, batch)
        del model
        with models.KeepFloat64():
            truth = run_step(high, batch, own_loss=True)
    exact = {name: value.cpu() for name, value in truth.all_tensors().items()
             if isinstance(names.parse(name), names.Grad)}
    variants = [{name: value.cpu() for name, value in v.items()} for v in variants]
    return exact, variants


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--again", action="store_true", help="measure goldens that have their bounds already")
    args = parser.parse_args()
    project = Project.resolve()
    refused = 0
    for path in args.paths:
        golden = store.read(path, root=project.goldens)
        m = golden.manifest
        grads = [n for n in m.tolerance if isinstance(names.parse(n), names.Grad) and n in golden.tensors]
        if m.key.dtype not in projection.LOW_PRECISION or not grads:
            print(f"skipped   {path}  (no whole low-precision gradients)")
            continue
        if all(m.tolerance[n].scale_bound is not None for n in grads) and not args.again:
            print(f"unchanged {path}  (has its projection bounds)")
            continue
        exact, variants = calibration(project, golden)
        noises = record.projection_noises({n: golden.tensors[n] for n in grads}, exact, variants)
        for name in grads:
            m.tolerance[name] = projection.with_projection(m.tolerance[name], noises[name])
        try:
            record.certified(project, golden)
        except VeosnapError as exc:
            print(f"veosnap: error: {exc} (its projection bounds are not written either)", file=sys.stderr)
            refused += 1
            continue
        store.write_bytes(record.encode_checked(golden, path), path, project.goldens)
        print(f"bounded   {path}  {len(grads)} projection bounds; {sensitivity_note(golden.manifest.reference.sensitivity)}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
