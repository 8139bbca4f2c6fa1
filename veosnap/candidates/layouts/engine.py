"""Run any layout on one rank (or in process): the part of a layout check every layout shares.

`run` loads the model as the layout says, applies the backend (its patches stay until the run is
done), sets the candidate up, and runs one step (or the train scenario's steps) of the layout's passes.
Each pass's loss is weighted by its share of the golden's predictions, and by the data group's size to
undo a reducer's averaging, so the reduced gradient is exactly the full-batch mean gradient. When any
real token went to other experts than the golden's, the step runs again forced onto the golden's
experts (route replay). Rank 0 then holds a `LayoutResult` shaped like the golden's capture:
`assemble` puts every rank's token outputs (logits, layer outputs, routes) back at their positions in
the golden's batch, and takes the full gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ...errors import Unsupported
from ...golden import names
from ...numerics.routes import flips
from ...reference import train
from ...reference.capture import Capture, Part, auxiliary_loss, forward_backward, gradients
from ...reference.inputs import Batch, Media
from ...reference.probes import RouteRecord
from ..backends import Backend
from .protocol import Layout, LayoutContext, Setup


@dataclass
class LayoutResult:
    """What a layout's run produced, shaped like the golden's capture (rank 0 only)."""

    capture: Capture
    replayed: Capture | None = None  # the run forced onto the golden's routes, when routes differed
    notes: list[str] = field(default_factory=list)
    forward_only: str = ""  # why gradients were not checked ('' when they were)


class LayoutError(RuntimeError):
    """A layout's passes do not cover the golden's batch (a bug in the layout)."""


def run(layout: Layout, backend: Backend, ctx: LayoutContext) -> LayoutResult | None:
    """Run `layout` with `backend` on this rank; the result on rank 0, None on the others."""
    model = layout.load(ctx)
    with backend.prepare(model) as candidate:
        why = candidate.forward_only
        if why and not layout.checks_forward_only:
            raise Unsupported(f"{backend.spec} runs forward only here ({why}); layouts check gradients")
        if why and ctx.hyper is not None:
            raise Unsupported(f"runs forward only here ({why}); the train scenario needs gradients")
        candidate.model.train()
        candidate.model.zero_grad(set_to_none=True)
        runner = _Runner(layout, ctx, layout.wrap(candidate.model, ctx), backward=not candidate.forward_only)
        result = runner.train() if ctx.hyper is not None else runner.step()
    if result is not None:
        result.forward_only = candidate.forward_only
        result.notes.extend(candidate.notes)
    return result


class _Runner:
    """One layout's passes on one rank, for a step or for the train scenario."""

    def __init__(self, layout: Layout, ctx: LayoutContext, setup: Setup, backward: bool) -> None:
        self.layout, self.ctx, self.setup, self.backward = layout, ctx, setup, backward
        self.shards = layout.shard(ctx, setup)
        self.total = ctx.batch.predictions
        extra = auxiliary_loss(setup.inner)
        if extra and not self.whole_batch():
            raise Unsupported(f"the model's loss holds {extra}, which is not a sum over tokens: {layout.name} computes "
                              "it per part of the batch, another function than the golden's whole-batch loss")

    def whole_batch(self) -> bool:
        """Whether one pass on one data share holds every real token of the golden's batch."""
        if self.setup.data.size != 1 or len(self.shards) != 1:
            return False
        mask = self.ctx.batch.token_mask
        return int(mask[self.shards[0].positions].sum()) == int(mask.sum())

    def passes(self, forced: dict[int, torch.Tensor] | None) -> list[Part]:
        """One step: every pass's forward and backward, gradients accumulating from zero."""
        self.setup.inner.zero_grad(set_to_none=True)
        parts = []
        for index, shard in enumerate(self.shards):
            with self.layout.accumulate(self.ctx, self.setup, index, len(self.shards)):
                share = shard.batch.predictions / self.total if shard.weight is None else shard.weight
                parts.append(forward_backward(
                    self.setup.model, shard.batch, inner=self.setup.inner, share=share,
                    grad_scale=float(self.setup.data.size), backward=self.backward,
                    # a padding slot (no golden position) may go anywhere: it is never compared
                    forced={layer: experts[shard.positions.clamp(min=0)] for layer, experts in forced.items()}
                    if forced else None))
        return parts

    def step(self) -> LayoutResult | None:
        parts = self.passes(None)
        grads = gradients(self.setup.inner) if self.backward else {}  # every rank joins the gathers of shards
        replayed = None
        if self.ctx.any(self.routes_differ(parts)):
            forced = self.ctx.golden.experts()
            replayed_parts = self.passes(forced)
            replayed = self.gather(replayed_parts, gradients(self.setup.inner) if self.backward else {})
        capture = self.gather(parts, grads)
        return None if capture is None else LayoutResult(capture, replayed, list(self.setup.notes))

    def train(self) -> LayoutResult | None:
        """The golden's optimizer steps, each step's forward and backward run as this layout's passes."""

        def forward_backward_step() -> tuple[torch.Tensor, dict[int, RouteRecord]]:
            parts = self.passes(None)
            # Only each step's loss and routes are kept: no token outputs cross between ranks.
            gathered = self.gather([replace(p, logits=None, layers={}, encoders={}) for p in parts], {})
            if gathered is None:
                return sum(p.loss for p in parts), {}
            return gathered.tensors[str(names.LOSS)], gathered.routes

        clip = lambda params, max_norm: self.layout.clip(params, max_norm, self.ctx)  # noqa: E731
        run = train.train(self.setup.inner, self.ctx.hyper, forward_backward_step, clip)
        return LayoutResult(run.capture, notes=list(self.setup.notes)) if self.ctx.rank == 0 else None

    def routes_differ(self, parts: list[Part]) -> bool:
        """Whether any real token of this rank's passes went to other experts than the golden's."""
        golden = self.ctx.golden.experts()
        mask = self.ctx.batch.token_mask
        for part, shard in zip(parts, self.shards):
            for layer, experts in golden.items():
                rec = part.routes.get(layer)
                expected = experts[shard.positions.clamp(min=0)]
                if rec is None or rec.experts.shape != expected.shape:
                    return True
                real = (shard.positions >= 0) & mask[shard.positions.clamp(min=0)]
                if flips(expected, rec.experts, real).any():
                    return True
        return False

    def gather(self, parts: list[Part], grads: dict[str, torch.Tensor]) -> Capture | None:
        """On rank 0, the passes of every distinct data share assembled into the golden's positions."""
        mine = list(zip(parts, (s.positions for s in self.shards)))
        if self.setup.data.size == 1:  # every rank ran the whole batch: rank 0's passes are the run's
            return assemble(self.ctx, mine, grads, self.backward) if self.ctx.rank == 0 else None
        gathered = self.ctx.gather((self.setup.data.rank, mine))
        if gathered is None:
            return None
        pieces, seen = [], set()
        for data_rank, items in gathered:
            if data_rank not in seen:  # peers holding the same data (tensor parallel) ran the same tokens
                seen.add(data_rank)
                pieces += items
        return assemble(self.ctx, pieces, grads, self.backward)


