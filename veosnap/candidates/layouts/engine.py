"""Run any layout on one rank (or in process): the part of a layout check every layout shares.

`run` loads the model as the layout says, tells the backend where it runs (`context.Context`), applies
it (its patches stay until the run is done), sets the candidate up (the layout wraps it, unless the
backend parallelizes it itself), and runs one step (or the train scenario's steps) of the layout's
passes, each in the candidate's own batch form when it adapts the batch (`Candidate.adapt_batch`).
Each pass's loss is weighted by its share of the golden's predictions, and by the data group's size to
undo a reducer's averaging, so the reduced gradient is exactly the full-batch mean gradient. When any
real token went to other experts than the golden's, the step runs again forced onto the golden's
experts (route replay). Rank 0 then holds a `LayoutResult` shaped like the golden's capture:
`assemble` puts every rank's token outputs (logits, layer outputs, routes) back at their positions in
the golden's batch, and takes the full gradients.

Tensors the golden holds as sketches are reduced where they are produced (`reference.reduce`): each
pass's hooks sketch its token rows at their golden positions, so a rank sends only rows x width numbers
(never a full activation) and rank 0 scatters them as it scatters whole rows; a gradient sharded by
rows (FSDP2) is sketched shard by shard. Any other sharding is gathered first (docs/layouts.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Iterator, TypeVar

import torch
from torch import nn

from ...errors import Unsupported, VeosnapError, describe
from ...golden import names
from ...golden.codec import Golden
from ...numerics.compare import whole_on_device
from ...numerics.routes import flips
from ...reference import train
from ...reference import isolation
from ...reference.capture import (Capture, Part, auxiliary_loss, forward_backward, reduce_gradients,
                                  sketched_as_accumulated)
from ...reference.inputs import Batch, Media
from ...reference.probes import RouteRecord
from ...reference.reduce import WHOLE, CandidateReducer, Reducer, Rows, assemble_rows
from .. import context, guard
from ..backends import Backend, Candidate
from .protocol import DataGroup, Layout, LayoutContext, Setup


T = TypeVar("T")


@dataclass
class LayoutResult:
    """What a layout's run produced, shaped like the golden's capture (rank 0 only)."""

    capture: Capture
    replayed: Capture | None = None  # the run forced onto the golden's routes, when routes differed
    notes: list[str] = field(default_factory=list)
    forward_only: str = ""  # why gradients were not checked ('' when they were)
    # Where the comparison runs (the candidate's device), and the golden's whole tensors already copied there
    # (before the candidate ran: a GPU is idle then), so comparing copies only the candidate's.
    device: torch.device | None = None
    golden_on: dict[str, torch.Tensor] = field(default_factory=dict)
    # Low precision: each layer's parts run in isolation (`reference.isolation`), the reference's and the
    # candidate's; or why they were not.
    isolated: tuple[isolation.Reference, isolation.Units] | None = None
    not_isolated: str = ""


class Staged:
    """What a check's first in-process run compares with, made on a thread while the model is built: the
    reducer with the golden's sketches (and the token mask) already on `device`, and the golden's whole
    tensors there (`whole_on_device`). It waits for the golden's decode; on any failure it holds nothing and
    the run makes them itself, meeting the same error in its turn."""

    def __init__(self, golden: Golden, token_mask: torch.Tensor, device: torch.device) -> None:
        self._made: tuple[Reducer, dict[str, torch.Tensor]] | None = None
        self._thread = threading.Thread(target=self._make, args=(golden, token_mask, device), daemon=True,
                                        name="veosnap-stage")
        self._thread.start()

    def _make(self, golden: Golden, token_mask: torch.Tensor, device: torch.device) -> None:
        try:
            self._made = compared_on(golden, token_mask, device)  # waits for the decode
        except BaseException:  # noqa: BLE001, S110 - the run makes them itself and meets the error, in its turn
            pass

    def take(self) -> tuple[Reducer, dict[str, torch.Tensor]] | None:
        """The reducer and the golden's whole tensors on the device, once (waits for the thread); else None."""
        self._thread.join()
        made, self._made = self._made, None
        return made


def compared_on(golden: Golden, token_mask: torch.Tensor, device: torch.device, whole: bool = True
                ) -> tuple[Reducer, dict[str, torch.Tensor]]:
    """What a run compares with on `device`: the reducer of the golden's sketched tensors (with its specs;
    everything else kept whole) and, with `whole`, the golden's whole tensors copied there (`whole_on_device`;
    in process only: a torchrun worker's result is compared by the parent, on the host)."""
    reducer = CandidateReducer(golden.sketches, token_mask, device=device) if golden.sketches else WHOLE
    return reducer, whole_on_device(golden, device) if whole else {}


