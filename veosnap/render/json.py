"""One JSON document per command: checks (`passed`, `results`), a goldens diff, the support matrix.

Every tensor is listed (worst first) with where it sits in the model (`stage`, `group`, `layer`) and its
worst rows (for token tensors: batch row, position, token id); every MoE layer's route flips per expert
(`gained`, `lost`); a failed check its `next` command. Numbers that are not finite are `null`. A tensor
compared from a sketch says so: `estimate` holds the sentence the text report prints ("estimate from a
64-wide sketch (groups of 2 rows)"), null where the figure is exact; `sketch` is {width, group} or null
(a sketched tensor has no worst rows: its figure is per group of rows).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from ..golden import names
from ..numerics.compare import TensorResult
from ..numerics.isolation import IsolatedResult
from ..numerics.fmt import json_number
from ..reference.zoo import Where
from ..runs.diff import DiffReport, FieldChange, GoldenDiff
from ..runs.drift import DriftReport
from ..runs.matrix import Matrix
from ..runs.verdict import CheckReport
from .view import SHOWN_ISOLATED, drift_rows, estimate_note, isolation_lines, next_step, sketch_note, versions_note


def check_dict(report: CheckReport) -> dict:
    worst = report.worst
    return {
        "golden": report.golden,
        "model": report.model,
        "dtype": report.dtype,
        "backend": report.backend,
        "layout": report.layout,
        "passed": report.passed,
        "status": report.status,
        "error": report.error or None,
        "skipped": report.skipped or None,
        "worst": {"tensor": worst.name, "ratio": json_number(worst.ratio)} if worst else None,
        "structure": report.structure,
        "versions": [{"package": v.package, "golden": v.golden, "here": v.here} for v in report.versions],
        "not_compared": dict(sorted(report.absent.items())),
        "first_divergence": report.first_divergence,
        "first_gradient_divergence": report.first_gradient_divergence,
        "route_replay": report.route_replay,
        "routes": [
            {"layer": r.layer, "tokens": r.tokens, "clear_flips": r.clear_flips, "near_tie_flips": r.near_tie_flips,
             "passed": r.passed, "readable": not r.unreadable, "message": r.message(),
             "first_flipped_token": r.first_flipped_token, "gained": list(r.gained), "lost": list(r.lost)}
            for r in report.routes
        ],
        "notes": report.notes,
        "sensitivity": report.sensitivity,  # null: the golden is not certified
        # Low precision: each layer's parts checked in isolation; failing statistics and the closest passing ones.
        "isolated": {
            "checked": bool(report.isolated), "why_not": report.not_isolated or None,
            "lines": isolation_lines(report, shown=len(report.isolated)),
            "statistics": [isolated_dict(i) for i in _shown_isolated(report)],
        },
        "next": None if report.passed or report.skipped else next_step(report),
        "tensors": [tensor_dict(t) for t in report.ranked()],
    }


def _shown_isolated(report: CheckReport) -> list[IsolatedResult]:
    ranked = report.isolated_ranked()
    failing = [i for i in ranked if not i.passed]
    return failing + [i for i in ranked if i.passed][:SHOWN_ISOLATED]


def isolated_dict(i: IsolatedResult) -> dict:
    return {"place": i.place, "statistic": i.statistic, "error": json_number(i.error), "bound": i.bound,
            "ratio": json_number(i.ratio), "passed": i.passed, "tokens": i.rows}


def tensor_dict(t: TensorResult) -> dict:
    parsed = t.parsed
    return {
        "name": t.name, "error": json_number(t.error), "bound": t.bound, "noise": t.noise,
        "ratio": json_number(t.ratio), "passed": t.passed, "where": t.where, "problem": t.problem or None,
        "stage": parsed.stage, "group": parsed.group, "layer": parsed.layer, "rows_over": t.rows_over, "rows": t.rows,
        "worst_rows": [{"row": w.row, "error": json_number(w.error),
                        "ratio": json_number(w.error / t.bound if t.bound > 0 else float("inf")),
                        "batch": w.batch, "pos": w.pos, "token": w.token} for w in t.worst_rows],
        **_encoder_place(t.name),
        "estimate": sketch_note(t) or None, "sketch": {"width": t.width, "group": t.group} if t.sketched else None,
        "scale": json_number(t.scale) if t.scale is not None else None, "scale_bound": t.scale_bound,
    }


def _encoder_place(name: str) -> dict:
    """An encoder tensor's place: its encoder (`vision`, `audio`) and block (None: a merger or projection);
    nothing for the language model's tensors."""
    parsed = names.try_parse(name)
    if isinstance(parsed, names.EncoderOutput):
        return {"encoder": parsed.encoder, "block": parsed.block}
    if isinstance(parsed, names.Grad) and parsed.encoder is not None:
        return {"encoder": parsed.encoder}
    return {}


