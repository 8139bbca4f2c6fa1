"""Human-readable summary of one golden (`veosnap show`)."""

from __future__ import annotations

from .golden.codec import Golden
from .golden.manifest import json_object


def describe(g: Golden, full: bool = False) -> str:
    """The manifest's key facts, the approval trail, and the tensors (all of them with `full`)."""
    m = g.manifest
    lines = [
        f"golden      {m.key}",
        f"file        {g.path}",
        f"schema      {m.schema_version}",
        f"config      {m.config.get('model_type')} ({m.config_hash[:19]}...)",
        f"inputs      {json_object(m.reference.batch)} ({m.inputs_hash[:19]}...)",
        f"reference   attn={m.reference.attn_implementation} experts={m.reference.experts_implementation} "
        f"seed={m.reference.seed} noise run={m.reference.noise_run}",
        "provenance  " + ", ".join(f"{k}={v}" for k, v in sorted(json_object(m.provenance).items())),
        f"tolerance   bound = {m.alpha:g} x noise + {m.floor:g}; tie epsilon {m.tie_epsilon:g}",
        f"payload     {m.payload_hash}",
    ]
    if m.min_margin:
        lines.append("routers     min margin " + ", ".join(f"layer {k}: {v:.3g}" for k, v in sorted(m.min_margin.items())))
    for approval in m.approvals:
        lines.append(f"approved    {approval.reason!r} (replaced {approval.previous_payload_hash})")
    names = sorted(g.tensors)
    lines.append(f"tensors     {len(names)}")
    shown = names if full else [n for n in names if not n.startswith(("grad.", "update."))]
    for name in shown:
        t = g.tensors[name]
        tol = m.tolerance.get(name)
        tol_text = f"noise {tol.noise:.3g} bound {tol.bound:.3g}" if tol else ""
        lines.append(f"  {name:55s} {str(t.dtype).removeprefix('torch.'):9s} {str(list(t.shape)):16s} {tol_text}")
    if not full:
        lines.append(f"  ... {len(names) - len(shown)} gradients or updates (--full lists them)")
    return "\n".join(lines)