class LayoutError(RuntimeError):
    """A layout's passes do not cover the golden's batch (a bug in the layout)."""


def run(layout: Layout, backend: Backend, ctx: LayoutContext, staged: Staged | None = None) -> LayoutResult | None:
    """Run `layout` with `backend` on this rank; the result on rank 0, None on the others. `staged`: the
    golden's device copies made while the model was built (in process only)."""
    # A backend that parallelizes the model itself gets the plain reference, never one transformers sharded.
    model = ctx.build(ctx.device) if backend.parallelizes else layout.load(ctx)
    ctx = replace(ctx, mesh=layout.mesh(ctx))
    data = layout.data(ctx)
    where = told(layout, ctx, data)
    not_isolated = isolation_declined(ctx, backend, layout)
    reference, isolated = None, None
    if not not_isolated:
        # The reference's parts run before the candidate is applied: its patches are not in place yet. A model
        # transformers' tensor or expert plan already split (tp, ep) is no reference: each rank runs a whole one.
        plain = (lambda: ctx.build(ctx.device)) if _sharded(model) else (lambda: model)
        reference, not_isolated = _isolating(lambda: isolation.reference_units(
            plain(), ctx.batch.model_kwargs(), ctx.golden.experts()), "the reference")
    with context.told(where), backend.prepare(model, where) as candidate:
        why = candidate.forward_only
        if why and not layout.checks_forward_only:
            raise Unsupported(f"{backend.spec} runs forward only here ({why}); layouts check gradients")
        if why and ctx.hyper is not None:
            raise Unsupported(f"runs forward only here ({why}); the train scenario needs gradients")
        if candidate.full_gradients is not None and ctx.hyper is not None:
            raise Unsupported("the train scenario reads full parameters, which full_gradients does not give")
        training(candidate.model)
        candidate.model.zero_grad(set_to_none=True)
        if backend.parallelizes:
            setup = Setup(candidate.model, _unwrapped(candidate.model), data,
                          notes=[f"parallelized by the backend ({backend.spec}), not wrapped by the layout"])
        else:
            setup = layout.wrap(candidate.model, ctx)
        if setup.data is None:
            setup.data = data
        elif setup.data != data:
            raise LayoutError(f"layout {layout.name}: wrap() set up data share {setup.data} but data() told the "
                              f"backend {data}; override data()")
        runner = _Runner(layout, ctx, setup, candidate, where, staged if ctx.world == 1 else None)

        def isolate() -> tuple[tuple[isolation.Reference, isolation.Units] | None, str]:
            # The layout's own passes, in the batch form each gives the candidate; on several ranks each runs
            # its own (FSDP's gathers, the parallel plans' collectives and exchanges join), and the rows merge.
            units, why = _isolating(lambda: isolation.candidate_units(
                setup.inner, runner.isolated_passes(), ctx.batch.token_mask.numel(), reference), "the candidate",
                _compiled(setup.inner))
            if ctx.world > 1:
                _reshard(setup.inner)
                if ctx.any(units is None):  # a rank whose run failed: none merges (its rows would be missing)
                    said = ctx.gather(why) or []
                    units, why = None, "; ".join(dict.fromkeys(f"rank {r}: {w}" for r, w in enumerate(said) if w))
                else:
                    isolation.gather_column_shards(setup.inner, units, ctx.device)
                    isolation.merge_ranks(units, ctx.device)
                    isolation.leave_out_shards(reference, units, layout.name)
            if units is not None:
                isolation.leave_out_other_rotary(reference, units)
            return ((reference, units) if units is not None else None), why

        if reference is not None and ctx.hyper is not None:
            # Train: the parts are the candidate's on the golden's own weights, before its optimizer moves them.
            isolated, not_isolated = isolate()
        result = runner.train() if ctx.hyper is not None else runner.step()
        if reference is not None and ctx.hyper is None:
            isolated, not_isolated = isolate()
    if result is not None:
        result.isolated, result.not_isolated = isolated, not_isolated
        result.device, result.golden_on = ctx.device, runner.golden_on
        result.forward_only = candidate.forward_only
        result.notes.extend(candidate.notes)
    return result