def checks(reports: list[CheckReport], where: Where | None = None) -> str:
    """`passed` and `results` (one entry per check); with `where`, `project`: the project's root (null: none
    found, veosnap's bundled zoo), its goldens directory and which directories are the bundled zoo's."""
    head = {} if where is None else {"project": {"root": None if where.root is None else str(where.root),
                                                 "goldens": str(where.goldens), "bundled": list(where.bundled)}}
    return json.dumps({**head, "passed": all(r.passed for r in reports), "versions_note": versions_note(reports) or None,
                       "results": [check_dict(r) for r in reports]}, indent=2)


def _fields(changes: list[FieldChange]) -> list[dict]:
    return [{"field": c.field, "old": c.old, "new": c.new} for c in changes]


def golden_diff_dict(d: GoldenDiff) -> dict:
    return {
        "key": str(d.key),
        "verdict": d.verdict,
        "material": d.material,
        "compared": d.compared,
        "tensors": [{"name": t.name, "ratio": json_number(t.ratio), "error": json_number(t.error), "bound": t.bound,
                     "problem": t.problem or None,
                     "estimate": estimate_note(t.width, t.group) if t.estimate else None} for t in d.ranked()],
        "tensors_added": d.tensors_added,
        "tensors_removed": d.tensors_removed,
        "routes": [{"layer": r.layer, "tokens": r.tokens, "flipped": r.flipped, "near_tie": r.near_tie,
                    "status": r.status} for r in d.routes],
        "route_layers": d.route_layers,
        "tolerance": [{"name": t.name, "old_bound": t.old_bound, "new_bound": t.new_bound,
                       "old_noise": t.old_noise, "new_noise": t.new_noise,
                       "old_scale_bound": json_number(t.old_scale_bound), "new_scale_bound": json_number(t.new_scale_bound)}
                      for t in d.tolerance],
        "tolerance_rule": _fields(d.tolerance_rule),
        "manifest": _fields(d.manifest),
        "provenance": _fields(d.provenance),
        "approvals": [dict(sorted(asdict(a).items())) for a in d.approvals],  # as the manifest stores them
        "trail": [{"change": c.kind, **dict(sorted(asdict(c.approval).items())),
                   "old": dict(sorted(asdict(c.old).items())) if c.old else None, "why": c.why or None}
                  for c in d.trail],
        "loosened": [{"name": t.name, "old_bound": t.old_bound, "new_bound": t.new_bound} for t in d.loosened],
        "absent": _fields(d.absent),
        "fields": [{"field": f.field, "where": f.where, "detail": f.detail} for f in d.fields],
        "material_fields": sorted(d.material_fields()),  # the schema paths (golden.schema) of every material change
        "why": d.why_material(),
    }


def diff(report: DiffReport) -> str:
    doc = {
        "base": report.base,
        "head": report.head,
        "material": report.material,
        "added": [str(k) for k in report.added],
        "removed": [str(k) for k in report.removed],
        "unchanged": [str(k) for k in report.unchanged],
        "stale": [{"key": str(k), "config_moved_in": str(by)} for k, by in report.stale],
        "changed": [golden_diff_dict(d) for d in report.changed],
    }
    return json.dumps(doc, indent=2)


def matrix_dict(m: Matrix) -> dict:
    return {
        "passed": m.passed,
        "counts": m.counts(),
        "seconds": round(m.seconds, 3),
        "columns": [{"backend": c.backend, "layout": c.layout} for c in m.columns],
        "rows": [{"model": r.model, "dtype": r.dtype} for r in m.rows],
        "unavailable": m.unavailable,
        "cells": [
            {"model": c.model, "dtype": c.dtype, "backend": c.backend, "layout": c.layout, "status": c.status,
             "worst_ratio": c.worst_ratio, "worst_tensor": c.worst_tensor or None, "reason": c.reason or None,
             "forward_only": c.forward_only, "notes": list(c.notes), "seconds": round(c.seconds, 3)}
            for c in m.cells
        ],
    }


def matrix(m: Matrix) -> str:
    """`passed`, `counts`, `columns`, `rows`, `cells` (one per check)."""
    return json.dumps(matrix_dict(m), indent=2)


def drift(report: DriftReport) -> str:
    """A drift report: the versions, then every golden's drift (status, worst tensor, first moved layer)."""
    return json.dumps({
        "versions": [{"package": v.package, "golden": v.golden, "here": v.here} for v in report.versions],
        "moved": len(report.moved),
        "goldens": [{**asdict(row), "ratio": json_number(d.worst.ratio) if d.worst else None}
                    for row, d in zip(drift_rows(report), report.drifts)],
    }, indent=2)