def assemble(ctx: LayoutContext, pieces: list[tuple[Part, torch.Tensor]], grads: dict[str, torch.Tensor],
             backward: bool = True) -> Capture:
    """Passes of a layout, each with the golden positions of its token slots, as one capture shaped
    like the golden's: token outputs scattered back to their positions (positions no pass covered are
    padding, and keep the golden's values), the loss summed, the gradients as given."""
    batch = ctx.batch
    tensors: dict[str, torch.Tensor] = {str(names.LOSS): sum(part.loss for part, _ in pieces)}
    parts = [part for part, _ in pieces]
    if parts[0].logits is not None:
        tensors[str(names.LOGITS)] = _grid(batch, _scatter(ctx, names.LOGITS, [p.logits for p in parts], pieces))
    for layer in sorted(parts[0].layers):
        name = names.LayerOutput(layer)
        tensors[str(name)] = _grid(batch, _scatter(ctx, name, [p.layers[layer] for p in parts], pieces))
    # Encoder outputs have rows of their own (patches, audio frames), kind by kind (images, then videos), each
    # kind's passes in (rank, pass) order: the golden's order of media as long as shards keep rows in order.
    for name in dict.fromkeys(n for part in parts for n in part.encoders):
        tensors[name] = torch.cat([part.encoders[name][kind] for kind in Media.KINDS for part in parts
                                   if kind in part.encoders.get(name, {})])
    routes = {}
    for layer in sorted(parts[0].routes):
        recs = [p.routes[layer] for p in parts]
        experts, weights, margin = (_scatter(ctx, names.Route(layer, part), [getattr(r, part) for r in recs], pieces)
                                    for part in ("experts", "weights", "margin"))
        routes[layer] = RouteRecord(layer, experts.long(), weights, margin)
    return Capture(tensors={**tensors, **grads}, routes=routes, backward=backward)


def _grid(batch: Batch, flat: torch.Tensor) -> torch.Tensor:
    return flat.reshape(batch.rows, batch.width, *flat.shape[1:])


def _scatter(ctx: LayoutContext, name: names.TensorName, values: list[torch.Tensor],
             pieces: list[tuple[Part, torch.Tensor]]) -> torch.Tensor:
    """[rows * width, ...]: each pass's per-token rows at the golden positions its shard names."""
    rows = torch.cat([_token_rows(name, v) for v in values])
    positions = torch.cat([positions for _, positions in pieces])
    if rows.shape[0] != positions.numel():
        raise LayoutError(f"{name}: the passes produced {rows.shape[0]} token rows for {positions.numel()} positions")
    kept = positions >= 0  # slots a layout added (padding) stand for no golden position
    rows, positions = rows[kept], positions[kept]
    count = ctx.batch.rows * ctx.batch.width
    covered = torch.zeros(count, dtype=torch.bool)
    if positions.numel() != positions.unique().numel():
        raise LayoutError(f"{name}: passes overlap (a golden position is produced twice)")
    covered[positions] = True
    missing = ~covered & ctx.batch.token_mask
    if missing.any():
        first = int(missing.nonzero()[0])
        row, pos = divmod(first, ctx.batch.width)
        raise LayoutError(f"{name}: no pass produced the token at row {row} pos {pos}")
    out = torch.zeros(count, *rows.shape[1:], dtype=rows.dtype)
    gold = ctx.golden.tensors.get(str(name))
    if gold is not None and gold.numel() == out.numel():  # padding nobody computed: the golden's own values
        out[~covered] = gold.reshape(out.shape)[~covered].to(out.dtype)
    out[positions] = rows
    return out


def _token_rows(name: names.TensorName, value: torch.Tensor) -> torch.Tensor:
    """A pass's token tensor with one entry per token slot: logits and layer outputs are [rows, positions,
    ...] (a token's row may have several dimensions: DeepSeek-V4's residual streams), routes [tokens, k], a
    route margin one number per token."""
    if isinstance(name, names.Route):
        return value.reshape(-1) if name.part == "margin" else value.reshape(-1, value.shape[-1])
    return value.reshape(-1, *value.shape[2:]) if value.ndim > 2 else value.reshape(-1, value.shape[-1])