def training(model: nn.Module) -> None:
    """`model` in training mode: `model.train()`, unless every module already is (a fresh build is). The call sets
    each module's flag through `nn.Module.__setattr__`, 1.2 ms of the check's path at 12 layers on the CPU; the
    look costs a quarter of that. A module left in eval mode (by a backend, say) still has the whole model set."""
    if not all(module.training for module in model.modules()):
        model.train()


def isolation_declined(ctx: LayoutContext, backend: Backend, layout: Layout | None = None) -> str:
    """Why this run's layer parts are not checked in isolation ('' when they are): only a low-precision
    golden (in the train scenario, on the golden's weights before the first step), under a layout whose ranks
    can each run the whole batch (`Layout.isolation`); a real-shape golden only when asked."""
    golden = ctx.golden
    if golden.key.dtype not in ("bfloat16", "float16"):
        return "float32"
    if layout is not None and layout.isolation:
        return f"{layout.name}: {layout.isolation}"
    if not ctx.isolate_real and any(isinstance(names.try_parse(name), names.LayerOutput) for name in golden.sketches):
        return ("a real-shape golden: isolating its layers runs the reference and a float64 copy of it beside the "
                "candidate, several times the step's cost; opt in with --isolate")
    return ""


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward with no backward (the isolated run's): shard
    them again, as the training step after it expects (its parameters are read sharded)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _sharded(model: nn.Module) -> bool:
    """Whether a parameter of `model` is a DTensor (a model transformers' tensor or expert plan split)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _compiled(model: nn.Module) -> bool:
    """Whether `model` or one of its modules is compiled by `torch.compile` (`nn.Module.compile` or a wrapper)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
               for m in model.modules())


def _isolating(run: Callable[[], T], who: str, compiled: bool = False) -> tuple[T | None, str]:
    """`run()`'s result, or None and why: a model the isolated run cannot drive (a forward that refuses a
    hooked input) leaves its parts unisolated, said in the report, and the whole-model verdict stands. The
    guard's own errors (a timeout, an exit) and veosnap's stay what they are. `compiled`: see `_recompiled`."""
    try:
        if not compiled:
            return run(), ""
        with _recompiled() as graphs:
            result, traced = run(), graphs()
        if not traced:
            return None, (f"{who}'s isolated run compiled no graph (torch.compile): its parts would be judged on code "
                          "it does not run")
        return result, ""
    except (guard.CandidateError, VeosnapError):
        raise
    except Exception as exc:  # noqa: BLE001 - said in the report
        return None, f"{who}'s isolated run failed: {describe(exc)}"


