"""Compare a candidate's capture with a golden: routes first, then loss, logits, layers, gradients."""

from __future__ import annotations

from .golden.codec import Golden
from .numerics.compare import compare_route_sets, compare_tensors, same_route_tokens
from .reference.capture import Capture
from .reference.inputs import Batch
from .runs.verdict import CheckReport


def compare(golden: Golden, capture: Capture, replayed: Capture | None = None, **report_fields: str) -> CheckReport:
    """Routes first; then every tensor. With `replayed` (the candidate re-run on the golden's routes),
    tensors downstream of routing are judged from the replayed run so a kernel error is never mistaken
    for a routing flip, or the other way round."""
    tokens = Batch.from_golden(golden).tokens()
    routes = compare_route_sets(golden, capture.experts(), tokens)
    source = replayed if replayed is not None else capture
    tensors = compare_tensors(golden, source.all_tensors(), tokens, gradients=source.backward,
                              same_routes=same_route_tokens(golden, source.experts()))
    return CheckReport(golden=str(golden.key), model=golden.key.model, dtype=golden.key.dtype, tensors=tensors,
                       routes=routes, route_replay=replayed is not None, **report_fields)