@contextmanager
def _recompiled() -> Iterator[Callable[[], int]]:
    """A compiled candidate's isolated run, compiled afresh with the isolation's hooks traced into it; yields
    how many graphs it compiled so far.

    Dynamo does not guard on hooks added to a module it already compiled: the step's graph could run without
    them, and the graph traced with them (each part's input replaced by the reference's) could serve a later
    train step. So its caches are dropped before the isolated run and after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    try:
        yield lambda: counters["stats"]["unique_graphs"] - before
    finally:
        torch._dynamo.reset()


def told(layout: Layout, ctx: LayoutContext, data: DataGroup) -> context.Context:
    """What a backend is told about where it runs (`veosnap.context()`)."""
    group = None
    if ctx.world > 1:
        import torch.distributed as dist

        group = dist.group.WORLD
    return context.Context(layout=layout.name, rank=ctx.rank, world=ctx.world, local_rank=ctx.local_rank,
                           device=ctx.device, dp_world=data.size, dp_rank=data.rank, mesh=ctx.mesh, group=group,
                           golden=ctx.golden.key)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The HF model inside a data-parallel wrapper a backend returned (hooks and gradients go there)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


class _Runner:
    """One layout's passes on one rank, for a step or for the train scenario."""

    def __init__(self, layout: Layout, ctx: LayoutContext, setup: Setup, candidate: Candidate,
                 where: context.Context, staged: Staged | None = None) -> None:
        self.layout, self.ctx, self.setup, self.candidate = layout, ctx, setup, candidate
        self.backward = not candidate.forward_only
        self.accumulated: dict = {}  # the last pass's gradients as its backward reduced them (`passes`)
        # In process, a step's results are compared on its device (`LayoutResult.device`): nothing waits for the
        # device after the backward, so the host queues the gradients' finishing and the compare behind it
        # (on a GPU the backward's host work ends well before the device's), and the compare's one read waits.
        self.on_device = ctx.workdir is None and ctx.world == 1 and ctx.hyper is None
        self.shards = layout.shard(ctx, setup)
        self.total = ctx.batch.predictions
        made = staged.take() if staged is not None else None
        self.reducer, self.golden_on = made if made is not None else \
            compared_on(ctx.golden, ctx.batch.token_mask, ctx.device, whole=ctx.world == 1)
        # Each pass's model call, and the golden position of each of its output token slots (-1: none).
        self.calls: list[dict | None] = []
        self.positions: list[torch.Tensor] = []
        for shard in self.shards:
            if candidate.adapt_batch is None:
                self.calls.append(None)
                self.positions.append(shard.positions)
                continue
            adapted = candidate.adapt_batch(shard.batch.to(ctx.device), where)
            local = torch.as_tensor(adapted.positions).reshape(-1).long().cpu()
            if local.numel() and int(local.max()) >= shard.positions.numel():
                raise LayoutError(f"adapt_batch gave position {int(local.max())} in a batch of "
                                  f"{shard.positions.numel()} token slots")
            self.calls.append(adapted.kwargs)
            self.positions.append(torch.where(local >= 0, shard.positions[local.clamp(min=0)], -1))
        extra = auxiliary_loss(setup.inner)
        if extra and not self.whole_batch():
            raise Unsupported(f"the model's loss holds {extra}, which is not a sum over tokens: {layout.name} computes "
                              "it per part of the batch, another function than the golden's whole-batch loss")

    def isolated_passes(self) -> list[isolation.Pass]:
        """This rank's passes as the isolated run replays them: each in the form the step ran it."""
        return [isolation.Pass(shard.batch.to(self.ctx.device).model_kwargs() if call is None else call, positions)
                for shard, call, positions in zip(self.shards, self.calls, self.positions)]

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
        self.accumulated = {}
        for index, (shard, call, positions) in enumerate(zip(self.shards, self.calls, self.positions)):
            # The last pass on a single rank leaves every gradient final as it is accumulated: the sketched ones
            # are reduced in the backward's own hooks (`sketched_as_accumulated`), `gradients` takes them.
            final = index == len(self.shards) - 1 and self.ctx.world == 1 and self.backward
            early = sketched_as_accumulated(self.setup.inner, self.reducer) if final and self.reducer is not WHOLE \
                else nullcontext({})
            with self.layout.accumulate(self.ctx, self.setup, index, len(self.shards)), early as self.accumulated:
                share = shard.batch.predictions / self.total if shard.weight is None else shard.weight
                parts.append(forward_backward(
                    self.setup.model, shard.batch, inner=self.setup.inner, share=share,
                    grad_scale=float(self.setup.data.size), backward=self.backward, call=call,
                    # a padding slot (no golden position) may go anywhere: it is never compared
                    forced={layer: experts[positions.clamp(min=0)] for layer, experts in forced.items()}
                    if forced else None,
                    reducer=self.reducer, positions=positions, sync=not self.on_device))
        return parts

    def gradients(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """The step's gradients, whole or reduced (every rank joins the gathers of shards), the
        candidate's own reader (`full_gradients`) taking precedence for what it returns."""
        if not self.backward:
            return {}, {}
        whole, kept = reduce_gradients(self.setup.inner, self.reducer, self.accumulated, host=not self.on_device)
        if self.candidate.full_gradients is not None:
            for param_name, grad in self.candidate.full_gradients(self.setup.inner).items():
                name = str(names.Grad(param_name))
                if self.reducer.spec(name) is None:
                    whole[name] = grad.detach().to("cpu", copy=True)
                else:
                    kept[name] = self.reducer.finish(name, self.reducer.keep_rows(name, grad.detach()))
        return whole, kept

    def step(self) -> LayoutResult | None:
        parts = self.passes(None)
        grads = self.gradients()
        replayed = None
        if self.ctx.any(self.routes_differ(parts)):
            forced = self.ctx.golden.experts()
            replayed_parts = self.passes(forced)
            replayed = self.gather(replayed_parts, self.gradients())
        capture = self.gather(parts, grads)
        if capture is None:
            return None
        notes = [*self.setup.notes, *capture.notes, *(replayed.notes if replayed else [])]
        return LayoutResult(capture, replayed, list(dict.fromkeys(notes)))

    def train(self) -> LayoutResult | None:
        """The golden's optimizer steps, each step's forward and backward run as this layout's passes."""

        unreadable: list[dict[str, str]] = []  # the first step's unreadable routes (a train golden holds its routes)

        def forward_backward_step() -> tuple[torch.Tensor, dict[int, RouteRecord]]:
            parts = self.passes(None)
            # Only each step's loss and routes are kept: no token outputs cross between ranks.
            gathered = self.gather([replace(p, logits=None, layers={}, encoders={}) for p in parts], ({}, {}))
            if gathered is None:
                return sum(p.loss for p in parts), {}
            if not unreadable:
                unreadable.append({n: why for n, why in gathered.absent.items()
                                   if isinstance(names.try_parse(n), names.Route)})
            return gathered.tensors[str(names.LOSS)], gathered.routes

        clip = lambda params, max_norm: self.layout.clip(params, max_norm, self.ctx)  # noqa: E731
        run = train.train(self.setup.inner, self.ctx.hyper, forward_backward_step, clip)
        if self.ctx.rank != 0:
            return None
        run.capture.absent = unreadable[0] if unreadable else {}
        return LayoutResult(run.capture, notes=list(self.setup.notes))

    def routes_differ(self, parts: list[Part]) -> bool:
        """Whether any real token of this rank's passes went to other experts than the golden's."""
        golden = self.ctx.golden.experts()
        mask = self.ctx.batch.token_mask
        for part, positions in zip(parts, self.positions):
            at = positions.clamp(min=0)
            for layer, experts in golden.items():
                if layer in part.unreadable:  # nothing to compare, and nothing to force: said in the report
                    continue
                rec = part.routes.get(layer)
                expected = experts[at]
                if rec is None or rec.experts.shape != expected.shape:
                    return True
                if flips(expected, rec.experts, mask[at] & (positions >= 0)).any():
                    return True
        return False

    def gather(self, parts: list[Part], grads: tuple[dict[str, torch.Tensor], dict[str, object]]) -> Capture | None:
        """On rank 0, the passes of every distinct data share assembled into the golden's positions."""
        mine = list(zip(parts, self.positions))
        if self.setup.data.size == 1:  # every rank ran the whole batch: rank 0's passes are the run's
            return assemble(self.ctx, mine, grads, self.backward, self.reducer) if self.ctx.rank == 0 else None
        # Only small things cross between ranks: whole token rows of whole tensors, and per-row
        # sketches (rows x width) of sketched ones, moved to the host first.
        gathered = self.ctx.gather((self.setup.data.rank, [(_to_host(part), positions) for part, positions in mine]))
        if gathered is None:
            return None
        pieces, seen = [], set()
        for data_rank, items in gathered:
            if data_rank not in seen:  # peers holding the same data (tensor parallel) ran the same tokens
                seen.add(data_rank)
                pieces += items
        return assemble(self.ctx, pieces, grads, self.backward, self.reducer)


def _to_host(part: Part) -> Part:
    """`part` with its sketched rows on the host (a collective pickles what it sends)."""
    host = lambda kept: kept.cpu() if isinstance(kept, Rows) else kept  # noqa: E731
    return replace(part, logits=host(part.logits), layers={layer: host(v) for layer, v in part.layers.items()})


def assemble(ctx: LayoutContext, pieces: list[tuple[Part, torch.Tensor]],
             grads: tuple[dict[str, torch.Tensor], dict[str, object]], backward: bool = True,
             reducer: Reducer = WHOLE) -> Capture:
    """Passes of a layout, each with the golden positions of its token slots, as one capture shaped
    like the golden's: token outputs scattered back to their positions (positions no pass covered are
    padding, and keep the golden's values; a sketched tensor's rows there are zero, and masked), the
    loss summed, the gradients as given (whole ones, and sketched ones as the reducer kept them)."""
    batch = ctx.batch
    whole_grads, kept_grads = grads
    tensors: dict[str, torch.Tensor] = {str(names.LOSS): sum(part.loss for part, _ in pieces)}
    sketches: dict[str, object] = dict(kept_grads)
    parts = [part for part, _ in pieces]
    absent = {name: why for part in reversed(parts) for name, why in part.absent.items()}  # the first pass's reason
    notes = list(dict.fromkeys(note for part in parts for note in part.notes))
    produced = {names.LOGITS: [p.logits for p in parts]} if all(p.logits is not None for p in parts) else {}
    produced.update({names.LayerOutput(layer): [p.layers[layer] for p in parts] for layer in sorted(parts[0].layers)})
    sketched = []
    for name, values in produced.items():
        if reducer.spec(str(name)) is not None:
            if all(isinstance(v, Rows) for v in values):  # a problem (wrong shape) is reported as the tensor's
                at = torch.cat([v.positions for v in values])
                if not _in_order(ctx, at):
                    _covered(ctx, name, at)
            sketched.append((str(name), assemble_rows(values, batch.rows * batch.width)))
        else:
            tensors[str(name)] = _grid(batch, _scatter(ctx, name, values, pieces))
    sketches.update(reducer.finish_all(sketched))  # the layers' outputs: one kind, finished together
    # Encoder outputs (always whole) have rows of their own (patches, audio frames), kind by kind (images, then
    # videos), each kind's passes in (rank, pass) order: the golden's order of media as long as shards keep
    # rows in order.
    for name in dict.fromkeys(n for part in parts for n in part.encoders):
        tensors[name] = torch.cat([part.encoders[name][kind] for kind in Media.KINDS for part in parts
                                   if kind in part.encoders.get(name, {})])
    routes = {}
    for layer in sorted(parts[0].routes):
        if any(layer not in p.routes for p in parts):  # read in some passes only: not a route of every token
            continue
        recs = [p.routes[layer] for p in parts]
        experts, weights, margin = (_scatter(ctx, names.Route(layer, part), [getattr(r, part) for r in recs], pieces)
                                    for part in ("experts", "weights", "margin"))
        routes[layer] = RouteRecord(layer, experts.long(), weights, margin)
    return Capture(tensors={**tensors, **whole_grads}, routes=routes, backward=backward, sketches=sketches,
                   absent=absent, notes=notes)


def _grid(batch: Batch, flat: torch.Tensor) -> torch.Tensor:
    return flat.reshape(batch.rows, batch.width, *flat.shape[1:])


def _scatter(ctx: LayoutContext, name: names.TensorName, values: list[torch.Tensor],
             pieces: list[tuple[Part, torch.Tensor]]) -> torch.Tensor:
    """[rows * width, ...]: each pass's per-token rows at the golden positions its shard names."""
    rows = torch.cat([_token_rows(name, v) for v in values])
    positions = torch.cat([positions for _, positions in pieces])
    if rows.shape[0] != positions.numel():
        raise LayoutError(f"{name}: the passes produced {rows.shape[0]} token rows for {positions.numel()} positions")
    if _in_order(ctx, positions):
        return rows  # every golden position once, in order (one pass over the whole batch): its layout already
    kept = positions >= 0  # slots a layout or an adapted batch added (padding) stand for no golden position
    rows, positions = rows[kept], positions[kept]
    covered = _covered(ctx, name, positions)
    out = torch.zeros(ctx.batch.rows * ctx.batch.width, *rows.shape[1:], dtype=rows.dtype)
    gold = ctx.golden.tensors.get(str(name))
    if gold is not None and gold.numel() == out.numel():  # padding nobody computed: the golden's own values
        out[~covered] = gold.reshape(out.shape)[~covered].to(out.dtype)
    out[positions] = rows
    return out


def _in_order(ctx: LayoutContext, positions: torch.Tensor) -> bool:
    """Whether `positions` are the golden batch's positions 0, 1, ..., each once in order: covered, nothing to
    move (what `_covered` would find, without sorting them for each tensor)."""
    count = ctx.batch.rows * ctx.batch.width
    return positions.numel() == count and bool(torch.equal(positions, torch.arange(count)))


def _covered(ctx: LayoutContext, name: names.TensorName, positions: torch.Tensor) -> torch.Tensor:
    """[rows * width] bool: the golden positions the passes produced, each once, every real token among them."""
    covered = torch.zeros(ctx.batch.rows * ctx.batch.width, dtype=torch.bool)
    if positions.numel() != positions.unique().numel():
        raise LayoutError(f"{name}: passes overlap (a golden position is produced twice)")
    covered[positions] = True
    missing = ~covered & ctx.batch.token_mask
    if missing.any():
        first = int(missing.nonzero()[0])
        row, pos = divmod(first, ctx.batch.width)
        raise LayoutError(f"{name}: no pass produced the token at row {row} pos {pos}")
    return covered


def _token_rows(name: names.TensorName, value: torch.Tensor) -> torch.Tensor:
    """A pass's token tensor with one entry per token slot: logits and layer outputs are [rows, positions,
    ...] (a token's row may have several dimensions: DeepSeek-V4's residual streams), routes [tokens, k], a
    route margin one number per token."""
    if isinstance(name, names.Route):
        return value.reshape(-1) if name.part == "margin" else value.reshape(-1, value.shape[-1])
    return value.reshape(-1, *value.shape[2:]) if value.ndim > 2 else value.reshape(-1, value.shape[-1])
